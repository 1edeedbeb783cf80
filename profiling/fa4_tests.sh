#!/usr/bin/env bash
# Lays out FlashAttention-4's own test files beside the stand-in interface (profiling/fa4_shim) in a folder to
# carry to the GPU machine, so FA4's tests run against cute-flash there:
#   profiling/fa4_tests.sh <flash-attention checkout or git dir> [.fa4]
#   then on the GPU machine:  cd .fa4 && PYTHONPATH=$PWD:$PYTHONPATH FA4_SAMPLE=0.012 \
#       python -m pytest -q -p conftest_sample tests/test_flash_attn.py -k "test_flash_attn_output or kvcache"
# FA4_SAMPLE keeps a deterministic fraction of the parametrised cases (there are tens of thousands).
set -euo pipefail
src=${1:?flash-attention checkout}; dest=${2:-.fa4}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dest/tests"
cp -r "$here/fa4_shim/flash_attn" "$here/fa4_shim/conftest_sample.py" "$dest/"
show() { if [ -d "$src/.git" ] || [ -f "$src/HEAD" ]; then git --git-dir="$( [ -d "$src/.git" ] && echo "$src/.git" || echo "$src")" show "HEAD:$1"; else cat "$src/$1"; fi; }
show flash_attn/cute/testing.py > "$dest/flash_attn/cute/testing.py"
for f in test_flash_attn.py test_flash_attn_varlen.py conftest.py; do show "tests/cute/$f" > "$dest/tests/$f"; done
git check-ignore -q "$dest" 2>/dev/null || echo "/$dest/" >> "$(git rev-parse --git-dir)/info/exclude"
echo "ready: $dest"

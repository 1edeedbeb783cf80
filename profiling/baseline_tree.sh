#!/usr/bin/env bash
# Extracts the whole tree of git revision REV into ./base_<REV> (untracked, so a device call carries it) for A/B timings:
# run the baseline from inside that folder, `(cd base_<REV> && python3 -m ...)`, never by putting it on PYTHONPATH
# (`python -m` puts the working directory first on sys.path). Also the tree to run `profiling.ptx_identity --save`
# in. docs/contributing.md, "Comparing two trees".
#
#   profiling/baseline_tree.sh HEAD~1      # -> base_<short sha>; delete it before committing
set -eu
case "${1:-}" in
  -h|--help|"") sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; [ -n "${1:-}" ]; exit ;;
esac
rev=$1
sha=$(git rev-parse --short "$rev")
dir="base_$sha"
rm -rf "$dir"
mkdir "$dir"
git archive "$rev" | tar -x -C "$dir"
echo "$dir"

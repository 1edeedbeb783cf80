#!/usr/bin/env bash
# Extracts the whole tree of git revision REV into ./base_<REV> (untracked, so a device call carries it) for A/B timings:
# run the baseline from inside that folder, `(cd base_<REV> && python3 -m ...)`, never by putting it on PYTHONPATH
# (`python -m` puts the working directory first on sys.path). docs/performance.md, "Comparing two trees".
#
#   profiling/baseline_tree.sh HEAD~1      # -> base_<short sha>; delete it before committing
set -eu
rev=${1:?usage: profiling/baseline_tree.sh REV}
sha=$(git rev-parse --short "$rev")
dir="base_$sha"
rm -rf "$dir"
mkdir "$dir"
git archive "$rev" | tar -x -C "$dir"
echo "$dir"

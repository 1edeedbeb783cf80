#!/usr/bin/env bash
# Runs cute-flash's kernels under compute-sanitizer: memcheck (out-of-bounds and misaligned accesses) and
# racecheck (shared-memory hazards); synccheck and initcheck on request.
#
#   profiling/sanitize.sh                          # memcheck + racecheck over profiling/sanitize_target.py
#   profiling/sanitize.sh --tools memcheck,synccheck,initcheck
#   profiling/sanitize.sh -- --forward-only        # arguments after -- go to sanitize_target
#   profiling/sanitize.sh --pytest tests/test_sm90_fwd.py -x -q -k q113   # over GPU tests instead (keep them small)
#
# Defaults: --tools memcheck,racecheck; target python3 -m profiling.sanitize_target; logs in
# ${SANITIZE_OUT:-out/sanitize}/<tool>.log. The exit status is non-zero when any tool reports an error or the target
# fails. Run from the repository root on the GPU machine (after `source .devkit/setup.sh`).
set -u
tools="memcheck,racecheck"
target=(python3 -m profiling.sanitize_target)
while [ $# -gt 0 ]; do
  case "$1" in
    --tools) tools="$2"; shift 2 ;;
    --pytest) shift; target=(python3 -m pytest "$@"); break ;;
    --) shift; target+=("$@"); break ;;
    -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "sanitize.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
command -v compute-sanitizer >/dev/null || { echo "sanitize.sh: compute-sanitizer is not on PATH" >&2; exit 2; }
out=${SANITIZE_OUT:-out/sanitize}
mkdir -p "$out"
status=0
for tool in ${tools//,/ }; do
  extra=()
  [ "$tool" = racecheck ] && extra=(--racecheck-report all)
  echo "== compute-sanitizer --tool $tool: ${target[*]}"
  start=$(date +%s)
  # Without torch's caching allocator every tensor is its own cudaMalloc, so memcheck sees an access past a
  # tensor's end instead of landing silently in a neighbouring tensor of the same cached block.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 99 --print-limit 50 --log-file "$out/$tool.log" \
    "${target[@]}"
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY" "$out/$tool.log" | tail -n 3 | tr '\n' ' ')
  echo "== $tool: exit $rc after $(( $(date +%s) - start )) s; ${summary:-no summary line (see $out/$tool.log)}"
  [ $rc -ne 0 ] && status=1
done
exit $status

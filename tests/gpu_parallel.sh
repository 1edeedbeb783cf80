#!/usr/bin/env bash
# tests/gpu_suite.sh on several GPUs at once (nvidia-h100-x2 / nvidia-h200-x2), one step list per GPU, within one device
# call: logs go to a local folder and are packed into $OUT/logs.tgz at the end, and once before the call's limit
# (DEADLINE seconds, default 570), so that a step list that overruns still brings back what it wrote.
#
#   source .devkit/setup.sh && tests/gpu_parallel.sh "vtime bench" "vtests torch varlen" "1:sm90"
#
# Put timings on one GPU and correctness on the other: a timing step then shares the GPU with nothing (the host
# CPUs are shared, which kernel timings with device events do not see). Step lists run in order on their GPU.
set -u
[ $# -ge 1 ] || { echo 'usage: tests/gpu_parallel.sh "STEPS FOR GPU 0" ["STEPS FOR GPU 1" ...]' >&2; exit 2; }
logs=${LOGS:-/tmp/gpu-logs}
out=${OUT:-/tmp/gpu-out}
mkdir -p "$logs" "$out"
pack() { tar czf "$out/logs.tgz.part" -C "$logs" . && mv "$out/logs.tgz.part" "$out/logs.tgz"; }
(sleep "${DEADLINE:-570}" && pack && echo "gpu_parallel: deadline reached, partial logs packed") &
deadline_pid=$!
# Step list i runs on GPU i mod (number of GPUs), or on GPU g when written "g:steps" (lists that share a GPU: for
# correctness steps only).
ngpu=$(nvidia-smi -L | wc -l)
pids=()
gpus=()
i=0
for steps in "$@"; do
  gpu=$((i % ngpu))
  if [[ $steps =~ ^([0-9]+):(.*)$ ]]; then gpu=${BASH_REMATCH[1]}; steps=${BASH_REMATCH[2]}; fi
  gpus+=("$gpu")
  CUDA_VISIBLE_DEVICES=$gpu STEPS="$steps" tests/gpu_suite.sh "$logs/s$i" > "$logs/s$i.txt" 2>&1 &
  pids+=($!)
  i=$((i + 1))
done
wait "${pids[@]}"
kill $deadline_pid 2>/dev/null
pack
for ((j = 0; j < i; j++)); do
  echo "=== list $j (GPU ${gpus[$j]})"
  cat "$logs/s$j.txt"
done

#!/usr/bin/env bash
# The GPU checks of a change, on one Hopper GPU, in one call of the device machine; prints one line per step and
# leaves every log in OUT_DIR. Run from the repository root after `source .devkit/setup.sh`.
#
#   tests/gpu_suite.sh OUT_DIR            # every step
#   STEPS="sm90 sm80_bwd" tests/gpu_suite.sh OUT_DIR
#
# Steps (each under its own time limit, seconds in brackets; a step that runs out reports exit 124):
#   sm90      [560] issue-13 regressions, the sm90 backward matrix, the sm90 forward matrix, FP8, edge cases (another
#                   GPU than the current one when two are visible, decode-like shapes, empty shapes, odd layouts)
#                   (pytest-xdist workers grouped by compiled kernels, so each compiles only its own)
#   sm80_fwd  [300] the sm80 forward (forced on Hopper): odd lengths, masked rows, windows, strides, other head dims
#   sm80_bwd  [180] the sm80 backward matrix through autograd at bf16 d128 and fp16 d64 (one process per shard)
#   bench     [240] backward grid beside FA4 and cuDNN: d 64/128/256 x $BENCH_SEQLENS (default 1k/4k/16k) x causal
#                   both (bench/report.md)
#   fbbench   [240] the same grid, forward + backward (fbbench/report.md)
#   torch     [300] torch integration (issue 15): inductor, CUDA graphs, autocast, opcheck, the transformers / SDPA
#                   plug-ins, the disk kernel cache loaded in a second process, the TVM-FFI launch
#   varlen    [300] packed sequences (issue 16) on the sm80 kernels, forward + gradients, CUDA graphs
#   varlen90  [300] the sm90 packed kernels (Hopper's default for varlen): out / lse and gradients, GQA, seqused_k
#                   with NaN in the unused rows, equal lengths against dense, CUDA graphs
#   host      [240] host time per warm call and first-call time from a cold / warm disk cache (profiling/), with a
#                   cProfile of one warm-cache first call (first_call_profile.txt)
#   hostprof  [90]  cProfile of warm forward + backward calls (profiling/host_overhead.py --cprofile)
#   sm90bwd   [300] only the sm90 backward matrix (tests/test_sm90_bwd.py)
#   fuzz      [540] randomised forward, training and packed-sequence calls against float64 (tests/test_fuzz_gpu.py;
#                   FUZZ_CASES / FUZZ_TRAIN_CASES / FUZZ_VARLEN_CASES set how many)
#   vbench    [180] packed sequences against dense cute-flash and FA4's varlen (profiling/varlen_benchmark.py)
#   serving   [240] the KV-cache forward (both families, fp8 caches, append, CUDA graphs, torch.compile), split-key
#                   decoding, the score_mod / mask_mod probe kernels
#   decode    [240] profiling/decode_benchmark.py (CUDA graphs, beside SDPA and FA4) and the KV-cache tile studies
#                   (profiling/kvcache_configs.py: small-grid 16-bit rings, the fp8 converter variants)
#   hotspots  [420] Nsight Compute source-level stall samples of the d128 backward main kernel without a mask (b4 s4096
#                   h16: the 80-row tile), ours and FA4's: summaries and profiling.hotspots tables next to the logs
#   ncu       [420] Nsight Compute (full set) of the backward main kernel, ours and FA4's, d128 / d256, causal and
#                   not (b2 s8192); summaries copied next to the logs, reports left in /tmp/ncu (too large to bring
#                   back; run profiling.hotspots there on a source-page export if needed)
#
# Two GPUs (nvidia-h100-x2): run two step lists side by side, each on its own GPU, e.g.
#   CUDA_VISIBLE_DEVICES=0 STEPS="bench varlen90" tests/gpu_suite.sh OUT/g0 & CUDA_VISIBLE_DEVICES=1 STEPS="sm90" ...
set -u
out=${1:?usage: tests/gpu_suite.sh OUT_DIR}
mkdir -p "$out"
steps=${STEPS:-"sm90 sm80_fwd sm80_bwd bench"}

step() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local summary
  summary=$(grep -E "[0-9]+ (passed|failed|error)|total failures" "$out/$name.log" | tail -n 2 | tr '\n' ' ')
  echo "$name: exit $rc, $((SECONDS - start)) s. $summary"
}

for s in $steps; do
  case $s in
    sm90) step sm90 560 python3 -m pytest -q -n 12 --dist loadgroup -p no:cacheprovider -rf \
            tests/test_correctness_gpu.py tests/test_sm90_bwd.py tests/test_sm90_fwd.py tests/test_fp8_gpu.py \
            tests/test_edge_cases_gpu.py ;;
    sm80_fwd) step sm80_fwd 300 python3 -m pytest -q -n 6 -p no:cacheprovider -rf -m sm80 tests/test_sm80_fwd.py \
            -k "q113k203 or q1023k1024 or q239k1 or fully or local or strided or other" ;;
    sm80_bwd) step sm80_bwd 180 python3 tests/test_sm80_bwd.py -j 6 --test test_sm80_attention_backward \
            -k "bf16-d128- or fp16-d64-" ;;
    bench|fbbench) dir=bwd; [ "$s" = fbbench ] && dir=fwdbwd
           step "$s" 240 python3 -m cute_flash bench --dtypes bf16 --head-dims 64,128,256 \
            --seqlens "${BENCH_SEQLENS:-1024,4096,16384}" --directions $dir --impls cute-flash,fa4,sdpa-cudnn --no-memory --no-plots \
            --rep-ms 50 --warmup-ms 15 --out "$out/$s"
           grep -A 22 "bf16 $dir" "$out/$s/report.md" 2>/dev/null || tail -n 25 "$out/$s.log" ;;
    torch) step torch 300 python3 -m pytest -q -n 3 --dist loadgroup -p no:cacheprovider -rf \
            tests/test_torch_integration_gpu.py tests/test_integrations_gpu.py tests/test_disk_cache_gpu.py \
            tests/test_launch_gpu.py ;;
    varlen) step varlen 300 python3 -m pytest -q -n 6 --dist loadgroup -p no:cacheprovider -rf tests/test_varlen_gpu.py \
            -m sm80 ;;
    varlen90) step varlen90 300 python3 -m pytest -q -n 6 --dist loadgroup -p no:cacheprovider -rf \
            tests/test_varlen_gpu.py -m sm90 ;;
    host) # The device machine sets PYTHONDONTWRITEBYTECODE and unpacks the bundle without bytecode, so every new process
          # would compile tvm_ffi's and our sources again (~0.05 s of a first call); pip byte-compiles at install time.
          [ -d /tmp/site ] && timeout 120 python3 -m compileall -q -j 0 /tmp/site cute_flash > "$out/compileall.log" 2>&1
          step host 240 bash -c "python3 -m profiling.host_overhead --breakdown && python3 -m profiling.cache_first_call --runs 2 \
            --torch-warmup --profile $out/first_call_profile.txt"
          grep -v -i warn "$out/host.log" | grep -v exe_args | tail -n 26 ;;
    hostprof) step hostprof 90 python3 -m profiling.host_overhead --cprofile --backward --calls 200
          head -n 45 "$out/hostprof.log" ;;
    sm90bwd) step sm90bwd 300 python3 -m pytest -q -n 10 --dist loadgroup -p no:cacheprovider -rf tests/test_sm90_bwd.py ;;
    vbench) step vbench 180 python3 -m profiling.varlen_benchmark
          tail -n 14 "$out/vbench.log" ;;
    ncu) step ncu 420 bash -c 'for c in "128 --causal" "128" "256 --causal" "256"; do set -- $c; for impl in cute-flash fa4; do
            name=bwd-d$1${2:+-causal}-$impl; python3 -m profiling.ncu_profile --impl $impl --direction bwd --batch 2 \
            --seqlen 8192 --heads $((2048 / $1)) --head-dim $1 $2 --set full \
            --kernel-regex "Sm90FlashBackward|FlashAttentionBackwardSm90" --out /tmp/ncu/$name \
            && cp /tmp/ncu/$name/summary.txt "'"$out"'/ncu-$name.txt"; done; done'
         tail -n 5 "$out"/ncu-*.txt 2>/dev/null | head -n 60 ;;
    fuzz) step fuzz 540 python3 -m pytest -q -n 12 -p no:cacheprovider -rf tests/test_fuzz_gpu.py ;;
    hotspots) step hotspots 420 bash -c 'for impl in cute-flash fa4; do d=/tmp/ncu/hot-$impl;
            python3 -m profiling.ncu_profile --impl $impl --direction bwd --batch 4 --seqlen 4096 --heads 16 \
            --head-dim 128 --set full --kernel-regex "Sm90FlashBackward|FlashAttentionBackwardSm90" --out $d \
            && cp $d/summary.txt "'"$out"'/hot-summary-$impl.txt" \
            && ${NCU:-ncu} --import $d/profile.ncu-rep --page source --csv --print-source sass > $d/src.csv \
            && python3 -m profiling.hotspots $d/src.csv --top 60 > "'"$out"'/hotspots-$impl.txt"; done'
         head -n 40 "$out"/hotspots-*.txt 2>/dev/null ;;
    serving) step serving 240 python3 -m pytest -q -n 8 -p no:cacheprovider -rf tests/test_kvcache_gpu.py \
            tests/test_sm90_kvcache.py tests/test_sm80_kvcache.py tests/test_sm80_kvcache_features.py \
            tests/test_sm80_kvcache_fp8.py tests/test_decode.py tests/test_split_kv.py tests/test_mods_gpu.py ;;
    decode) step decode 240 bash -c "python3 -m profiling.decode_benchmark --graphs --impls cute,sdpa,fa4 --fp8 \
            --batches 1,8,64 --contexts 4096,32768 --pages 0,16,128 && python3 -m profiling.kvcache_configs --cache bf16 \
            --batches 1,2 --contexts 4096,32768 --pages 0 && python3 -m profiling.kvcache_configs --cache fp8 \
            --batches 8 --contexts 32768 --pages 0"
          grep -v -i warn "$out/decode.log" | tail -n 50 ;;
    *) echo "unknown step $s" ;;
  esac
done
grep -h -E "^(FAILED|ERROR)" "$out"/*.log | head -n 30

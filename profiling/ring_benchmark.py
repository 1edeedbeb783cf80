"""Ring attention (cute_flash.distributed) over W GPUs against the single-GPU kernel at the same per-GPU work.

Spawns one process per GPU itself (no torchrun) with NCCL between them. For each total sequence length N (batch 1,
heads 16, d128, bf16, zigzag by default) and causal or not, it times with CUDA events:
  ring    ring_attention on shards of N / W positions, forward and forward + backward;
  single  cute_flash.attention on one GPU with seqlen_q = N / W and seqlen_k = N: one rank's share of the ring's
          work (its queries against every key), forward and forward + backward.
Each time is the median over 2 to --max-iters calls after a first call at that size (as many as fit --budget-s),
and for the ring the maximum over the ranks.

TFLOP/s count only the (query, key) pairs the mask leaves visible (cute_flash.bench.flops.visible_pairs, exact;
not the halved-causal convention of the main benchmark), 4·b·h·d per pair forward, 2.5x that backward. The ring's
per-GPU rate divides the whole sequence's work by W; efficiency = ring TFLOP/s per GPU / single-GPU TFLOP/s.
The issue's target: >= 90% at W = 2 for N >= 256k. Peak memory is torch.cuda.max_memory_allocated per GPU
(the ring's maximum over ranks). Configurations whose estimated memory exceeds a GPU's free memory are skipped
(an out-of-memory error inside the ring would leave the other ranks waiting).

    python -m profiling.ring_benchmark --out out/ring [--world 2] [--seqlens 131072,262144,524288,1048576]
        [--heads 16] [--head-dim 128] [--causal both|true|false] [--layout zigzag] [--modes fwd,fwd_bwd]

Writes ring_benchmark.json (every row and the environment) and ring_benchmark.txt (the table) into --out. With
2 H200s and the defaults it should take about 4 minutes, most of it at N = 1M (a forward + backward there takes
tens of seconds per call); --seqlens 131072,262144 is a quick run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from profiling import HelpFormatter

GIB = float(1 << 30)


def _parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--out", required=True, help="directory for ring_benchmark.json / .txt")
    ap.add_argument("--world", type=int, default=None, help="GPUs (None: every visible GPU)")
    ap.add_argument("--seqlens", default="131072,262144,524288,1048576", help="total sequence lengths N")
    ap.add_argument("--batch", type=int, default=1, help="batch")
    ap.add_argument("--heads", type=int, default=16, help="query heads")
    ap.add_argument("--heads-kv", type=int, default=None, help="KV heads (None: --heads)")
    ap.add_argument("--head-dim", type=int, default=128, help="head dim")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="input dtype")
    ap.add_argument("--causal", choices=["both", "true", "false"], default="both", help="masks to time")
    ap.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag", help="how the sequence is sharded")
    ap.add_argument("--modes", default="fwd,fwd_bwd", help="fwd and/or fwd_bwd")
    ap.add_argument("--budget-s", type=float, default=2.0, help="timed seconds per measurement (after its first call)")
    ap.add_argument("--max-iters", type=int, default=5, help="timed calls per measurement at most")
    ap.add_argument("--no-single", action="store_true", help="skip the single-GPU baseline")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------------------------------
# Timing (every rank calls these together: the iteration count is agreed over the group)
# ---------------------------------------------------------------------------------------------------------------------
def _all_max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _all_min(x: float) -> float:
    return -_all_max(-x)


def _one_call_ms(fn: Callable[[], object]) -> float:
    dist.barrier()  # the ranks start together, so the ring's time is not another rank's lateness
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _time_ms(fn: Callable[[], object], budget_s: float, max_iters: int) -> Dict[str, float]:
    """Median ms over a few calls after a first one (which also warms the allocator at this size); the maximum over
    the ranks."""
    first = _all_max(_one_call_ms(fn))
    # Never the first call alone: at a new size it pays for allocator growth and NCCL buffer set-up (a 262k-position
    # forward measured 4.0 s first, ~0.45 s after).
    n = min(max_iters, max(2, math.ceil(budget_s * 1e3 / first)))
    samples = [_one_call_ms(fn) for _ in range(n)]
    return {"ms": _all_max(statistics.median(samples)), "calls": len(samples), "first_ms": first}


# ---------------------------------------------------------------------------------------------------------------------
# Work and memory
# ---------------------------------------------------------------------------------------------------------------------
def _pairs(seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    from cute_flash.bench.flops import visible_pairs

    return visible_pairs(seqlen_q, seqlen_k, None, 0 if causal else None)


def _time_modes(opts, modes, fns, pairs: float, tflops_key: str) -> Dict[str, object]:
    """Per mode ("fwd", "fwd_bwd") in `modes`: its time (_time_ms), TFLOP/s of `pairs` visible pairs under
    `tflops_key`, and the peak memory; the maximum over the ranks."""
    from cute_flash.bench.flops import pair_flops, tflops

    row: Dict[str, object] = {}
    for mode, fn in fns:
        if mode not in modes:
            continue
        torch.cuda.reset_peak_memory_stats()
        t = _time_ms(fn, opts.budget_s, opts.max_iters)
        direction = "fwdbwd" if mode == "fwd_bwd" else "fwd"
        flops = pair_flops(pairs, opts.batch, opts.heads, opts.head_dim, opts.head_dim, direction=direction)
        row[mode] = dict(t, **{tflops_key: tflops(flops, t["ms"])})
        row[mode]["peak_gib"] = _all_max(_peak_gib())
    return row


def _estimate_bytes(opts, seqlen_local: int, seqlen: int, single: bool) -> float:
    """A generous estimate of the peak, so that a configuration that would run out of memory is skipped on every rank
    together. Per element of a (seqlen, heads, head_dim) tensor: ring, 16-bit q, k, v, out, dout, dq, dk, dv, the
    K/V shard in flight and block gradients; float32 out / dq accumulators and two dk/dv accumulators (one in
    flight) and the backward kernel's float32 dq. Single: q, out, dout, dq over seqlen_local, k, v, dk, dv over
    seqlen, float32 dq."""
    elems = opts.batch * opts.heads * opts.head_dim
    if single:
        return elems * (seqlen_local * (2 * 4 + 4) + seqlen * 2 * 4) * 1.25
    return elems * seqlen_local * (2 * 13 + 4 * 7) * 1.25


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / GIB


# ---------------------------------------------------------------------------------------------------------------------
# One configuration
# ---------------------------------------------------------------------------------------------------------------------
def _randn(*shape, dtype, requires_grad=False):
    return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_(requires_grad)


def _run_ring(opts, seqlen: int, causal: bool, world: int, dtype, modes) -> Dict[str, object]:
    from cute_flash.distributed import ring_attention

    s = seqlen // world
    hkv = opts.heads_kv or opts.heads
    q = _randn(opts.batch, s, opts.heads, opts.head_dim, dtype=dtype, requires_grad=True)
    k = _randn(opts.batch, s, hkv, opts.head_dim, dtype=dtype, requires_grad=True)
    v = _randn(opts.batch, s, hkv, opts.head_dim, dtype=dtype, requires_grad=True)
    dout = _randn(opts.batch, s, opts.heads, opts.head_dim, dtype=dtype)
    pairs = _pairs(seqlen, seqlen, causal) / world  # the whole sequence's work, per GPU

    def fwd():
        with torch.no_grad():
            return ring_attention(q, k, v, causal=causal, layout=opts.layout)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        ring_attention(q, k, v, causal=causal, layout=opts.layout).backward(dout)

    return _time_modes(opts, modes, (("fwd", fwd), ("fwd_bwd", fwd_bwd)), pairs, "tflops_per_gpu")


def _run_single(opts, seqlen: int, causal: bool, world: int, dtype, modes) -> Dict[str, object]:
    import cute_flash

    s = seqlen // world
    hkv = opts.heads_kv or opts.heads
    q = _randn(opts.batch, s, opts.heads, opts.head_dim, dtype=dtype, requires_grad=True)
    k = _randn(opts.batch, seqlen, hkv, opts.head_dim, dtype=dtype, requires_grad=True)
    v = _randn(opts.batch, seqlen, hkv, opts.head_dim, dtype=dtype, requires_grad=True)
    dout = _randn(opts.batch, s, opts.heads, opts.head_dim, dtype=dtype)
    pairs = _pairs(s, seqlen, causal)

    def fwd():
        with torch.no_grad():
            return cute_flash.attention(q, k, v, causal=causal)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        cute_flash.attention(q, k, v, causal=causal).backward(dout)

    return _time_modes(opts, modes, (("fwd", fwd), ("fwd_bwd", fwd_bwd)), pairs, "tflops")


def _release() -> None:
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def _fits(opts, seqlen: int, world: int, single: bool) -> bool:
    free, _ = torch.cuda.mem_get_info()
    need = _estimate_bytes(opts, seqlen // world, seqlen, single)
    return _all_min(free - need) > 0


def _warm_up(opts, world: int, dtype, causal_flags, modes) -> float:
    """Compiles every kernel the timed calls use (each process compiles its own) and starts NCCL, at a small size."""
    start = time.perf_counter()
    small = dict(vars(opts), budget_s=0.0, max_iters=1)
    small = argparse.Namespace(**small)
    for causal in causal_flags:
        _run_ring(small, 8192 * world, causal, world, dtype, modes)
        if not opts.no_single:
            _run_single(small, 8192 * world, causal, world, dtype, modes)
    _release()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------------
def _fmt(x: Optional[float], spec: str) -> str:
    width = int(spec.split(".")[0])
    return f"{'-':>{width}}" if x is None else format(x, spec)


def _table(rows: List[Dict[str, object]], world: int) -> str:
    head = (
        f"{'seqlen':>8} {'causal':>6} {'mode':>7} | {'ring ms':>9} {'TFLOP/s/GPU':>11} {'peak GiB':>8} | "
        f"{'single ms':>9} {'TFLOP/s':>8} {'peak GiB':>8} | {'eff.':>6}"
    )
    lines = [f"ring attention over {world} GPUs vs one GPU at the same per-GPU work (seqlen_q = N/W, seqlen_k = N)"]
    lines += [head, "-" * len(head)]
    for r in rows:
        for mode in ("fwd", "fwd_bwd"):
            ring = (r.get("ring") or {}).get(mode)
            single = (r.get("single") or {}).get(mode)
            if ring is None and single is None:
                if r.get("skipped") and mode == "fwd":
                    lines.append(f"{r['seqlen']:>8} {str(r['causal']):>6}  skipped: {r['skipped']}")
                continue
            eff = None
            if ring and single:
                eff = 100.0 * ring["tflops_per_gpu"] / single["tflops"]
            lines.append(
                f"{r['seqlen']:>8} {str(r['causal']):>6} {mode:>7} | "
                f"{_fmt(ring and ring['ms'], '9.1f')} {_fmt(ring and ring['tflops_per_gpu'], '11.1f')} "
                f"{_fmt(ring and ring['peak_gib'], '8.2f')} | {_fmt(single and single['ms'], '9.1f')} "
                f"{_fmt(single and single['tflops'], '8.1f')} {_fmt(single and single['peak_gib'], '8.2f')} | "
                f"{_fmt(eff, '5.1f')}%"
            )
            if eff is not None:
                r.setdefault("efficiency_pct", {})[mode] = eff
    return "\n".join(lines)


def _environment(world: int) -> Dict[str, object]:
    import cute_flash

    return {
        "world": world,
        "gpu": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "nccl": str(torch.cuda.nccl.version()),
        "cute_flash": cute_flash.__version__,
        "family": cute_flash.backend(),
    }


def _worker(rank: int, world: int, argv: List[str]) -> None:
    opts = _parse(argv)
    torch.manual_seed(1234 + rank)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[opts.dtype]
    modes = set(opts.modes.split(","))
    causal_flags = {"both": [False, True], "true": [True], "false": [False]}[opts.causal]
    seqlens = [int(x) for x in opts.seqlens.split(",")]
    log = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)

    warm_s = _warm_up(opts, world, dtype, causal_flags, modes)
    log(f"warm-up (compile + NCCL start) {warm_s:.1f} s")
    rows: List[Dict[str, object]] = []
    for causal in causal_flags:
        for seqlen in seqlens:
            row: Dict[str, object] = {"seqlen": seqlen, "causal": causal, "seqlen_local": seqlen // world}
            if seqlen % (2 * world):
                row["skipped"] = f"N not a multiple of 2·W = {2 * world}"
            elif not _fits(opts, seqlen, world, single=False):
                row["skipped"] = "estimated ring memory exceeds a GPU's free memory"
            else:
                t0 = time.perf_counter()
                row["ring"] = _run_ring(opts, seqlen, causal, world, dtype, modes)
                _release()
                if not opts.no_single:
                    if _fits(opts, seqlen, world, single=True):
                        row["single"] = _run_single(opts, seqlen, causal, world, dtype, modes)
                    else:
                        row["single_skipped"] = "estimated memory exceeds a GPU's free memory"
                    _release()
                log(f"N={seqlen} causal={causal}: {time.perf_counter() - t0:.1f} s")
            rows.append(row)
    if rank == 0:
        table = _table(rows, world)
        print(table, flush=True)
        os.makedirs(opts.out, exist_ok=True)
        meta = {"args": vars(opts), "environment": _environment(world), "warm_up_s": warm_s}
        with open(os.path.join(opts.out, "ring_benchmark.json"), "w") as fh:
            json.dump({**meta, "rows": rows}, fh, indent=1)
        with open(os.path.join(opts.out, "ring_benchmark.txt"), "w") as fh:
            fh.write(table + "\n")


def main(argv: Optional[List[str]] = None) -> None:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    opts = _parse(argv)
    world = opts.world or torch.cuda.device_count()
    if world < 1 or world > torch.cuda.device_count():
        raise SystemExit(f"--world {world}: {torch.cuda.device_count()} CUDA GPU(s) visible")
    from cute_flash.distributed.testing import spawn

    start = time.perf_counter()
    spawn(_worker, world, argv, backend="nccl")
    print(f"total {time.perf_counter() - start:.1f} s; results in {opts.out}")


if __name__ == "__main__":
    main()

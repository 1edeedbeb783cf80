"""Study: speed, SM clock and power under sustained load, ours beside FA4, on the varlen benchmark's drawn mix.

A kernel timed back to back runs at whatever clock the GPU's power limit allows; Nsight Compute's one-shot replays
run near the boost clock. Two kernels with the same cycle count can differ in time when one draws more power. Each
row runs back to back for --seconds while `nvidia-smi` samples the SM clock and the board power every 50 ms; rows go in
turn for --rounds rounds. Prints per row: ms per call, mean SM clock (MHz), mean power (W), and ms x clock (millions of
cycles per call: the clock-independent cost).

    python -m profiling.sustained_clocks --seed 1 --seconds 3 --rounds 2 [--dense] [--causal] [--bwd]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from typing import Callable, Dict, List

import torch

from .varlen_benchmark import (
    MAX_LEN,
    MIN_LEN,
    cu_seqlens,
    draw_lengths,
    equal_work_dense,
    fa4_function,
    first_output,
    parse_lengths,
)


def _smi_index() -> str:
    """nvidia-smi's index of the GPU this process uses (CUDA_VISIBLE_DEVICES maps torch's indices), so that on a
    machine with several GPUs only this one is sampled."""
    index = torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


def _sampled(fn: Callable[[], object], seconds: float) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    query = ["--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits", "-lms", "50"]
    smi = subprocess.Popen(["nvidia-smi", "-i", _smi_index(), *query], stdout=subprocess.PIPE, text=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, t0 = 0, time.time()
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(5):
            fn()
        calls += 5
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    out, _ = smi.communicate()
    samples = [[float(x) for x in line.split(",")] for line in out.strip().splitlines() if line.count(",") == 2]
    samples = samples[len(samples) // 5 :]  # the first fifth: the clock still settling
    ms = start.elapsed_time(end) / calls
    clock = statistics.mean(s[0] for s in samples) if samples else float("nan")
    power = statistics.mean(s[1] for s in samples) if samples else float("nan")
    temp = max(s[2] for s in samples) if samples else float("nan")
    return {"ms": ms, "mhz": clock, "w": power, "temp": temp, "mcycles": ms * clock / 1e3}


def _backward_of(forward: Callable[[], torch.Tensor], leaves) -> Callable[[], object]:
    """The backward alone of one forward call, on its graph kept for replay with a fixed dout (as varlen_benchmark)."""
    out = forward()
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lengths", help="these sequence lengths (varlen_benchmark's form, LxN: N of length L), no draw")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dense", action="store_true", help="also the dense calls at equal work (ours and FA4)")
    ap.add_argument("--bwd", action="store_true", help="time each row's backward (autograd on a kept graph) instead")
    args = ap.parse_args(argv)

    import cute_flash

    dev, dtype = "cuda", torch.bfloat16
    lens = parse_lengths(args.lengths) if args.lengths else draw_lengths(65536, MIN_LEN, MAX_LEN, args.seed)
    total, mx = sum(lens), max(lens)

    def make(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype).requires_grad_(args.bwd)

    q, k, v = (make(total, args.heads, args.head_dim) for _ in range(3))
    cu = cu_seqlens(lens, dev)
    rows: Dict[str, Callable] = {
        "ours varlen": lambda: cute_flash.attention_varlen(q, k, v, cu, cu, mx, mx, causal=args.causal)
    }
    fa4 = fa4_function("flash_attn_varlen_func")
    if fa4 is not None:
        rows["FA4 varlen"] = lambda: first_output(
            fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx, causal=args.causal)
        )
    if args.dense:
        batch, seqlen = equal_work_dense(lens)
        dq, dk, dv = (make(batch, seqlen, args.heads, args.head_dim) for _ in range(3))
        rows[f"ours dense {batch}x{seqlen}"] = lambda: cute_flash.attention(dq, dk, dv, causal=args.causal)
        fa4d = fa4_function("flash_attn_func")
        if fa4d is not None:
            rows[f"FA4 dense {batch}x{seqlen}"] = lambda: first_output(fa4d(dq, dk, dv, causal=args.causal))
    if args.bwd:
        rows = {name: _backward_of(fn, (q, k, v) if "varlen" in name else (dq, dk, dv)) for name, fn in rows.items()}
    mask = "causal" if args.causal else "no mask"
    which = f"lengths {args.lengths}" if args.lengths else f"seed {args.seed}"
    print(f"{torch.cuda.get_device_name()}: {which}, {len(lens)} sequences, h{args.heads} d{args.head_dim} "
          f"bf16 {'bwd' if args.bwd else 'fwd'} {mask}, {args.seconds} s per row, {args.rounds} rounds")  # fmt: skip
    results: Dict[str, List[dict]] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, fn in rows.items():
            results[name].append(_sampled(fn, args.seconds))
    print(f"{'row':<26}{'ms':>8}{'MHz':>7}{'W':>6}{'°C':>5}{'Mcycles':>9}")
    for name, rs in results.items():
        for r in rs:
            print(f"{name:<26}{r['ms']:>8.3f}{r['mhz']:>7.0f}{r['w']:>6.0f}{r['temp']:>5.0f}{r['mcycles']:>9.3f}")


if __name__ == "__main__":
    main()

"""Study: speed, SM clock and power under sustained load, ours beside FA4, on the varlen benchmark's drawn mix.

A kernel timed back to back runs at whatever clock the GPU's power limit allows; Nsight Compute's one-shot replays
run near the boost clock. Two kernels with the same cycle count can differ in time when one draws more power. Each
row runs back to back for --seconds while `nvidia-smi` samples the SM clock and the board power every 50 ms; rows go in
turn for --rounds rounds, round r starting at row r (as varlen_benchmark's rounds). Prints per row: ms per call, mean SM
clock (MHz), mean power (W), and ms x clock (millions of cycles per call: the clock-independent cost); then, per seed
and as a geomean over the seeds, each other row's median ms, MHz and Mcycles over ours' ("FA4 varlen" 1.02: FA4 takes
2% longer than ours).

    python -m profiling.sustained_clocks --seeds 1,0,2 --seconds 3 --rounds 2 [--dense] [--causal] [--bwd]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
from typing import Callable, Dict, List

import torch

from .varlen_benchmark import MAX_LEN, MIN_LEN, back_to_back, draw_lengths, parse_lengths, peer_calls, rotated

OURS = "ours varlen"


def _smi_index() -> str:
    """nvidia-smi's index of the GPU this process uses (CUDA_VISIBLE_DEVICES maps torch's indices), so that on a
    machine with several GPUs only this one is sampled."""
    index = torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


def sampled(fn: Callable[[], object], seconds: float) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    query = ["--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits", "-lms", "50"]
    smi = subprocess.Popen(["nvidia-smi", "-i", _smi_index(), *query], stdout=subprocess.PIPE, text=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    calls = back_to_back(fn, seconds)
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


def ratios(results: Dict[str, List[dict]], base: str = OURS) -> Dict[str, Dict[str, float]]:
    """Each row's median ms, MHz and Mcycles over the `base` row's (medians over the rounds): a row that takes longer
    than ours gets an ms ratio above 1."""
    if base not in results:
        return {}
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("ms", "mhz", "mcycles")} for name, rs in results.items()
    }
    return {name: {k: m[k] / med[base][k] for k in m} for name, m in med.items() if name != base}


def geomean_ratios(per_seed: List[Dict[str, Dict[str, float]]]) -> Dict[str, Dict[str, float]]:
    """Geometric means over seeds of `ratios`' values, for the rows every seed has."""
    names = [n for n in (per_seed[0] if per_seed else {}) if all(n in r for r in per_seed)]
    return {
        n: {k: math.exp(statistics.fmean(math.log(r[n][k]) for r in per_seed)) for k in per_seed[0][n]} for n in names
    }


def _print_ratios(label: str, table: Dict[str, Dict[str, float]]) -> None:
    for name, r in table.items():
        print(f"{label:<10} {name:<34} ms {r['ms']:.3f}  MHz {r['mhz']:.3f}  Mcycles {r['mcycles']:.3f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", "--seed", dest="seeds", help="comma-separated draws, each in turn (default 1)")
    ap.add_argument("--lengths", help="these sequence lengths (varlen_benchmark's form, LxN: N of length L), no draw")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dense", action="store_true", help="also the dense calls at equal work (ours and FA4)")
    ap.add_argument("--bwd", action="store_true", help="time each row's backward (autograd on a kept graph) instead")
    args = ap.parse_args(argv)
    if args.lengths and args.seeds:
        ap.error("--lengths times those lengths, not a draw: give --seeds or --lengths, not both")

    seeds = [None] if args.lengths else [int(s) for s in (args.seeds or "1").split(",")]
    per_seed = []
    for seed in seeds:
        results = run_seed(args, seed)
        per_seed.append(ratios(results))
        _print_ratios("lengths" if seed is None else f"seed {seed}", per_seed[-1])
    if len(per_seed) > 1:
        _print_ratios("geomean", geomean_ratios(per_seed))


def run_seed(args, seed) -> Dict[str, List[dict]]:
    """Times one draw's rows (`seed`, or --lengths when None) and prints them; returns each row's samples."""
    lens = parse_lengths(args.lengths) if seed is None else draw_lengths(65536, MIN_LEN, MAX_LEN, seed)
    calls = peer_calls(lens, args.heads, args.head_dim, args.causal, grad=args.bwd, dense=args.dense)
    rows: Dict[str, Callable] = {name: _backward_of(*c) if args.bwd else c[0] for name, c in calls.items()}
    mask = "causal" if args.causal else "no mask"
    which = f"lengths {args.lengths}" if seed is None else f"seed {seed}"
    print(f"{torch.cuda.get_device_name()}: {which}, {len(lens)} sequences, h{args.heads} d{args.head_dim} "
          f"bf16 {'bwd' if args.bwd else 'fwd'} {mask}, {args.seconds} s per row, {args.rounds} rounds")  # fmt: skip
    results: Dict[str, List[dict]] = {name: [] for name in rows}
    for turn in range(args.rounds):
        for name in rotated(list(rows), turn):
            results[name].append(sampled(rows[name], args.seconds))
    width = max(26, *(len(name) + 2 for name in rows))
    print(f"{'row':<{width}}{'ms':>8}{'MHz':>7}{'W':>6}{'°C':>5}{'Mcycles':>9}")
    for name, rs in results.items():
        for r in rs:
            print(f"{name:<{width}}{r['ms']:>8.3f}{r['mhz']:>7.0f}{r['w']:>6.0f}{r['temp']:>5.0f}{r['mcycles']:>9.3f}")
    return results


if __name__ == "__main__":
    main()

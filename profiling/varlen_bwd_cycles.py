"""Study: the cycles of each kernel of one backward (preprocess, main kernel, dQ conversion), ours beside FA4's, on the
varlen benchmark's drawn mixes (packed) and the first mix's equal-work dense shape, as Nsight Compute counts them
(one-shot launches at the clock it finds, caches flushed; no programmatic-launch overlap). Back-to-back timings move
with the power cap by more than the 1-2% this separates.

    ncu --profile-from-start off --clock-control none --csv --print-units base --log-file ncu.csv \\
        --metrics gpc__cycles_elapsed.max,gpu__time_duration.sum \\
        python -m profiling.varlen_bwd_cycles --labels out/bwd_labels.txt [--seeds 1,0,2]
    python -m profiling.varlen_bwd_cycles --join ncu.csv out/bwd_labels.txt

Every row's backward runs once for warm-up, then --repeats times in turn inside the profiler range, each after a
`torch.cuda._sleep` launch that marks where it starts (--join splits the launches there).
"""

from __future__ import annotations

import argparse
from typing import List

import torch

from .varlen_benchmark import MAX_LEN, MIN_LEN, draw_lengths, peer_calls
from .varlen_fwd_variants import ncu_launches

MARKER = "spin_kernel"  # torch.cuda._sleep's kernel


def rows(seeds: List[int], heads: int, head_dim: int, ours_only: bool, tag: str) -> list:
    """(label, forward, leaves) per row: packed per seed (ours, FA4's varlen), then the first seed's equal-work dense
    batch (ours, FA4's); ours labelled `tag`."""
    packed, dense = [], []
    for i, seed in enumerate(seeds):
        lens = draw_lengths(65536, MIN_LEN, MAX_LEN, seed)
        calls = peer_calls(lens, heads, head_dim, grad=True, dense=i == 0, peers=not ours_only)
        for name, (fn, leaves) in calls.items():
            who, kind = name.split(" ", 1)  # "ours varlen", "FA4 dense 12x5248", ...
            who = tag if who == "ours" else who
            if kind == "varlen":
                packed.append((f"seed {seed} {who}", fn, leaves))
            else:
                dense.append((f"{kind} {who}", fn, leaves))
    return packed + dense


def profile(args) -> None:
    prepared = []
    for label, forward, leaves in rows(args.seeds, args.heads, args.head_dim, False, "ours"):
        out = forward()
        dout = torch.randn_like(out)
        torch.autograd.grad(out, leaves, dout, retain_graph=True)  # builds, warms
        prepared.append((label, out, leaves, dout))
    torch.cuda.synchronize()
    labels = []
    torch.cuda.cudart().cudaProfilerStart()
    for _ in range(args.repeats):
        for label, out, leaves, dout in prepared:
            torch.cuda._sleep(1000)
            labels.append(label)
            torch.autograd.grad(out, leaves, dout, retain_graph=True)
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    with open(args.labels, "w") as f:
        f.write("\n".join(labels) + "\n")


def join(ncu_csv: str, labels_path: str) -> None:
    """Per labelled backward: total Mcycles and each kernel's, in launch order."""
    labels = [line.rstrip("\n") for line in open(labels_path) if line.strip()]
    groups, group = [], None
    for launch in ncu_launches(ncu_csv):
        if MARKER in str(launch["kernel"]):
            if group is not None:
                groups.append(group)
            group = []
        elif group is not None:
            group.append(launch)
    if len(groups) != len(labels):
        raise SystemExit(f"{len(groups)} marked backwards but {len(labels)} labels: not the same run")
    print(f"{'row':<34}{'Mcycles':>9}  per kernel (Mcycles, launch order)")
    for label, group in zip(labels, groups):
        cycles = [float(k.get("gpc__cycles_elapsed.max", 0.0)) / 1e6 for k in group]
        print(f"{label:<34}{sum(cycles):>9.3f}  " + " ".join(f"{c:.3f}" for c in cycles))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 0, 2])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--labels", default="out/bwd_labels.txt", help="where the rows' labels go, in launch order")
    ap.add_argument("--join", nargs=2, metavar=("NCU_CSV", "LABELS"), help="print ncu's cycles per labelled row")
    args = ap.parse_args(argv)
    if args.join:
        join(*args.join)
    else:
        profile(args)


if __name__ == "__main__":
    main()

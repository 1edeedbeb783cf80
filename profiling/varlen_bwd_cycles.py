"""Study: the cycles of each kernel of one backward (preprocess, main kernel, dQ conversion), ours beside FA4's, on the
varlen benchmark's drawn mixes (packed) and the first mix's equal-work dense shape, as Nsight Compute counts them
(one-shot launches at the clock it finds, caches flushed; no programmatic-launch overlap). Back-to-back timings move
with the power cap by more than the 1-2% this separates.

    ncu --profile-from-start off --clock-control none --csv --print-units base --log-file ncu.csv \\
        --metrics gpc__cycles_elapsed.max,gpu__time_duration.sum \\
        python -m profiling.varlen_bwd_cycles --labels out/bwd_labels.txt [--variant m80_kb1_at_use] [--seeds 1,0,2]
    python -m profiling.varlen_bwd_cycles --join ncu.csv out/bwd_labels.txt

Every row's backward runs once for warm-up, then --repeats times in turn inside the profiler range, each after a
`torch.cuda._sleep` launch that marks where it starts (--join splits the launches there). --variant: a
profiling/sm90_bwd_variants.py variant, or BwdTileConfig fields as JSON, as the d128 no-mask default
(profiling/bwd_variant_patch.py); then only our rows run (compare with a run without it).
"""

from __future__ import annotations

import argparse
from typing import List

import torch

from .varlen_benchmark import MAX_LEN, MIN_LEN, cu_seqlens, draw_lengths, equal_work_dense, fa4_function, first_output
from .varlen_fwd_variants import ncu_launches

MARKER = "spin_kernel"  # torch.cuda._sleep's kernel


def rows(seeds: List[int], heads: int, head_dim: int, ours_only: bool, tag: str) -> list:
    """(label, forward, leaves) per row: packed per seed, then dense at the first seed's equal work."""
    import cute_flash

    def make(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_(True)

    names = ("flash_attn_varlen_func", "flash_attn_func")
    fa4_varlen, fa4_dense = (None, None) if ours_only else (fa4_function(n) for n in names)
    out = []
    for seed in seeds:
        lens = draw_lengths(65536, MIN_LEN, MAX_LEN, seed)
        cu, mx = cu_seqlens(lens, "cuda"), max(lens)
        q, k, v = (make(sum(lens), heads, head_dim) for _ in range(3))
        ours = lambda q=q, k=k, v=v, cu=cu, mx=mx: cute_flash.attention_varlen(q, k, v, cu, cu, mx, mx)  # noqa: E731
        out.append((f"seed {seed} {tag}", ours, (q, k, v)))
        if fa4_varlen is not None:
            run = lambda q=q, k=k, v=v, cu=cu, mx=mx: first_output(  # noqa: E731
                fa4_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx)
            )
            out.append((f"seed {seed} FA4", run, (q, k, v)))
    batch, seqlen = equal_work_dense(draw_lengths(65536, MIN_LEN, MAX_LEN, seeds[0]))
    q, k, v = (make(batch, seqlen, heads, head_dim) for _ in range(3))
    out.append((f"dense {batch}x{seqlen} {tag}", lambda: cute_flash.attention(q, k, v), (q, k, v)))
    if fa4_dense is not None:
        out.append((f"dense {batch}x{seqlen} FA4", lambda: first_output(fa4_dense(q, k, v)), (q, k, v)))
    return out


def profile(args) -> None:
    if args.variant:
        from .bwd_variant_patch import apply

        apply(args.variant, args.head_dim, "none")
    tag = "ours" + (f" {args.variant}" if args.variant else "")
    prepared = []
    for label, forward, leaves in rows(args.seeds, args.heads, args.head_dim, bool(args.variant), tag):
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
    ap.add_argument("--variant", help="a sm90_bwd_variants variant or JSON BwdTileConfig fields (ours only)")
    ap.add_argument("--labels", default="out/bwd_labels.txt", help="where the rows' labels go, in launch order")
    ap.add_argument("--join", nargs=2, metavar=("NCU_CSV", "LABELS"), help="print ncu's cycles per labelled row")
    args = ap.parse_args(argv)
    if args.join:
        join(*args.join)
    else:
        profile(args)


if __name__ == "__main__":
    main()

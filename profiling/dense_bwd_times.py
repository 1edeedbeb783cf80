"""The dense backward's time at a few d128 shapes, with each kernel's device time (GPU).

    python3 -m profiling.dense_bwd_times [LABEL]

Shapes: b11 s5888 (none, causal), b4 s4096, b16 s4096, b2 s8192 (none); h16 d128 bf16. do_bench medians of
`torch.autograd.grad` on a kept graph, and `bwd_breakdown.kernel_times` per kernel. Used to time two trees in
alternation (run the baseline from inside its own tree: profiling/baseline_tree.sh), docs/performance.md session 19.
"""

import sys

import torch
from triton.testing import do_bench

import cute_flash
from profiling.bwd_breakdown import kernel_times

SHAPES = [(11, 5888, False), (11, 5888, True), (4, 4096, False), (16, 4096, False), (2, 8192, False)]


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else ""
    for b, s, causal in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(b, s, 16, 128, generator=g, device="cuda").bfloat16().requires_grad_(True) for _ in range(3)
        )
        out = cute_flash.attention(q, k, v, causal=causal)
        dout = torch.randn_like(out)

        def bwd():
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        ms = do_bench(bwd, warmup=50, rep=200, return_mode="median")
        tflops = 2.5 * 4 * b * 16 * s * s * 128 * (0.5 if causal else 1) / ms / 1e9
        parts = ", ".join(f"{n} {us:.0f}" for n, us in sorted(kernel_times(bwd, 5).items(), key=lambda kv: -kv[1]))
        print(f"{label} b{b} s{s} causal={causal}: {ms:.3f} ms {tflops:.0f} TF/s  {parts}", flush=True)


if __name__ == "__main__":
    main()

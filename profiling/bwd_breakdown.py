"""Per-kernel GPU time of one backward pass, cute-flash beside FlashAttention-4 (GPU).

  python3 -m profiling.bwd_breakdown --head-dims 64,128,256 --seqlens 1024,4096,16384 [--iters 10]

Runs `torch.autograd.grad` of each implementation's output `--iters` times under torch.profiler and prints, per
kernel, the mean device time of one backward (preprocess, memset, main kernel, postprocess, conversions), so a gap
in the end-to-end backward can be split into the main kernel and everything around it. Shapes as in the issue grid:
bf16, batch·seqlen = 16k tokens, heads·d = 2048.
"""

from __future__ import annotations

import argparse
import collections

import torch


def _short(name: str) -> str:
    for key, short in (
        ("Sm90FlashBackward", "main"),
        ("FlashAttentionBackwardSm90", "main"),
        ("Preprocess", "preprocess"),
        ("preprocess", "preprocess"),
        ("Postprocess", "postprocess"),
        ("DqConvert", "postprocess"),
        ("postprocess", "postprocess"),
        ("AccumConvert", "dkv_convert"),
        ("fill", "memset"),
        ("Memset", "memset"),
    ):
        if key in name:
            return short
    return name[:60]


def kernel_times(fn, iters: int) -> dict:
    """Mean device time (µs) per call of `fn`, per kernel (short names), under torch.profiler."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per_kernel = collections.defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[_short(evt.name)] += evt.device_time / iters
    return dict(per_kernel)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--seqlens", default="1024,4096,16384")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()

    import cute_flash
    from flash_attn.cute import flash_attn_func

    def fa4(q, k, v, causal):
        result = flash_attn_func(q, k, v, causal=causal)
        return result[0] if isinstance(result, tuple) else result

    impls = {"cute-flash": lambda q, k, v, c: cute_flash.attention(q, k, v, causal=c), "fa4": fa4}
    print(f"{'d':>4} {'seqlen':>6} {'causal':>6} {'impl':>10} {'total':>8} {'main':>8}  others (µs)")
    for d in [int(x) for x in args.head_dims.split(",")]:
        for seqlen in [int(x) for x in args.seqlens.split(",")]:
            for causal in (False, True):
                b, h = max(1, 16384 // seqlen), 2048 // d
                q, k, v, dout = (
                    torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(4)
                )
                for name, impl in impls.items():
                    out = impl(q, k, v, causal)

                    def bwd(out=out):
                        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

                    times = kernel_times(bwd, args.iters)
                    total = sum(times.values())
                    others = ", ".join(f"{k} {t:.0f}" for k, t in sorted(times.items()) if k != "main")
                    print(
                        f"{d:>4} {seqlen:>6} {str(causal):>6} {name:>10} {total:8.0f} {times.get('main', 0):8.0f}  "
                        f"{others}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()

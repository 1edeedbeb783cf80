"""score_mod / mask_mod speed (GPU): cute-flash's forward (`attention(score_mod=, mask_mod=, block_mask=)`) beside
FlexAttention (torch.compile'd flex_attention, its default Triton backend, with its own block mask) and the plain
kernels (`causal=True`, no mods) in one process, d128 bf16, 16 query heads / 16 KV heads.

    python3 -m profiling.mods_benchmark                          # every example at 4 x 4k and 1 x 16k
    python3 -m profiling.mods_benchmark --examples alibi,causal --shapes 1x16384

Prints ms (do_bench median) and cute-flash's speed-up over FlexAttention per example; dense FLOPs
(4 b h s^2 d, halved for causal masks) as TFLOP/s where the mask keeps every key or a causal half.
"""

from __future__ import annotations

import argparse
import sys

EXAMPLES = ("alibi", "t5_bias", "softcap", "causal", "sliding", "document", "prefix_lm")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", default=",".join(EXAMPLES), help="comma-separated, of " + ",".join(EXAMPLES))
    p.add_argument("--shapes", default="4x4096,1x16384", help="batch x seqlen pairs")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    args = p.parse_args(argv)
    args.examples = [e for e in args.examples.split(",") if e]
    bad = [e for e in args.examples if e not in EXAMPLES]
    if bad:
        p.error(f"unknown examples {bad}; choose from {EXAMPLES}")
    args.shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",") if s]
    return args


def _callables(name, b, s, h, device):
    """(score_mod, mask_mod, dense-FLOP fraction) of one example, tables on `device`."""
    import torch

    if name == "alibi":
        slopes = torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)], device=device)
        return (lambda sc, bb, hh, qi, ki: sc - slopes[hh] * (qi - ki)), None, 1.0
    if name == "t5_bias":
        table = torch.randn(h, 257, device=device) * 0.1
        return (lambda sc, bb, hh, qi, ki: sc + table[hh, torch.clamp(ki - qi, -128, 128) + 128]), None, 1.0
    if name == "softcap":
        return (lambda sc, bb, hh, qi, ki: 30.0 * torch.tanh(sc / 30.0)), None, 1.0
    if name == "causal":
        return None, (lambda bb, hh, qi, ki: qi >= ki), 0.5
    if name == "sliding":
        return None, (lambda bb, hh, qi, ki: (qi >= ki) & (qi - ki < 1024)), None
    if name == "document":
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(s // 16, s // 4, (64,), generator=g).cumsum(0)
        doc = torch.searchsorted(lengths, torch.arange(s), right=True).to(device).expand(b, s).contiguous()
        return None, (lambda bb, hh, qi, ki: (doc[bb, qi] == doc[bb, ki]) & (qi >= ki)), None
    prefix = torch.full((b,), s // 8, device=device, dtype=torch.int32)
    return None, (lambda bb, hh, qi, ki: (ki < prefix[bb]) | (qi >= ki)), None


def main(argv=None) -> int:
    args = _parse(argv)
    import torch
    from triton.testing import do_bench

    import cute_flash

    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}: torch {torch.__version__}; d128 bf16, heads {args.heads}")
    flex = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import create_block_mask as flex_block_mask
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = 256  # one graph per example and shape
        flex = torch.compile(flex_attention, dynamic=False)
    print(f"{'example':>10} {'shape':>9} {'cute ms':>8} {'flex ms':>8} {'causal=True ms':>14} {'cute TF/s':>9} "
          f"{'cute / flex':>11}")  # fmt: skip
    for b, s in args.shapes:
        h = args.heads
        q, k, v = (torch.randn(b, s, h, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
        with torch.no_grad():
            plain = do_bench(lambda: cute_flash.attention(q, k, v, causal=True), warmup=20, rep=200)
        for name in args.examples:
            score_mod, mask_mod, frac = _callables(name, b, s, h, dev)
            block = None
            if mask_mod is not None:
                block = cute_flash.mods.create_block_mask(mask_mod, b if name in ("document", "prefix_lm") else None,
                                                          None, s, s, device=dev)  # fmt: skip
            with torch.no_grad():
                fn = lambda: cute_flash.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,  # noqa: E731
                                                  block_mask=block)  # fmt: skip
                ref = fn()
                ours = do_bench(fn, warmup=20, rep=200)
                theirs = float("nan")
                if flex is not None:
                    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                    fb = None
                    if mask_mod is not None:
                        fb = flex_block_mask(mask_mod, b if name in ("document", "prefix_lm") else None, None, s, s,
                                             device=dev)  # fmt: skip
                    ffn = lambda: flex(qt, kt, vt, score_mod=score_mod, block_mask=fb)  # noqa: E731
                    err = (ffn().transpose(1, 2).float() - ref.float()).abs().max().item()
                    if err > 0.05:
                        print(f"  {name}: cute-flash and FlexAttention differ by {err:.3g}", file=sys.stderr)
                    theirs = do_bench(ffn, warmup=20, rep=200)
            tf = f"{4 * b * h * s * s * 128 * frac / ours / 1e9:9.0f}" if frac else f"{'-':>9}"
            print(f"{name:>10} {b}x{s:>7} {ours:8.3f} {theirs:8.3f} {plain:14.3f} {tf} {theirs / ours:11.2f}",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""score_mod / mask_mod speed (GPU): cute-flash's forward (`attention(score_mod=, mask_mod=, block_mask=)`) beside
FlexAttention (torch.compile'd flex_attention, its default Triton backend, with its own block mask), FlashAttention-4
(`flash_attn.cute.flash_attn_func` with CuTe DSL score_mod / mask_mod callbacks, the same tables, and block-sparse
tensors from that FlexAttention block mask: profiling/fa4_mods.py) and the plain kernels (`causal=True`, no mods) in
one process, d128 bf16, 16 query heads / 16 KV heads.

    python3 -m profiling.mods_benchmark                          # every example at 4 x 4k and 1 x 16k
    python3 -m profiling.mods_benchmark --examples alibi,causal --shapes 1x16384
    python3 -m profiling.mods_benchmark --no-fa4 --no-flex       # cute-flash alone
    python3 -m profiling.mods_benchmark --backward --no-fa4      # forward + backward (dq, dk, dv) beside Flex

Prints ms (do_bench median) and cute-flash's speed-up over FlexAttention and over FA4 per example; dense FLOPs
(4 b h s^2 d, halved for causal masks) as TFLOP/s where the mask keeps every key or a causal half. FA4 is on where
flash_attn.cute imports (softcap through its own `softcap=` argument, which it applies as a score_mod); a cell it
cannot fill (FA4 absent, or raising for that example) reads n/a, with the reason on stderr. FlexAttention's and FA4's
outputs are checked against cute-flash's (a warning on stderr past 0.05). With --backward every column times a
forward and its backward (torch.autograd.grad of q, k, v; TF/s from 3.5x the forward's FLOPs).
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
    p.add_argument("--no-fa4", action="store_true", help="skip FlashAttention-4 (on by default where it imports)")
    p.add_argument("--backward", action="store_true", help="time forward + backward instead of the forward")
    args = p.parse_args(argv)
    args.examples = [e for e in args.examples.split(",") if e]
    bad = [e for e in args.examples if e not in EXAMPLES]
    if bad:
        p.error(f"unknown examples {bad}; choose from {EXAMPLES}")
    args.shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",") if s]
    return args


def _callables(name, b, s, h, device):
    """(score_mod, mask_mod, dense-FLOP fraction, tables) of one example, tables on `device`. `tables` holds what
    the callables read (tensors and constants), for FA4's callbacks (profiling/fa4_mods.py) to read the same."""
    import torch

    if name == "alibi":
        slopes = torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)], device=device)
        return (lambda sc, bb, hh, qi, ki: sc - slopes[hh] * (qi - ki)), None, 1.0, {"slopes": slopes}
    if name == "t5_bias":
        far = 128  # relative distances clamp to +-far: the table has 2 * far + 1 buckets
        table = torch.randn(h, 2 * far + 1, device=device) * 0.1
        score_mod = lambda sc, bb, hh, qi, ki: sc + table[hh, torch.clamp(ki - qi, -far, far) + far]  # noqa: E731
        return score_mod, None, 1.0, {"table": table, "max_distance": far}
    if name == "softcap":
        return (lambda sc, bb, hh, qi, ki: 30.0 * torch.tanh(sc / 30.0)), None, 1.0, {}
    if name == "causal":
        return None, (lambda bb, hh, qi, ki: qi >= ki), 0.5, {}
    if name == "sliding":
        window = 1024
        return None, (lambda bb, hh, qi, ki: (qi >= ki) & (qi - ki < window)), None, {"window": window}
    if name == "document":
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(s // 16, s // 4, (64,), generator=g).cumsum(0)
        doc = torch.searchsorted(lengths, torch.arange(s), right=True).to(device).expand(b, s).contiguous()
        return None, (lambda bb, hh, qi, ki: (doc[bb, qi] == doc[bb, ki]) & (qi >= ki)), None, {"doc": doc}
    prefix = torch.full((b,), s // 8, device=device, dtype=torch.int32)
    return None, (lambda bb, hh, qi, ki: (ki < prefix[bb]) | (qi >= ki)), None, {"prefix": prefix}


def _suspect(name, fn, ours, block, do_bench):
    """A row more than 2x behind a peer: timed again, its host time alone, and how many tiles its lists visit, on
    stderr (whether the kernel, the host path or the lists were slow)."""
    import time

    import torch

    again = do_bench(fn, warmup=5, rep=50)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        fn()
    host = (time.perf_counter() - start) / 20 * 1e3
    torch.cuda.synchronize()
    lists = ""
    if block is not None:
        cached = block.__dict__.get("_key_tile_lists", {})
        lists = "; ".join(f"{t}: {int(c.count.sum())} of {c.index.numel()} tiles" for t, c in cached.items())
    print(
        f"  {name}: {ours:.3f} ms (again {again:.3f}; host {host:.3f} ms per call unsynchronised); lists {lists}",
        file=sys.stderr,
    )


def _timed(call, inputs, grad):
    """call itself (no grad), or with `grad` a forward + backward: the gradients of `inputs` for that output
    gradient."""
    import torch

    if grad is None:
        return call
    return lambda: torch.autograd.grad(call(), inputs, grad)


def _cell(value, width, digits):
    """A time or a ratio, right-aligned in `width`; n/a where it was not measured (nan)."""
    return f"{'n/a':>{width}}" if value != value else f"{value:{width}.{digits}f}"


def main(argv=None) -> int:
    args = _parse(argv)
    import torch
    from triton.testing import do_bench

    import cute_flash

    from profiling import fa4_mods

    dev = torch.device("cuda")
    fa4 = not args.no_fa4
    if fa4:
        why = fa4_mods.unavailable()
        if why is not None:
            print(f"FA4 not timed: {why}", file=sys.stderr)
            fa4 = False
    print(f"{torch.cuda.get_device_name()}: torch {torch.__version__}; d128 bf16, heads {args.heads}"
          + (f"; FA4 {fa4_mods.version()}" if fa4 else ""))  # fmt: skip
    flex = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = 256  # one graph per example and shape
        flex = torch.compile(flex_attention, dynamic=False)
    print(f"{'example':>10} {'shape':>9} {'cute ms':>8} {'flex ms':>8} {'fa4 ms':>8} {'causal=True ms':>14} "
          f"{'cute TF/s':>9} {'cute / flex':>11} {'cute / fa4':>10}")  # fmt: skip
    for b, s in args.shapes:
        h = args.heads
        q, k, v = (torch.randn(b, s, h, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
        grad = grad_t = None
        if args.backward:
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            grad = torch.randn_like(q)
            grad_t = grad.transpose(1, 2)  # (FlexAttention's (b, h, s, d) output)
        with torch.set_grad_enabled(args.backward):
            plain_fn = _timed(lambda: cute_flash.attention(q, k, v, causal=True), (q, k, v), grad)
            plain = do_bench(plain_fn, warmup=20, rep=200)
        for name in args.examples:
            score_mod, mask_mod, frac, tables = _callables(name, b, s, h, dev)
            per_batch = b if name in ("document", "prefix_lm") else None
            block = fb = None
            if mask_mod is not None:
                block = cute_flash.mods.create_block_mask(mask_mod, per_batch, None, s, s, device=dev)
                if flex is not None or fa4:
                    from torch.nn.attention.flex_attention import create_block_mask as flex_block_mask

                    # One FlexAttention block mask for Flex and FA4, at FA4's sm90 d128 tile (128 x 128; FA4 wants
                    # its block-sparse tensors at its tile: profiling/fa4_mods.py), which is Flex's default too.
                    fb = flex_block_mask(mask_mod, per_batch, None, s, s, device=dev, BLOCK_SIZE=fa4_mods.BLOCK_SIZE)
            with torch.set_grad_enabled(args.backward):
                call = lambda: cute_flash.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,  # noqa: E731
                                                    block_mask=block)  # fmt: skip
                fn = _timed(call, (q, k, v), grad)
                ref = call().detach()
                ours = do_bench(fn, warmup=20, rep=200)
                theirs = float("nan")
                if flex is not None:
                    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                    fcall = lambda: flex(qt, kt, vt, score_mod=score_mod, block_mask=fb)  # noqa: E731
                    err = (fcall().detach().transpose(1, 2).float() - ref.float()).abs().max().item()
                    if err > 0.05:
                        print(f"  {name}: cute-flash and FlexAttention differ by {err:.3g}", file=sys.stderr)
                    theirs = do_bench(_timed(fcall, (q, k, v), grad_t), warmup=20, rep=200)
                fa4_ms = float("nan")
                if fa4 and args.backward:
                    print(f"  {name}: FA4 not timed with --backward", file=sys.stderr)
                elif fa4:
                    try:
                        afn = fa4_mods.fa4_call(name, q, k, v, tables, fb)
                        err = (afn().float() - ref.float()).abs().max().item()
                        if err > 0.05:
                            print(f"  {name}: cute-flash and FA4 differ by {err:.3g}", file=sys.stderr)
                        fa4_ms = do_bench(afn, warmup=20, rep=200)
                    except Exception as e:  # noqa: BLE001 - FA4 lacking this example on this GPU: n/a, go on
                        print(f"  {name} {b}x{s}: FA4 n/a: {fa4_mods.reason(e)}", file=sys.stderr)
                if ours > 2 * min(theirs, fa4_ms):  # (nan compares False) a row 5x off was seen twice: say more
                    _suspect(name, fn, ours, block, do_bench)
            flops = 4 * b * h * s * s * 128 * (3.5 if args.backward else 1.0)
            tf = f"{flops * frac / ours / 1e9:9.0f}" if frac else f"{'-':>9}"
            print(f"{name:>10} {b}x{s:>7} {ours:8.3f} {_cell(theirs, 8, 3)} {_cell(fa4_ms, 8, 3)} {plain:14.3f} "
                  f"{tf} {_cell(theirs / ours, 11, 2)} {_cell(fa4_ms / ours, 10, 2)}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

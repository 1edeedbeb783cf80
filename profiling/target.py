"""One attention configuration, launched so that a profiler sees only the launches that matter.

Warm-up calls (JIT compilation included) run first; then the profiled calls run between
cudaProfilerStart/Stop, each inside an NVTX range named `cf_profile`, so that
`ncu --profile-from-start off --nvtx --nvtx-include cf_profile/` picks exactly those kernels.

  python -m profiling.target --impl cute-flash --dtype bf16 --direction fwd --batch 2 --seqlen 8192 \
      --heads 16 --head-dim 128 --causal --meta out/meta.json

With --varlen-seed S the call is packed (`cute_flash.attention_varlen`, or FA4's `flash_attn_varlen_func` for
--impl fa4): batch x seqlen tokens in sequences drawn as profiling.varlen_benchmark draws them (128..8192, seed S);
the meta's FLOPs are the sequences' own, its IO-model bytes those of the dense batch x seqlen case. With
--varlen-equal the packed call has batch sequences of seqlen each: the dense shape's work through the packed kernel.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

NVTX_RANGE = "cf_profile"


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """The configuration flags, shared with profiling.ncu_profile, which passes them through."""
    p.add_argument("--impl", default="cute-flash", help="cute-flash, fa4, sdpa-cudnn, ... (as in the benchmark)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp8"))
    p.add_argument("--direction", default="fwd", choices=("fwd", "bwd"))
    p.add_argument("--causal", action="store_true")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=8192, help="seqlen_q and seqlen_k unless --seqlen-k is given")
    p.add_argument("--seqlen-k", type=int, default=None)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--heads-kv", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--head-dim-v", type=int, default=None)
    p.add_argument("--tile-m", type=int, default=128, help="query tile of the IO model (bytes FlashAttention reads)")
    p.add_argument("--tile-n", type=int, default=128, help="key tile of the backward IO model")
    p.add_argument(
        "--varlen-seed", type=int, default=None, help="packed: lengths drawn with this seed (cute-flash, fa4)"
    )
    p.add_argument(
        "--varlen-equal", action="store_true", help="packed: batch sequences of seqlen each (the dense shape, packed)"
    )


def config_argv(args) -> list:
    """The flags that reproduce `args`' configuration (for the profiled subprocess)."""
    argv = [
        "--impl",
        args.impl,
        "--dtype",
        args.dtype,
        "--direction",
        args.direction,
        "--batch",
        str(args.batch),
        "--seqlen",
        str(args.seqlen),
        "--heads",
        str(args.heads),
        "--head-dim",
        str(args.head_dim),
        "--tile-m",
        str(args.tile_m),
        "--tile-n",
        str(args.tile_n),
    ]
    for flag, value in (
        ("--seqlen-k", args.seqlen_k),
        ("--heads-kv", args.heads_kv),
        ("--head-dim-v", args.head_dim_v),
        ("--varlen-seed", args.varlen_seed),
    ):
        if value is not None:
            argv += [flag, str(value)]
    return argv + (["--varlen-equal"] if args.varlen_equal else []) + (["--causal"] if args.causal else [])


def case_from_args(args):
    from cute_flash.bench.grid import Case, Shape

    shape = Shape(
        args.batch,
        args.seqlen,
        args.seqlen_k or args.seqlen,
        args.heads,
        args.heads_kv or args.heads,
        args.head_dim,
        args.head_dim_v or args.head_dim,
    )
    return Case(args.dtype, args.direction, args.causal, shape)


def describe(args) -> dict:
    """The configuration, its FLOPs and the DRAM bytes the IO model predicts (see profiling/io_model.py)."""
    from .io_model import predicted_bytes

    case = case_from_args(args)
    meta = {
        "impl": args.impl,
        "case": case.as_dict(),
        "label": case.label(),
        "flops": case.flops,
        "io_bytes": predicted_bytes(case, tile_m=args.tile_m, tile_n=args.tile_n),
    }
    if packed(args):
        lens = varlen_lengths(args)
        shape = case.shape
        fwd = sum(4 * shape.heads * shape.head_dim * s * s for s in lens) * (0.5 if args.causal else 1.0)
        meta["flops"] = fwd * (2.5 if args.direction == "bwd" else 1.0)
        drawn = "equal" if args.varlen_equal else f"seed {args.varlen_seed}"
        meta["label"] = f"{case.label()} packed: {len(lens)} sequences {min(lens)}..{max(lens)} ({drawn})"
        meta["lengths"] = lens
    return meta


def packed(args) -> bool:
    """Whether the call is packed (--varlen-seed or --varlen-equal)."""
    return args.varlen_seed is not None or args.varlen_equal


def varlen_lengths(args) -> list:
    from .varlen_benchmark import MAX_LEN, MIN_LEN, draw_lengths

    if args.varlen_equal:
        return [args.seqlen] * args.batch
    return draw_lengths(args.batch * args.seqlen, MIN_LEN, MAX_LEN, args.varlen_seed)


def _varlen_call(args, case):
    """The packed call of --varlen-seed / --varlen-equal (forward, or a backward on a kept graph)."""
    import torch

    from .varlen_benchmark import cu_seqlens

    if args.impl not in ("cute-flash", "fa4") or case.dtype not in ("bf16", "fp16"):
        raise SystemExit("--varlen-seed / --varlen-equal: --impl cute-flash or fa4, --dtype bf16 or fp16")
    lens = varlen_lengths(args)
    shape, dev = case.shape, "cuda"
    dtype = torch.bfloat16 if case.dtype == "bf16" else torch.float16
    grad = case.direction == "bwd"
    total, mx = sum(lens), max(lens)
    cu = cu_seqlens(lens, dev)
    q = torch.randn(total, shape.heads, shape.head_dim, device=dev, dtype=dtype, requires_grad=grad)
    k, v = (
        torch.randn(total, shape.heads_kv, d, device=dev, dtype=dtype, requires_grad=grad)
        for d in (shape.head_dim, shape.head_dim_v)
    )
    if args.impl == "cute-flash":
        import cute_flash

        def fn():
            return cute_flash.attention_varlen(q, k, v, cu, cu, mx, mx, causal=args.causal)
    else:
        from .varlen_benchmark import fa4_function, first_output

        fa4 = fa4_function("flash_attn_varlen_func")
        if fa4 is None:
            raise SystemExit("--impl fa4: flash_attn.cute does not import")

        def fn():
            return first_output(
                fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx, causal=args.causal)
            )

    if not grad:
        return fn
    out = fn()
    dout = torch.randn_like(out)

    def call():
        for t in (q, k, v):
            t.grad = None
        out.backward(dout, retain_graph=True)

    return call


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(p)
    p.add_argument("--warmup", type=int, default=2, help="unprofiled calls first (compilation happens here)")
    p.add_argument("--iters", type=int, default=1, help="profiled calls")
    p.add_argument("--meta", default=None, help="write the configuration, FLOPs and IO-model bytes here (JSON)")
    args = p.parse_args(argv)

    import torch

    from cute_flash.bench.peers import select_impls
    from cute_flash.bench.runner import make_inputs

    case = case_from_args(args)
    impls = select_impls([args.impl], log=lambda m: print(m, file=sys.stderr))
    if not impls:
        return 2
    impl = impls[0]
    reason = impl.unsupported_reason(case)
    if reason:
        print(f"target: {args.impl} cannot run {case.label()}: {reason}", file=sys.stderr)
        return 2
    if args.meta:
        os.makedirs(os.path.dirname(os.path.abspath(args.meta)), exist_ok=True)
        with open(args.meta, "w") as f:
            json.dump(describe(args), f, indent=1)

    scale = 1.0 / math.sqrt(case.shape.head_dim)
    if packed(args):
        call = _varlen_call(args, case)
    elif case.direction == "fwd":
        q, k, v = make_inputs(case)
        call = lambda: impl(q, k, v, case, scale)  # noqa: E731
    else:
        q, k, v = make_inputs(case, requires_grad=True)
        out = impl(q, k, v, case, scale)
        dout = torch.randn_like(out)

        def call():
            for t in (q, k, v):
                t.grad = None
            out.backward(dout, retain_graph=True)

    for _ in range(args.warmup):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(args.iters):
        torch.cuda.nvtx.range_push(NVTX_RANGE)
        call()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"target: profiled {args.iters} call(s) of {args.impl} on {case.label()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

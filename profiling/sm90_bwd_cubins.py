"""CPU, no GPU: cross-compiles one sm90 backward main kernel (ours, or FlashAttention-4's for comparison) with fake
tensors and keeps its PTX and cubin, for `profiling.sass_census`.

    python -m profiling.sm90_bwd_cubins --impl ours --head-dim 128 --mask causal --out /tmp/c/ours_causal \
        [--override '{"tile_m": 80, "dq_swap_ab": true}'] [--role bwd_gqa]
    PYTHONPATH=/path/to/flash-attention python -m profiling.sm90_bwd_cubins --impl fa4 --head-dim 128 \
        --mask causal --out /tmp/c/fa4_causal [--tile-m 64]

`--impl ours` builds the role's kernel from `bwd_tile_config(spec)` (its deterministic build's for `*_det` roles) with
`--override` applied (BwdTileConfig fields, JSON); to compile a patched copy of the package, put that copy first on
PYTHONPATH. `--impl fa4` needs flash_attn.cute (FA4's sources) and quack-kernels importable; it takes FA4's own d128
choice (`_tile_size_bwd_sm90`: 64 x 128 causal, 80 x 128 without a mask) unless `--tile-m 64` forces the 64-row
tile (and then dQ_swapAB off). quack's package __init__ imports triton-backed modules; on a machine without triton,
install quack with `pip install --no-deps --target DIR` and drop those three imports from DIR/quack/__init__.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import time


def _ours(args):
    from cute_flash import compile_cache
    from cute_flash.arch.sm90.backward import _build, kernel_key
    from cute_flash.arch.sm90.tile_config import bwd_tile_config
    from cute_flash.spec import AttentionSpec

    spec = AttentionSpec(dtype=args.dtype, head_dim=args.head_dim, head_dim_v=args.head_dim, mask=args.mask)
    # (a deterministic role from the deterministic build's configuration, as calls take it)
    cfg = bwd_tile_config(spec, deterministic=args.role.endswith("_det"))
    cfg = dataclasses.replace(cfg, **json.loads(args.override))
    print(cfg)
    _build(args.role, *kernel_key(args.role, spec, cfg), "sm_90a", compile_cache.keep_artifacts_options(args.out))


def _fa4(args):
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
    from flash_attn.cute.interface import _tile_size_bwd_sm90
    from flash_attn.cute.utils import AuxData

    d, causal = args.head_dim, args.mask == "causal"
    cfg = _tile_size_bwd_sm90(d, d, causal, False)
    if args.tile_m:
        cfg = dataclasses.replace(cfg, m_block_size=args.tile_m, dQ_swapAB=args.tile_m % 64 != 0)
    print(cfg)
    dt = cutlass.BFloat16 if args.dtype == "bf16" else cutlass.Float16

    def fake(shape, dtype=dt, div=8):
        strides = tuple(cute.sym_int64(divisibility=div) for _ in shape[:-1]) + (1,)
        return cute.runtime.make_fake_tensor(dtype, tuple(shape), strides, assumed_align=16)

    b, sq, sk, h = (cute.sym_int() for _ in range(4))
    sq_pad, dq_len = cute.sym_int(divisibility=cfg.m_block_size), cute.sym_int(divisibility=cfg.m_block_size * d)
    q, k, v, do, dk, dv = (fake((b, s, h, d)) for s in (sq, sk, sk, sq, sk, sk))
    lse, dpsum = (fake((b, h, sq_pad), cutlass.Float32, 4) for _ in range(2))
    dq_accum = fake((b, h, dq_len), cutlass.Float32, cfg.m_block_size * d)
    kernel = FlashAttentionBackwardSm90(
        dt, d, d, 1, causal, is_local=False, deterministic=False, tile_m=cfg.m_block_size,
        tile_n=cfg.n_block_size, Q_stage=cfg.num_stages_Q, dO_stage=cfg.num_stages_dO, PdS_stage=cfg.num_stages_PdS,
        SdP_swapAB=cfg.SdP_swapAB, dKV_swapAB=cfg.dKV_swapAB, dQ_swapAB=cfg.dQ_swapAB,
        AtomLayoutMSdP=cfg.AtomLayoutMSdP, AtomLayoutNdKV=cfg.AtomLayoutNdKV, AtomLayoutMdQ=cfg.AtomLayoutMdQ,
        num_threads=(cfg.num_wg + 1) * 128, V_in_regs=False, dQ_single_wg=cfg.dQ_single_wg,
    )  # fmt: skip
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    # (softmax_scale, cu_seqlens_q/k, seqused_q/k, window left/right, dQ/dK/dV semaphores, aux, block sparsity,
    # cu_total_m_blocks, stream): FA4's __call__ order.
    opts = f"--gpu-arch sm_90a --enable-tvm-ffi --keep-ptx --keep-cubin --dump-dir {args.out} remarks{{ptx}}"
    none9 = (None,) * 9
    cute.compile(kernel, q, k, v, do, lse, dpsum, dq_accum, dk, dv, cutlass.Float32(1.0), *none9, AuxData(), None,
                 None, stream, options=opts)  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=("ours", "fa4"), default="ours")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--mask", choices=("none", "causal"), default="none")
    ap.add_argument("--role", default="bwd", help="ours: bwd, bwd_gqa, bwd_det, bwd_gqa_det")
    ap.add_argument("--override", default="{}", help="ours: BwdTileConfig fields as JSON")
    ap.add_argument("--tile-m", type=int, default=0, help="fa4: force this tile_m")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.makedirs(args.out, exist_ok=True)
    t = time.time()
    (_ours if args.impl == "ours" else _fa4)(args)
    print(f"compiled in {time.time() - t:.1f} s:", *glob.glob(os.path.join(args.out, "*.cubin")), sep="\n  ")


if __name__ == "__main__":
    main()

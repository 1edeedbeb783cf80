"""Compiling and launching the sm90 FP8 forward: what the sm90 backend calls for `spec.dtype == "fp8"`.

  fp8_unsupported_reason(spec)             None, or why this spec has no FP8 kernel (a sentence)
  run_forward_fp8(q8, k8, v_t8, out, lse, descale=..., spec=..., softmax_scale=..., mask=...)
  compile_fp8_artifacts(spec, target)      [KernelArtifact] for the `compile` command (fake tensors, no GPU)

Inputs are what `cute_flash.fp8.prepare.Fp8Inputs` holds: q8 (b, sq, h, d), k8 (b, sk, h_kv, d) e4m3; v_t8
(b, h_kv, dv, sk_pad) e4m3 with keys permuted per 16; descale = {"q": (b, h, q blocks), "k", "v": (b, h_kv, k blocks)}
float32. The kernel is compiled once per (target, spec, config) with symbolic batch, seqlens and heads.
"""

from __future__ import annotations

import tempfile
from typing import Dict, List, Optional

import torch

from .... import compile_cache
from ....spec import AttentionSpec, MaskBounds
from ...base import KernelArtifact
from ....common.dsl_types import dsl_dtype
from ....common.fake_tensors import fake_tensor
from .tile_config import FP8_MAX_HEAD_DIM, Fp8FwdConfig, budget_problem, fp8_fwd_config, kv_scale_block, smem_bytes

FAMILY = "sm90"


def fp8_unsupported_reason(spec: AttentionSpec) -> Optional[str]:
    if spec.dtype != "fp8":
        return f"the sm90 FP8 kernel computes in fp8, not {spec.dtype}"
    if spec.out_dtype not in ("bf16", "fp16"):
        return f"the sm90 FP8 kernel writes out bf16 or fp16, not {spec.out_dtype}"
    for name, d in (("head_dim", spec.head_dim), ("head_dim_v", spec.head_dim_v)):
        if d % 32 != 0 or not 32 <= d <= FP8_MAX_HEAD_DIM:
            return (
                f"the sm90 FP8 kernel needs {name} a multiple of 32 up to {FP8_MAX_HEAD_DIM} (e4m3 wgmma k = 32), "
                f"got {d}"
            )
    if spec.mask not in ("none", "causal", "local"):
        return f"unknown mask kind {spec.mask!r}"
    missing = [name for name, on in (("soft-capping", spec.softcap), ("learnable sinks", spec.sink)) if on]
    if missing:
        return f"the sm90 FP8 forward has no {' or '.join(missing)} (the bf16 / fp16 kernels have them)"
    return budget_problem(fp8_fwd_config(spec.head_dim, spec.head_dim_v, spec.mask), spec.head_dim, spec.head_dim_v)


def build_fp8_forward(spec: AttentionSpec, cfg: Fp8FwdConfig, target: str, extra_options: str = ""):
    """The compiled kernel: fn(q8, k8, v_t8, out, lse, q_descale, k_descale, v_descale, scale, left, right)."""
    compile_cache.ensure_cute_dsl_arch("sm_90a")
    import cutlass
    import cutlass.cute as cute

    from .flash_fwd import Sm90FlashForwardFp8

    fp8 = cutlass.Float8E4M3FN
    out_dtype = dsl_dtype(spec.out_dtype)
    b, sq, sk, h, hkv = (cute.sym_int() for _ in range(5))
    sk_pad = cute.sym_int(divisibility=16)

    tensor = fake_tensor

    q = tensor(fp8, (b, sq, h, spec.head_dim), 16)  # TMA: 16-byte strides
    k = tensor(fp8, (b, sk, hkv, spec.head_dim), 16)
    v_t = tensor(fp8, (b, hkv, spec.head_dim_v, sk_pad), 16)
    out = tensor(out_dtype, (b, sq, h, spec.head_dim_v), 8)
    lse = tensor(cutlass.Float32, (b, h, sq), 1, align=4)
    q_descale = tensor(cutlass.Float32, (b, h, cute.sym_int()), 1, align=4)
    nkb = cute.sym_int()
    k_descale = tensor(cutlass.Float32, (b, hkv, nkb), 1, align=4)
    v_descale = tensor(cutlass.Float32, (b, hkv, nkb), 1, align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = Sm90FlashForwardFp8(spec, cfg)
    options = compile_cache.compile_options(target, extra=extra_options)
    return cute.compile(
        kernel,
        q,
        k,
        v_t,
        out,
        lse,
        q_descale,
        k_descale,
        v_descale,
        cutlass.Float32(1.0),
        cutlass.Int32(0),
        cutlass.Int32(0),
        stream,
        options=options,
    )


def _kernel(spec: AttentionSpec, target: str, cfg: Optional[Fp8FwdConfig] = None):
    cfg = cfg or fp8_fwd_config(spec.head_dim, spec.head_dim_v, spec.mask)
    key = (FAMILY, target, "fwd_fp8", spec, cfg)
    return compile_cache.get_or_compile(key, lambda: build_fp8_forward(spec, cfg, target))


def run_forward_fp8(
    q8: torch.Tensor,
    k8: torch.Tensor,
    v_t8: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    descale: Dict[str, torch.Tensor],
    spec: AttentionSpec,
    softmax_scale: float,
    mask: MaskBounds,
    cfg: Optional[Fp8FwdConfig] = None,
) -> None:
    """Fills out and lse. `cfg` overrides the default configuration (benchmarks, the accumulation study)."""
    reason = fp8_unsupported_reason(spec)
    if reason is not None:
        raise NotImplementedError(reason)
    if descale is None:
        raise ValueError("the FP8 kernel needs descale factors {'q', 'k', 'v'} (see cute_flash.fp8.prepare)")
    block = kv_scale_block(spec.head_dim, spec.head_dim_v)
    key_blocks = -(-k8.shape[1] // block)
    for name in ("k", "v"):
        if descale[name].shape[-1] != key_blocks:
            # A wrong block size would index other blocks' factors without any error: refuse it.
            raise ValueError(
                f"descale[{name!r}] has {descale[name].shape[-1]} key blocks; the sm90 FP8 kernel reads one per "
                f"{block} keys at this head dim ({key_blocks} for seqlen_k {k8.shape[1]}): prepare the inputs with "
                f"block_n={block}"
            )
    target = compile_cache.runtime_target(q8.device)
    kernel = _kernel(spec, target, cfg)
    kernel(
        q8,
        k8,
        v_t8,
        out,
        lse,
        descale["q"],
        descale["k"],
        descale["v"],
        float(softmax_scale),
        int(mask.left),
        int(mask.right),
    )


def compile_fp8_artifacts(spec: AttentionSpec, target: str, cfg: Optional[Fp8FwdConfig] = None) -> List[KernelArtifact]:
    reason = fp8_unsupported_reason(spec)
    if reason is not None:
        raise NotImplementedError(reason)
    compile_cache.ensure_cute_dsl_arch(target)
    cfg = cfg or fp8_fwd_config(spec.head_dim, spec.head_dim_v, spec.mask)
    from ....census import read_artifacts
    from ....fp8.prepare import BLOCK_M
    from ....fp8.prepass_kernel import prepass_artifacts

    with tempfile.TemporaryDirectory(prefix="cute_flash_sm90_fp8_") as dump:
        compiled = build_fp8_forward(spec, cfg, target, compile_cache.keep_artifacts_options(dump))
        ptx, cubin = read_artifacts(compiled)
    config = {
        **cfg.as_dict(),
        "shared_bytes": smem_bytes(cfg, spec.head_dim, spec.head_dim_v),
        "threads": cfg.tile.num_threads,
    }
    forward = KernelArtifact(kernel="fwd_fp8", ptx=ptx, cubin=cubin, config=config)
    # The pre-pass that feeds it from fp16/bf16 inputs (the output dtype is the inputs' dtype).
    return [forward] + prepass_artifacts(spec, target, BLOCK_M, kv_scale_block(spec.head_dim, spec.head_dim_v))

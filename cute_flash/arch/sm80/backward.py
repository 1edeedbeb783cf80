"""The sm80 backward pass: preprocess, main kernel, postprocess (see flash_bwd.py for the algorithm).

    1. preprocess:  D = rowsum(dO * O) and lse_log2 (both (b, h, sq_padded) fp32, padding rows inert)
    2. main:        per key tile: dK, dV in registers; dQ added with fp32 atomics to dq_accum, (b, sq_padded, h, d)
                    or, in the "fragment" layout (tile_config.BwdTileConfig.dq_layout), (b, h, sq_padded * d)
    3. postprocess: dq = scale * dq_accum in the input dtype

Under GQA/MQA the main kernel's dK/dV are partial sums per query head; they are added with fp32 atomics into
(b, sk_padded, h_kv, d) buffers that the postprocess converts as well.

Sinks (spec.sink) change no kernel: dsink is computed on the host from lse and the preprocess's D (dlse folded in),
arch/base.sink_grad; the kernels are those of the spec without the sink (`kernel_spec`).

The kernels take one head dim, a multiple of 32. Other calls (head_dim != head_dim_v, e.g. DeepSeek's (192, 128) on
Ampere, or a head dim such as 80) run them at the wider of the two rounded up to a multiple of 32, with the operands
zero-padded to it, exactly (arch/padded_head_dims.py).

Kernels are compiled once per (target, role, spec, tile config) with symbolic batch, sequence and head extents and
launched through TVM-FFI on torch's current stream.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from typing import Callable, List, Optional

import torch

from ... import compile_cache
from ...mods.graph import MAX_TABLES
from ...spec import AttentionSpec, ModsSpec
from ...validation import Problem, VarlenProblem, kernel_view
from ..base import BwdTensors, Grads, KernelArtifact, PackedSeqs, fold_lse_grad, fold_lse_grad_packed, sink_grad
from ..padded_head_dims import padded_launcher, widened_problem, widened_spec
from ...common.dsl_types import dsl_dtype
from ...common.fake_tensors import fake_f32, fake_tensor
from ...common.packed import PRE_POST_ROWS, packed_pads, padded_rows
from .tile_config import BwdTileConfig, bwd_tile_config

FAMILY = "sm80"
_PRE_POST_BLOCK_M = PRE_POST_ROWS  # rows per CTA of the preprocess / postprocess kernels
_SUPPORTED_DTYPES = ("fp16", "bf16")
_MAX_HEAD_DIM = 256


# ---------------------------------------------------------------------------------------------------- support
def backward_unsupported_reason(spec: AttentionSpec) -> Optional[str]:
    if spec.kvcache:
        return "the KV-cache forward (attention_with_kvcache) has no backward"
    if spec.dtype not in _SUPPORTED_DTYPES:
        return f"the sm80 backward supports fp16 and bf16 inputs, not {spec.dtype}"
    if spec.out_dtype != spec.dtype:
        return f"the sm80 backward needs out_dtype equal to the input dtype ({spec.dtype}), got {spec.out_dtype}"
    if isinstance(spec, ModsSpec) and (spec.head_dim != spec.head_dim_v or spec.head_dim % 32):
        return "score_mod / mask_mod have a backward at head_dim == head_dim_v, a multiple of 32, only"
    if isinstance(spec, ModsSpec) and spec.varlen and spec.block_sparse:
        return "the score_mod / mask_mod backward takes no block mask with packed sequences"
    if not 0 < max(spec.head_dim, spec.head_dim_v) <= _MAX_HEAD_DIM:
        dims = f"{spec.head_dim}" if spec.head_dim == spec.head_dim_v else f"({spec.head_dim}, {spec.head_dim_v})"
        return f"the sm80 backward supports head dims up to {_MAX_HEAD_DIM}, got {dims}"
    return None


def kernel_width(spec: AttentionSpec) -> int:
    """The head dim of the kernels serving `spec`: the wider of head_dim and head_dim_v rounded up to a multiple of
    32, the kernels' (the narrower operands zero-padded to it: arch/padded_head_dims.py)."""
    return -(-max(spec.head_dim, spec.head_dim_v) // 32) * 32


def plain_spec(spec: AttentionSpec) -> AttentionSpec:
    """`spec` as a plain AttentionSpec (a ModsSpec without its callables)."""
    if not isinstance(spec, ModsSpec):
        return spec
    return AttentionSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(AttentionSpec)})


def kernel_spec(spec: AttentionSpec) -> AttentionSpec:
    """The spec the kernels serving `spec` are built for: at the kernel width, and without the sink, which changes
    no kernel of the backward (its gradient is computed on the host, `sink_grad`)."""
    return dataclasses.replace(widened_spec(spec, (kernel_width(spec),) * 2), sink=False)


# ---------------------------------------------------------------------------------------------------- compiling
def _fake_bshd(dtype, batch, seqlen, heads, head_dim, align=16):
    # 8-element outer strides for fp32 accumulators too (what their buffers are allocated with).
    return fake_tensor(dtype, (batch, seqlen, heads, head_dim), 8, align)


def _fake_bhs(batch, heads, seqlen, divisibility=1):
    return fake_f32((batch, heads, seqlen), divisibility)


def _build_preprocess(spec: AttentionSpec, options: str, target: str, cfg: Optional[BwdTileConfig] = None):
    import cutlass.cute as cute

    from .flash_bwd_preprocess import BackwardPreprocessSm80

    if spec.varlen:
        return _build_packed("bwd_preprocess", spec, options, target, cfg)
    dt = dsl_dtype(spec.dtype)
    b, sq, sq_pad, h = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    kernel = BackwardPreprocessSm80(dt, spec.head_dim_v, block_m=_PRE_POST_BLOCK_M)
    return cute.compile(
        kernel,
        _fake_bshd(dt, b, sq, h, spec.head_dim_v),
        _fake_bshd(dt, b, sq, h, spec.head_dim_v),
        _fake_bhs(b, h, sq),
        _fake_bhs(b, h, sq_pad, divisibility=_PRE_POST_BLOCK_M),
        _fake_bhs(b, h, sq_pad, divisibility=_PRE_POST_BLOCK_M),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        options=options,
    )


def _fake_dq_accum(cfg, b, sq_pad, h, d):
    import cutlass
    import cutlass.cute as cute

    if cfg.dq_layout == "fragment":
        strides = (cute.sym_int64(divisibility=cfg.block_m * d), cute.sym_int64(divisibility=cfg.block_m * d), 1)
        return cute.runtime.make_fake_tensor(cutlass.Float32, (b, h, cute.sym_int()), strides, assumed_align=16)
    return _fake_bshd(cutlass.Float32, b, sq_pad, h, d)


def _build_main(
    spec: AttentionSpec,
    options: str,
    target: str,
    cfg: Optional[BwdTileConfig] = None,
    *,
    gqa: bool,
    seqused: bool = False,
):
    import cutlass
    import cutlass.cute as cute

    from .flash_bwd import Sm80FlashBackward

    if spec.varlen:
        return _build_packed("bwd_gqa" if gqa else "bwd", spec, options, target, cfg, seqused)
    dt = dsl_dtype(spec.dtype)
    d = spec.head_dim
    b, sq, sk, h, h_kv = (cute.sym_int() for _ in range(5))
    sq_pad, sk_pad = cute.sym_int(), cute.sym_int()
    dkv_dtype = cutlass.Float32 if gqa else dt
    dkv_rows = sk_pad if gqa else sk
    cfg = cfg or bwd_tile_config(d, target)
    if isinstance(spec, ModsSpec):
        return _build_main_mods(spec, options, cfg, gqa)
    kernel = Sm80FlashBackward(spec, cfg, gqa)
    softcap = (cutlass.Float32(0.0),) if spec.softcap else ()  # the `features` entry's softcap
    return cute.compile(
        kernel.features if spec.softcap else kernel,
        _fake_bshd(dt, b, sq, h, d),  # q
        _fake_bshd(dt, b, sk, h_kv, d),  # k
        _fake_bshd(dt, b, sk, h_kv, d),  # v
        _fake_bshd(dt, b, sq, h, d),  # dout
        _fake_bhs(b, h, sq_pad, divisibility=_PRE_POST_BLOCK_M),  # lse_log2
        _fake_bhs(b, h, sq_pad, divisibility=_PRE_POST_BLOCK_M),  # dpsum
        _fake_dq_accum(cfg, b, sq_pad, h, d),  # dq_accum
        _fake_bshd(dkv_dtype, b, dkv_rows, h_kv, d),  # dk or dk_accum
        _fake_bshd(dkv_dtype, b, dkv_rows, h_kv, d),  # dv or dv_accum
        None,  # no semaphores: this family has no deterministic build
        None,
        cutlass.Float32(1.0),
        cutlass.Int32(0),
        cutlass.Int32(0),
        *softcap,
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        options=options,
    )


def _build_main_mods(spec: ModsSpec, options: str, cfg: BwdTileConfig, gqa: bool):
    """The main kernel with a score_mod / mask_mod (flash_bwd_mods.py): the `mods` entry, its tables fake tensors of
    the graphs' read types and ranks (as the forward's, build.build_forward_mods)."""
    import cutlass
    import cutlass.cute as cute

    from ...common.fake_tensors import fake_mods_tables
    from .flash_bwd_mods import Sm80ModsBackward

    dt, d = dsl_dtype(spec.dtype), spec.head_dim
    b, sq, sk, h, h_kv = (cute.sym_int() for _ in range(5))
    sq_pad, sk_pad = cute.sym_int(), cute.sym_int()
    dkv_dtype = cutlass.Float32 if gqa else dt
    dkv_rows = sk_pad if gqa else sk
    kernel = Sm80ModsBackward(spec, cfg, gqa)
    return cute.compile(
        kernel.mods,
        _fake_bshd(dt, b, sq, h, d),
        _fake_bshd(dt, b, sk, h_kv, d),
        _fake_bshd(dt, b, sk, h_kv, d),
        _fake_bshd(dt, b, sq, h, d),
        _fake_bhs(b, h, sq_pad, divisibility=_PRE_POST_BLOCK_M),
        _fake_bhs(b, h, sq_pad, divisibility=_PRE_POST_BLOCK_M),
        _fake_dq_accum(cfg, b, sq_pad, h, d),
        _fake_bshd(dkv_dtype, b, dkv_rows, h_kv, d),
        _fake_bshd(dkv_dtype, b, dkv_rows, h_kv, d),
        cutlass.Float32(1.0),
        cutlass.Int32(0),
        cutlass.Int32(0),
        *fake_mods_tables(spec),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        options=options,
    )


def _build_postprocess(
    spec: AttentionSpec, options: str, target: str, cfg: Optional[BwdTileConfig] = None, *, fragment: bool = False
):
    """An fp32 accumulator's conversion: (b, s_padded, h, d) rows, or with `fragment` dQ's "fragment" layout."""
    import cutlass
    import cutlass.cute as cute

    from .flash_bwd_postprocess import AccumConvertSm80, DqFragmentConvertSm80

    if spec.varlen:
        return _build_packed("bwd_dq_postprocess" if fragment else "bwd_postprocess", spec, options, target, cfg)
    dt, d = dsl_dtype(spec.dtype), spec.head_dim
    b, s, s_pad, h = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    if fragment:
        cfg = cfg or bwd_tile_config(d, target)
        kernel, accum = DqFragmentConvertSm80(dt, d, cfg), _fake_dq_accum(cfg, b, s_pad, h, d)
    else:
        kernel, accum = AccumConvertSm80(dt, d, block_m=_PRE_POST_BLOCK_M), _fake_bshd(cutlass.Float32, b, s_pad, h, d)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, accum, _fake_bshd(dt, b, s, h, d), cutlass.Float32(1.0), stream, options=options)


def _build_packed(
    role: str, spec: AttentionSpec, options: str, target: str, cfg: Optional[BwdTileConfig], seqused: bool = False
):
    """The packed (varlen) twin of `role`: q / k / v / dout (total, h, d), row statistics (h, padded rows), the fp32
    accumulators with padded rows (sequence b from its padded offset and pads, common/packed.py); batch is
    cu_seqlens' length - 1. Kernels take their padding and grid extent as runtime ints."""
    import cutlass
    import cutlass.cute as cute

    from .flash_bwd import Sm80FlashBackward
    from .flash_bwd_postprocess import AccumConvertSm80, DqFragmentConvertSm80
    from .flash_bwd_preprocess import BackwardPreprocessSm80
    from ...common.fake_tensors import fake_cu_seqlens, fake_packed_preprocess_args

    dt = dsl_dtype(spec.dtype)
    d, dv = spec.head_dim, spec.head_dim_v
    cfg = cfg or bwd_tile_config(d, target)
    tq, tk, tq_pad, tk_pad, h, h_kv, n = (cute.sym_int() for _ in range(7))
    i32, f32, stream = (
        cutlass.Int32(0),
        cutlass.Float32(1.0),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )

    def rows(dtype, total, heads, dim):  # outer strides of whole 16-byte units, as kernel_view guarantees
        return fake_tensor(dtype, (total, heads, dim), 8, 16)

    def stats(total):
        return fake_f32((h, total))

    if role == "bwd_preprocess":
        kernel = BackwardPreprocessSm80(dt, dv, block_m=_PRE_POST_BLOCK_M, varlen=True)
        return cute.compile(kernel.packed, *fake_packed_preprocess_args(dt, dv), stream, options=options)
    if role == "bwd_postprocess":
        kernel = AccumConvertSm80(dt, d, block_m=_PRE_POST_BLOCK_M, varlen=True)
        args = (rows(cutlass.Float32, tq_pad, h, d), rows(dt, tq, h, d), f32, fake_cu_seqlens(n))
        return cute.compile(kernel.packed, *args, i32, i32, stream, options=options)
    if cfg.dq_layout == "fragment":
        dq_accum = cute.runtime.make_fake_tensor(
            cutlass.Float32, (h, cute.sym_int()), (cute.sym_int64(divisibility=d), 1), assumed_align=16
        )
    else:
        dq_accum = rows(cutlass.Float32, tq_pad, h, d)
    if role == "bwd_dq_postprocess":
        kernel = DqFragmentConvertSm80(dt, d, cfg, varlen=True)
        return cute.compile(kernel.packed, dq_accum, rows(dt, tq, h, d), f32, fake_cu_seqlens(n), i32, i32, stream,
                            options=options)  # fmt: skip
    gqa = role == "bwd_gqa"
    dkv = rows(cutlass.Float32, tk_pad, h_kv, d) if gqa else rows(dt, tk, h_kv, d)
    dkv2 = rows(cutlass.Float32, tk_pad, h_kv, d) if gqa else rows(dt, tk, h_kv, d)
    if isinstance(spec, ModsSpec):  # (flash_bwd_mods.py's `packed_mods` entry: the tables after the scalars)
        from ...common.fake_tensors import fake_mods_tables
        from .flash_bwd_mods import Sm80ModsBackward

        tensors = (rows(dt, tq, h, d), rows(dt, tk, h_kv, d), rows(dt, tk, h_kv, d), rows(dt, tq, h, d),
                   stats(tq_pad), stats(tq_pad), dq_accum, dkv, dkv2)  # fmt: skip
        packed = (fake_cu_seqlens(cute.sym_int()), fake_cu_seqlens(cute.sym_int()),
                  fake_cu_seqlens(n) if seqused else None, i32)  # fmt: skip
        kernel = Sm80ModsBackward(spec, cfg, gqa)
        return cute.compile(kernel.packed_mods, *tensors, f32, i32, i32, *fake_mods_tables(spec), *packed, stream,
                            options=options)  # fmt: skip
    kernel = Sm80FlashBackward(spec, cfg, gqa)
    softcap = (f32,) if spec.softcap else ()  # the `packed_features` entry's softcap
    return cute.compile(
        kernel.packed_features if spec.softcap else kernel.packed,
        rows(dt, tq, h, d),  # q
        rows(dt, tk, h_kv, d),  # k
        rows(dt, tk, h_kv, d),  # v
        rows(dt, tq, h, d),  # dout
        stats(tq_pad),  # lse_log2
        stats(tq_pad),  # dpsum
        dq_accum,
        dkv,
        dkv2,
        None,  # no semaphores: this family has no deterministic build
        None,
        f32,
        i32,
        i32,
        *softcap,
        fake_cu_seqlens(cute.sym_int()),
        fake_cu_seqlens(cute.sym_int()),
        fake_cu_seqlens(n) if seqused else None,
        i32,
        stream,
        options=options,
    )


_ROLES = {
    "bwd_preprocess": _build_preprocess,
    "bwd": functools.partial(_build_main, gqa=False),
    "bwd_gqa": functools.partial(_build_main, gqa=True),
    "bwd_postprocess": _build_postprocess,
    "bwd_dq_postprocess": functools.partial(_build_postprocess, fragment=True),  # only for the "fragment" dQ layout
    # Packed (varlen) main kernels reading seqused_k (the other roles serve both).
    "bwd_seqused": functools.partial(_build_main, gqa=False, seqused=True),
    "bwd_gqa_seqused": functools.partial(_build_main, gqa=True, seqused=True),
}
_MAIN_ROLES = ("bwd", "bwd_gqa", "bwd_seqused", "bwd_gqa_seqused")  # their code depends on the mask
_TILED_ROLES = _MAIN_ROLES + ("bwd_dq_postprocess",)  # roles whose code depends on the main kernel's tile config


def _roles(spec: AttentionSpec, target: str, cfg: Optional[BwdTileConfig] = None) -> List[str]:
    fragment = (cfg or bwd_tile_config(spec.head_dim, target)).dq_layout == "fragment"
    return [r for r in _ROLES if (fragment or r != "bwd_dq_postprocess") and not r.endswith("_seqused")]


def _role_config(role: str, spec: AttentionSpec, target: str, cfg: Optional[BwdTileConfig] = None) -> dict:
    if role in _TILED_ROLES:
        return (cfg or bwd_tile_config(spec.head_dim, target)).as_dict(spec.head_dim)
    return {"block_m": _PRE_POST_BLOCK_M, "threads": 128, "shared_bytes": 0}


@functools.lru_cache(maxsize=None)
def _cache_key(role: str, spec: AttentionSpec, target: str, cfg: Optional[BwdTileConfig] = None) -> tuple:
    """(family, target, role, spec, tile): preprocess / postprocess code depends on dtype and head dim, not the mask.
    Memoised because the launch path asks for it on every call."""
    key_spec = spec
    if role not in _MAIN_ROLES:
        key_spec = AttentionSpec(spec.dtype, spec.head_dim, spec.head_dim_v, "none", varlen=spec.varlen)
    return (FAMILY, target, role, key_spec, tuple(sorted(_role_config(role, spec, target, cfg).items())))


def _options(role: str, spec: AttentionSpec, target: str, extra: str = "", cfg: Optional[BwdTileConfig] = None) -> str:
    if role in _TILED_ROLES:
        extra = f"--opt-level {(cfg or bwd_tile_config(spec.head_dim, target)).opt_level} {extra}".strip()
    return compile_cache.compile_options(target, extra=extra)


def _kernel(role: str, spec: AttentionSpec, target: str, cfg: Optional[BwdTileConfig] = None):
    """The compiled kernel of `role`; cfg: a tile config other than the default (studies)."""
    key = _cache_key(role, spec, target, cfg)
    compile_cache.ensure_cute_dsl_arch(target)
    return compile_cache.get_or_compile(
        key, lambda: _ROLES[role](key[3], _options(role, key[3], target, cfg=cfg), target, cfg)
    )


def preprocess_kernel(spec: AttentionSpec, target: str):
    """The compiled preprocess (D and lse_log2, padded to whole 64-row blocks): (out, dout, lse, dpsum, lse_log2).
    The sm90 backward reuses it too."""
    return _kernel("bwd_preprocess", spec, target)


def accum_convert_kernel(spec: AttentionSpec, target: str):
    """The compiled fp32-accumulator conversion: (accum (b, s_padded, h, d), out (b, s, h, d), scale).
    The sm90 backward reuses it for its GQA dK / dV sums."""
    return _kernel("bwd_postprocess", spec, target)


def warm_backward(spec: AttentionSpec, target: str, *, gqa: bool) -> None:
    """Gets every kernel `run_backward` launches for `spec` (default tile config) under the same cache keys."""
    spec = kernel_spec(spec)
    pspec = plain_spec(spec)  # (as backward_launcher: the pre- and postprocess do not depend on a score_mod / mask_mod)
    _kernel("bwd_preprocess", pspec, target)
    _kernel("bwd_gqa" if gqa else "bwd", spec, target)
    _kernel("bwd_postprocess", pspec, target)
    if bwd_tile_config(spec.head_dim, target).dq_layout == "fragment":
        _kernel("bwd_dq_postprocess", pspec, target)


def compile_backward_artifacts(
    spec: AttentionSpec, target: str, roles: Optional[List[str]] = None
) -> List[KernelArtifact]:
    """Compiles every backward kernel serving `spec` for `target` with fake tensors (no GPU needed), or only
    `roles` of them."""
    reason = backward_unsupported_reason(spec)
    if reason is not None:
        raise NotImplementedError(reason)
    spec = kernel_spec(spec)
    compile_cache.ensure_cute_dsl_arch(target)
    artifacts = []
    with tempfile.TemporaryDirectory(prefix="cute_flash_sm80_bwd_") as dump:
        for role in _roles(spec, target) if roles is None else roles:
            build = _ROLES[role]
            sub = os.path.join(dump, role)
            # remarks{ptx}: ptxas reports registers and spills on stderr, where the compile command reads them.
            options = _options(role, spec, target, compile_cache.keep_artifacts_options(sub))
            compiled = build(spec, options, target)
            artifacts.append(
                KernelArtifact(
                    kernel=role,
                    ptx=compiled.artifacts.PTX,
                    cubin=compiled.artifacts.CUBIN,
                    config=_role_config(role, spec, target),
                )
            )
    return artifacts


# ---------------------------------------------------------------------------------------------------- running
def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def grad_views(q, k, v, dout, out, dq, dk, dv) -> list:
    """The backward's tensors as its kernels take them (validation.kernel_view, never a copy), in this order."""
    names = ("q", "k", "v", "dout", "out", "dq", "dk", "dv")
    return [kernel_view(t, copy=False, name=n) for n, t in zip(names, (q, k, v, dout, out, dq, dk, dv))]


def dkv_destinations(dk: torch.Tensor, dv: torch.Tensor, gqa: bool, block: int):
    """Where the main kernel writes dK / dV (dense (b, sk, h_kv, d) tensors): dk / dv themselves, or under GQA zeroed
    fp32 accumulators with sk rounded up to `block` rows, which a conversion kernel then turns into dk / dv."""
    if not gqa:
        return dk, dv
    f32 = dict(dtype=torch.float32, device=dk.device)
    padded = lambda t: (t.shape[0], _round_up(t.shape[1], block), *t.shape[2:])  # noqa: E731
    return torch.zeros(padded(dk), **f32), torch.zeros(padded(dv), **f32)


def packed_dkv_destinations(dk: torch.Tensor, dv: torch.Tensor, gqa: bool, seqused: bool, rows_k: int):
    """Where a packed main kernel writes dK / dV ((total_k, h_kv, d) tensors): under GQA zeroed fp32 sums of rows_k
    padded rows (common/packed.py), which a conversion kernel then turns into dk / dv; else dk / dv themselves,
    zeroed first with seqused_k (the kernel writes only the first seqused_k[b] keys' rows; the others' gradients are
    zero)."""
    if gqa:
        f32 = dict(dtype=torch.float32, device=dk.device)
        return torch.zeros(rows_k, *dk.shape[1:], **f32), torch.zeros(rows_k, *dv.shape[1:], **f32)
    if seqused:
        dk.zero_()
        dv.zero_()
    return dk, dv


def packed_rows(stats: torch.Tensor, cu_seqlens_q: torch.Tensor, pad: int, total_q: int) -> torch.Tensor:
    """The (h, total_q) rows of a packed row statistic `stats` (h, padded rows), in which sequence b starts at its
    padded offset (common/packed.py): a gather on the device (no host copy of cu_seqlens). Each row finds its
    sequence by a sorted search of the sequence ends (empty sequences own no row)."""
    cu = cu_seqlens_q.long()
    rows = torch.arange(total_q, device=stats.device)
    seq = torch.searchsorted(cu[1:], rows, right=True)
    starts = torch.div(cu[:-1] + torch.arange(cu.shape[0] - 1, device=cu.device) * pad, pad, rounding_mode="floor")
    return stats[:, starts[seq] * pad + rows - cu[seq]]


def run_backward(t: BwdTensors, grads: Grads, problem: Problem, cfg: Optional[BwdTileConfig] = None) -> None:
    """Fills `grads` (shaped and typed like q, k, v) on torch's current stream. cfg: a tile config other than the
    default (for studies of other tiles)."""
    backward_launcher(problem, t.q.device, cfg)(t, grads)


def backward_launcher(
    problem: Problem, device, cfg: Optional[BwdTileConfig] = None, checked: bool = True
) -> Callable[[BwdTensors, Grads], None]:
    """`run_backward` of one dense `problem` on `device` as launch(t, grads), with what depends only on them (the
    kernels, the buffers' shapes, the scalars) settled once. checked: every tensor goes through kernel_view's check
    (grad_views: raises for a layout the kernels cannot take); the eager plan, whose tensors are in the kernels'
    layout by construction, keeps an unchecked launcher."""
    spec, softmax_scale, mask = problem.spec, problem.softmax_scale, problem.mask
    reason = backward_unsupported_reason(spec)
    if reason is not None:
        raise NotImplementedError(reason)
    width = kernel_width(spec)
    if (problem.head_dim, problem.head_dim_v) != (width, width):
        dims = (width, width)
        return padded_launcher(dims, backward_launcher(widened_problem(problem, dims), device, cfg, checked))
    target = compile_cache.runtime_target(device)
    override = cfg
    cfg = cfg or bwd_tile_config(spec.head_dim, target)
    batch, seqlen_q, nheads, head_dim = problem.batch, problem.seqlen_q, problem.nheads, problem.head_dim
    gqa = nheads != problem.nheads_kv
    seqlen_q_pad = _round_up(seqlen_q, max(cfg.block_m, _PRE_POST_BLOCK_M))
    f32 = dict(dtype=torch.float32, device=device)
    stats_shape = (batch, nheads, seqlen_q_pad)
    fragment = cfg.dq_layout == "fragment"
    dq_accum_shape = (batch, nheads, seqlen_q_pad * head_dim) if fragment else (batch, seqlen_q_pad, nheads, head_dim)
    dkv_block = max(cfg.block_n, _PRE_POST_BLOCK_M)  # whole postprocess blocks
    kspec = kernel_spec(spec)
    pspec = plain_spec(kspec)  # the pre- and postprocess do not depend on a score_mod / mask_mod
    preprocess = _kernel("bwd_preprocess", pspec, target)
    main = _kernel("bwd_gqa" if gqa else "bwd", kspec, target, override)
    postprocess = _kernel("bwd_postprocess", pspec, target)
    dq_postprocess = _kernel("bwd_dq_postprocess", pspec, target, override) if fragment else postprocess
    mods = isinstance(spec, ModsSpec)
    scale, left, right = softmax_scale, mask.left, mask.right
    softcap = (float(problem.softcap),) if spec.softcap else ()  # the feature entry's argument

    def launch(t: BwdTensors, grads: Grads, tables=()) -> None:
        """tables: a ModsSpec's captured tensors as the kernel stores them (cute_flash/mods/call.py)."""
        dout, q, k, v, out, lse, dlse = t[:7]
        dq, dk, dv = grads[:3]
        lse_log2 = torch.empty(stats_shape, **f32)
        dpsum = torch.empty(stats_shape, **f32)
        dq_accum = torch.zeros(dq_accum_shape, **f32)
        if checked:
            assert q.shape == (batch, seqlen_q, nheads, head_dim) and k.shape[1:3] == (
                problem.seqlen_k,
                problem.nheads_kv,
            )
            q, k, v, dout, out, dq, dk, dv = grad_views(q, k, v, dout, out, dq, dk, dv)
        preprocess(out, dout, lse, dpsum, lse_log2)
        fold_lse_grad(dpsum, dlse, lse)
        if spec.sink:
            sink_grad(grads.dsink, t.sink, lse, dpsum[..., :seqlen_q])
        dk_out, dv_out = dkv_destinations(dk, dv, gqa, dkv_block)
        if mods:
            slots = (*tables, *([None] * (MAX_TABLES - len(tables))))
            main(q, k, v, dout, lse_log2, dpsum, dq_accum, dk_out, dv_out, scale, left, right, *slots)
        else:
            no_semaphores = (None, None)  # this family has no deterministic build
            main(q, k, v, dout, lse_log2, dpsum, dq_accum, dk_out, dv_out, *no_semaphores, scale, left, right,
                 *softcap)  # fmt: skip
        dq_postprocess(dq_accum, dq, scale)
        if gqa:
            # The main kernel already applied the softmax scale to dK.
            postprocess(dk_out, dk, 1.0)
            postprocess(dv_out, dv, 1.0)

    return launch


def run_backward_varlen(
    t: BwdTensors, grads: Grads, seqs: PackedSeqs, problem: VarlenProblem, tables: tuple = ()
) -> None:
    """The packed backward: q / dout / out / dq (total_q, h, d), k / v / dk / dv (total_k, h_kv, d), lse (h, total_q).

    The same three steps as `run_backward`, on buffers whose sequence b starts at row cu_seqlens[b] + b * pad
    rounded down to a multiple of pad
    (common/packed.packed_pads): lse_log2 / D (h, rows), dQ's fp32 accumulator (rows, h, d) or (h, rows * d), and under
    GQA dK / dV's (rows, h_kv, d). Keys past seqused_k[b] get zero gradients. tables: a ModsSpec's captured tensors
    as the kernel stores them (cute_flash/mods/call.py), for the main kernel's `packed_mods` entry.
    """
    spec = problem.spec
    reason = backward_unsupported_reason(spec)
    if reason is not None:
        raise NotImplementedError(reason)
    width = kernel_width(spec)
    if (problem.head_dim, problem.head_dim_v) != (width, width):
        wide = widened_problem(problem, (width, width))
        padded_launcher((width, width), lambda tw, gw: run_backward_varlen(tw, gw, seqs, wide, tables))(t, grads)
        return
    dout, q, k, v, out, lse, dlse = t[:7]
    dq, dk, dv = grads[:3]
    cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k = seqs
    softmax_scale, mask = problem.softmax_scale, problem.mask
    target = compile_cache.runtime_target(q.device)
    cfg = bwd_tile_config(spec.head_dim, target)
    pad_q, pad_k = packed_pads(cfg.block_m, cfg.block_n)
    batch = cu_seqlens_q.shape[0] - 1
    total_q, nheads, head_dim = q.shape
    total_k, nheads_kv = k.shape[0], k.shape[1]
    gqa = nheads != nheads_kv
    rows_q = padded_rows(total_q, batch, pad_q)
    f32 = dict(dtype=torch.float32, device=q.device)

    lse_log2 = torch.empty(nheads, rows_q, **f32)
    dpsum = torch.empty(nheads, rows_q, **f32)
    if cfg.dq_layout == "fragment":
        dq_accum = torch.zeros(nheads, rows_q * head_dim, **f32)
    else:
        dq_accum = torch.zeros(rows_q, nheads, head_dim, **f32)
    q, k, v, dout, out, dq, dk, dv = grad_views(q, k, v, dout, out, dq, dk, dv)

    kspec = kernel_spec(spec)
    pspec = plain_spec(kspec)  # the pre- and postprocess do not depend on a score_mod / mask_mod
    pre_blocks = -(-max_seqlen_q // pad_q) * pad_q // _PRE_POST_BLOCK_M  # whole pad_q rows per sequence
    _kernel("bwd_preprocess", pspec, target)(out, dout, lse, dpsum, lse_log2, cu_seqlens_q, pad_q, pre_blocks)
    fold_lse_grad_packed(dpsum, dlse, lse, cu_seqlens_q, pad_q)
    if spec.sink:
        sink_grad(grads.dsink, t.sink, lse, packed_rows(dpsum, cu_seqlens_q, pad_q, total_q))
    dk_out, dv_out = packed_dkv_destinations(dk, dv, gqa, seqused_k is not None, padded_rows(total_k, batch, pad_k))
    role = ("bwd_gqa" if gqa else "bwd") + ("_seqused" if seqused_k is not None else "")
    scalars = (softmax_scale, mask.left, mask.right)
    if isinstance(spec, ModsSpec):  # (the `packed_mods` entry: no semaphores, the tables after the scalars)
        args = (*scalars, *tables, *([None] * (MAX_TABLES - len(tables))))
    else:
        softcap = (float(problem.softcap),) if spec.softcap else ()  # the feature entry's argument
        args = (None, None, *scalars, *softcap)  # (no semaphores: this family has no deterministic build)
    _kernel(role, kspec, target)(
        q, k, v, dout, lse_log2, dpsum, dq_accum, dk_out, dv_out, *args, cu_seqlens_q, cu_seqlens_k, seqused_k,
        max_seqlen_k,
    )  # fmt: skip
    postprocess = _kernel("bwd_postprocess", pspec, target)
    if cfg.dq_layout == "fragment":
        _kernel("bwd_dq_postprocess", pspec, target)(dq_accum, dq, softmax_scale, cu_seqlens_q, pad_q, max_seqlen_q)
    else:
        postprocess(dq_accum, dq, softmax_scale, cu_seqlens_q, pad_q, max_seqlen_q)
    if gqa:
        # Every key row of each sequence (cu_seqlens_k, not seqused_k): rows past seqused_k convert their zeros.
        postprocess(dk_out, dk, 1.0, cu_seqlens_k, pad_k, max_seqlen_k)
        postprocess(dv_out, dv, 1.0, cu_seqlens_k, pad_k, max_seqlen_k)

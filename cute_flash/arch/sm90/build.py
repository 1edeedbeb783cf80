"""Compiling the sm90 kernels with fake tensors: one compile serves every shape, stride and head count.

Batch, sequence lengths and head counts are symbolic; strides are symbolic multiples of 8 elements (16 bytes, what
TMA needs); the last dimension is contiguous. The stream is torch's current stream, read through TVM-FFI.
"""

from __future__ import annotations

from typing import Optional

from ... import compile_cache
from ...spec import AttentionSpec, ModsSpec
from ...common.dsl_types import dsl_dtype
from ...common.fake_tensors import (
    fake_cu_seqlens,
    fake_f32,
    fake_feature_args,
    fake_mods_tables,
    fake_operand,
    fake_packed_forward_args,
    fake_packed_preprocess_args,
    fake_tensor,
)
from .tile_config import FwdTileConfig

compile_cache.ensure_cute_dsl_arch("sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

from .flash_fwd import Sm90FlashForward  # noqa: E402


def _strided(dtype, shape, last_dim: int):
    return fake_operand(dtype, (*shape, last_dim))


def _fake_dense_io(spec: AttentionSpec) -> tuple:
    """q, k, v, out (b, s, h, d) in spec's dtype and lse (b, h, sq) fp32 of a dense forward, shapes symbolic."""
    dtype = dsl_dtype(spec.dtype)
    batch, seqlen_q, seqlen_k, heads, heads_kv = (cute.sym_int() for _ in range(5))
    q = _strided(dtype, (batch, seqlen_q, heads), spec.head_dim)
    k = _strided(dtype, (batch, seqlen_k, heads_kv), spec.head_dim)
    v = _strided(dtype, (batch, seqlen_k, heads_kv), spec.head_dim_v)
    out = _strided(dtype, (batch, seqlen_q, heads), spec.head_dim_v)
    return q, k, v, out, fake_f32((batch, heads, seqlen_q))


def compile_forward(spec: AttentionSpec, cfg: FwdTileConfig, target: str, extra_options: Optional[str] = None):
    """The compiled forward: call it as fn(q, k, v, out, lse, softmax_scale, window_left, window_right); with
    spec.varlen the packed entry (compile_forward_packed). Builds for spec.softcap / spec.sink take the `features`
    entry: fn(..., window_right, softcap, sink) with sink the (rows, h) fp32 view (None without spec.sink)."""
    if spec.varlen:
        return compile_forward_packed(spec, cfg, target, extra_options, seqused=False)
    if isinstance(spec, ModsSpec):
        return _compile_forward_mods(spec, cfg, target, extra_options)
    q, k, v, out, lse = _fake_dense_io(spec)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = Sm90FlashForward(spec, cfg)
    options = compile_cache.compile_options(target, extra=extra_options or "")
    scalars = cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0)
    if spec.softcap or spec.sink:
        features = fake_feature_args(spec.sink)
        return cute.compile(kernel.features, q, k, v, out, lse, *scalars, *features, stream, options=options)
    return cute.compile(kernel, q, k, v, out, lse, *scalars, stream, options=options)


def _compile_forward_mods(spec: ModsSpec, cfg: FwdTileConfig, target: str, extra_options: Optional[str]):
    """The score_mod / mask_mod forward (flash_fwd_mods.py): fn(q, k, v, out, lse, softmax_scale, window_left,
    window_right, a0, a1, a2, a3, block_count, block_index, block_full, block_tiles), the tables fake tensors of the
    graphs' read types and ranks (None past them), the block mask's lists (spec.block_sparse) or None."""
    from .flash_fwd_mods import Sm90ModsForward

    q, k, v, out, lse = _fake_dense_io(spec)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = Sm90ModsForward(spec, cfg)
    options = compile_cache.compile_options(target, extra=extra_options or "")
    scalars = cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0)
    blocks = (None,) * 4
    if spec.block_sparse:
        b, h, m, n = (cute.sym_int() for _ in range(4))
        shapes = ((b, h, m), (b, h, m, n), (b, h, m, n), (b, h, m))  # mods/call.KeyTileLists
        blocks = tuple(fake_tensor(cutlass.Int32, shape, 1, 4) for shape in shapes)
    tables = fake_mods_tables(spec)
    return cute.compile(kernel.mods, q, k, v, out, lse, *scalars, *tables, *blocks, stream, options=options)


def compile_forward_split(spec: AttentionSpec, cfg: FwdTileConfig, target: str, extra_options: Optional[str] = None):
    """The split-key forward (arch/split_kv.py): fn(q, k, v, o_part, lse_part, softmax_scale, window_left, window_right)
    with o_part (splits * b, sq, h, dv) and lse_part (splits * b, h, sq) fp32, the split count their first
    extent over q's batch. Builds for spec.softcap / spec.sink take the `features` entry, fn(..., window_right,
    softcap, None): the partials leave the sink out (the combine adds it)."""
    dtype = dsl_dtype(spec.dtype)
    batch, seqlen_q, seqlen_k, heads, heads_kv, parts = (cute.sym_int() for _ in range(6))
    q = _strided(dtype, (batch, seqlen_q, heads), spec.head_dim)
    k = _strided(dtype, (batch, seqlen_k, heads_kv), spec.head_dim)
    v = _strided(dtype, (batch, seqlen_k, heads_kv), spec.head_dim_v)
    o_part = fake_f32((parts, seqlen_q, heads, spec.head_dim_v))
    lse_part = fake_f32((parts, heads, seqlen_q))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = Sm90FlashForward(spec, cfg, split_kv=True)
    options = compile_cache.compile_options(target, extra=extra_options or "")
    scalars = cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0)
    if spec.softcap or spec.sink:
        features = fake_feature_args(sink=False)
        return cute.compile(kernel.features, q, k, v, o_part, lse_part, *scalars, *features, stream, options=options)
    return cute.compile(kernel, q, k, v, o_part, lse_part, *scalars, stream, options=options)


def compile_forward_packed(
    spec: AttentionSpec, cfg: FwdTileConfig, target: str, extra_options: Optional[str] = None, seqused: bool = False
):
    """The packed (varlen) forward: fn(q, k, v, out, lse, softmax_scale, window_left, window_right, cu_seqlens_q,
    cu_seqlens_k, seqused_k (a tensor when `seqused`, else None), max_seqlen_q) with q (total_q, h, d), k / v
    (total_k, h_kv, d / dv), out (total_q, h, dv), lse (h, total_q); batch = cu_seqlens_q's length - 1. Builds for
    spec.softcap / spec.sink take the `packed_features` entry: softcap and the (total_q, h) sink view (None without
    spec.sink) after window_right; a ModsSpec the `packed_mods` entry: the tables a0 .. a3 there."""
    dtype = dsl_dtype(spec.dtype)
    args = fake_packed_forward_args(dtype, spec.head_dim, spec.head_dim_v, seqused)
    assert spec.varlen
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = compile_cache.compile_options(target, extra=extra_options or "")
    if isinstance(spec, ModsSpec):  # (flash_fwd_mods.py's `packed_mods` entry: the tables after the scalars)
        from .flash_fwd_mods import Sm90ModsForward

        kernel = Sm90ModsForward(spec, cfg)
        args = (*args[:8], *fake_mods_tables(spec), *args[8:])
        return cute.compile(kernel.packed_mods, *args, stream, options=options)
    kernel = Sm90FlashForward(spec, cfg)  # the `packed` entry (common/entries.FwdEntries)
    if spec.softcap or spec.sink:
        args = (*args[:8], *fake_feature_args(spec.sink), *args[8:])
        return cute.compile(kernel.packed_features, *args, stream, options=options)
    return cute.compile(kernel.packed, *args, stream, options=options)


def compile_forward_kvcache(
    spec: AttentionSpec, cfg, target: str, packed_q: bool, split: bool, extra_options: Optional[str] = None
):
    """The KV-cache forward (kvcache/flash_fwd.py): fn(q, k_cache, v_cache, out, lse, seqlens_k, page_table,
    cu_seqlens_q, k_descale, v_descale, max_seqlen_q, softmax_scale, window_left, window_right) with q (b, sq, h, d)
    or, packed_q, (total_q, h, d) and cu_seqlens_q (b + 1,) int32 (else None); k_cache / v_cache (pages,
    spec.page_size, h_kv, d) with page_table (b, max_pages) int32, or for spec.page_size 0 a dense (b, seqlen_cache,
    h_kv, d) and None, in q's dtype or with spec.kv_fp8 float8_e4m3fn and k_descale / v_descale (b, h_kv) fp32 (else
    None); seqlens_k (b,) int32; out / lse like q ((b, sq, h, dv) / (b, h, sq), packed (total_q, h, dv) / (h,
    total_q)), or with `split` the fp32 partials (parts, sq or total_q, h, dv) / (parts, h, sq or total_q), parts =
    splits x b (packed: splits). Builds for spec.softcap / spec.sink take the `kvcache_features` entry: fn(...,
    window_right, softcap, sink) with sink the (h,) fp32 logits (None without spec.sink, and for `split`: the
    partials leave the sink to the combine)."""
    from .kvcache.flash_fwd import Sm90FlashForwardKvCache
    from .kvcache.tile_config import SwappedTileConfig

    dtype = dsl_dtype(spec.dtype)
    d, dv = spec.head_dim, spec.head_dim_v
    batch, seqlen_q, heads, heads_kv, parts = (cute.sym_int() for _ in range(5))
    q_rows = (cute.sym_int(),) if packed_q else (batch, seqlen_q)
    q = _strided(dtype, (*q_rows, heads), d)
    if split:
        out = fake_f32((parts, q_rows[-1], heads, dv))
        lse = fake_f32((parts, heads, q_rows[-1]))
    else:
        out = _strided(dtype, (*q_rows, heads), dv)
        lse = fake_f32((heads, q_rows[0]) if packed_q else (batch, heads, seqlen_q))
    if spec.page_size:
        cache_rows = (cute.sym_int(), spec.page_size)
        page_table = fake_tensor(cutlass.Int32, (batch, cute.sym_int()), 1, 4)  # (any int32 alignment)
    else:
        cache_rows, page_table = (batch, cute.sym_int()), None
    cache_dtype = cutlass.Float8E4M3FN if spec.kv_fp8 else dtype
    k = _strided(cache_dtype, (*cache_rows, heads_kv), d)
    v = _strided(cache_dtype, (*cache_rows, heads_kv), dv)
    descales = (fake_f32((batch, heads_kv)), fake_f32((batch, heads_kv))) if spec.kv_fp8 else (None, None)
    seqlens_k = fake_cu_seqlens(batch)
    cu_seqlens_q = fake_cu_seqlens(cute.sym_int()) if packed_q else None
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    if isinstance(cfg, SwappedTileConfig):
        from .kvcache.swapped import Sm90KvCacheSwapped

        kernel = Sm90KvCacheSwapped(spec, cfg, split_kv=split, packed_q=packed_q)
    else:
        kernel = Sm90FlashForwardKvCache(spec, cfg, split_kv=split, packed_q=packed_q)
    options = compile_cache.compile_options(target, extra=extra_options or "")
    scalars = cutlass.Int32(1), cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0)
    args = (q, k, v, out, lse, seqlens_k, page_table, cu_seqlens_q, *descales, *scalars)
    if spec.softcap or spec.sink:
        sink = fake_f32((heads,)) if spec.sink and not split else None
        return cute.compile(kernel.kvcache_features, *args, cutlass.Float32(1.0), sink, stream, options=options)
    return cute.compile(kernel.kvcache, *args, stream, options=options)


def _fake_stats(batch, heads, seqlen_padded):
    """(b, h, sq_padded) fp32, rows padded to whole 64-row blocks (what TMA boxes of the stats need)."""
    return fake_f32((batch, heads, seqlen_padded), divisibility=64, align=16)


def compile_backward(
    spec: AttentionSpec,
    cfg,
    target: str,
    gqa: bool,
    deterministic: bool = False,
    extra_options: Optional[str] = None,
    seqused: bool = False,
):
    """The compiled backward main kernel: fn(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, dq_semaphores,
    dkv_semaphores, softmax_scale, window_left, window_right), dk / dv fp32 padded sums under GQA; the semaphores
    are None, or int32 (b, h, query tiles) / (b, h_kv, key tiles) where a deterministic (GQA) build reads them.
    spec.softcap: the feature entries (common/entries.py), with the cap after window_right. A ModsSpec (score_mod /
    mask_mod, flash_bwd_mods.py): fn(q, ..., dv, softmax_scale, window_left, window_right, a0, a1, a2, a3,
    block_count, block_index, block_full, block_tiles), dense and without semaphores, a0 .. a3 the graphs' tables
    (None past them), the block lists by key tile (spec.block_sparse) or None.

    spec.varlen: the packed entry, fn(..., window_right, cu_seqlens_q, cu_seqlens_k, seqused_k (a tensor when
    `seqused`, else None), max_seqlen_k) with q / dout (total_q, h, d), k / v (total_k, h_kv, d), lse_log2 / dpsum
    (1, h, rows_q), dq_accum (h, rows_q * d), dk / dv (total_k, h_kv, d) or fp32 (rows_k, h_kv, d) sums under GQA,
    semaphores (1, h, rows_q / tile_m) / (1, h_kv, rows_k / tile_n); rows_q / rows_k: the padded buffers' rows
    (common/packed.packed_pads; rows_q a multiple of 64)."""
    from .flash_bwd import Sm90FlashBackward

    dtype = dsl_dtype(spec.dtype)
    tensors = _fake_backward_tensors(dtype, spec.head_dim, spec.head_dim_v, cfg, gqa, spec.varlen)
    scalars = cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0)
    options = compile_cache.compile_options(target, extra=extra_options or "")
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    if isinstance(spec, ModsSpec):  # (flash_bwd_mods.py: dense, no deterministic build, the tables after the scalars)
        from .flash_bwd_mods import Sm90ModsBackward

        assert not deterministic, "score_mod / mask_mod: no deterministic backward"
        kernel = Sm90ModsBackward(spec, cfg, gqa)
        tables = fake_mods_tables(spec)
        if spec.varlen:
            cu = fake_cu_seqlens(cute.sym_int()), fake_cu_seqlens(cute.sym_int())
            packed = (*cu, fake_cu_seqlens(cute.sym_int()) if seqused else None, cutlass.Int32(0))
            return cute.compile(kernel.packed_mods, *tensors, *scalars, *tables, *packed, stream, options=options)
        blocks = (None,) * 4
        if spec.block_sparse:
            b, h, n, m = (cute.sym_int() for _ in range(4))
            shapes = ((b, h, n), (b, h, n, m), (b, h, n, m), (b, h, n))  # mods/call.TileLists by key tile
            blocks = tuple(fake_tensor(cutlass.Int32, shape, 1, 4) for shape in shapes)
        return cute.compile(kernel.mods, *tensors, *scalars, *tables, *blocks, stream, options=options)
    kernel = Sm90FlashBackward(spec, cfg, gqa, deterministic)
    sems = _fake_semaphores(deterministic, gqa)
    features = (cutlass.Float32(1.0),) if spec.softcap else ()
    if not spec.varlen:
        entry = kernel.features if spec.softcap else kernel
        return cute.compile(entry, *tensors, *sems, *scalars, *features, stream, options=options)
    cu = fake_cu_seqlens(cute.sym_int()), fake_cu_seqlens(cute.sym_int())
    seqused_k = fake_cu_seqlens(cute.sym_int()) if seqused else None
    packed = (*cu, seqused_k, cutlass.Int32(0))
    entry = kernel.packed_features if spec.softcap else kernel.packed
    return cute.compile(entry, *tensors, *sems, *scalars, *features, *packed, stream, options=options)


def _fake_backward_tensors(dtype, d: int, dv: int, cfg, gqa: bool, packed: bool) -> tuple:
    """(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv) of a dense or packed build (layouts: compile_backward;
    v, dout and dv head_dim_v wide)."""
    heads, heads_kv, rows_q = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=64)
    if packed:
        total_q, total_k, rows_k = (cute.sym_int() for _ in range(3))
        q_rows, k_rows, sum_rows = (total_q, heads), (total_k, heads_kv), (rows_k, heads_kv)
        stats = [_fake_stats(cute.sym_int(), heads, rows_q) for _ in range(2)]
        dq_accum = _fake_dq_accum(cfg, d, (heads,), cute.sym_int())
    else:
        batch, seqlen_q, seqlen_k, sk_pad = (cute.sym_int() for _ in range(4))
        q_rows, k_rows, sum_rows = (batch, seqlen_q, heads), (batch, seqlen_k, heads_kv), (batch, sk_pad, heads_kv)
        stats = [_fake_stats(batch, heads, rows_q) for _ in range(2)]
        dq_accum = _fake_dq_accum(cfg, d, (batch, heads), cute.sym_int())
    q, dout = _strided(dtype, q_rows, d), _strided(dtype, q_rows, dv)
    k, v = _strided(dtype, k_rows, d), _strided(dtype, k_rows, dv)
    grad_dtype, grad_rows = (cutlass.Float32, sum_rows) if gqa else (dtype, k_rows)
    dk, dv_ = _strided(grad_dtype, grad_rows, d), _strided(grad_dtype, grad_rows, dv)
    return (q, k, v, dout, *stats, dq_accum, dk, dv_)


def _fake_semaphores(deterministic: bool, gqa: bool) -> tuple:
    """The int32 dQ and dK / dV semaphores a build reads ((b, h, tiles), shapes of their own), None for the others:
    dQ's in deterministic builds, dK / dV's in deterministic GQA builds."""
    fake = lambda: cute.runtime.make_fake_tensor(  # noqa: E731
        cutlass.Int32, tuple(cute.sym_int() for _ in range(3)), (cute.sym_int64(), cute.sym_int64(), 1)
    )
    return (fake() if deterministic else None), (fake() if deterministic and gqa else None)


def _fake_dq_accum(cfg, d: int, leading: tuple, length):
    """The fp32 dQ accumulator: leading modes (batch, heads) or (heads,), then length floats, whole query tiles per
    (batch, head) or packed buffer."""
    strides = tuple(cute.sym_int64(divisibility=cfg.tile_m * d) for _ in leading)
    return cute.runtime.make_fake_tensor(cutlass.Float32, (*leading, length), (*strides, 1), assumed_align=16)


def compile_dq_postprocess(spec: AttentionSpec, cfg, target: str, extra_options: Optional[str] = None):
    """The compiled dQ conversion: fn(dq_accum, dq, softmax_scale); spec.varlen: fn(dq_accum (h, rows_q * d), dq
    (total_q, h, d), softmax_scale, cu_seqlens_q, pad_q, max_seqlen_q)."""
    from .flash_bwd_postprocess import DqConvertSm90

    dtype = dsl_dtype(spec.dtype)
    d = spec.head_dim
    if spec.varlen:
        kernel = DqConvertSm90(dtype, d, cfg, varlen=True)
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        options = compile_cache.compile_options(target, extra=extra_options or "")
        total, heads = cute.sym_int(), cute.sym_int()
        return cute.compile(
            kernel.packed, _fake_dq_accum(cfg, d, (heads,), cute.sym_int()), _strided(dtype, (total, heads), d),
            cutlass.Float32(1.0), fake_cu_seqlens(cute.sym_int()), cutlass.Int32(0), cutlass.Int32(0), stream,
            options=options,
        )  # fmt: skip
    batch, seqlen_q, heads, dq_len = (cute.sym_int() for _ in range(4))
    dq_accum = _fake_dq_accum(cfg, d, (batch, heads), dq_len)
    dq = _strided(dtype, (batch, seqlen_q, heads), d)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = compile_cache.compile_options(target, extra=extra_options or "")
    return cute.compile(DqConvertSm90(dtype, d, cfg), dq_accum, dq, cutlass.Float32(1.0), stream, options=options)


def compile_preprocess(spec: AttentionSpec, cfg, target: str, extra_options: Optional[str] = None):
    """The sm80 family's preprocess (D and lse_log2) built as the sm90 backward runs it: it zeroes the dQ
    accumulator and lets the main kernel launch early (programmatic dependent launch): fn(out, dout, lse, dpsum,
    lse_log2, dq_accum); packed specs: fn(out, dout, lse, dpsum, lse_log2, cu_seqlens_q, pad_q, num_blocks,
    dq_accum)."""
    from ..sm80.flash_bwd_preprocess import BackwardPreprocessSm80

    dtype = dsl_dtype(spec.dtype)
    dv = spec.head_dim_v
    block_m = 64  # STATS_ROW_MULTIPLE: one CTA per 64 padded query rows
    kernel = BackwardPreprocessSm80(dtype, dv, block_m=block_m, varlen=spec.varlen)
    kernel.zero_dq_accum, kernel.launch_dependents = True, True  # over the class defaults (the sm80 family's)
    kernel.dq_head_dim = d = spec.head_dim  # (the dQ accumulator's rows: head_dim, where dO and O are head_dim_v)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = compile_cache.compile_options(target, extra=extra_options or "")
    if spec.varlen:
        return _compile_packed_preprocess(kernel, dtype, dv, d, block_m, stream, options)
    batch, seqlen_q, heads, sq_pad = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=block_m)
    o = _strided(dtype, (batch, seqlen_q, heads), dv)
    do = _strided(dtype, (batch, seqlen_q, heads), dv)
    lse = fake_f32((batch, heads, seqlen_q))
    stats = [fake_f32((batch, heads, sq_pad), divisibility=block_m) for _ in range(2)]
    dq_accum = cute.runtime.make_fake_tensor(
        cutlass.Float32,
        (batch, heads, cute.sym_int()),
        (cute.sym_int64(divisibility=block_m * d), cute.sym_int64(divisibility=block_m * d), 1),
        assumed_align=16,
    )
    return cute.compile(kernel.with_dq_zeroing, o, do, lse, *stats, dq_accum, stream, options=options)


def _compile_packed_preprocess(kernel, dtype, dv: int, d: int, block_m: int, stream, options: str):
    """compile_preprocess's packed build: (total_q, h, dv) out / dout, (h, total_q) lse, (h, padded rows) statistics
    and the (h, padded rows * d) dQ accumulator."""
    args = fake_packed_preprocess_args(dtype, dv, dq_zeroing_block=block_m, dq_head_dim=d)
    return cute.compile(kernel.packed_with_dq_zeroing, *args, stream, options=options)

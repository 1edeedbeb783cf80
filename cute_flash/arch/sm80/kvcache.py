"""The sm80 KV-cache forward's host side (arch/base.ArchBackend.kvcache_splits / forward_kvcache; the kernel is
flash_fwd_kvcache.py): what it supports, how many splits a call gets, compiling and launching.

Builds: one per (spec, target, packed q, split), spec carrying the page size (0: a dense cache), kv_fp8, softcap, sink
and the mask kind; head counts, lengths, page counts and the split count are runtime. A split call (num_splits > 1)
runs the split build into fp32 partials and the shared combine (common/split_combine.py, arch/split_kv.py's build
for the output dtype and dv: the sink joins split 0's partial, so the combine needs no sink of its own). Nothing reads
device values on the host, so a decoding step captures in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch

from ... import compile_cache
from ...common.dsl_types import dsl_dtype
from ...common.fake_tensors import fake_cu_seqlens, fake_f32, fake_operand, fake_tensor
from ...spec import AttentionSpec
from ...validation import MAX_GRID_YZ, KvCacheProblem, kernel_view
from .. import split_kv
from ..base import KvCacheTensors
from .tile_config import FwdTileConfig, kvcache_tile_candidates

FAMILY = "sm80"
MAX_PAGE_SIZE = 256
# Splits: CTAs for about two per SM (one K or V tile in flight each, which a memory-bound decoding step needs to keep
# the SM's share of DRAM bandwidth busy), each walking at least MIN_TILES_PER_SPLIT key tiles, at most MAX_SPLITS.
CTAS_PER_SM = 2
MIN_TILES_PER_SPLIT = 2
MAX_SPLITS = 64


def unsupported_reason(spec: AttentionSpec, forward_reason: Optional[str]) -> Optional[str]:
    """None when the sm80 KV-cache forward serves `spec` (forward_reason: the plain forward's answer for its dtype,
    head dims and mask), else what is missing."""
    if forward_reason is not None:
        return forward_reason
    if spec.varlen:
        return "the KV-cache forward takes packed queries through cu_seqlens_q, not a varlen spec"
    if not 0 <= spec.page_size <= MAX_PAGE_SIZE:
        return f"page_size {spec.page_size} is not supported by the sm80 KV-cache forward (1..{MAX_PAGE_SIZE}, 0 dense)"
    if spec.kv_fp8 and (spec.head_dim % 32 or spec.head_dim_v % 32):
        return (
            f"the sm80 KV-cache forward reads fp8 caches at head dims that are multiples of 32, not "
            f"({spec.head_dim}, {spec.head_dim_v})"
        )
    return None


def first_tile(spec: AttentionSpec, target: str) -> FwdTileConfig:
    return kvcache_tile_candidates(spec.head_dim, spec.head_dim_v, target)[0]


def num_splits(problem: KvCacheProblem, sm_count: int, target: str = "sm_80") -> int:
    """Splits of each row tile's keys (1: unsplit) from host shapes only: enough CTAs for CTAS_PER_SM per SM (one
    wave), no more than the cache's key tiles allow (MIN_TILES_PER_SPLIT each) or MAX_SPLITS. Deterministic: the same
    shapes always give the same split, and a given split always the same result."""
    p = problem
    tile = first_tile(p.spec, target)
    if p.batch == 0 or p.nheads_kv == 0 or p.seqlen_q == 0 or p.max_seqlen_k == 0:
        return 1
    rows = p.seqlen_q * (p.nheads // p.nheads_kv)
    ctas = -(-rows // tile.tile_m) * p.nheads_kv * p.batch
    key_tiles = -(-p.max_seqlen_k // tile.tile_n)
    splits = min(CTAS_PER_SM * sm_count // ctas, key_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS)
    return max(splits, 1)


def _build(spec: AttentionSpec, tile: FwdTileConfig, options: str, packed_q: bool, split: bool):
    """Compiles the KV-cache forward with fake tensors (all extents symbolic)."""
    import cutlass
    import cutlass.cute as cute

    from .flash_fwd_kvcache import Sm80KvCacheForward

    dtype = dsl_dtype(spec.dtype)
    d, dv = spec.head_dim, spec.head_dim_v
    batch, seqlen_q, total_q, heads, heads_kv, pages, rows_per_page, max_pages, parts = (
        cute.sym_int() for _ in range(9)
    )
    if packed_q:
        q, out = fake_operand(dtype, (total_q, heads, d)), fake_operand(dtype, (total_q, heads, dv))
        lse = fake_f32((heads, total_q))
        if split:
            out, lse = fake_f32((parts, total_q, heads, dv)), fake_f32((parts, heads, total_q))
        cu_seqlens_q = fake_cu_seqlens(cute.sym_int())
    else:
        q, out = fake_operand(dtype, (batch, seqlen_q, heads, d)), fake_operand(dtype, (batch, seqlen_q, heads, dv))
        lse = fake_f32((batch, heads, seqlen_q))
        if split:
            out, lse = fake_f32((parts, seqlen_q, heads, dv)), fake_f32((parts, heads, seqlen_q))
        cu_seqlens_q = None
    # A paged cache (num_pages, page_size, h_kv, d), or a dense one (b, seqlen_cache, h_kv, d): its own extents.
    page_rows = spec.page_size if spec.page_size else rows_per_page
    cache_dtype = cutlass.Float8E4M3FN if spec.kv_fp8 else dtype
    k_cache = fake_operand(cache_dtype, (pages, page_rows, heads_kv, d))
    v_cache = fake_operand(cache_dtype, (pages, page_rows, heads_kv, dv))
    descales = (fake_f32((batch, heads_kv)), fake_f32((batch, heads_kv))) if spec.kv_fp8 else (None, None)
    seqlens_k = fake_cu_seqlens(batch)
    page_table = fake_tensor(cutlass.Int32, (batch, max_pages), 1, 4) if spec.page_size else None
    sink = fake_f32((heads,)) if spec.sink else None
    kernel = Sm80KvCacheForward(spec, tile, split_kv=split, packed_q=packed_q)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    f32, i32 = cutlass.Float32, cutlass.Int32
    return cute.compile(
        kernel, q, k_cache, v_cache, out, lse, seqlens_k, page_table, cu_seqlens_q, *descales, f32(1.0), i32(0),
        i32(0), f32(0.0), sink, i32(0), stream, options=options,
    )  # fmt: skip


def compile_kvcache(spec: AttentionSpec, target: str, packed_q: bool, split: bool, extra_options: str = ""):
    """The first tile candidate that compiles without spills (build.compile_first_fitting)."""
    from .build import compile_first_fitting

    candidates = kvcache_tile_candidates(spec.head_dim, spec.head_dim_v, target)

    def build(tile: FwdTileConfig, options: str):
        return _build(spec, tile, options, packed_q, split)

    return compile_first_fitting(spec, candidates, build, target, extra_options)


def kernel(spec: AttentionSpec, target: str, packed_q: bool, split: bool):
    """The compiled KV-cache forward (from the compile cache)."""
    from .build import check_runnable_target

    key = (FAMILY, target, "fwd_kvcache", spec, packed_q, split)

    def build():
        check_runnable_target(target)
        return compile_kvcache(spec, target, packed_q, split).kernel

    return compile_cache.get_or_compile(key, build)


def combine(spec: AttentionSpec, target: str):
    """The shared combine for the output dtype and dv (its plain build: the sink is in split 0's partial)."""
    plain = AttentionSpec(spec.dtype, spec.head_dim, spec.head_dim_v, "none", spec.out_dtype)
    return split_kv.combine_kernel(plain, target)


def forward(t: KvCacheTensors, problem: KvCacheProblem, num_splits: int) -> None:
    """Fills t.out and t.lse (arch/base.KvCacheTensors' conventions) on torch's current stream."""
    p, spec = problem, problem.spec
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    if p.batch == 0 or p.total_q == 0:
        return  # no row to fill (and no grid to launch)
    num_splits = max(1, min(num_splits, MAX_GRID_YZ // p.batch))  # grid z = splits x b (changes speed only)
    target = compile_cache.runtime_target(t.q.device)
    views = [kernel_view(x, copy=False, name=n) for n, x in (("q", t.q), ("k_cache", t.k_cache),
                                                              ("v_cache", t.v_cache), ("out", t.out))]  # fmt: skip
    q, k_cache, v_cache, out = views
    scalars = (float(p.softmax_scale), int(p.mask.left), int(p.mask.right), float(p.softcap))
    tail = (t.sink if spec.sink else None, int(p.seqlen_q))
    extras = (t.seqlens_k, t.page_table if spec.page_size else None, t.cu_seqlens_q if p.packed_q else None)
    descales = (t.k_descale, t.v_descale) if spec.kv_fp8 else (None, None)
    if num_splits == 1:
        run = kernel(spec, target, p.packed_q, split=False)
        run(q, k_cache, v_cache, out, t.lse, *extras, *descales, *scalars, *tail)
        return
    dv = p.head_dim_v
    if p.packed_q:
        o_shape, lse_shape = (num_splits, p.total_q, p.nheads, dv), (num_splits, p.nheads, p.total_q)
    else:
        o_shape = (num_splits * p.batch, p.seqlen_q, p.nheads, dv)
        lse_shape = (num_splits * p.batch, p.nheads, p.seqlen_q)
    o_elems = num_splits * p.total_q * p.nheads * dv
    block = torch.empty(o_elems + o_elems // dv, dtype=torch.float32, device=q.device)
    o_part, lse_part = block[:o_elems].view(o_shape), block[o_elems:].view(lse_shape)
    kernel(spec, target, p.packed_q, split=True)(q, k_cache, v_cache, o_part, lse_part, *extras, *descales, *scalars,
                                                 *tail)  # fmt: skip
    # The combine waits (programmatic dependent launch on sm_90) for the kernel launched just before it.
    out_view, lse_view = (out.unsqueeze(0), t.lse.unsqueeze(0)) if p.packed_q else (out, t.lse)
    combine(spec, target)(o_part, lse_part, out_view, lse_view)


def warm(spec: AttentionSpec, target: str) -> None:
    """The kernels of dense-q calls of `spec` (unsplit, split, the combine); packed-q builds compile on first use."""
    kernel(spec, target, packed_q=False, split=False)
    kernel(spec, target, packed_q=False, split=True)
    combine(spec, target)

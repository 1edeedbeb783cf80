"""The KV-cache append of `attention_with_kvcache`: one kernel that writes the new tokens' K and V rows into the cache
at each sequence's current length (through the page table of a paged cache) and the sequences' new lengths, before
the attention kernel reads them. Arch-neutral plain loads and stores (every family's KV-cache forward runs after
it, on the same stream).

Sequence b appends its new tokens i = 0 .. n_b - 1 at key positions cache_seqlens[b] + i: dense k_new
(b, s_new, h_kv, d) appends s_new tokens per sequence, packed k_new (total, h_kv, d) those of [cu_seqlens[b],
cu_seqlens[b + 1]) (the query rows' own tokens: chunked prefill). Position p of sequence b lives in page
page_table[b, p // page_size] at row p % page_size of a paged cache (num_pages, page_size, h_kv, d); in row p of a
dense cache (b, seqlen_cache, h_kv, d). Writes that would land outside the cache (a position past the page table
or the dense cache, a page index outside [0, num_pages)) are dropped: the cache's memory is never written out of
bounds, whatever the lengths and page tables hold, and no row outside k_new / v_new is read.
seqlens_k[b] = cache_seqlens[b] + n_b is written for the attention kernel (the caller's cache_seqlens is left
alone).

FP8 caches (float8_e4m3fn) store the new rows divided by their sequence's and KV head's descale, rounded to the
nearest e4m3 value and saturated to its range (+-448).

Layout: one CTA per (128-row block of new tokens, KV head, sequence); each thread copies COLS columns of one row at
a time. The rows are a few per decoding step (batch x h_kv x d elements), so plain loads and stores suffice.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

THREADS = 128
ROWS_PER_CTA = 128
COLS = 8  # columns per thread and copy (16 bytes of fp16 / bf16)


class KvAppend:
    """Compiled per (new rows' dtype, cache dtype, head dims, paged or dense, packed or dense new rows, descales)."""

    def __init__(self, new_dtype, cache_dtype, head_dim: int, head_dim_v: int, paged: bool, packed: bool):
        assert head_dim % COLS == 0 and head_dim_v % COLS == 0
        self.new_dtype, self.cache_dtype = new_dtype, cache_dtype
        self.head_dim, self.head_dim_v = head_dim, head_dim_v
        self.paged, self.packed = paged, packed
        self.fp8 = cache_dtype.width == 8
        self.width = max(head_dim, head_dim_v) // COLS  # threads per row

    @cute.jit
    def __call__(
        self,
        mKnew: cute.Tensor,  # (b, s_new, h_kv, d), or packed (total, h_kv, d)
        mVnew: cute.Tensor,  # like mKnew, dv wide
        mKcache: cute.Tensor,  # (num_pages, page_size, h_kv, d), or dense (b, seqlen_cache, h_kv, d)
        mVcache: cute.Tensor,
        mPageTable: cute.Tensor,  # (b, max_pages) int32 (paged), or None
        mCacheSeqlens: cute.Tensor,  # (b,) int32
        mCuSeqlens: cute.Tensor,  # (b + 1,) int32 (packed new rows), or None
        mSeqlensK: cute.Tensor,  # (b,) int32, written
        mKdescale: cute.Tensor,  # (b, h_kv) fp32 (fp8 cache), or None
        mVdescale: cute.Tensor,
        max_new: Int32,  # the most new tokens of any sequence (grid bound)
        stream,
    ):
        batch = mCacheSeqlens.shape[0]
        grid = [cute.ceil_div(max_new, ROWS_PER_CTA), cute.size(mKcache.shape[2]), batch]
        self.kernel(
            mKnew, mVnew, mKcache, mVcache, mPageTable, mCacheSeqlens, mCuSeqlens, mSeqlensK, mKdescale, mVdescale
        ).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self, mKnew, mVnew, mKcache, mVcache, mPageTable, mCacheSeqlens, mCuSeqlens, mSeqlensK, mKdescale, mVdescale
    ):
        tidx, _, _ = cute.arch.thread_idx()
        block, head, b = cute.arch.block_idx()
        start = mCacheSeqlens[b]
        if cutlass.const_expr(self.packed):
            first = mCuSeqlens[b]
            count = mCuSeqlens[b + 1] - first
        else:
            first = Int32(0)
            count = mKnew.shape[1]
        if block == 0 and head == 0 and tidx == 0:
            mSeqlensK[b] = start + count
        capacity = mKcache.shape[1]  # rows of one page, or of a dense cache's sequence
        if cutlass.const_expr(self.paged):
            capacity = mKcache.shape[1] * mPageTable.shape[1]
        k_scale = Float32(1.0)
        v_scale = Float32(1.0)
        if cutlass.const_expr(self.fp8):
            k_scale = mKdescale[b, head]
            v_scale = mVdescale[b, head]
        col = (tidx % self.width) * COLS
        rows_per_pass = THREADS // self.width
        # Every row of the block: a width that does not divide THREADS (d 80, 96, 160, ...) leaves the last threads
        # idle and takes one pass more.
        local = tidx // self.width
        for r in cutlass.range((ROWS_PER_CTA + rows_per_pass - 1) // rows_per_pass, unroll=1):
            row_in_block = r * rows_per_pass + local
            i = block * ROWS_PER_CTA + row_in_block
            pos = start + i
            # (a packed source row past k_new's rows, from a bad cu_seqlens, is dropped too)
            in_new = True
            if cutlass.const_expr(self.packed):
                in_new = first + i < mKnew.shape[0] and first + i >= 0
            mine = local < rows_per_pass and row_in_block < ROWS_PER_CTA
            if mine and i < count and pos >= 0 and pos < capacity and in_new:
                page = b
                row = pos
                if cutlass.const_expr(self.paged):
                    page_size = mKcache.shape[1]
                    page = mPageTable[b, pos // page_size]
                    row = pos % page_size
                if page >= 0 and page < mKcache.shape[0]:
                    self.copy_row(mKnew, mKcache, first + i, b, head, page, row, col, self.head_dim, k_scale)
                    self.copy_row(mVnew, mVcache, first + i, b, head, page, row, col, self.head_dim_v, v_scale)

    @cute.jit
    def copy_row(self, mNew, mCache, src_row, b, head, page, row, col, dim: cutlass.Constexpr[int], descale):
        if col < dim:
            for c in cutlass.range_constexpr(COLS):
                if cutlass.const_expr(self.packed):
                    x = mNew[src_row, head, col + c]
                else:
                    x = mNew[b, src_row, head, col + c]
                if cutlass.const_expr(self.fp8):
                    # x / descale rounded once (IEEE division, as the reference), saturated at e4m3's largest
                    # finite value instead of producing NaN for out-of-range values; a NaN input stays NaN
                    scaled = x.to(Float32) / descale
                    y = cute.arch.fmin(cute.arch.fmax(scaled, Float32(-448.0), nan=True), Float32(448.0), nan=True)
                    mCache[page, row, head, col + c] = y.to(self.cache_dtype)
                else:
                    mCache[page, row, head, col + c] = x.to(self.cache_dtype)


def compile_kv_append(
    new_dtype: str, cache_fp8: bool, head_dim: int, head_dim_v: int, paged: bool, packed: bool, target: str
):
    """The compiled append: fn(k_new, v_new, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens, seqlens_k,
    k_descale, v_descale, max_new) with None for the tensors a build does not take (page_table unless `paged`,
    cu_seqlens unless `packed`, the descales unless `cache_fp8`)."""
    from .. import compile_cache
    from .dsl_types import dsl_dtype
    from .fake_tensors import fake_cu_seqlens, fake_f32, fake_tensor

    dtype = dsl_dtype(new_dtype)
    cache_dtype = cutlass.Float8E4M3FN if cache_fp8 else dtype
    batch, new, heads_kv, pages, page_rows, total = (cute.sym_int() for _ in range(6))
    new_shape = (total, heads_kv) if packed else (batch, new, heads_kv)
    k_new = fake_tensor(dtype, (*new_shape, head_dim))
    v_new = fake_tensor(dtype, (*new_shape, head_dim_v))
    k_cache = fake_tensor(cache_dtype, (pages, page_rows, heads_kv, head_dim))
    v_cache = fake_tensor(cache_dtype, (pages, page_rows, heads_kv, head_dim_v))
    page_table = fake_tensor(cutlass.Int32, (batch, cute.sym_int())) if paged else None
    cache_seqlens = fake_cu_seqlens(batch)
    cu_seqlens = fake_cu_seqlens(cute.sym_int()) if packed else None
    seqlens_k = fake_cu_seqlens(batch)
    descales = (fake_f32((batch, heads_kv)), fake_f32((batch, heads_kv))) if cache_fp8 else (None, None)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = KvAppend(dtype, cache_dtype, head_dim, head_dim_v, paged, packed)
    args = (k_new, v_new, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens, seqlens_k, *descales, Int32(1))
    return cute.compile(kernel, *args, stream, options=compile_cache.compile_options(target))

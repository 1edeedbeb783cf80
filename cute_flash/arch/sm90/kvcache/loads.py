"""The producer warpgroup of the sm90 KV-cache forward: K / V tiles from the cache by TMA, and the query rows.

K / V (warp 0). A tile of tile_n keys is `tile_n / chunk` TMA boxes of `chunk` rows, chunk = gcd(page_size,
tile_n) (`tile_config.chunk_rows`), so that every box lies in one page: box i of tile n holds keys
n * tile_n + i * chunk .., read from page page_table[b, key // page_size] at row key % page_size, into rows
i * chunk .. of the stage. The stage keeps the forward's 128-byte-swizzled K-major layout (the consumers' wgmma
descriptors do not change); a box of whole 8-row swizzle atoms starts on a 1 KiB boundary of it (chunk a multiple
of 8, every stage 1 KiB aligned), where the swizzle pattern repeats, so the TMA's address-based swizzle writes what
the wgmma reads. (TMA itself needs a 128-byte aligned shared-memory destination; CuTe issues each box as one
instruction per 128 bytes of a row, the 128-byte swizzle's widest box.) A dense cache is one page per sequence (page
b, page_size the cache's length) with chunk = tile_n: one box per tile, rows past the cache zero-filled.

Boxes that start past seqlen_k[b] are not issued (their page-table entries are never read): the full barrier
expects the bytes of the boxes issued, not the tile's. Their stage rows keep stale data, and the rows of a page
past seqlen_k hold whatever the cache holds: the consumers mask those keys and zero those V rows
(Sm90FlashForward.zero_v_tail: v_tail_dirty).

Page-table entries: lane i of the warp holds the entry of box i of a tile (up to 32 boxes: tile_n / 8 <= 32), read a
tile ahead of the tile's TMA issue (the loads of tile n - 1's entries go out before the producer waits for the
stages of tile n), and the issuing lane takes each by a shuffle. Only the walk's own tiles' entries are read, and
none past a sequence's row of the table: seqlen_k is the sequence's length clamped to the table's capacity
(flash_fwd.kvcache_work). A page index outside [0, num_pages) reads zeros, never other memory: TMA zero-fills
boxes outside the cache tensor, whose extents (the page count included) the descriptor takes from k_cache / v_cache
at each launch.

The query rows (warp 1): (token, head) pairs have two strides, which one TMA box cannot follow, so the warp copies
each row's 16-byte chunks with cp.async into the consumers' swizzled Q slices (zeros for rows past the sequence),
waits for them, fences them for the wgmma (async proxy) and arrives once on the Q ring's full barrier, which the
consumers wait on as in the forward.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from ....common.inline_ptx import bits_float, float_bits
from .. import wgmma
from ..pipelines import producer_state
from ..tile_config import ROWS_PER_CONSUMER

COPY_BITS = 128


class CacheTiles(NamedTuple):
    """One of K / V: its ring, TMA atom, the per-thread TMA views of the stages' boxes (boxes per tile, 1, stages) and
    of the cache's boxes (rows / chunk, 1, pages) of one KV head, and the bytes of one box."""

    ring: object
    atom: cute.CopyAtom
    sX: cute.Tensor
    gX: cute.Tensor
    box_bytes: int


def cache_tiles(ring, atom, mX, sX, head_kv, chunk: int, cols: int, box_bytes: int) -> CacheTiles:
    gX = cute.flat_divide(mX[None, None, head_kv, None], (chunk, cols))  # (chunk, cols, rows / chunk, 1, pages)
    sX = cute.flat_divide(sX, (chunk, cols))  # (chunk, cols, boxes, 1, stages)
    tXsX, tXgX = cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2)
    )
    return CacheTiles(ring, atom, tXsX, tXgX, box_bytes)


@cute.jit
def load_cache_tiles(
    k_tiles: CacheTiles,
    v_tiles: CacheTiles,
    mPageTable,  # (b, max_pages) int32, or None (dense cache)
    batch: Int32,
    seqlen_k: Int32,
    n_min: Int32,
    n_max: Int32,
    tile_n: cutlass.Constexpr[int],
    chunk: cutlass.Constexpr[int],
    page_size: cutlass.Constexpr[int],
    num_stages: cutlass.Constexpr[int],
):
    """K_last, then K_{j-1} with V_j, then V_first (the consumers' order, as loads.load_q_k_v), tiles as boxes."""
    lane = cute.arch.lane_idx()
    pages = PageEntries(mPageTable, batch, seqlen_k, n_min, lane, tile_n, chunk, page_size)
    if n_max > n_min:
        kv = producer_state(num_stages)
        n_last = n_max - 1
        entries_k = pages.of_tile(n_last)
        entries_ahead = pages.of_tile(n_last - 1)
        _load_tile(k_tiles, kv, n_last, entries_k, seqlen_k, tile_n, chunk, page_size)
        entries_v = entries_k
        for i in cutlass.range(n_max - 1 - n_min, unroll=1):
            n_v = n_last - i
            entries_k = entries_ahead
            entries_ahead = pages.of_tile(n_v - 2)  # used by the next step: its latency overlaps this one's waits
            kv_v = kv.clone()
            kv.advance()
            _load_tile(k_tiles, kv, n_v - 1, entries_k, seqlen_k, tile_n, chunk, page_size)
            _load_tile(v_tiles, kv_v, n_v, entries_v, seqlen_k, tile_n, chunk, page_size)
            entries_v = entries_k
        _load_tile(v_tiles, kv, n_min, entries_v, seqlen_k, tile_n, chunk, page_size)


class PageEntries(NamedTuple):
    """Which page each box of a tile reads: lane i's value is box i's page (a dense cache: the sequence itself)."""

    mPageTable: object  # (b, max_pages) int32, or None
    batch: Int32
    seqlen_k: Int32
    n_min: Int32
    lane: Int32
    tile_n: int
    chunk: int
    page_size: int

    @cute.jit
    def of_tile(self, n_block: Int32) -> Int32:
        """This lane's entry for tile n_block: read only for a box of the walk ([n_min, ...) and before seqlen_k)."""
        page = self.batch
        if const_expr(self.mPageTable is not None):
            page = Int32(0)
            key = n_block * self.tile_n + self.lane * self.chunk
            if self.lane < self.tile_n // self.chunk and n_block >= self.n_min and key < self.seqlen_k:
                page = self.mPageTable[self.batch, key // self.page_size]
        return page


@cute.jit
def _load_tile(
    tiles: CacheTiles,
    state,
    n_block: Int32,
    entries: Int32,  # this lane's page (box `lane` of the tile)
    seqlen_k: Int32,
    tile_n: cutlass.Constexpr[int],
    chunk: cutlass.Constexpr[int],
    page_size: cutlass.Constexpr[int],
):
    """Tile n_block into the stage `state` names: acquire the stage (its full barrier expecting the boxes' bytes),
    then one TMA copy per box (CuTe issues it as one instruction per 128 bytes of a row)."""
    ring = tiles.ring
    boxes = tile_n // chunk
    key0 = n_block * tile_n
    bar = ring.producer_get_barrier(state)
    if const_expr(boxes == 1):
        ring.producer_acquire(state)  # the whole tile's bytes (rows past a dense cache: zero-filled, counted)
        row_box = n_block
        if const_expr(page_size > 0):
            row_box = (key0 % page_size) // chunk
        page = cute.arch.shuffle_sync(entries, 0)
        cute.copy(tiles.atom, tiles.gX[None, row_box, 0, page], tiles.sX[None, 0, 0, state.index], tma_bar_ptr=bar)
    else:
        issued = cutlass.min((seqlen_k - key0 + (chunk - 1)) // chunk, boxes)
        ring.sync_object_empty.wait(state.index, state.phase)
        ring.sync_object_full.arrive_and_expect_tx(state.index, issued * tiles.box_bytes)
        for i in cutlass.range_constexpr(boxes):
            page = cute.arch.shuffle_sync(entries, i)
            if i < issued:
                row_box = ((key0 + i * chunk) % page_size) // chunk
                cute.copy(
                    tiles.atom, tiles.gX[None, row_box, 0, page], tiles.sX[None, i, 0, state.index], tma_bar_ptr=bar
                )


@cute.jit
def load_q_rows(
    q_ring,
    mQ_rows: cute.Tensor,  # ((group, tokens), d): this (sequence, KV head)'s rows, flat row index r = s * group + j
    sQ: cute.Tensor,  # (64, d, consumers) swizzled Q slices
    first_row: Int32,  # the sequence's row of this CTA's first row (its packed rows' offset included)
    rows_left: Int32,  # rows of the sequence from this CTA's first row on (may exceed the tile)
    dtype: cutlass.Constexpr,
    head_dim: cutlass.Constexpr[int],
    tile_m: cutlass.Constexpr[int],
):
    """The CTA's query rows by one warp: lane l copies rows l, l + 32, ... (one row's chunks in a row: each row's
    address needs a division by group, once per row)."""
    lane = cute.arch.lane_idx()
    elems = COPY_BITS // dtype.width
    op = cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS)  # L1 keeps a row's sectors for its next chunks
    atom = cute.make_copy_atom(op, dtype, num_bits_per_copy=COPY_BITS)
    zeros = cute.make_rmem_tensor((elems,), dtype)
    zeros.fill(0.0)
    for p in cutlass.range_constexpr(tile_m // 32):
        row = p * 32 + lane
        consumer = p * 32 // ROWS_PER_CONSUMER
        sRow = cute.zipped_divide(sQ[row % ROWS_PER_CONSUMER, None, consumer], (elems,))  # ((elems), chunks)
        if row < rows_left:
            gRow = cute.zipped_divide(mQ_rows[first_row + row, None], (elems,))
            for c in cutlass.range_constexpr(head_dim // elems):
                cute.copy(atom, gRow[None, c], sRow[None, c])
        else:
            for c in cutlass.range_constexpr(head_dim // elems):
                cute.autovec_copy(zeros, sRow[None, c])
    cute.arch.cp_async_commit_group()
    cute.arch.cp_async_wait_group(0)
    cute.arch.fence_view_async_shared()  # this thread's rows, generic proxy -> the consumers' wgmma (async proxy)
    cute.arch.sync_warp()
    if lane == 0:
        cute.arch.mbarrier_arrive(q_ring.producer_get_barrier(producer_state(1)))


def fp16_exponent(amax: Float32) -> Int32:
    """E, the biased exponent of the largest |q| of a tile (at least 15), for bf16 queries put into fp16 GEMMs: the
    rows are scaled by 2^(268 - E) = 2^(14 - e) (the largest value lands in [2^14, 2^15)) and the scores by the
    inverse 2^(E - 14 - 127). Both factors are normal floats for E in [15, 255] (smaller E: zero or tiny rows, a
    factor of 2^126 cannot overflow them; 255: inf / NaN stay so)."""
    return cutlass.max((float_bits(amax) >> 23) & 0xFF, 15)


@cute.jit
def load_q_rows_as_fp16(
    q_ring,
    mQ_rows: cute.Tensor,  # ((group, tokens), d) bf16: as load_q_rows
    sQ: cute.Tensor,  # (64, d, consumers) swizzled fp16 Q slices
    sQScale: cute.Tensor,  # (1,) fp32: the factor the consumers fold into the score scale (1 / the scale here)
    first_row: Int32,
    rows_left: Int32,
    head_dim: cutlass.Constexpr[int],
    tile_m: cutlass.Constexpr[int],
):
    """load_q_rows for an fp8 cache's fp16 GEMMs with bf16 queries: the rows scaled by one power of two, 2^(14 - e)
    with e the exponent of the tile's largest |q|, and rounded to fp16. The largest value lands in [2^14, 2^15),
    so nothing overflows fp16 and every value within 2^-28 of the largest keeps all of bf16's bits (the scaling
    is exact; only values below that, whose products are below the scores' own rounding, are rounded). Lane l
    handles rows l, l + 32, ..; two passes over the rows (the maximum, then the conversion; the second reads L1)."""
    lane = cute.arch.lane_idx()
    elems = COPY_BITS // 16
    amax = Float32(0.0)
    for p in cutlass.range_constexpr(tile_m // 32):
        row = p * 32 + lane
        if row < rows_left:
            gRow = cute.zipped_divide(mQ_rows[first_row + row, None], (elems,))
            for c in cutlass.range_constexpr(head_dim // elems):
                r = cute.make_fragment_like(gRow[None, c])
                cute.autovec_copy(gRow[None, c], r)
                for i in cutlass.range_constexpr(elems):
                    amax = cute.arch.fmax(amax, abs(r[i].to(Float32)))
    for offset in (16, 8, 4, 2, 1):
        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=offset))
    e = fp16_exponent(amax)
    scale = bits_float((127 + 127 + 14 - e) << 23)
    for p in cutlass.range_constexpr(tile_m // 32):
        row = p * 32 + lane
        consumer = p * 32 // ROWS_PER_CONSUMER
        sRow = cute.zipped_divide(sQ[row % ROWS_PER_CONSUMER, None, consumer], (elems,))
        for c in cutlass.range_constexpr(head_dim // elems):
            x = cute.make_rmem_tensor((elems,), Float32)
            x.fill(0.0)
            if row < rows_left:
                gRow = cute.zipped_divide(mQ_rows[first_row + row, None], (elems,))
                r = cute.make_fragment_like(gRow[None, c])
                cute.autovec_copy(gRow[None, c], r)
                for i in cutlass.range_constexpr(elems):
                    x[i] = r[i].to(Float32) * scale
            h = cute.make_rmem_tensor((elems,), cutlass.Float16)
            wgmma.convert_to_16bit(x, h)
            cute.autovec_copy(h, sRow[None, c])
    cute.arch.fence_view_async_shared()  # this thread's rows, generic proxy -> the consumers' wgmma (async proxy)
    cute.arch.sync_warp()
    if lane == 0:
        sQScale[0] = bits_float((e - 14) << 23)
        cute.arch.mbarrier_arrive(q_ring.producer_get_barrier(producer_state(1)))

"""The consumer epilogue of the sm90 forward kernels: O through shared memory and a TMA store, LSE from registers.

Shared by the bf16/fp16 and the FP8 kernels (both write O in a 16-bit dtype). Packed (varlen) sequences: a TMA store
would clip only at the end of the packed tensor and so overwrite the next sequence's first rows; O goes out with
16-byte stores predicated on the sequence's length instead (FlashAttention-3 does the same).
"""

from __future__ import annotations

import math

from typing import Type

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from ...common.acc_views import rows_cols_view
from .barriers import warpgroup_sync
from .tile_config import ROWS_PER_CONSUMER, WARPGROUP_THREADS
from .views import head_stat_rows, head_tiles
from . import wgmma

COPY_ELEMS = 8  # 16-bit elements per 16-byte store


@cute.jit
def store_o_and_lse(
    acc_O: cute.Tensor,  # fp32, already normalised
    lse: cute.Tensor,  # per row of this thread
    out_dtype: cutlass.Constexpr[Type[cutlass.Numeric]],
    head_dim_v: cutlass.Constexpr[int],
    tiled_mma_o: cute.TiledMma,  # the MMA whose C layout acc_O has
    thr_o,
    sO: cute.Tensor,  # (rows, dv, consumers)
    mO: cute.Tensor,  # TMA coordinate tensor (s, dv, h, b); packed: the (total, dv, h) output itself
    mLSE: cute.Tensor,  # (sq, h, b); packed: (total, h)
    atom_o: cute.CopyAtom,
    slice_idx: Int32,  # which 64-row slice of the sequence this consumer owns
    head: Int32,
    batch: Int32,
    seqlen_q: Int32,
    consumer: Int32,
    tidx: Int32,
    warp_in_wg: Int32,
    offset_q=None,  # packed: the sequence's first row (None: dense)
):
    rows = ROWS_PER_CONSUMER
    rO = cute.make_rmem_tensor(acc_O.shape, out_dtype)
    wgmma.convert_to_16bit(acc_O, rO)
    stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), out_dtype)
    smem_copy = cute.make_tiled_copy_C(stmatrix, tiled_mma_o).get_slice(tidx)
    cute.copy(smem_copy, smem_copy.retile(rO), smem_copy.partition_D(sO[None, None, consumer]))
    cute.arch.fence_view_async_shared()  # the generic-proxy stores must be visible to the TMA (async proxy)
    warpgroup_sync(consumer)

    if cutlass.const_expr(offset_q is None):
        if warp_in_wg == 0:
            gO = cute.local_tile(mO[None, None, head, batch], (rows, head_dim_v), (None, 0))
            tOsO, tOgO = cpasync.tma_partition(
                atom_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2)
            )
            cute.copy(atom_o, tOsO[None, consumer], tOgO[None, slice_idx])
            cute.arch.cp_async_bulk_commit_group()
    else:
        gO = cute.local_tile(head_tiles(mO, head, batch, offset_q), (rows, head_dim_v), (slice_idx, 0))
        store_rows_predicated(sO[None, None, consumer], gO, seqlen_q - slice_idx * rows, out_dtype, head_dim_v, tidx)

    # LSE straight from registers: of the 4 threads sharing a row, the one holding column 0 writes it.
    coords = rows_cols_view(thr_o.partition_C(cute.make_identity_tensor((rows, head_dim_v))))
    gLSE = None if cutlass.const_expr(offset_q is None) else head_stat_rows(mLSE, head, batch, offset_q)
    if coords[0, 0][1] == 0:
        for r in cutlass.range_constexpr(cute.size(lse)):
            row = slice_idx * rows + coords[r, 0][0]
            if row < seqlen_q:
                if cutlass.const_expr(offset_q is None):
                    mLSE[row, head, batch] = lse[r]
                else:
                    gLSE[row] = lse[r]

    if cutlass.const_expr(offset_q is None):
        if warp_in_wg == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # shared memory must outlive the store's reads


@cute.jit
def store_partial_o_and_lse(
    acc_O: cute.Tensor,  # fp32, already normalised (0 for rows that saw no key)
    lse: cute.Tensor,  # per row of this thread (-inf for rows that saw no key)
    head_dim_v: cutlass.Constexpr[int],
    thr_o,  # this thread's slice of the MMA whose C layout acc_O has
    mO: cute.Tensor,  # (sq, dv, h, splits * b) fp32 partials (a seq-major view)
    mLSE: cute.Tensor,  # (sq, h, splits * b) fp32
    slice_idx: Int32,
    head: Int32,
    out_batch: Int32,
    seqlen_q: Int32,
):
    """A split-key CTA's partial O and LSE in fp32, straight from registers (common/split_combine.py combines them):
    few rows (decoding), so no staging through shared memory; each thread stores the column pairs the MMA gave it."""
    rows = ROWS_PER_CONSUMER
    coords = rows_cols_view(thr_o.partition_C(cute.make_identity_tensor((rows, head_dim_v))))
    acc = rows_cols_view(acc_O)
    gO = mO[None, None, head, out_batch]
    for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
        row = slice_idx * rows + coords[r, 0][0]
        if row < seqlen_q:
            for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                gO[row, coords[r, c][1]] = acc[r, c]
            if coords[0, 0][1] == 0:
                mLSE[row, head, out_batch] = lse[r]


def row_chunks_copy(dtype, cols: int, tidx: Int32, threads: int = WARPGROUP_THREADS):
    """This thread's slice of a 16-byte-per-thread copy over a (rows, cols) tile by `threads` threads (one
    warpgroup unless said): consecutive threads take consecutive 16-byte chunks of a row, up to 16 threads (256
    bytes) per row, as many as divide the row's chunks (head dims 96 and 192: 4 and 8)."""
    per_row = math.gcd(cols // COPY_ELEMS, 16)
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    thread_layout = cute.make_ordered_layout((threads // per_row, per_row), order=(1, 0))
    tiled = cute.make_tiled_copy_tv(atom, thread_layout, cute.make_layout((1, COPY_ELEMS)))
    return tiled, tiled.get_slice(tidx)


@cute.jit
def store_rows_predicated(
    sO: cute.Tensor,  # (rows, dv) in shared memory, filled and synchronised
    gO: cute.Tensor,  # (rows, dv) in global memory
    rows_left: Int32,  # rows of gO that belong to the sequence (may exceed `rows`, or be <= 0)
    dtype: cutlass.Constexpr,
    head_dim_v: cutlass.Constexpr[int],
    tidx: Int32,  # 0 .. threads - 1
    rows: cutlass.Constexpr[int] = ROWS_PER_CONSUMER,
    threads: cutlass.Constexpr[int] = WARPGROUP_THREADS,
):
    """16-byte stores of the first `rows_left` rows of sO to gO, by `threads` threads (one warpgroup unless said)."""
    tiled, thr = row_chunks_copy(dtype, head_dim_v, tidx, threads)
    tOsO = thr.partition_S(sO)
    tOgO = thr.partition_D(gO)
    tOcO = thr.partition_S(cute.make_identity_tensor((rows, head_dim_v)))
    tOrO = cute.make_fragment_like(tOsO, dtype)
    cute.autovec_copy(tOsO, tOrO)
    for m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
        if tOcO[0, m, 0][0] < rows_left:
            cute.copy(tiled, tOrO[None, m, None], tOgO[None, m, None])


@cute.jit
def zero_rows_from(
    sT: cute.Tensor,  # (rows, cols) in shared memory, landed
    first_row: Int32,  # rows first_row .. rows - 1 become 0
    dtype: cutlass.Constexpr,
    rows: cutlass.Constexpr[int],
    cols: cutlass.Constexpr[int],
    tidx: Int32,  # 0 .. 127 within the consumer warpgroup
):
    """Zeroes the tail rows of a shared-memory tile by 16-byte stores of one warpgroup; the caller fences them for
    the async proxy and synchronises the warpgroup before a wgmma reads the tile."""
    tiled, thr = row_chunks_copy(dtype, cols, tidx)
    tTsT = thr.partition_D(sT)
    tTcT = thr.partition_D(cute.make_identity_tensor((rows, cols)))
    tTrZ = cute.make_fragment_like(tTsT[None, 0, None], dtype)
    tTrZ.fill(0.0)
    for m in cutlass.range_constexpr(cute.size(tTsT.shape[1])):
        if tTcT[0, m, 0][0] >= first_row:
            cute.copy(tiled, tTrZ, tTsT[None, m, None])

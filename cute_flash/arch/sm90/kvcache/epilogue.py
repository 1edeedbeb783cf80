"""The consumer epilogue of the sm90 KV-cache forward: O and LSE to their (query token, query head) places.

A consumer's 64 rows are (token, head) pairs (views.py), not rows of one strided tensor, so nothing goes out by TMA:
O (16-bit) is staged through the consumer's Q slice of shared memory (stmatrix) and written with 16-byte stores, one
row address per row; the split build's fp32 partials go straight from registers (as the forward's
epilogue.store_partial_o_and_lse). LSE comes from registers. Rows past the sequence are not stored.
"""

from __future__ import annotations

from typing import Type

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ....common.acc_views import rows_cols_view
from ..barriers import warpgroup_sync
from ..epilogue import COPY_ELEMS, row_chunks_copy
from ..tile_config import ROWS_PER_CONSUMER
from .. import wgmma


@cute.jit
def store_o_rows(
    acc_O: cute.Tensor,  # fp32, already normalised
    out_dtype: cutlass.Constexpr[Type[cutlass.Numeric]],
    head_dim_v: cutlass.Constexpr[int],
    tiled_mma_o: cute.TiledMma,
    sO: cute.Tensor,  # (64, dv) this consumer's slot
    mO_rows: cute.Tensor,  # ((group, tokens), dv) of this (sequence or split, KV head)
    first_row: Int32,  # mO_rows' row of this consumer's first row
    rows_left: Int32,  # rows of the sequence from that row on (may exceed 64, or be <= 0)
    consumer: Int32,
    tidx: Int32,
):
    rO = cute.make_rmem_tensor(acc_O.shape, out_dtype)
    wgmma.convert_to_16bit(acc_O, rO)
    stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), out_dtype)
    smem_copy = cute.make_tiled_copy_C(stmatrix, tiled_mma_o).get_slice(tidx)
    cute.copy(smem_copy, smem_copy.retile(rO), smem_copy.partition_D(sO))
    warpgroup_sync(consumer)

    tiled, thr = row_chunks_copy(out_dtype, head_dim_v, tidx)
    tOsO = thr.partition_S(sO)
    tOcO = thr.partition_S(cute.make_identity_tensor((ROWS_PER_CONSUMER, head_dim_v)))
    tOrO = cute.make_fragment_like(tOsO, out_dtype)
    cute.autovec_copy(tOsO, tOrO)
    for m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
        row = tOcO[0, m, 0][0]
        if row < rows_left:
            gRow = cute.zipped_divide(mO_rows[first_row + row, None], (COPY_ELEMS,))  # ((8), dv / 8)
            for k in cutlass.range_constexpr(cute.size(tOrO.shape[2])):
                cute.copy(tiled, tOrO[None, m, k], gRow[None, tOcO[0, m, k][1] // COPY_ELEMS])


@cute.jit
def store_partial_o_rows(
    acc_O: cute.Tensor,  # fp32, already normalised (0 for rows that saw no key)
    head_dim_v: cutlass.Constexpr[int],
    thr_o,
    mO_rows: cute.Tensor,  # ((group, tokens), dv) fp32 partials of this (split, KV head)
    first_row: Int32,
    rows_left: Int32,
):
    coords = rows_cols_view(thr_o.partition_C(cute.make_identity_tensor((ROWS_PER_CONSUMER, head_dim_v))))
    acc = rows_cols_view(acc_O)
    for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
        row = coords[r, 0][0]
        if row < rows_left:
            gRow = mO_rows[first_row + row, None]
            for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                gRow[coords[r, c][1]] = acc[r, c]


@cute.jit
def store_lse_rows(
    lse: cute.Tensor,  # per row of this thread
    head_dim_v: cutlass.Constexpr[int],
    thr_o,
    mLSE_rows: cute.Tensor,  # ((group, tokens),) of this (sequence or split, KV head)
    first_row: Int32,
    rows_left: Int32,
):
    """Of the 4 threads sharing a row, the one holding column 0 writes its LSE."""
    coords = rows_cols_view(thr_o.partition_C(cute.make_identity_tensor((ROWS_PER_CONSUMER, head_dim_v))))
    if coords[0, 0][1] == 0:
        for r in cutlass.range_constexpr(cute.size(lse)):
            row = coords[r, 0][0]
            if row < rows_left:
                mLSE_rows[first_row + row] = lse[r]

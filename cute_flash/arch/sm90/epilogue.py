"""The consumer epilogue of the sm90 forward kernels: O through shared memory and a TMA store, LSE from registers.

Shared by the bf16/fp16 and the FP8 kernels (both write O in a 16-bit dtype).
"""

from __future__ import annotations

from typing import Type

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from ...common.acc_views import rows_cols_view
from .barriers import epilogue_sync
from .tile_config import ROWS_PER_CONSUMER
from . import wgmma


@cute.jit
def store_o_and_lse(
    acc_O: cute.Tensor,  # fp32, already normalised
    lse: cute.Tensor,  # per row of this thread
    out_dtype: cutlass.Constexpr[Type[cutlass.Numeric]],
    head_dim_v: cutlass.Constexpr[int],
    tiled_mma_o: cute.TiledMma,  # the MMA whose C layout acc_O has
    thr_o,
    sO: cute.Tensor,  # (rows, dv, consumers)
    mO: cute.Tensor,  # TMA coordinate tensor (s, dv, h, b)
    mLSE: cute.Tensor,  # (sq, h, b)
    atom_o: cute.CopyAtom,
    slice_idx: Int32,  # which 64-row slice of the sequence this consumer owns
    head: Int32,
    batch: Int32,
    seqlen_q: Int32,
    consumer: Int32,
    tidx: Int32,
    warp_in_wg: Int32,
):
    rows = ROWS_PER_CONSUMER
    rO = cute.make_rmem_tensor(acc_O.shape, out_dtype)
    wgmma.convert_to_16bit(acc_O, rO)
    stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), out_dtype)
    smem_copy = cute.make_tiled_copy_C(stmatrix, tiled_mma_o).get_slice(tidx)
    cute.copy(smem_copy, smem_copy.retile(rO), smem_copy.partition_D(sO[None, None, consumer]))
    cute.arch.fence_view_async_shared()  # the generic-proxy stores must be visible to the TMA (async proxy)
    epilogue_sync(consumer)

    if warp_in_wg == 0:
        gO = cute.local_tile(mO[None, None, head, batch], (rows, head_dim_v), (None, 0))
        tOsO, tOgO = cpasync.tma_partition(
            atom_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2)
        )
        cute.copy(atom_o, tOsO[None, consumer], tOgO[None, slice_idx])
        cute.arch.cp_async_bulk_commit_group()

    # LSE straight from registers: of the 4 threads sharing a row, the one holding column 0 writes it.
    coords = rows_cols_view(thr_o.partition_C(cute.make_identity_tensor((rows, head_dim_v))))
    if coords[0, 0][1] == 0:
        for r in cutlass.range_constexpr(cute.size(lse)):
            row = slice_idx * rows + coords[r, 0][0]
            if row < seqlen_q:
                mLSE[row, head, batch] = lse[r]

    if warp_in_wg == 0:
        cute.arch.cp_async_bulk_wait_group(0, read=True)  # shared memory must outlive the store's reads

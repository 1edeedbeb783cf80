"""Backward postprocess of the sm90 family: dq = scale * dQ accumulator, from the main kernel's "fragment" layout.

The main kernel (flash_bwd.py) adds each query tile's dQ to a (b, h, sq_padded * d) fp32 buffer in its dQ MMA's
register order (`flash_bwd.dq_fragment_offset`). One CTA with the main kernel's consumer thread count converts one
query tile: thread t reads what consumer thread t added (16-byte loads), so its registers hold that MMA's
accumulator; it scales and converts them, stmatrix puts the tile in shared memory, and one TMA store writes it
(rows past seqlen_q clipped), so that global memory sees whole 128-byte lines instead of 4-byte pieces.

Packed sequences (`packed` entry, varlen instances): the accumulator is (h, rows * d) with sequence b's tiles from
row cu_seqlens[b] + b * pad rounded down to a multiple of pad; the grid spans the longest sequence's query tiles
(the CTAs past their sequence's end exit), and the tile goes out by 16-byte stores of the sequence's rows (a TMA
store would clip only at the end of the packed tensor).
"""

from __future__ import annotations

from typing import Type

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import cpasync

from ...common.entries import AccumEntries
from ...common.packed import seq_rows
from .epilogue import store_rows_predicated
from .flash_bwd import DQ_VEC, SMEM_ALIGN, transposed_layout, dq_fragment_offset, dq_tile, dq_tiled_mma
from .tile_config import WARPGROUP_THREADS, BwdTileConfig, operand_atom_cols
from .views import accum_rows, head_tiles, packed_seq_major_view, seq_major_view
from . import wgmma


class DqConvertSm90(AccumEntries):
    """dq = scale * dQ accumulator (entries in common/entries.py): accum (b, h, sq_padded * d) fp32, out (b, sq, h,
    d); packed: accum (h, rows * d), out (total_q, h, d)."""

    def __init__(self, dtype: Type[cutlass.Numeric], head_dim: int, cfg: BwdTileConfig, varlen: bool = False):
        """varlen: packed sequences (the `packed` entry), else dense tensors (`__call__`)."""
        self.varlen = varlen
        self.dtype = dtype
        self.head_dim = head_dim
        self.cfg = cfg
        self.num_threads = cfg.num_dq_wgs * WARPGROUP_THREADS

    @cute.jit
    def _launch(
        self, mAccum: cute.Tensor, mOut: cute.Tensor, scale: Float32, stream, mCuSeqlens=None, pad=None, max_seqlen=None
    ):
        tile_m, d = self.cfg.tile_m, self.head_dim
        sO_layout = wgmma.k_major_smem_layout(self.dtype, tile_m, d, 1, atom_cols=operand_atom_cols(d, self.cfg))

        @cute.struct
        class SharedStorage:
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sO_layout)], SMEM_ALIGN]

        if cutlass.const_expr(mCuSeqlens is None):
            mO = seq_major_view(mOut)  # (s, d, h, b)
            atom_o, tma_o = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, cute.select(sO_layout, mode=[0, 1]), (tile_m, d)
            )
            grid = (cute.ceil_div(mOut.shape[1], tile_m), mOut.shape[2], mOut.shape[0])
            seqs = None
        else:
            atom_o, tma_o = None, packed_seq_major_view(mOut)  # (total, d, h)
            grid = ((max_seqlen + tile_m - 1) // tile_m, mOut.shape[1], mCuSeqlens.shape[0] - 1)
            seqs = (mCuSeqlens, pad)
        self.kernel(
            mAccum, tma_o, atom_o, scale, dq_tiled_mma(self.dtype, d, self.cfg), sO_layout, seqs, SharedStorage
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(
        self,
        mAccum: cute.Tensor,
        mO: cute.Tensor,  # TMA coordinate tensor (s, d, h, b); packed: the (total, d, h) output
        atom_o: cute.CopyAtom,
        scale: Float32,
        tiled_mma: cute.TiledMma,
        sO_layout: cute.ComposedLayout,
        seqs,  # packed: (mCuSeqlens, pad); dense: None
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(seqs is None):
            self.convert_tile(
                mAccum, mO, atom_o, scale, tiled_mma, sO_layout, SharedStorage, tidx, m_block, head, batch
            )
        else:
            seq = seq_rows(batch, seqs[0], seqs[0])
            if m_block * self.cfg.tile_m < seq.seqlen_q:
                self.convert_tile(
                    mAccum, mO, atom_o, scale, tiled_mma, sO_layout, SharedStorage, tidx, m_block, head, batch,
                    seq.offset_q, seq.padded_offset_q(seqs[1]), seq.seqlen_q,
                )  # fmt: skip

    @cute.jit
    def convert_tile(
        self,
        mAccum: cute.Tensor,
        mO: cute.Tensor,
        atom_o: cute.CopyAtom,
        scale: Float32,
        tiled_mma: cute.TiledMma,
        sO_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
        tidx,
        m_block,
        head,
        batch,
        offset_q=None,  # packed: the sequence's first row of out, of the accumulator, and its length
        padded_q=None,
        seqlen_q=None,
    ):
        tile_m, d = self.cfg.tile_m, self.head_dim
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)

        acc = cute.make_rmem_tensor(tiled_mma.get_slice(tidx).partition_shape_C(dq_tile(d, self.cfg)), Float32)
        base = accum_rows(mAccum, head, batch, padded_q, d).iterator + m_block * (tile_m * d)
        cute.arch.griddepcontrol_wait()  # launched while the main kernel may still add to the accumulator
        for i in cutlass.range_constexpr(cute.size(acc) // DQ_VEC):  # the tile is padding past seqlen: in bounds
            ptr = (base + dq_fragment_offset(i * DQ_VEC, tidx, tile_m * d // self.cfg.num_dq_wgs)).align(DQ_VEC * 4)
            src = cute.make_tensor(ptr, cute.make_layout(DQ_VEC))
            cute.autovec_copy(src, cute.make_tensor(acc.iterator + i * DQ_VEC, cute.make_layout(DQ_VEC)))
        acc.store(acc.load() * scale)
        r16 = cute.make_rmem_tensor(acc.shape, self.dtype)
        wgmma.convert_to_16bit(acc, r16)
        # With dq_swap_ab the registers hold dQᵀ: the transposing stmatrix writes them into the (d, tile_m) view.
        swap = self.cfg.dq_swap_ab
        stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=swap, num_matrices=4), self.dtype)
        smem_copy = cute.make_tiled_copy_C(stmatrix, tiled_mma).get_slice(tidx)
        s_dst = transposed_layout(sO, tile_m, d, 1) if cutlass.const_expr(swap) else sO
        cute.copy(smem_copy, smem_copy.retile(r16), smem_copy.partition_D(s_dst[None, None, 0]))
        cute.arch.fence_view_async_shared()  # generic-proxy stores, read next by the TMA (async proxy)
        cute.arch.sync_threads()
        if cutlass.const_expr(offset_q is None):
            if tidx < 32:
                gO = cute.local_tile(mO[None, None, head, batch], (tile_m, d), (None, 0))
                tOsO, tOgO = cpasync.tma_partition(
                    atom_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2)
                )
                cute.copy(atom_o, tOsO[None, 0], tOgO[None, m_block])
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        else:
            gO = cute.local_tile(head_tiles(mO, head, batch, offset_q), (tile_m, d), (m_block, 0))
            store_rows_predicated(
                sO[None, None, 0], gO, seqlen_q - m_block * tile_m, self.dtype, d, tidx, tile_m, self.num_threads
            )

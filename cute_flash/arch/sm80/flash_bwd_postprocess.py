"""Backward postprocess: converts an fp32 gradient accumulator to the output dtype, times a scale.

The main backward kernel accumulates dQ (and, with GQA, dK/dV) with fp32 atomics into a (b, s_padded, h, d) buffer
(dQ may instead use the "fragment" layout, converted by DqFragmentConvertSm80 below);
this kernel writes out[b, i, h, :] = scale * accum[b, i, h, :] for i < s. One CTA converts `block_m` rows of one
(batch, head).

Both kernels issue every load of a thread before its first branch: the accumulators are padded to whole blocks of
rows, so the loads need no predicate, and only the stores check the sequence length. (A load inside each row's
branch is converted before the next one is issued, so a thread would wait for one memory latency per row.)
"""

from __future__ import annotations

import math
from typing import Optional, Type

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ...common.entries import AccumEntries
from ...common.packed import head_rows, head_stats, seq_rows
from ...common.pin import pin_values


class AccumConvertSm80(AccumEntries):
    """out = scale * accum (entries in common/entries.py; the kernel's signature gives the layouts)."""

    def __init__(
        self, dtype: Type[cutlass.Numeric], head_dim: int, block_m: int = 64, num_threads: int = 128, varlen=False
    ):
        """varlen: the packed variant (entry `packed`): sequence b's accumulator rows start at cu_seqlens[b] + b * pad
        rounded down to a multiple of pad (pad >= block_m, a runtime argument), its output rows at cu_seqlens[b]."""
        assert head_dim % 8 == 0
        self.varlen = varlen
        self.dtype = dtype
        self.head_dim = head_dim
        self.block_m = block_m
        self.num_threads = num_threads
        self.lanes_per_row = math.gcd(head_dim // 8, 32)  # each lane moves 8 elements at a time

    @cute.jit
    def _launch(self, mAccum, mOut, scale, stream, mCuSeqlens=None, pad=None, max_seqlen=None):
        thread_layout = cute.make_ordered_layout(
            (self.num_threads // self.lanes_per_row, self.lanes_per_row), order=(1, 0)
        )
        value_layout = cute.make_layout((1, 8))
        load_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        tiled_load = cute.make_tiled_copy_tv(load_atom, thread_layout, value_layout)
        tiled_store = cute.make_tiled_copy_tv(store_atom, thread_layout, value_layout)
        if cutlass.const_expr(self.varlen):
            grid = ((max_seqlen + (self.block_m - 1)) // self.block_m, mOut.shape[1], mCuSeqlens.shape[0] - 1)
        else:
            grid = (cute.ceil_div(mOut.shape[1], self.block_m), mOut.shape[2], mOut.shape[0])
        self.kernel(mAccum, mOut, scale, tiled_load, tiled_store, mCuSeqlens, pad).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mAccum: cute.Tensor,  # (b, s_padded, h, d) fp32, or packed (total + batch * pad, h, d)
        mOut: cute.Tensor,  # (b, s, h, d), or packed (total, h, d)
        scale: Float32,
        tiled_load: cute.TiledCopy,
        tiled_store: cute.TiledCopy,
        mCuSeqlens: Optional[cute.Tensor] = None,
        pad: Optional[Int32] = None,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.varlen):
            seq = seq_rows(batch, mCuSeqlens, mCuSeqlens)
            if m_block * self.block_m < seq.seqlen_q:
                self.cta(
                    head_rows(mAccum, batch, head, seq.padded_offset_q(pad)),
                    head_rows(mOut, batch, head, seq.offset_q), scale, tiled_load, tiled_store, tidx, m_block,
                    seq.seqlen_q,
                )  # fmt: skip
        else:
            self.cta(
                mAccum[batch, None, head, None], mOut[batch, None, head, None], scale, tiled_load, tiled_store, tidx,
                m_block, mOut.shape[1],
            )  # fmt: skip

    @cute.jit
    def cta(self, mAccum, mOut, scale, tiled_load, tiled_store, tidx, m_block, seqlen):
        """One block of rows of one (sequence, head): mAccum / mOut are its (rows, d) views."""
        tile = (self.block_m, self.head_dim)

        gAccum = cute.local_tile(mAccum, tile, (m_block, 0))
        gOut = cute.local_tile(mOut, tile, (m_block, 0))
        cOut = cute.make_identity_tensor(tile)
        thr_load = tiled_load.get_slice(tidx)
        thr_store = tiled_store.get_slice(tidx)
        tAgA = thr_load.partition_S(gAccum)
        tOgO = thr_store.partition_D(gOut)
        tOcO = thr_store.partition_D(cOut)
        tArA = cute.make_fragment_like(tAgA)
        tOrO = cute.make_fragment_like(tOgO)
        cute.copy(tiled_load, tAgA, tArA)  # rows past seqlen are padding of mAccum: in bounds
        tOrO.store((tArA.load() * scale).to(self.dtype))
        for m in cutlass.range_constexpr(cute.size(tOgO.shape[1])):
            if m_block * self.block_m + tOcO[0, m, 0][0] < seqlen:
                cute.copy(tiled_store, tOrO[None, m, None], tOgO[None, m, None])


class DqFragmentConvertSm80(AccumEntries):
    """dq = scale * dQ accumulator, from the main kernel's "fragment" layout: (b, h, sq_padded * d) fp32 where each
    m-block (and each dq_chunk of its columns) holds the dQ mma's accumulator registers thread-interleaved
    (flash_bwd.dq_fragment_offset); the packed accumulator is (h, (total_q + batch * pad) * d). One CTA, with the main
    kernel's thread count, converts one m-block: thread t reads what thread t of the main kernel added, and finds its
    (row, column) from the same tiled mma."""

    def __init__(self, dtype: Type[cutlass.Numeric], head_dim: int, config, varlen: bool = False):
        """varlen: the packed variant (entry `packed`): sequence b's accumulator is (h, rows * d) from row
        cu_seqlens_q[b] + b * pad rounded down to a multiple of pad (pad >= block_m, a runtime argument), its output
        rows start at cu_seqlens_q[b]."""
        self.varlen = varlen
        self.dtype = dtype
        self.head_dim = head_dim
        self.cfg = config
        self.dq_chunk = config.dq_chunk or head_dim

    @cute.jit
    def _launch(self, mAccum, mOut, scale, stream, mCuSeqlens=None, pad=None, max_seqlen=None):
        from .flash_bwd import dq_tiled_mma

        if cutlass.const_expr(self.varlen):
            block_m = self.cfg.block_m
            grid = ((max_seqlen + (block_m - 1)) // block_m, mOut.shape[1], mCuSeqlens.shape[0] - 1)
        else:
            grid = (cute.ceil_div(mOut.shape[1], self.cfg.block_m), mOut.shape[2], mOut.shape[0])
        self.kernel(mAccum, mOut, scale, dq_tiled_mma(self.dtype, self.cfg), mCuSeqlens, pad).launch(
            grid=grid, block=[self.cfg.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mAccum: cute.Tensor,  # (b, h, sq_padded * d) fp32 in the "fragment" layout, or packed (h, padded rows * d)
        mOut: cute.Tensor,  # (b, sq, h, d), or packed (total_q, h, d)
        scale: Float32,
        tiled_mma: cute.TiledMma,
        mCuSeqlens: Optional[cute.Tensor] = None,
        pad: Optional[Int32] = None,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        args = (mAccum, mOut, scale, tiled_mma, tidx, m_block, head, batch)
        if cutlass.const_expr(self.varlen):
            seq = seq_rows(batch, mCuSeqlens, mCuSeqlens)
            if m_block * self.cfg.block_m < seq.seqlen_q:
                self.cta(*args, seq.seqlen_q, seq.offset_q, seq.padded_offset_q(pad) * self.head_dim)
        else:
            self.cta(*args, mOut.shape[1], None, None)

    @cute.jit
    def cta(
        self,
        mAccum: cute.Tensor,
        mOut: cute.Tensor,
        scale: Float32,
        tiled_mma: cute.TiledMma,
        tidx: Int32,
        m_block: Int32,
        head: Int32,
        batch: Int32,
        seqlen: Int32,
        out_offset: Optional[Int32],
        accum_offset: Optional[Int32],
    ):
        """One m-block of one (sequence, head); out_offset / accum_offset: the sequence's first output row and first
        accumulator element in packed tensors (None: dense tensors, indexed by batch)."""
        from .flash_bwd import dq_fragment_offset

        block_m, chunk_cols = self.cfg.block_m, self.dq_chunk
        num_chunks = self.head_dim // chunk_cols
        tCcC = tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((block_m, chunk_cols)))
        per_chunk = cute.size(tCcC)
        values = cute.make_rmem_tensor(num_chunks * per_chunk, Float32)
        for chunk in cutlass.range_constexpr(num_chunks):  # the block is padding past seqlen: in bounds
            gAccum = cute.local_tile(
                head_stats(mAccum, batch, head, accum_offset), (block_m * chunk_cols,), (m_block * num_chunks + chunk,)
            )
            for i in cutlass.range_constexpr(per_chunk):
                offset = dq_fragment_offset(i, tidx, self.cfg.num_threads, self.cfg.dq_vec)
                values[chunk * per_chunk + i] = gAccum[offset]
        pin_values([values[j] for j in range(num_chunks * per_chunk)])
        for chunk in cutlass.range_constexpr(num_chunks):
            for i in cutlass.range_constexpr(per_chunk):
                row = m_block * block_m + tCcC[i][0]
                if row < seqlen:
                    value = values[chunk * per_chunk + i] * scale
                    if cutlass.const_expr(out_offset is None):
                        mOut[batch, row, head, chunk * chunk_cols + tCcC[i][1]] = value.to(self.dtype)
                    else:
                        mOut[out_offset + row, head, chunk * chunk_cols + tCcC[i][1]] = value.to(self.dtype)

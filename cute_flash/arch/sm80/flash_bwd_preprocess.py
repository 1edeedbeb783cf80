"""Backward preprocess: D = rowsum(dO * O) and the log2-domain LSE the main backward kernel reads.

One CTA handles 64 query rows of one (batch, head), one warp per 16 rows. Both outputs are (b, h, seqlen_q_padded)
fp32, padded to the main kernel's query tile so that it reads them without predicates. Padding rows, and rows whose
forward saw no key (lse = -inf), get D = 0 and lse_log2 = +inf: the main kernel then computes P = exp2(s - inf) = 0
for them, so their gradients vanish without any special case there.

D is the diagonal of dO O^T computed with the same mma.sync chain (m16n8k16, fp32 accumulation, k-blocks in order
from a zero accumulator) as the main kernel's dP = dO V^T. When a row's output is exactly one value row (a row that
sees a single key: P = 1, O = V_j bitwise), dP_ij - D_i is then exactly 0, as it is in plain torch, instead of the
rounding difference between two summation orders.

Two options serve the sm90 backward (zeroing its dQ accumulator, programmatic dependent launch; on there, off here):
zero_dq_accum also zeroes the main kernel's (b, h, sq_padded * d) fp32 dQ accumulator (packed: each sequence's padded
rows of (h, rows * d)), each CTA its 64 rows (64 * d contiguous floats, 16-byte stores), in place of a separate
memset; launch_dependents lets a dependent kernel launched
with programmatic dependent launch (PDL) start at once (it waits, griddepcontrol.wait, before reading what this
kernel writes).
"""

from __future__ import annotations

import math
from typing import Optional, Type

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass import Int32
from cutlass.cute.nvgpu import warp

from ...common.packed import SeqRows, dense_seq, head_rows, seq_rows

LOG2_E = math.log2(math.e)
ROWS_PER_WARP = 16  # the mma's m


class BackwardPreprocessSm80:
    """Computes dpsum = rowsum(dO * O) and lse_log2 = lse * log2(e) (+inf where the row is empty or padding)."""

    # Options of the sm90 backward, set per instance by its option builds (arch/sm90/build.py compile_preprocess):
    # zero_dq_accum, entries `with_dq_zeroing` / `packed_with_dq_zeroing`, also zeroes the sm90 dQ accumulator;
    # launch_dependents, griddepcontrol.launch_dependents at the start of every CTA (for a PDL-launched successor).
    zero_dq_accum = False
    launch_dependents = False
    dq_head_dim = None  # with zero_dq_accum: the accumulator's head dim (the main kernel's head_dim; None: head_dim_v)

    def __init__(self, dtype: Type[cutlass.Numeric], head_dim_v: int, block_m: int = 64, varlen: bool = False):
        """varlen: the packed variant (entry `packed`), whose outputs give each sequence its rows from
        cu_seqlens_q[b] + b * pad_q (rounded down to a multiple of pad_q, common/packed.py) and fill them up to a
        whole multiple of pad_q (a runtime multiple of block_m)."""
        assert head_dim_v % 16 == 0 and block_m % ROWS_PER_WARP == 0
        self.varlen = varlen
        self.dtype = dtype
        self.head_dim_v = head_dim_v
        self.block_m = block_m
        self.num_warps = block_m // ROWS_PER_WARP

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (b, sq, h, dv)
        mdO: cute.Tensor,  # (b, sq, h, dv)
        mLSE: cute.Tensor,  # (b, h, sq) natural log
        mdPsum: cute.Tensor,  # (b, h, sq_padded), sq_padded a multiple of block_m
        mLSElog2: cute.Tensor,  # (b, h, sq_padded)
        stream,
    ):
        self._launch(mO, mdO, mLSE, mdPsum, mLSElog2, stream)

    @cute.jit
    def with_dq_zeroing(self, mO, mdO, mLSE, mdPsum, mLSElog2, mdQaccum, stream):
        """`__call__` that also zeroes mdQaccum, (b, h, sq_padded * dv) fp32 with 16-byte aligned rows."""
        assert self.zero_dq_accum and not self.varlen
        self._launch(mO, mdO, mLSE, mdPsum, mLSElog2, stream, mdQaccum=mdQaccum)

    @cute.jit
    def packed(
        self,
        mO: cute.Tensor,  # (total_q, h, dv)
        mdO: cute.Tensor,  # (total_q, h, dv)
        mLSE: cute.Tensor,  # (h, total_q) natural log
        mdPsum: cute.Tensor,  # (h, total_q + batch * pad_q)
        mLSElog2: cute.Tensor,  # (h, total_q + batch * pad_q)
        mCuSeqlensQ: cute.Tensor,
        pad_q: Int32,
        num_blocks: Int32,  # round_up(max_seqlen_q, pad_q) / block_m
        stream,
    ):
        assert self.varlen
        self._launch(mO, mdO, mLSE, mdPsum, mLSElog2, stream, mCuSeqlensQ, pad_q, num_blocks)

    @cute.jit
    def packed_with_dq_zeroing(
        self, mO, mdO, mLSE, mdPsum, mLSElog2, mCuSeqlensQ, pad_q: Int32, num_blocks: Int32, mdQaccum, stream
    ):
        """`packed` that also zeroes the rows of mdQaccum, (h, (total_q + batch * pad_q) * dv) fp32, that the main
        kernel adds to: each sequence's padded rows up to its length rounded up to pad_q."""
        assert self.zero_dq_accum and self.varlen
        self._launch(mO, mdO, mLSE, mdPsum, mLSElog2, stream, mCuSeqlensQ, pad_q, num_blocks, mdQaccum)

    @cute.jit
    def _launch(
        self, mO, mdO, mLSE, mdPsum, mLSElog2, stream, mCuSeqlensQ=None, pad_q=None, num_blocks=None, mdQaccum=None
    ):
        # One warp computes a 16 x 16 tile of dO O^T per k-block (two n8 atoms), of which it keeps the diagonal.
        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)),
            (1, 1, 1),
            permutation_mnk=(ROWS_PER_WARP, ROWS_PER_WARP, 16),
        )
        if cutlass.const_expr(self.varlen):
            grid = (num_blocks, mO.shape[1], mCuSeqlensQ.shape[0] - 1)
        else:
            grid = (cute.ceil_div(mdPsum.shape[2], self.block_m), mO.shape[2], mO.shape[0])
        zeroed = () if cutlass.const_expr(mdQaccum is None) else (mdQaccum,)  # the kernel's optional last argument
        self.kernel(mO, mdO, mLSE, mdPsum, mLSElog2, tiled_mma, mCuSeqlensQ, pad_q, *zeroed).launch(
            grid=grid, block=[self.num_warps * 32, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,  # dense (b, sq, h, dv) or packed (total_q, h, dv), like mdO
        mdO: cute.Tensor,
        mLSE: cute.Tensor,  # (b, h, sq) or (h, total_q), natural log
        mdPsum: cute.Tensor,  # (b, h, sq_padded) or (h, total_q + batch * pad_q), like mLSElog2
        mLSElog2: cute.Tensor,
        tiled_mma: cute.TiledMma,
        mCuSeqlensQ: Optional[cute.Tensor] = None,
        pad_q: Optional[Int32] = None,  # packed: sequence b's rows from cu_seqlens_q[b] + b * pad_q, rounded down
        mdQaccum: Optional[cute.Tensor] = None,  # zero_dq_accum: (b, h, sq_padded * d) or (h, padded rows * d) fp32
    ):
        if cutlass.const_expr(self.launch_dependents):
            cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        tensors = (mO, mdO, mLSE, mdPsum, mLSElog2)
        if cutlass.const_expr(self.varlen):
            seq = seq_rows(batch, mCuSeqlensQ, mCuSeqlensQ)
            # Rows up to the sequence's length rounded up to pad_q are read by the main kernel (as inert padding).
            if m_block * self.block_m < (seq.seqlen_q + (pad_q - 1)) // pad_q * pad_q:
                self.cta(tensors, tiled_mma, tidx, m_block, head, seq, pad_q)
                if cutlass.const_expr(self.zero_dq_accum):
                    first = seq.padded_offset_q(pad_q) + m_block * self.block_m
                    self.zero_dq_rows(mdQaccum[head, None], tidx, first * self.dq_width)
        else:
            self.cta(tensors, tiled_mma, tidx, m_block, head, dense_seq(batch, mO.shape[1]), None)
            if cutlass.const_expr(self.zero_dq_accum):
                self.zero_dq_rows(mdQaccum[batch, head, None], tidx, m_block * (self.block_m * self.dq_width))

    @property
    def dq_width(self) -> int:
        """The dQ accumulator's floats per row (zero_dq_accum)."""
        return self.head_dim_v if self.dq_head_dim is None else self.dq_head_dim

    @cute.jit
    def zero_dq_rows(self, mdQhead: cute.Tensor, tidx: Int32, offset: Int32):
        """Zeroes block_m rows of one (sequence, head)'s dQ accumulator `mdQhead` from float `offset` on: block_m * d
        contiguous floats (whatever order the main kernel gives them inside its tiles), one 16-byte store per
        thread and round, consecutive threads on consecutive 16 bytes."""
        vec = 4
        threads = self.num_warps * 32
        chunk = self.block_m * self.dq_width
        assert chunk % (vec * threads) == 0
        zeros = cute.make_rmem_tensor(vec, Float32)
        zeros.fill(0.0)
        base = mdQhead.iterator + offset
        for i in cutlass.range_constexpr(chunk // (vec * threads)):
            dst = (base + (i * threads + tidx) * vec).align(vec * 4)
            cute.autovec_copy(zeros, cute.make_tensor(dst, cute.make_layout(vec)))

    @cute.jit
    def cta(self, tensors, tiled_mma: cute.TiledMma, tidx: Int32, m_block: Int32, head: Int32, seq: SeqRows, pad_q):
        """One block of rows of one (sequence, head); seq.offset_q / stats_offset: the sequence's first row of the
        packed inputs / padded outputs (None: dense tensors, indexed by batch)."""
        stats_offset = seq.padded_offset_q(pad_q)
        mO, mdO, mLSE, mdPsum, mLSElog2 = tensors
        batch, seqlen_q, offset_q = seq.batch, seq.seqlen_q, seq.offset_q
        warp_idx = tidx // 32
        lane = tidx % 32
        rows_block = m_block * (self.block_m // ROWS_PER_WARP) + warp_idx
        first_row = rows_block * ROWS_PER_WARP
        tile = (ROWS_PER_WARP, self.head_dim_v)

        gO = cute.local_tile(head_rows(mO, batch, head, offset_q), tile, (rows_block, 0))
        gdO = cute.local_tile(head_rows(mdO, batch, head, offset_q), tile, (rows_block, 0))
        cT = cute.make_identity_tensor(tile)
        thr_mma = tiled_mma.get_slice(lane)
        tAgdO = thr_mma.partition_A(gdO)
        tBgO = thr_mma.partition_B(gO)
        tAcT = thr_mma.partition_A(cT)
        tBcT = thr_mma.partition_B(cT)
        tArdO = thr_mma.make_fragment_A(tAgdO)
        tBrO = thr_mma.make_fragment_B(tBgO)
        if first_row + ROWS_PER_WARP <= seqlen_q:
            cute.autovec_copy(tAgdO, tArdO)
            cute.autovec_copy(tBgO, tBrO)
        else:
            # Rows past the sequence end are zero, so their D is 0.
            tArdO.fill(0)
            tBrO.fill(0)
            for i in cutlass.range_constexpr(cute.size(tArdO)):
                if first_row + tAcT[i][0] < seqlen_q:
                    tArdO[i] = tAgdO[i]
            for i in cutlass.range_constexpr(cute.size(tBrO)):
                if first_row + tBcT[i][0] < seqlen_q:
                    tBrO[i] = tBgO[i]

        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS_PER_WARP, ROWS_PER_WARP)), Float32)
        acc.fill(0.0)
        for k in cutlass.range_constexpr(cute.size(tArdO, mode=[2])):
            cute.gemm(tiled_mma, acc, tArdO[None, None, k], tBrO[None, None, k], acc)

        tCcC = thr_mma.partition_C(cute.make_identity_tensor((ROWS_PER_WARP, ROWS_PER_WARP)))
        for i in cutlass.range_constexpr(cute.size(acc)):
            if tCcC[i][0] == tCcC[i][1]:
                row_global = first_row + tCcC[i][0]
                lse_log2 = Float32.inf
                if row_global < seqlen_q:
                    if cutlass.const_expr(offset_q is None):
                        lse = Float32(mLSE[batch, head, row_global])
                    else:
                        lse = Float32(mLSE[head, offset_q + row_global])
                    if lse != -Float32.inf:
                        lse_log2 = lse * LOG2_E
                if cutlass.const_expr(stats_offset is None):
                    mdPsum[batch, head, row_global] = acc[i]
                    mLSElog2[batch, head, row_global] = lse_log2
                else:
                    mdPsum[head, stats_offset + row_global] = acc[i]
                    mLSElog2[head, stats_offset + row_global] = lse_log2

"""The sm90 FP8 forward kernel: the bf16 kernel's Hopper design with e4m3 wgmma for both GEMMs.

Same CTA as `flash_fwd.Sm90FlashForward` (its pipelines, barriers, ping-pong turns, block ranges and masks): a
producer warp issues TMA loads of Q once and K / Vᵀ tiles right to left; each consumer warpgroup owns 64 query rows.
What FP8 changes:

  operands  Q (b, sq, h, d), K (b, sk, h_kv, d) in e4m3, d contiguous: Q·Kᵀ is an SS e4m3 wgmma (k = 32).
            V arrives transposed, Vᵀ (b, h_kv, dv, sk_pad) with keys contiguous, because an e4m3 wgmma needs its B
            operand K-major and P·V reduces over keys. Its keys are permuted within groups of 16 (`permute`), so
            P goes from the fp32 score accumulator to the e4m3 A operand of the RS P·V wgmma by register renaming
            and `cvt.rn.satfinite.e4m3x2` only — no shuffles.
  scales    one descale per 64 query rows (q), per key tile (k, v); see `cute_flash.fp8.prepare`. Q and K scales
            fold into the softmax exponent (`softmax`: one factor per tile), V scales into O's per-tile
            rescale: O is kept in units of the V scale of the last tile it absorbed, and the ratio of consecutive
            V scales joins the online-softmax rescale factor (no extra instruction per element).
  P         2^(s − m + 8) ∈ [0, 256], keeping small probabilities out of e4m3's subnormals.
  O         staged in shared memory in the 16-bit output dtype (its own buffer: the e4m3 Q slice is too small), one
            TMA store per consumer; LSE from registers.
  promote   with `promote_pv`, P·V of each tile lands in a fresh wgmma accumulator, added to O in fp32 in the same
            FFMA that rescales O; otherwise O accumulates inside the wgmma like the bf16 kernel.
  row sums  with `row_sum_mma`, each Vᵀ stage has 8 extra rows of ones below the dv rows the TMA fills (written
            once by the consumers), so the P·V wgmma (N = dv + 8) also returns Σ P per row; the softmax then does
            no additions per score.
"""

from __future__ import annotations

from functools import partial

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
import cutlass.utils.hopper_helpers as sm90_utils

from ....common.acc_views import rows_cols_view
from ....common.dsl_types import dsl_dtype
from ....common.online_softmax import LOG2_E
from ....fp8.prepare import BLOCK_M
from ....spec import AttentionSpec
from ..barriers import WarpGroupTurns, warpgroup_sync
from ..cta import CtaWork
from .permute import store_p_operand_e4m3
from .softmax import MIN_TILE_SCALE, Fp8OnlineSoftmax
from .tile_config import ROW_SUM_COLUMNS, Fp8FwdConfig, kv_scale_block
from ..tile_config import ROWS_PER_CONSUMER, WARPGROUP_THREADS
from .. import wgmma
from ..flash_fwd import Sm90FlashForward, one_stage

SMEM_ALIGN = 1024  # 128-byte swizzle atoms repeat every 1 KiB
FP8 = cutlass.Float8E4M3FN


def _select(t: cute.Tensor, modes) -> cute.Tensor:
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


class Sm90FlashForwardFp8(Sm90FlashForward):
    """Compiled once per (output dtype, head dims, mask kind, config); shapes, strides and scales are runtime.

    The bf16 kernel's skeleton (`Sm90FlashForward`: TMA atoms, launch shape, prologue, warp roles, producer, score
    coordinates, masks, the first key tile and the overlapped S / P·V GEMMs of every later one); what is its own is
    below: e4m3 operands and Vᵀ, descales, the FP8 softmax and O's updates."""

    def __init__(self, spec: AttentionSpec, cfg: Fp8FwdConfig):
        """spec.dtype "fp8"; out is spec.out_dtype (bf16 or fp16)."""
        head_dim, head_dim_v = spec.head_dim, spec.head_dim_v
        assert spec.dtype == "fp8" and not spec.varlen
        self.out_dtype = dsl_dtype(spec.out_dtype)
        assert self.out_dtype in (cutlass.BFloat16, cutlass.Float16)
        assert head_dim % 32 == 0 and head_dim_v % 32 == 0
        self._init_cta(spec, cfg.tile)
        assert self.cluster_m == 1, "the FP8 kernel has no K / V multicast (its consume takes whole CTAs' tiles)"
        self.promote_pv = cfg.promote_pv
        self.exp2_poly_per_row = cfg.exp2_poly_per_row
        self.row_sum_mma = cfg.row_sum_mma
        self.pv_n = cfg.pv_width(head_dim_v)
        assert BLOCK_M == ROWS_PER_CONSUMER, "one Q descale per consumer slice"
        self.kv_scale_block = kv_scale_block(head_dim, head_dim_v)
        assert self.kv_scale_block % self.tile_n == 0
        self.tiles_per_scale = self.kv_scale_block // self.tile_n

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, sq, h, d) e4m3
        mK: cute.Tensor,  # (b, sk, h_kv, d) e4m3
        mVt: cute.Tensor,  # (b, h_kv, dv, sk_pad) e4m3, keys permuted per 16
        mO: cute.Tensor,  # (b, sq, h, dv) bf16/fp16
        mLSE: cute.Tensor,  # (b, h, sq) fp32
        mQd: cute.Tensor,  # (b, h, ceil(sq / BLOCK_M)) fp32
        mKd: cute.Tensor,  # (b, h_kv, ceil(sk / kv_scale_block)) fp32
        mVd: cute.Tensor,  # (b, h_kv, ceil(sk / kv_scale_block)) fp32
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        stream: cuda.CUstream,
    ):
        # Sequence-major views: TMA boxes never cross a (batch, head); rows past seqlen are out of bounds.
        mQ, mK, mO = [_select(t, [1, 3, 2, 0]) for t in (mQ, mK, mO)]  # (s, d, h, b)
        mVt = _select(mVt, [2, 3, 1, 0])  # (dv, sk_pad, h_kv, b)
        mLSE = _select(mLSE, [2, 1, 0])  # (sq, h, b)

        rows = ROWS_PER_CONSUMER
        sQ_layout = wgmma.k_major_smem_layout(FP8, rows, self.head_dim, self.num_consumers)
        sK_layout = wgmma.k_major_smem_layout(FP8, self.tile_n, self.head_dim, self.num_stages)
        sVt_layout = wgmma.k_major_smem_layout(FP8, self.pv_n, self.tile_n, self.num_stages)
        sVt_load_layout = wgmma.k_major_smem_layout(
            FP8, self.head_dim_v, self.tile_n, self.num_stages
        )  # what TMA fills
        sO_layout = wgmma.k_major_smem_layout(self.out_dtype, rows, self.head_dim_v, self.num_consumers)

        k_major = cute.nvgpu.OperandMajorMode.K
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            FP8, FP8, k_major, k_major, Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(rows, self.tile_n)
        )
        tiled_mma_pv, tiled_mma_o = (
            sm90_utils.make_trivial_tiled_mma(
                FP8,
                FP8,
                k_major,
                k_major,
                Float32,
                atom_layout_mnk=(1, 1, 1),
                tiler_mn=(rows, n),
                a_source=warpgroup.OperandSource.RMEM,
            )
            for n in (self.pv_n, self.head_dim_v)  # P·[V | 1], and the O columns alone (O's registers, epilogue)
        )

        atoms, tmas = self.tma_atoms(
            mQ, mK, mVt, mO, sQ_layout, sK_layout, sVt_load_layout, sO_layout, (self.head_dim_v, self.tile_n)
        )
        self.bytes_q = cute.size_in_bytes(FP8, sQ_layout)
        self.bytes_k = cute.size_in_bytes(FP8, one_stage(sK_layout))
        self.bytes_v = cute.size_in_bytes(FP8, one_stage(sVt_load_layout))

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(sQ_layout)], SMEM_ALIGN]
            sK: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(sK_layout)], SMEM_ALIGN]
            sVt: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(sVt_layout)], SMEM_ALIGN]
            sO: cute.struct.Align[cute.struct.MemRange[self.out_dtype, cute.cosize(sO_layout)], SMEM_ALIGN]

        mmas, layouts = (tiled_mma_qk, tiled_mma_pv, tiled_mma_o), (sQ_layout, sK_layout, sVt_layout, sO_layout)
        descales = (mQd, mKd, mVd)
        self.kernel(
            tmas, mLSE, descales, atoms, mmas, layouts, softmax_scale, window_left, window_right, SharedStorage
        ).launch(stream=stream, **self.launch_shape(mQ))

    def v_and_o_smem(self, storage, layouts):
        """Vᵀ as the TMA fills it (the first dv rows of every stage; all of it without row_sum_mma), Vᵀ with the
        buffer's unswizzled base (for the ones rows) as consume takes it, and O's own 16-bit buffer."""
        sVt_layout, sO_layout = layouts[2:]
        sVt = storage.sVt.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner)
        sVt_load = cute.make_tensor(
            sVt.iterator,
            cute.composition(
                sVt.layout,
                cute.make_layout(
                    (self.head_dim_v, self.tile_n, self.num_stages),
                    stride=(1, self.pv_n, self.pv_n * self.tile_n),
                ),
            ),
        )
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        return sVt_load, (sVt, storage.sVt.data_ptr()), sO

    def v_tiles(self, mVt: cute.Tensor, head_kv: Int32, batch: Int32, offset_k=None) -> cute.Tensor:
        """Vᵀ tiles (dv, tile_n, tiles): keys contiguous, as the e4m3 P·V wgmma's K-major B operand needs."""
        return cute.local_tile(mVt[None, None, head_kv, batch], (self.head_dim_v, self.tile_n), (0, None))

    @cute.jit
    def consume(self, pipes, mmas, smem, out, descales, softmax_scale, work: CtaWork, consumer, tidx, warp_in_wg):
        """mmas: (Q·Kᵀ, P·[V | 1], O); smem: sQ, sK and (sVt, its unswizzled base); descales (mQd, mKd, mVd): per 64
        query rows, per K / V scale block."""
        m_block, head, head_kv, batch = work.m_block, work.head, work.head_kv, work.batch
        n_min, n_max = work.n_min, work.n_max
        mQd, mKd, mVd = descales
        tiled_mma_qk, tiled_mma_pv, tiled_mma_o = mmas
        sQ, sK, (sVt, sVt_base) = smem
        gemms, thr_qk, _ = self.consumer_gemms(tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, tidx)
        thr_o = tiled_mma_o.get_slice(tidx)
        acc_O = cute.make_rmem_tensor(thr_o.partition_shape_C((ROWS_PER_CONSUMER, self.head_dim_v)), Float32)
        acc_O.fill(0.0)
        if const_expr(self.row_sum_mma):
            self.fill_ones_rows(sVt_base, sVt.layout, tidx, consumer)

        coords = self.score_coords(tiled_mma_qk, thr_qk, consumer)
        softmax = Fp8OnlineSoftmax.create(
            cute.size(rows_cols_view(acc_O), mode=[0]),
            exp2_poly_per_row=self.exp2_poly_per_row,
            sum_in_mma=self.row_sum_mma,
        )
        turns = WarpGroupTurns(consumer, self.num_consumers, self.cfg.ping_pong)
        turns.prime()

        # This consumer's Q scale times softmax_scale·log2(e); slices past seqlen_q have no descale entry.
        slice_idx = m_block * self.num_consumers + consumer
        q_scale = softmax_scale * LOG2_E
        if slice_idx < mQd.shape[2]:
            q_scale = q_scale * mQd[batch, head, slice_idx]
        scales = partial(self.tile_scales, mKd, mVd, batch, head_kv, q_scale=q_scale)

        v_scale_last = Float32(1.0)  # the V descale O is expressed in at the end
        if n_max > n_min:
            v_scale_last = self.mainloop(
                pipes, gemms.for_consumer(consumer), acc_O, softmax, turns, work, coords, scales
            )[1]

        row_scale, lse = softmax.finalize(v_scale_last)
        rows_O = rows_cols_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(row_scale)):
            rows_O[r, None].store(rows_O[r, None].load() * row_scale[r])
        self.store_output(acc_O, lse, tiled_mma_o, thr_o, out, work, consumer, tidx, warp_in_wg)

    @cute.jit
    def fill_ones_rows(self, sVt_base: cute.Pointer, sVt_layout: cute.Layout, tidx: Int32, consumer: Int32):
        """Rows dv..dv+7 of every Vᵀ stage = 1.0 (e4m3 0x38). With tile_n <= 128 keys they are one whole swizzle
        atom per stage (8 rows of tile_n bytes), so the bytes go in unpermuted. Each consumer writes them all (the
        same bytes) and waits only for its own warpgroup, before its first P·V."""
        assert self.tile_n <= 128, "the ones rows must be one swizzle atom wide"
        words_per_stage = ROW_SUM_COLUMNS * self.tile_n // 4
        for stage in cutlass.range_constexpr(self.num_stages):
            offset = cute.crd2idx((self.head_dim_v, 0, stage), sVt_layout)
            words = cute.make_tensor(cute.recast_ptr(sVt_base + offset, dtype=Int32), cute.make_layout(words_per_stage))
            for i in cutlass.range_constexpr(cute.ceil_div(words_per_stage, WARPGROUP_THREADS)):
                w = tidx + i * WARPGROUP_THREADS
                if w < words_per_stage:
                    words[w] = Int32(0x38383838)
        cute.arch.fence_view_async_shared()  # generic-proxy stores, read by wgmma (async proxy)
        warpgroup_sync(consumer)

    @cute.jit
    def tile_scales(
        self, mKd: cute.Tensor, mVd: cute.Tensor, batch: Int32, head_kv: Int32, n_block: Int32, q_scale: Float32
    ):
        """(exponent factor c_n, V descale) of key tile n_block."""
        blk = n_block // self.tiles_per_scale
        # Clamped above 0: a zero descale would give NaN from masked -inf scores and from the V-descale ratio.
        c = cute.arch.fmax(q_scale * mKd[batch, head_kv, blk], Float32(MIN_TILE_SCALE))
        return c, cute.arch.fmax(Float32(mVd[batch, head_kv, blk]), Float32(MIN_TILE_SCALE))

    @cute.jit
    def absorb(
        self,
        acc_O: cute.Tensor,
        acc_PV: cute.Tensor,
        factor: cute.Tensor,
        softmax: Fp8OnlineSoftmax,
        factor_sum: cute.Tensor,
    ):
        """O = O · factor[row] + PV: the fp32 promotion of one tile's P·V, fused with O's rescale. With row_sum_mma
        PV has 8 more columns (all equal: Σ P of the row), added to the softmax's row sums with their own factor."""
        rows_O = rows_cols_view(acc_O)
        rows_PV = rows_cols_view(acc_PV)
        if const_expr(not self.row_sum_mma):
            for r in cutlass.range_constexpr(cute.size(factor)):
                rows_O[r, None].store(rows_O[r, None].load() * factor[r] + rows_PV[r, None].load())
        else:
            # Column j < dv/4 of a thread's row is the same register in both accumulators (the extra columns
            # form the last 8-column group of the wider one).
            n_o = cute.size(rows_O, mode=[1])
            sums = cute.make_rmem_tensor(cute.size(factor), Float32)
            for r in cutlass.range_constexpr(cute.size(factor)):
                for j in cutlass.range_constexpr(n_o):
                    rows_O[r, j] = rows_O[r, j] * factor[r] + rows_PV[r, j]
                sums[r] = rows_PV[r, n_o]
            softmax.absorb_row_sums(sums, factor_sum)

    # --- hooks of the skeleton (Sm90FlashForward.mainloop / step) ---------------------------------------------------
    def tile_factors(self, scales, n_block: Int32):
        """(exponent factor c_n, V descale v_n) of key tile n_block."""
        return scales(n_block=n_block)

    def softmax_update(self, softmax: Fp8OnlineSoftmax, acc_S: cute.Tensor, factors, is_first: bool):
        return softmax.update(rows_cols_view(acc_S), factors[0], is_first=is_first)

    def store_p(self, acc_S: cute.Tensor, tOrP: cute.Tensor):
        store_p_operand_e4m3(acc_S, tOrP)

    @cute.jit
    def loop_state(self, gemms, acc_O: cute.Tensor, softmax: Fp8OnlineSoftmax, kv, factors):
        """O-update state: the V descale of the tile whose P is pending (in tOrP, carried by the walk with the K/V
        state), and, with promotion, the fresh P·V accumulator and the factor for the O accumulated so far (the
        previous tile's softmax rescale times the ratio of V descales)."""
        acc_PV = acc_O
        if const_expr(self.promote_pv):
            pv_shape = gemms.mma_pv.get_slice(0).partition_shape_C((ROWS_PER_CONSUMER, self.pv_n))
            acc_PV = cute.make_rmem_tensor(pv_shape, Float32)
        pending = cute.make_rmem_tensor(softmax.num_rows, Float32)
        pending.fill(1.0)
        pending_sum = cute.make_rmem_tensor(softmax.num_rows, Float32)  # with row_sum_mma: l's factor (no V ratio)
        pending_sum.fill(1.0)
        return acc_PV, (pending, pending_sum), (kv, factors[1])

    def carry_kv(self, carry):
        return carry[0]

    @cute.jit
    def finish_step(self, carry, kv, kv_v, acc_S: cute.Tensor, row_scale: cute.Tensor, factors, loop):
        """Without promotion O accumulates in the wgmma and is then rescaled by scale_n · v_{n+1} / v_n, keeping it in
        units of v_n for the next P·V. With promotion PV_{n+1} lands in acc_PV (zero-initialised) and
        O = O · pending + PV_{n+1}, where pending = scale_{n+1} · v_{n+2} / v_{n+1} came from the previous step."""
        v_prev = carry[1]
        v_n = factors[1]
        ratio = v_prev / v_n
        warpgroup.wait_group(0)  # P·V done: the P registers and the V stage are free
        loop.pipes.v.consumer_release(kv_v)
        if const_expr(self.promote_pv):
            pending, pending_sum = loop.o_state
            self.absorb(loop.acc_O, loop.acc_PV, pending, loop.softmax, pending_sum)
            for r in cutlass.range_constexpr(cute.size(pending)):
                pending[r] = row_scale[r] * ratio
                pending_sum[r] = row_scale[r]
        else:
            rows_O = rows_cols_view(loop.acc_O)
            for r in cutlass.range_constexpr(cute.size(row_scale)):
                rows_O[r, None].store(rows_O[r, None].load() * (row_scale[r] * ratio))
        self.store_p(acc_S, loop.gemms.tOrP)
        return kv, v_n

    @cute.jit
    def finish_loop(self, loop):
        """The last tile's P·V, promoted (in units of its own V descale)."""
        if const_expr(self.promote_pv):
            pending, pending_sum = loop.o_state
            self.absorb(loop.acc_O, loop.acc_PV, pending, loop.softmax, pending_sum)

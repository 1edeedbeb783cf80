"""The sm80 backward main kernel (FlashAttention-2 design): mma.sync, ldmatrix, cp.async.

One CTA owns one key tile (block_n keys) of one query head and walks the query tiles that see it. For each query tile
it recomputes S = Q K^T, P = exp2(S * scale * log2e - lse_log2) (the forward's softmax, from the saved LSE), then
dP = dO V^T and dS = P * (dP - D), and accumulates
    dV += P^T dO,   dK += dS^T Q   (in registers, across the whole walk),
    dQ_tile = dS K                  (added with fp32 atomics to a (b, sq_padded, h, d) buffer, or in the "fragment"
                                     layout to (b, h, sq_padded * d) in register order, with red.v4 on sm_90+).
P and dS go through shared memory to serve as transposed operands (ldmatrix.trans). The softmax scale is applied to dK
here and to dQ in the postprocess kernel.

GQA: a CTA works on a query head and reads kv head `head // (h // h_kv)`; its dK/dV are partial sums, added with fp32
atomics to (b, sk_padded, h_kv, d) buffers that the postprocess converts. Without GQA the CTA writes dK/dV directly.

Soft-capping (spec.softcap, the `features` entries): S becomes T = tanh(S * softmax_scale / softcap) before the mask,
P = exp2(T * softcap * log2e - lse_log2), and dS = P * (dP - D) * (1 - T^2) (the tanh's derivative; P goes to shared
memory first, while the factor is folded into the register copy); dK and dQ keep their softmax_scale factor.

The exponent's factor softmax_scale * log2e is clamped into [FLT_MIN, FLT_MAX] as in the forward
(common/online_softmax.py): at softmax_scale = 0 a masked -inf score times 0 would make P NaN.

Rows past seqlen_q / seqlen_k are zero-filled in shared memory; key columns past seqlen_k and outside the mask window
are set to -inf in S. Query rows past seqlen_q, and rows that see no key, carry lse_log2 = +inf and D = 0 from the
preprocess kernel, so their P and dS are exactly 0.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Type

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.cutlass_dsl import dsl_user_op

from ...common.block_info import BlockInfo
from ...common.dsl_types import dsl_dtype
from ...common.entries import BwdEntries
from ...common.grid import block_grid
from ...common.online_softmax import clamp_scale_log2
from ...common.packed import SeqRows, cta_sequence, head_rows, head_stats, packed_pads
from ...common.softcap import apply_softcap, softcap_factors
from ...spec import AttentionSpec
from .tile_config import BwdTileConfig

LOG2_E = math.log2(math.e)


def dq_tiled_mma(dtype: Type[cutlass.Numeric], config: BwdTileConfig) -> cute.TiledMma:
    """The dQ = dS K product's tiled mma; the "fragment" dQ layout is its register order, so the postprocess that
    undoes that layout builds the same one."""
    return _tiled_mma(dtype, config.warps_m_dq, config.num_warps)


def _tiled_mma(dtype: Type[cutlass.Numeric], warps_m: int, num_warps: int) -> cute.TiledMma:
    warps_n = num_warps // warps_m
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)),
        (warps_m, warps_n, 1),
        permutation_mnk=(warps_m * 16, warps_n * 16, 16),
    )


def dq_fragment_offset(i: int, tidx, num_threads: int, vec: int):
    """Offset, in an m-block's (chunk's) slice of the "fragment" dQ buffer, of dQ accumulator element `i` of thread
    `tidx`: groups of `vec` consecutive elements, thread-interleaved, so one warp-wide atomic covers 32 * vec floats."""
    return (i // vec) * (num_threads * vec) + tidx * vec + i % vec


@dsl_user_op
def red_add_f32_vec(ptr: cute.Pointer, values, *, loc=None, ip=None) -> None:
    """*ptr[0:len(values)] += values with one vector reduction (red.global.add.v2/v4.f32, sm_90 and newer); ptr must
    be aligned to the vector's size."""
    n = len(values)
    assert n in (2, 4)
    operands = ", ".join(f"${i + 1}" for i in range(n))
    llvm.inline_asm(
        None,
        [ptr.toint(loc=loc, ip=ip).ir_value()] + [Float32(v).ir_value(loc=loc, ip=ip) for v in values],
        f"red.global.add.v{n}.f32 [$0], {{{operands}}};",
        "l" + ",f" * n,
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def _swizzled_smem_atom(dtype: Type[cutlass.Numeric], cols: int) -> cute.ComposedLayout:
    """An 8-row swizzled atom whose 16-byte chunks spread over all banks for ldmatrix (row-major, `cols` wide)."""
    assert dtype.width == 16
    block_k = 64 if cols % 64 == 0 else 32
    swizzle_bits = 3 if block_k == 64 else 2
    return cute.make_composed_layout(
        cute.make_swizzle(swizzle_bits, 3, 3), 0, cute.make_ordered_layout((8, block_k), order=(1, 0))
    )


def _transposed(t: cute.Tensor, rows: int, cols: int, stages: int = 0) -> cute.Tensor:
    """The (cols, rows[, stages]) view of a (rows, cols[, stages]) shared-memory tensor."""
    if stages == 0:
        return cute.composition(t, cute.make_layout((cols, rows), stride=(rows, 1)))
    return cute.composition(t, cute.make_layout((cols, rows, stages), stride=(rows, 1, rows * cols)))


def acc_rows_cols(t: cute.Tensor) -> cute.Tensor:
    """Views an mma.sync accumulator ((2, 2), MMA_M, MMA_N) as (rows, cols) of this thread."""
    flat = cute.make_layout(t.layout.shape)
    rows_cols = cute.make_layout(
        ((flat.shape[0][1], flat.shape[1]), (flat.shape[0][0], flat.shape[2])),
        stride=((flat.stride[0][1], flat.stride[1]), (flat.stride[0][0], flat.stride[2])),
    )
    return cute.make_tensor(t.iterator, cute.composition(t.layout, rows_cols))


@cute.jit
def _gemm_smem(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    tCsA: cute.Tensor,
    tCsB: cute.Tensor,
    s2r_A: cute.TiledCopy,
    s2r_B: cute.TiledCopy,
):
    """acc += A B with both operands read from shared memory by ldmatrix, one k-block ahead of the mma."""
    tCrA_view = s2r_A.retile(tCrA)
    tCrB_view = s2r_B.retile(tCrB)
    num_k = cute.size(tCsA.shape[2])
    cute.copy(s2r_A, tCsA[None, None, 0], tCrA_view[None, None, 0])
    cute.copy(s2r_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
    for k in cutlass.range_constexpr(num_k):
        if cutlass.const_expr(k + 1 < num_k):
            cute.copy(s2r_A, tCsA[None, None, k + 1], tCrA_view[None, None, k + 1])
            cute.copy(s2r_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


@cute.jit
def _load_rows(tiled_copy: cute.TiledCopy, src: cute.Tensor, dst: cute.Tensor, coords: cute.Tensor, rows: Int32):
    """cp.async rows [0, rows) of a tile to shared memory; zero the rows past the sequence end."""
    for m in cutlass.range_constexpr(cute.size(dst.shape[1])):
        if coords[0, m, 0][0] < rows:
            cute.copy(tiled_copy, src[None, m, None], dst[None, m, None])
        else:
            dst[None, m, None].fill(0)


class DqOperands(NamedTuple):
    """What the dQ = dS K product of one query block reads: its tiled MMA and thread slice, the register fragments of
    dS and Kᵀ, their shared-memory partitions and the ldmatrix copies between them (built once per CTA)."""

    tiled_mma: cute.TiledMma
    thr_mma: object
    tdQrdS: cute.Tensor
    tdQrKt: cute.Tensor
    tdQsdS: cute.Tensor
    tdQsKt: cute.Tensor
    s2r_dS: object
    s2r_Kt: object


class BwdParams(NamedTuple):
    """The main kernel's parameters, built by the launch and passed to `kernel` and `cta` as one argument."""

    mQ: cute.Tensor
    mK: cute.Tensor
    mV: cute.Tensor
    mdO: cute.Tensor
    mLSElog2: cute.Tensor
    mdPsum: cute.Tensor
    mdQaccum: cute.Tensor
    mdK: cute.Tensor
    mdV: cute.Tensor
    softmax_scale: Float32
    softmax_scale_log2: Float32
    window_left: Int32
    window_right: Int32
    sQ_layout: cute.ComposedLayout
    sK_layout: cute.ComposedLayout
    sP_layout: cute.ComposedLayout
    g2s_copy: cute.TiledCopy
    s2g_copy: cute.TiledCopy
    tiled_mma_sdp: cute.TiledMma
    tiled_mma_dkv: cute.TiledMma
    tiled_mma_dq: cute.TiledMma
    SharedStorage: object


class Sm80FlashBackward(BwdEntries):
    def __init__(self, spec: AttentionSpec, config: BwdTileConfig, gqa: bool):
        """spec.varlen: packed sequences (entry `packed`), else dense tensors (`__call__`)."""
        head_dim = spec.head_dim
        assert head_dim % 32 == 0, "head_dim must be a multiple of 32"
        assert spec.mask in ("none", "causal", "local")
        assert config.num_stages in (1, 2)
        self.dtype = dsl_dtype(spec.dtype)
        self.head_dim = head_dim
        self.cfg = config
        self.mask_kind = spec.mask
        self.gqa = gqa
        # Packed sequences: per-sequence rows of the padded buffers start pad_q / pad_k rows apart (common/packed.py);
        # whole tiles of the main kernel and of the 64-row pre/postprocess kernels fit in them.
        self.varlen = spec.varlen
        self.pad_q, self.pad_k = packed_pads(config.block_m, config.block_n)
        self.dq_chunk = config.dq_chunk or head_dim
        assert head_dim % self.dq_chunk == 0
        assert config.dq_layout in ("rows", "fragment")
        assert config.dq_vec == 1 or config.dq_layout == "fragment"

    # ------------------------------------------------------------------ host side
    def _tiled_mma(self, warps_m: int) -> cute.TiledMma:
        return _tiled_mma(self.dtype, warps_m, self.cfg.num_warps)

    def _g2s_copy(self, cols: int, atom_op) -> cute.TiledCopy:
        """128-bit copies of a row-major tile `cols` wide, threads laid out to match the swizzle atom's width."""
        lanes_per_row = _swizzled_smem_atom(self.dtype, cols).outer.shape[1] // 8
        thread_layout = cute.make_ordered_layout((self.cfg.num_threads // lanes_per_row, lanes_per_row), order=(1, 0))
        atom = cute.make_copy_atom(atom_op, self.dtype, num_bits_per_copy=128)
        return cute.make_tiled_copy_tv(atom, thread_layout, cute.make_layout((1, 8)))

    @cute.jit
    def _launch(
        self,
        tensors: tuple,  # (mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV) as the entry points take them
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        stream,
        packed=None,  # (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_k) of packed tensors (common/entries.py)
        semaphores=(None, None),  # the entries' deterministic semaphores: this family has no deterministic build
        features=None,  # (softcap,) of a spec.softcap build (the feature entries)
    ):
        assert semaphores[0] is None and semaphores[1] is None, "the sm80 backward has no deterministic build"
        mQ, mK = tensors[0], tensors[1]
        mCuSeqlensQ = mCuSeqlensK = mSeqUsedK = max_seqlen_k = None
        if cutlass.const_expr(packed is not None):
            mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_k = packed
        cfg = self.cfg
        d = self.head_dim
        stages = cfg.num_stages
        qdo_atom = _swizzled_smem_atom(self.dtype, d)
        sQ_layout = cute.tile_to_shape(qdo_atom, (cfg.block_m, d, stages), (0, 1, 2))
        sK_layout = cute.tile_to_shape(qdo_atom, (cfg.block_n, d), (0, 1))
        sP_layout = cute.tile_to_shape(_swizzled_smem_atom(self.dtype, cfg.block_n), (cfg.block_m, cfg.block_n), (0, 1))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout)], 1024]

        g2s_copy = self._g2s_copy(d, cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL))
        s2g_copy = self._g2s_copy(d, cute.nvgpu.CopyUniversalOp())
        grid = block_grid(mQ, mK, cfg.block_n, mCuSeqlensQ, max_seqlen_k)
        params = BwdParams(
            *tensors, softmax_scale, softmax_scale * LOG2_E, window_left, window_right, sQ_layout, sK_layout,
            sP_layout, g2s_copy, s2g_copy, self._tiled_mma(cfg.warps_m_sdp), self._tiled_mma(cfg.warps_n_dkv),
            self._tiled_mma(cfg.warps_m_dq), SharedStorage,
        )  # fmt: skip
        score_ctx = None
        if cutlass.const_expr(features is not None):
            scale_log2, score_ctx = self.score_factors(softmax_scale, features)
            params = params._replace(softmax_scale_log2=scale_log2)
        self.kernel(params, (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK), score_ctx).launch(
            grid=grid, block=[cfg.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream
        )

    # ------------------------------------------------------------------ device side
    def score_factors(self, softmax_scale, features):
        """(the softmax's scale_log2, what `probs` reads besides the tile) of a feature build: softcap's. The softmax
        runs on T = tanh(S * softmax_scale / softcap) with scale softcap (common/softcap.py); dK and dQ keep their
        softmax_scale factor, which with dS's (1 - T^2) is the capped score's derivative."""
        pre_tanh, scale_log2 = softcap_factors(softmax_scale, features[0])
        return scale_log2, pre_tanh

    @cute.kernel
    def kernel(self, params: BwdParams, packed: tuple, score_ctx):
        """packed: (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK) of packed sequences, or three None; score_ctx:
        `score_factors`' (None without features)."""
        # Only the exponent's factor is clamped (away from 0, where masked -inf scores times 0 gave NaN P, and from
        # inf); dK and dQ are scaled by softmax_scale itself, so scale 0 still gives dq = dk = 0 exactly.
        params = params._replace(softmax_scale_log2=clamp_scale_log2(params.softmax_scale_log2))
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head, batch = cute.arch.block_idx()
        seq, head_kv = cta_sequence(self.varlen, batch, head, params.mQ, params.mK, *packed)
        if cutlass.const_expr(self.varlen):
            # The grid spans the longest sequence's key blocks: the others' surplus blocks exit here.
            if n_block * self.cfg.block_n < seq.seqlen_k:
                self.cta(params, tidx, n_block, head, head_kv, seq, score_ctx)
        else:
            self.cta(params, tidx, n_block, head, head_kv, seq, score_ctx)

    @cute.jit
    def cta(
        self,
        params: BwdParams,
        tidx: Int32,
        n_block: Int32,
        head: Int32,
        head_kv: Int32,
        seq: SeqRows,
        score_ctx=None,
    ):
        """One (key block, head, sequence) tile. Packed tensors: seq.offset_q / offset_k are the sequence's first
        rows of q, dO / k, v; stats_offset its first row in the padded buffers (LSE, D, dQ accumulator); dkv_offset
        its first row of dK / dV (of their padded fp32 accumulators under GQA). None everywhere for dense tensors.
        score_ctx: `score_factors`' (softmax_scale / softcap in a spec.softcap build), else None."""
        dkv_offset = seq.padded_offset_k(self.pad_k) if self.gqa else seq.offset_k
        stats_offset = seq.padded_offset_q(self.pad_q)
        (
            mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV, softmax_scale, softmax_scale_log2, window_left,
            window_right, sQ_layout, sK_layout, sP_layout, g2s_copy, s2g_copy, tiled_mma_sdp, tiled_mma_dkv,
            tiled_mma_dq, SharedStorage,
        ) = params  # fmt: skip
        batch, offset_q, offset_k = seq.batch, seq.offset_q, seq.offset_k
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
        cfg = self.cfg
        block_m, block_n, d, stages = cfg.block_m, cfg.block_n, self.head_dim, cfg.num_stages
        blocks = BlockInfo(block_m, block_n, self.mask_kind, seqlen_q, seqlen_k, window_left, window_right)
        m_block_min, m_block_max = blocks.q_block_range(n_block)

        # ---------------------------------------------------------- shared memory and its transposed views
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)  # (block_m, d, stages)
        sdO = storage.sdO.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sK_layout)  # (block_n, d)
        sV = storage.sV.get_tensor(sK_layout)
        sP = storage.sP.get_tensor(sP_layout)  # (block_m, block_n)
        sdS = storage.sdS.get_tensor(sP_layout)
        sQt = _transposed(sQ, block_m, d, stages)  # (d, block_m, stages)
        sdOt = _transposed(sdO, block_m, d, stages)
        sKt = _transposed(sK, block_n, d)  # (d, block_n)
        sPt = _transposed(sP, block_m, block_n)  # (block_n, block_m)
        sdSt = _transposed(sdS, block_m, block_n)

        # ---------------------------------------------------------- global tiles and cp.async partitions
        gQ = cute.local_tile(head_rows(mQ, batch, head, offset_q), (block_m, d), (None, 0))  # (block_m, d, m_blocks)
        gdO = cute.local_tile(head_rows(mdO, batch, head, offset_q), (block_m, d), (None, 0))
        gK = cute.local_tile(head_rows(mK, batch, head_kv, offset_k), (block_n, d), (n_block, 0))
        gV = cute.local_tile(head_rows(mV, batch, head_kv, offset_k), (block_n, d), (n_block, 0))
        mLSE_cur = head_stats(mLSElog2, batch, head, stats_offset)
        mdPsum_cur = head_stats(mdPsum, batch, head, stats_offset)

        thr_g2s = g2s_copy.get_slice(tidx)
        tQgQ = thr_g2s.partition_S(gQ)
        tQsQ = thr_g2s.partition_D(sQ)
        tdOgdO = thr_g2s.partition_S(gdO)
        tdOsdO = thr_g2s.partition_D(sdO)
        tKgK = thr_g2s.partition_S(gK)
        tKsK = thr_g2s.partition_D(sK)
        tVgV = thr_g2s.partition_S(gV)
        tVsV = thr_g2s.partition_D(sV)
        tQcQ = thr_g2s.partition_S(cute.make_identity_tensor((block_m, d)))
        tKcK = thr_g2s.partition_S(cute.make_identity_tensor((block_n, d)))

        # ---------------------------------------------------------- mma partitions and register fragments
        thr_sdp = tiled_mma_sdp.get_slice(tidx)
        thr_dkv = tiled_mma_dkv.get_slice(tidx)
        thr_dq = tiled_mma_dq.get_slice(tidx)
        tSrQ = thr_sdp.make_fragment_A(thr_sdp.partition_A(sQ[None, None, 0]))
        tSrK = thr_sdp.make_fragment_B(thr_sdp.partition_B(sK))
        tdPrdO = thr_sdp.make_fragment_A(thr_sdp.partition_A(sdO[None, None, 0]))
        tdPrV = thr_sdp.make_fragment_B(thr_sdp.partition_B(sV))
        tdVrPt = thr_dkv.make_fragment_A(thr_dkv.partition_A(sPt))
        tdVrdOt = thr_dkv.make_fragment_B(thr_dkv.partition_B(sdOt[None, None, 0]))
        tdKrdSt = thr_dkv.make_fragment_A(thr_dkv.partition_A(sdSt))
        tdKrQt = thr_dkv.make_fragment_B(thr_dkv.partition_B(sQt[None, None, 0]))
        # dQ is computed dq_chunk head-dim columns at a time, which bounds its accumulator's registers.
        dq_chunk = self.dq_chunk
        sKt_chunks = cute.local_tile(sKt, (dq_chunk, block_n), (None, 0))  # (dq_chunk, block_n, chunks)
        tdQrdS = thr_dq.make_fragment_A(thr_dq.partition_A(sdS))
        tdQrKt = thr_dq.make_fragment_B(thr_dq.partition_B(sKt_chunks[None, None, 0]))

        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        s2r_QdO = cute.make_tiled_copy_A(ldsm, tiled_mma_sdp).get_slice(tidx)
        s2r_KV = cute.make_tiled_copy_B(ldsm, tiled_mma_sdp).get_slice(tidx)
        s2r_PdSt = cute.make_tiled_copy_A(ldsm_t, tiled_mma_dkv).get_slice(tidx)
        s2r_QdOt = cute.make_tiled_copy_B(ldsm_t, tiled_mma_dkv).get_slice(tidx)
        s2r_dS = cute.make_tiled_copy_A(ldsm, tiled_mma_dq).get_slice(tidx)
        s2r_Kt = cute.make_tiled_copy_B(ldsm_t, tiled_mma_dq).get_slice(tidx)
        tSsQ = s2r_QdO.partition_S(sQ)  # (..., stages)
        tdPsdO = s2r_QdO.partition_S(sdO)
        tSsK = s2r_KV.partition_S(sK)
        tdPsV = s2r_KV.partition_S(sV)
        tdVsPt = s2r_PdSt.partition_S(sPt)
        tdKsdSt = s2r_PdSt.partition_S(sdSt)
        tdVsdOt = s2r_QdOt.partition_S(sdOt)  # (..., stages)
        tdKsQt = s2r_QdOt.partition_S(sQt)
        tdQsdS = s2r_dS.partition_S(sdS)
        tdQsKt = s2r_Kt.partition_S(sKt_chunks)  # (..., chunks)
        dq_operands = DqOperands(tiled_mma_dq, thr_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, s2r_dS, s2r_Kt)

        r2s_PdS = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32), tiled_mma_sdp
        ).get_slice(tidx)
        tPsP = r2s_PdS.partition_D(sP)
        tdSsdS = r2s_PdS.partition_D(sdS)

        # Tile coordinates of this thread's S / dP accumulator entries, as (rows, cols).
        tScS = acc_rows_cols(thr_sdp.partition_C(cute.make_identity_tensor((block_m, block_n))))
        acc_shape_S = thr_sdp.partition_shape_C((block_m, block_n))

        acc_dK = cute.make_rmem_tensor(thr_dkv.partition_shape_C((block_n, d)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_dkv.partition_shape_C((block_n, d)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        if m_block_min < m_block_max:
            # ------------------------------------------------------ prologue: K, V and the first Q / dO tile
            kv_rows = seqlen_k - n_block * block_n
            _load_rows(g2s_copy, tKgK, tKsK, tKcK, kv_rows)
            _load_rows(g2s_copy, tVgV, tVsV, tKcK, kv_rows)
            q_rows = seqlen_q - m_block_min * block_m
            _load_rows(g2s_copy, tQgQ[None, None, None, m_block_min], tQsQ[None, None, None, 0], tQcQ, q_rows)
            _load_rows(g2s_copy, tdOgdO[None, None, None, m_block_min], tdOsdO[None, None, None, 0], tQcQ, q_rows)
            cute.arch.cp_async_commit_group()

            for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                slot = Int32(0)
                if cutlass.const_expr(stages == 2):
                    slot = (m_block - m_block_min) % 2
                # Row statistics of this thread's S rows (padded buffers: no bounds check needed).
                lse = cute.make_rmem_tensor((cute.size(tScS, mode=[0]),), Float32)
                dpsum = cute.make_rmem_tensor((cute.size(tScS, mode=[0]),), Float32)
                for r in cutlass.range_constexpr(cute.size(tScS, mode=[0])):
                    row = m_block * block_m + tScS[r, 0][0]
                    lse[r] = mLSE_cur[row]
                    dpsum[r] = mdPsum_cur[row]

                # This Q / dO tile has landed; every warp is done with the previous step's buffers.
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                if cutlass.const_expr(stages == 2):
                    if m_block + 1 < m_block_max:
                        self._load_q_do(g2s_copy, tQgQ, tQsQ, tdOgdO, tdOsdO, tQcQ, m_block + 1, 1 - slot, seqlen_q)
                    cute.arch.cp_async_commit_group()

                # S = Q K^T, then P = exp(S * scale - lse) with the mask applied.
                acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
                acc_S.fill(0.0)
                _gemm_smem(tiled_mma_sdp, acc_S, tSrQ, tSrK, tSsQ[None, None, None, slot], tSsK, s2r_QdO, s2r_KV)
                rP = self.probs(
                    acc_S, lse, softmax_scale_log2, tScS, m_block, n_block, blocks, seqlen_q, seqlen_k, window_left,
                    window_right, head, batch, score_ctx,
                )  # fmt: skip
                if cutlass.const_expr(rP is not None):
                    cute.copy(r2s_PdS, r2s_PdS.retile(rP), tPsP)
                acc_S_rc = acc_rows_cols(acc_S)

                # dP = dO V^T, then dS = P * (dP - D).
                acc_dP = cute.make_rmem_tensor(acc_shape_S, Float32)
                acc_dP.fill(0.0)
                _gemm_smem(tiled_mma_sdp, acc_dP, tdPrdO, tdPrV, tdPsdO[None, None, None, slot], tdPsV, s2r_QdO, s2r_KV)
                acc_dP_rc = acc_rows_cols(acc_dP)
                for r in cutlass.range_constexpr(cute.size(acc_dP_rc, mode=[0])):
                    acc_dP_rc[r, None].store(acc_S_rc[r, None].load() * (acc_dP_rc[r, None].load() - dpsum[r]))

                if cutlass.const_expr(rP is None):
                    rP = cute.make_fragment_like(acc_S, self.dtype)
                    rP.store(acc_S.load().to(self.dtype))
                    cute.copy(r2s_PdS, r2s_PdS.retile(rP), tPsP)
                rdS = cute.make_fragment_like(acc_dP, self.dtype)
                rdS.store(acc_dP.load().to(self.dtype))
                cute.copy(r2s_PdS, r2s_PdS.retile(rdS), tdSsdS)
                cute.arch.barrier()

                # dV += P^T dO and dK += dS^T Q.
                _gemm_smem(
                    tiled_mma_dkv, acc_dV, tdVrPt, tdVrdOt, tdVsPt, tdVsdOt[None, None, None, slot], s2r_PdSt, s2r_QdOt
                )
                if cutlass.const_expr(cfg.dq_before_dk):
                    self._dq_product(dq_operands, mdQaccum, batch, head, m_block, tidx, stats_offset)
                _gemm_smem(
                    tiled_mma_dkv, acc_dK, tdKrdSt, tdKrQt, tdKsdSt, tdKsQt[None, None, None, slot], s2r_PdSt, s2r_QdOt
                )
                if cutlass.const_expr(stages == 1):
                    # Single buffer: refill it as soon as every warp is done reading Q and dO.
                    cute.arch.barrier()
                    if m_block + 1 < m_block_max:
                        self._load_q_do(g2s_copy, tQgQ, tQsQ, tdOgdO, tdOsdO, tQcQ, m_block + 1, 0, seqlen_q)
                    cute.arch.cp_async_commit_group()

                if cutlass.const_expr(not cfg.dq_before_dk):
                    self._dq_product(dq_operands, mdQaccum, batch, head, m_block, tidx, stats_offset)

        # ---------------------------------------------------------- epilogue: dK (scaled) and dV
        acc_dK.store(acc_dK.load() * softmax_scale)
        if cutlass.const_expr(self.gqa):
            gdK = cute.local_tile(head_rows(mdK, batch, head_kv, dkv_offset), (block_n, d), (n_block, 0))
            gdV = cute.local_tile(head_rows(mdV, batch, head_kv, dkv_offset), (block_n, d), (n_block, 0))
            self._atomic_add(acc_dK, thr_dkv.partition_C(gdK))
            self._atomic_add(acc_dV, thr_dkv.partition_C(gdV))
        else:
            self._store_dkv(
                acc_dK, acc_dV, mdK, mdV, sK, sV, s2g_copy, tiled_mma_dkv, tidx, tKcK, batch, head_kv, n_block,
                seqlen_k, dkv_offset,
            )  # fmt: skip

    @cute.jit
    def _load_q_do(
        self,
        g2s_copy: cute.TiledCopy,
        tQgQ: cute.Tensor,
        tQsQ: cute.Tensor,
        tdOgdO: cute.Tensor,
        tdOsdO: cute.Tensor,
        tQcQ: cute.Tensor,
        m_block: Int32,
        slot: Int32,
        seqlen_q: Int32,
    ):
        rows = seqlen_q - m_block * self.cfg.block_m
        _load_rows(g2s_copy, tQgQ[None, None, None, m_block], tQsQ[None, None, None, slot], tQcQ, rows)
        _load_rows(g2s_copy, tdOgdO[None, None, None, m_block], tdOsdO[None, None, None, slot], tQcQ, rows)

    @cute.jit
    def probs(
        self, acc_S, lse, scale_log2, tScS, m_block, n_block, blocks, seqlen_q, seqlen_k, window_left, window_right,
        head, batch, score_ctx,
    ):  # fmt: skip
        """acc_S = S (a tile's raw scores) -> P = exp2(S * scale_log2 - lse_log2), masked, in place; or a P in the
        input dtype to store now, with acc_S left holding P times the score's derivative (softcap: (1 - T^2), the
        tanh's, folded in before dS = P * (dP - D), since T is gone once P is computed). None in the first case."""
        pre_tanh = score_ctx
        if cutlass.const_expr(pre_tanh is not None):
            apply_softcap(acc_S, pre_tanh)  # T = tanh(S * scale / softcap), before the mask
        if blocks.tile_needs_mask(m_block, n_block):
            self._apply_mask(acc_S, tScS, m_block, n_block, seqlen_q, seqlen_k, window_left, window_right)
        rP = None
        if cutlass.const_expr(pre_tanh is None):
            acc_S_rc = acc_rows_cols(acc_S)
            for r in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[0])):
                acc_S_rc[r, None].store(cute.math.exp2(acc_S_rc[r, None].load() * scale_log2 - lse[r], fastmath=True))
        else:
            rP = self._softcap_probs(acc_S, lse, scale_log2)
        return rP

    @cute.jit
    def _softcap_probs(self, acc_S: cute.Tensor, lse: cute.Tensor, scale_log2: Float32) -> cute.Tensor:
        """The softcap build's P = exp2(T * softcap * log2(e) - lse_log2) from acc_S = T (tanh of the scores, masked to
        -inf), returned in the input dtype, while acc_S becomes P * (1 - T^2) (`softcap_grad`'s factor). A masked
        T = -inf has P = 0 and a factor of -inf: the factor is clamped at 0 so that their product is 0, not NaN."""
        acc = acc_rows_cols(acc_S)
        probs = cute.make_fragment_like(acc_S)
        probs_rc = acc_rows_cols(probs)
        for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                t = acc[r, c]
                p = cute.math.exp2(t * scale_log2 - lse[r], fastmath=True)
                probs_rc[r, c] = p
                acc[r, c] = p * cute.arch.fmax(1.0 - t * t, Float32(0.0))
        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(probs.load().to(self.dtype))
        return rP

    @cute.jit
    def _apply_mask(
        self,
        acc_S: cute.Tensor,
        tScS: cute.Tensor,
        m_block: Int32,
        n_block: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        window_left: Int32,
        window_right: Int32,
    ):
        """Sets S to -inf where the key is past seqlen_k or outside the query's window."""
        acc = acc_rows_cols(acc_S)
        offset = seqlen_k - seqlen_q
        for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
            query = m_block * self.cfg.block_m + tScS[r, 0][0]
            key_end = seqlen_k  # exclusive
            key_begin = Int32(0)
            if cutlass.const_expr(self.mask_kind == "causal"):
                key_end = cutlass.min(key_end, query + offset + 1)
            if cutlass.const_expr(self.mask_kind == "local"):
                key_end = cutlass.min(key_end, query + offset + window_right + 1)
                key_begin = query + offset - window_left
            for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                key = n_block * self.cfg.block_n + tScS[0, c][1]
                if key >= key_end or key < key_begin:
                    acc[r, c] = -Float32.inf

    @cute.jit
    def _atomic_add(self, acc: cute.Tensor, dst: cute.Tensor):
        """dst += acc element-wise with fp32 atomics (dst is the matching partition of a padded fp32 buffer)."""
        for i in cutlass.range(cute.size(acc), unroll_full=True):
            cute.arch.atomic_add(dst.iterator + cute.crd2idx(i, dst.layout), acc[i])

    @cute.jit
    def _dq_product(
        self,
        dq_operands: DqOperands,
        mdQaccum: cute.Tensor,
        batch: Int32,
        head: Int32,
        m_block: Int32,
        tidx: Int32,
        stats_offset: Optional[Int32],
    ):
        """dQ_tile = dS K, added to the fp32 accumulator, dq_chunk head-dim columns at a time (stats_offset: the
        sequence's first row of a packed accumulator)."""
        tiled_mma_dq, thr_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, s2r_dS, s2r_Kt = dq_operands
        block_m, d, dq_chunk = self.cfg.block_m, self.head_dim, self.dq_chunk
        for chunk in cutlass.range_constexpr(d // dq_chunk):
            acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((block_m, dq_chunk)), Float32)
            acc_dQ.fill(0.0)
            _gemm_smem(tiled_mma_dq, acc_dQ, tdQrdS, tdQrKt, tdQsdS, tdQsKt[None, None, None, chunk], s2r_dS, s2r_Kt)
            if cutlass.const_expr(self.cfg.dq_layout == "fragment"):
                # This m-block's chunk is block_m * dq_chunk consecutive floats of the (b, h, sq_padded * d) buffer.
                offset = None if stats_offset is None else stats_offset * d  # packed: (h, rows * d)
                mdQ_cur = head_stats(mdQaccum, batch, head, offset)
                gdQ = cute.local_tile(mdQ_cur, (block_m * dq_chunk,), (m_block * (d // dq_chunk) + chunk,))
                self._atomic_add_fragment(acc_dQ, gdQ, tidx)
            else:
                gdQ = cute.local_tile(
                    head_rows(mdQaccum, batch, head, stats_offset), (block_m, dq_chunk), (m_block, chunk)
                )
                self._atomic_add(acc_dQ, thr_dq.partition_C(gdQ))

    @cute.jit
    def _atomic_add_fragment(self, acc: cute.Tensor, dst: cute.Tensor, tidx: Int32):
        """dst[dq_fragment_offset(i)] += acc[i]: a warp's reduction covers 32 * dq_vec consecutive floats."""
        vec = self.cfg.dq_vec
        for j in cutlass.range_constexpr(cute.size(acc) // vec):
            ptr = dst.iterator + dq_fragment_offset(j * vec, tidx, self.cfg.num_threads, vec)
            if cutlass.const_expr(vec == 1):
                cute.arch.atomic_add(ptr, acc[j])
            else:
                red_add_f32_vec(ptr, [acc[j * vec + e] for e in range(vec)])

    @cute.jit
    def _store_dkv(
        self,
        acc_dK: cute.Tensor,
        acc_dV: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        s2g_copy: cute.TiledCopy,
        tiled_mma_dkv: cute.TiledMma,
        tidx: Int32,
        tKcK: cute.Tensor,
        batch: Int32,
        head_kv: Int32,
        n_block: Int32,
        seqlen_k: Int32,
        offset_k: Optional[Int32],
    ):
        """Writes dK, dV in the input dtype through shared memory (reusing sK / sV) for 128-bit global stores."""
        block_n, d = self.cfg.block_n, self.head_dim
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32), tiled_mma_dkv
        ).get_slice(tidx)
        rdK = cute.make_fragment_like(acc_dK, self.dtype)
        rdK.store(acc_dK.load().to(self.dtype))
        rdV = cute.make_fragment_like(acc_dV, self.dtype)
        rdV.store(acc_dV.load().to(self.dtype))
        cute.arch.barrier()  # every warp is done reading sK / sV
        cute.copy(r2s, r2s.retile(rdK), r2s.partition_D(sK))
        cute.copy(r2s, r2s.retile(rdV), r2s.partition_D(sV))
        cute.arch.barrier()

        thr_s2g = s2g_copy.get_slice(tidx)
        gdK = cute.local_tile(head_rows(mdK, batch, head_kv, offset_k), (block_n, d), (n_block, 0))
        gdV = cute.local_tile(head_rows(mdV, batch, head_kv, offset_k), (block_n, d), (n_block, 0))
        tdKsdK = thr_s2g.partition_S(sK)
        tdVsdV = thr_s2g.partition_S(sV)
        tdKgdK = thr_s2g.partition_D(gdK)
        tdVgdV = thr_s2g.partition_D(gdV)
        tdKrdK = cute.make_fragment_like(tdKgdK)
        tdVrdV = cute.make_fragment_like(tdVgdV)
        cute.autovec_copy(tdKsdK, tdKrdK)
        cute.autovec_copy(tdVsdV, tdVrdV)
        rows = seqlen_k - n_block * block_n
        for m in cutlass.range_constexpr(cute.size(tdKgdK.shape[1])):
            if tKcK[0, m, 0][0] < rows:
                cute.copy(s2g_copy, tdKrdK[None, m, None], tdKgdK[None, m, None])
                cute.copy(s2g_copy, tdVrdV[None, m, None], tdVgdV[None, m, None])

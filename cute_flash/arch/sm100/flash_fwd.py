"""The sm100 (Blackwell) attention forward kernel: tcgen05 MMA, accumulators in tensor memory, optional 2-CTA MMA.

One CTA (one cluster of two CTAs in 2-CTA mode) computes two query tiles of 128 rows per CTA against every KV
block the mask lets them see. Sixteen warps, each with one job:

  warps 0-3   softmax, q stage 0   read S0 from TMEM, online softmax, write P0 (bf16/fp16/e4m3) back into TMEM
  warps 4-7   softmax, q stage 1   the same for S1 / P1
  warps 8-11  correction           rescale O0/O1 in TMEM when a row max moves; final 1/rowsum, LSE, O -> smem;
                                   packed builds: zero the first V tile's rows past the sequence (_zero_v_tail)
  warp  12    MMA                  allocates TMEM and issues every tcgen05.mma (leader CTA only in 2-CTA mode)
  warp  13    epilogue             TMA-stores O tiles from smem
  warp  14    load                 TMA-loads Q (2 tiles) and the K/V ring
  warp  15    idle

MMA order per KV block j (walked from the last block down, so the seqlen_k tail and the causal diagonal come
first):  S_s = Q_s K_j^T for both stages, then for each stage O_s += P_s V_j once softmax has written P_s and
correction has rescaled O_s, immediately followed by S_s = Q_s K_{j-1}^T into the same TMEM columns (tcgen05.mma
executes in issue order, so the PV reading P_s finishes before the next QK overwrites it).

Synchronisation (every mbarrier pipeline has one slot per q stage unless noted):
  q        TMA -> MMA               Q tiles, used once
  kv       TMA -> MMA               K and V tiles alternate in one ring of `kv_stages` slots
  s_p_o    MMA -> softmax+correction  full: S_s is in TMEM (tcgen05.commit); empty: P_s written AND O_s rescaled
  o_full   MMA -> correction        the last PV of a stage has completed
  stats    softmax -> correction    per block the O rescale factor; after the last block row sum and row max
  o_epi    correction -> epilogue   the normalised O tile is in smem
A tcgen05.commit tracks every MMA issued before it, so "S_s(j) full" also means "PV_s(j+1) done": the correction
warps may rescale O_s as soon as softmax reports block j, without a separate O-ready barrier.

Soft-capping and learnable sinks (spec.softcap / spec.sink, fp16 / bf16; the `features` entry, which takes the cap
and the (rows, h) fp32 sink view after the window bounds): the softmax warps replace each score S read from TMEM by
tanh(S * softmax_scale / softcap) before the mask and run the softmax with softcap * log2(e) as the scale
(common/softcap.py); the correction warps fold each row's sink into its denominator and LSE at the end (rows without
keys: O 0, LSE the sink), as the sm90 kernel's OnlineSoftmax.finalize does.

2-CTA mode: `tcgen05.mma.cta_group::2` with M = 256 spans both CTAs of the cluster; each CTA loads its own 128 Q rows
and half of every K tile (64 keys) and V tile (half of head_dim_v). The leader's MMA warp issues for both; its
commits multicast to both CTAs' barriers, and the peer's softmax/correction threads arrive remotely on the leader's
s_p_o barriers. Both CTAs walk the KV range of the whole 512-row cluster tile; per-row masking keeps it exact.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from ...common.block_info import BlockInfo
from ...common.online_softmax import FLT_MIN, LOG2_E, clamp_scale_log2
from ...common.packed import seq_rows
from ...common.softcap import apply_softcap, softcap_factors
from ...spec import AttentionSpec
from . import pipelines
from .smem_tails import zero_k_rows_from
from .tile_config import FP8_Q_SCALE_ROWS, M_BLOCK, N_BLOCK, Q_STAGES, TMEM_COLUMNS, FwdTileConfig
from .tmem_softmax import TmemRowSoftmax, finalize_row, mask_row
from .umma import gemm


# Warp roles.
SOFTMAX_WARPS = 8  # warps 0..7: two warpgroups, one per q stage
CORRECTION_WARP0 = 8  # warps 8..11
MMA_WARP = 12
EPILOGUE_WARP = 13
LOAD_WARP = 14
NUM_WARPS = 16
THREADS = NUM_WARPS * 32
WG_THREADS = 128

# Named barrier 1: TMEM allocation / deallocation handshake between the MMA warp and every TMEM user.
TMEM_BARRIER_ID = 1
TMEM_USER_THREADS = 32 * (1 + SOFTMAX_WARPS + 4)
# The ring slot of the first V tile (load_warp's order: that block's K, the Q tiles, then its V).
V_FIRST_SLOT = 1


class ClusterTile(NamedTuple):
    """What one CTA works on: its (batch, head) and KV head, its cluster's query tile, its place in the CTA pair, and
    the key blocks [n_block_min, n_block_max) some row of the cluster tile sees; packed builds: the sequence's first
    query and key rows (0 in a dense batch; `batch` is then the tensors' one entry, 0)."""

    head: Int32
    head_kv: Int32
    batch: Int32
    cluster_m: Int32
    cta_v: Int32  # 0 or 1 in 2-CTA mode; the constant 0 otherwise
    seqlen_q: Int32
    seqlen_k: Int32
    n_block_min: Int32
    n_block_max: Int32
    row_q: Int32 = 0
    row_k: Int32 = 0


class Pipes(NamedTuple):
    """The kernel's mbarrier pipelines (see the module docstring)."""

    q: pipeline.PipelineTmaUmma
    kv: pipeline.PipelineTmaUmma
    s_p_o: pipeline.PipelineUmmaAsync
    o_full: pipeline.PipelineUmmaAsync
    stats: pipeline.PipelineAsync
    o_epi: pipeline.PipelineAsync


class SoftmaxCopies(NamedTuple):
    """A softmax thread's TMEM traffic: S loads (with the score coordinates) and P stores."""

    thr_load: cute.TiledCopy
    tStS_t2r: cute.Tensor
    tScS_t2r: cute.Tensor
    thr_store: cute.TiledCopy
    tStP_r2t: cute.Tensor
    tPshape: cute.Shape


class SoftmaxRow(NamedTuple):
    """What every step of a softmax thread shares: its q stage and thread, its row's key bounds [key_begin, key_end),
    the running statistics, its TMEM copies, the stats buffer and the pipelines."""

    stage: Int32
    tidx: Int32
    key_begin: Int32
    key_end: Int32
    softmax: TmemRowSoftmax
    copies: SoftmaxCopies
    sStats: cute.Tensor
    pipes: Pipes
    pre_tanh: Optional[Float32] = None  # spec.softcap: the factor before the tanh (common/softcap.py)


def _one_batch(t: cute.Tensor) -> cute.Tensor:
    """A packed (rows, ...) tensor as a batch of one, (1, rows, ...), for the dense kernel's views."""
    # (The batch stride is never used; a whole tensor's extent keeps the TMA descriptor's strides increasing.)
    return cute.make_tensor(t.iterator, cute.make_layout((1, *t.shape), stride=(t.shape[0] * t.stride[0], *t.stride)))


def _stage_state(index, phase) -> pipeline.PipelineState:
    """Pipeline position for a pipeline whose slot is always the q stage (`index`); only the phase advances."""
    return pipeline.PipelineState(Q_STAGES, Int32(0), index, phase)


class Sm100FlashForward:
    """Builds (via `cute.compile`) the forward kernel for one `AttentionSpec` and one `FwdTileConfig`."""

    def __init__(self, spec: AttentionSpec, cfg: FwdTileConfig, v_seq_major: Optional[bool] = None):
        self.spec = spec
        self.cfg = cfg
        self.is_fp8 = spec.dtype == "fp8"
        self.varlen = spec.varlen
        assert not (self.varlen and (self.is_fp8 or cfg.use_2cta)), "packed builds are fp16 / bf16, 1-CTA"
        assert cfg.kv_stages > V_FIRST_SLOT, "the first V tile has a ring slot of its own (_zero_v_tail)"
        # fp8 V arrives transposed from the front end, (b, h_kv, dv, sk_pad) with keys contiguous (K-major B for P @ V);
        # fp16/bf16 V stays (b, sk, h_kv, dv), head-dim contiguous (MN-major B). tcgen05 takes either for both kinds.
        self.v_seq_major = self.is_fp8 if v_seq_major is None else v_seq_major
        self.head_dim = spec.head_dim
        self.head_dim_v = spec.head_dim_v
        self.cta = cfg.cta_group
        self.use_2cta = cfg.use_2cta
        self.has_right = spec.mask in ("causal", "local")
        self.has_left = spec.mask == "local"
        self.mma_tiler_qk = (M_BLOCK * self.cta, N_BLOCK, self.head_dim)
        self.mma_tiler_pv = (M_BLOCK * self.cta, self.head_dim_v, N_BLOCK)
        self.epi_tile = (M_BLOCK, self.head_dim_v)
        # TMEM columns: S0 | S1 | O0 | O1. P_s overwrites the upper half of S_s.
        self.tmem_s = (0, N_BLOCK)
        self.tmem_o = (2 * N_BLOCK, 2 * N_BLOCK + self.head_dim_v)
        self.tmem_s_to_p = N_BLOCK // 2
        assert 2 * N_BLOCK + 2 * self.head_dim_v <= TMEM_COLUMNS
        # See tmem_softmax: 16-bit P tolerates a lagging max; fp8 P instead uses e4m3's range above 1.
        self.rescale_threshold = 0.0 if self.is_fp8 else 8.0
        self.max_offset = 8.0 if self.is_fp8 else 0.0
        self.softcap = spec.softcap
        self.sink = spec.sink
        assert not (self.is_fp8 and (self.softcap or self.sink)), "fp8 builds have no soft-capping or sinks"

    # ------------------------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, sq, h, d)
        mK: cute.Tensor,  # (b, sk, h_kv, d)
        mV: cute.Tensor,  # (b, sk, h_kv, dv), or (b, h_kv, dv, sk_pad) when v_seq_major
        mO: cute.Tensor,  # (b, sq, h, dv)
        mLSE: cute.Tensor,  # (b, h, sq) fp32
        softmax_scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        mDescaleQ: Optional[cute.Tensor],  # fp8 only: (b, h, ceil(sq / 64)) fp32, one factor per 64 query rows
        mDescaleK: Optional[cute.Tensor],  # fp8 only: (b, h_kv, ceil(sk / 128)) fp32, one per KV block
        mDescaleV: Optional[cute.Tensor],  # fp8 only: (b, h_kv, ceil(sk / 128)) fp32, one per KV block
        stream,
    ):
        descales = (mDescaleQ, mDescaleK, mDescaleV)
        self._launch(mQ, mK, mV, mO, mLSE, softmax_scale_log2, window_left, window_right, descales, stream)

    @cute.jit
    def features(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        softmax_scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        softcap: Float32,  # spec.softcap: the cap (> 0)
        mSink: Optional[cute.Tensor],  # spec.sink: the (rows, h) fp32 sink view (arch/base.py), else None
        mDescaleQ: Optional[cute.Tensor],
        mDescaleK: Optional[cute.Tensor],
        mDescaleV: Optional[cute.Tensor],
        stream,
    ):
        """The entry of builds for spec.softcap / spec.sink."""
        descales = (mDescaleQ, mDescaleK, mDescaleV)
        features = (softcap, mSink)
        self._launch(mQ, mK, mV, mO, mLSE, softmax_scale_log2, window_left, window_right, descales, stream, features)

    @cute.jit
    def packed(
        self,
        mQ: cute.Tensor,  # packed queries (total_q, h, d): sequence b from row cu_seqlens_q[b]
        mK: cute.Tensor,  # (total_k, h_kv, d)
        mV: cute.Tensor,  # (total_k, h_kv, dv)
        mO: cute.Tensor,  # (total_q, h, dv)
        mLSE: cute.Tensor,  # (h, total_q) fp32
        softmax_scale: Float32,  # (the packed entries take the scale itself, as every family's: arch/base.py)
        window_left: Int32,
        window_right: Int32,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mSeqUsedK: Optional[cute.Tensor],
        max_seqlen_q: Int32,
        stream,
    ):
        """The entry of packed-sequence builds (spec.varlen; arch/base.launch_packed_forward's convention)."""
        seqs = (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q)
        mQ, mK, mV, mO, mLSE = (_one_batch(t) for t in (mQ, mK, mV, mO, mLSE))
        scale_log2 = softmax_scale * LOG2_E
        self._launch(mQ, mK, mV, mO, mLSE, scale_log2, window_left, window_right, (None,) * 3, stream, None, seqs)

    @cute.jit
    def packed_features(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        softcap: Float32,
        mSink: Optional[cute.Tensor],  # spec.sink: the (total_q, h) fp32 sink view
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mSeqUsedK: Optional[cute.Tensor],
        max_seqlen_q: Int32,
        stream,
    ):
        """The entry of packed builds with spec.softcap / spec.sink."""
        seqs = (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q)
        mQ, mK, mV, mO, mLSE = (_one_batch(t) for t in (mQ, mK, mV, mO, mLSE))
        scale_log2 = softmax_scale * LOG2_E
        features = (softcap, mSink)
        self._launch(mQ, mK, mV, mO, mLSE, scale_log2, window_left, window_right, (None,) * 3, stream, features, seqs)

    @cute.jit
    def _launch(
        self, mQ, mK, mV, mO, mLSE, softmax_scale_log2, window_left, window_right, descales, stream, features=None,
        seqs=None,
    ):  # fmt: skip
        """Every entry; descales: fp8's (q, k, v) descale tensors or Nones; features: (softcap, sink view) of the
        feature entries; seqs: (cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q) of the packed ones (their
        tensors with one batch entry)."""
        if const_expr(self.varlen != (seqs is not None)):
            raise ValueError("packed builds (spec.varlen) take the sequences, others none")
        self.q_dtype = mQ.element_type
        self.k_dtype = mK.element_type
        self.v_dtype = mV.element_type
        self.o_dtype = mO.element_type
        if const_expr(self.q_dtype != self.k_dtype or self.q_dtype != self.v_dtype):
            raise TypeError("q, k and v must share one dtype")

        mQ, mK, mV, mO, mLSE = self.kernel_views(mQ, mK, mV, mO, mLSE)

        cta_group = tcgen05.CtaGroup.TWO if const_expr(self.use_2cta) else tcgen05.CtaGroup.ONE
        tiled_mma_qk = sm100_utils.make_trivial_tiled_mma(
            self.q_dtype,
            self.k_dtype,
            OperandMajorMode.K,
            OperandMajorMode.K,
            Float32,
            cta_group,
            self.mma_tiler_qk[:2],
        )
        # P comes from TMEM (always K-major there). Head-dim-contiguous V is MN-major for P @ V; kind::f8f6f4 accepts
        # an MN-major 8-bit B too, so sm100 needs no transposed V (the front end's fp8 path sends one anyway).
        v_major = OperandMajorMode.K if const_expr(self.v_seq_major) else OperandMajorMode.MN
        tiled_mma_pv = sm100_utils.make_trivial_tiled_mma(
            self.v_dtype,
            self.v_dtype,
            OperandMajorMode.K,
            v_major,
            Float32,
            cta_group,
            self.mma_tiler_pv[:2],
            tcgen05.OperandSource.TMEM,
        )
        cluster_shape = (self.cta, 1, 1)
        cta_layout_vmnk = cute.tiled_divide(cute.make_layout(cluster_shape), (tiled_mma_qk.thr_id.shape,))

        sQ_layout = sm100_utils.make_smem_layout_a(tiled_mma_qk, self.mma_tiler_qk, self.q_dtype, Q_STAGES)
        sK_layout = sm100_utils.make_smem_layout_b(tiled_mma_qk, self.mma_tiler_qk, self.k_dtype, self.cfg.kv_stages)
        sV_layout = sm100_utils.make_smem_layout_b(tiled_mma_pv, self.mma_tiler_pv, self.v_dtype, self.cfg.kv_stages)
        tP_layout = sm100_utils.make_smem_layout_a(tiled_mma_pv, self.mma_tiler_pv, self.v_dtype, 1)
        o_layout_enum = cutlass.utils.LayoutEnum.from_tensor(mO)
        sO_layout = sm100_utils.make_smem_layout_epi(self.o_dtype, o_layout_enum, self.epi_tile, Q_STAGES)
        # K and V tiles take turns in the same ring slots.
        if const_expr(cute.cosize(sK_layout) != cute.cosize(sV_layout)):
            raise ValueError("K and V ring slots must have the same size (head_dim == head_dim_v)")

        tma_load_op = cpasync.CopyBulkTensorTileG2SOp(cta_group)

        def tma_load(make_atom, tensor, smem_layout, mma_tiler, tiled_mma):
            """A TMA load atom for one MMA operand (make_atom: the A or the B form)."""
            one_stage = cute.select(smem_layout, mode=[0, 1, 2])
            return make_atom(tma_load_op, tensor, one_stage, mma_tiler, tiled_mma, cta_layout_vmnk.shape)

        tma_atom_q, tma_q = tma_load(cute.nvgpu.make_tiled_tma_atom_A, mQ, sQ_layout, self.mma_tiler_qk, tiled_mma_qk)
        tma_atom_k, tma_k = tma_load(cute.nvgpu.make_tiled_tma_atom_B, mK, sK_layout, self.mma_tiler_qk, tiled_mma_qk)
        tma_atom_v, tma_v = tma_load(cute.nvgpu.make_tiled_tma_atom_B, mV, sV_layout, self.mma_tiler_pv, tiled_mma_pv)
        tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, cute.select(sO_layout, mode=[0, 1]), self.epi_tile
        )
        # In 2-CTA mode both CTAs' halves land on the leader's full barrier.
        self.q_tx_bytes = cute.size_in_bytes(self.q_dtype, cute.select(sQ_layout, mode=[0, 1, 2])) * self.cta
        self.kv_tx_bytes = cute.size_in_bytes(self.k_dtype, cute.select(sK_layout, mode=[0, 1, 2])) * self.cta

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[Int64, Q_STAGES * 2]
            mbar_kv: cute.struct.MemRange[Int64, self.cfg.kv_stages * 2]
            mbar_s_p_o: cute.struct.MemRange[Int64, Q_STAGES * 2]
            mbar_o_full: cute.struct.MemRange[Int64, Q_STAGES * 2]
            mbar_stats: cute.struct.MemRange[Int64, Q_STAGES * 2]
            mbar_o_epi: cute.struct.MemRange[Int64, Q_STAGES * 2]
            tmem_dealloc_mbar: Int64
            tmem_holding_buf: Int32
            # Per q stage and row: rescale factor / final row sum, then final row max.
            stats: cute.struct.MemRange[Float32, 2 * Q_STAGES * M_BLOCK]
            sO: cute.struct.Align[cute.struct.MemRange[self.o_dtype, cute.cosize(sO_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.q_dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.k_dtype, cute.cosize(sK_layout)], 1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        if const_expr(self.smem_bytes > cutlass.memory.SmemAllocator.capacity_in_bytes("sm_100")):
            raise ValueError(f"shared memory {self.smem_bytes} B exceeds sm100's {227 * 1024} B (kv_stages too deep)")

        num_clusters = cute.ceil_div(cute.size(mQ.shape[0]), self.cfg.rows_per_cluster)
        grid = (num_clusters * self.cta, cute.size(mQ.shape[2]), cute.size(mQ.shape[3]))
        if const_expr(self.varlen):  # one CTA row per sequence, as many query tiles as the longest one has
            num_clusters = cute.ceil_div(seqs[3], self.cfg.rows_per_cluster)
            grid = (num_clusters * self.cta, cute.size(mQ.shape[2]), cute.size(seqs[0].shape[0]) - 1)
        self.kernel(
            (tiled_mma_qk, tiled_mma_pv),
            ((tma_atom_q, tma_q), (tma_atom_k, tma_k), (tma_atom_v, tma_v), (tma_atom_o, tma_o)),
            mLSE,
            (sQ_layout, sK_layout, sV_layout, tP_layout, sO_layout),
            softmax_scale_log2,
            window_left,
            window_right,
            descales,
            features,
            (*seqs, mO) if const_expr(self.varlen) else None,  # (the packed epilogue stores O itself)
        ).launch(
            grid=grid,
            block=[THREADS, 1, 1],
            cluster=cluster_shape if const_expr(self.cta > 1) else None,
            stream=stream,
            min_blocks_per_mp=1,
        )

    def kernel_views(self, mQ, mK, mV, mO, mLSE):
        """The mode orders the TMA atoms and MMA partitioners expect: (seqlen, head_dim, head, batch); V as
        (dv, seqlen, head, batch); LSE as (sq, h, b)."""
        mQ = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 3, 2, 0]))
        mK = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))
        if const_expr(self.v_seq_major):
            # Keys bounded by seqlen_k (not sk_pad): the TMA zero-fills the tail instead of reading the padding.
            mV = cute.make_tensor(
                mV.iterator,
                cute.make_layout(
                    (mV.shape[2], mK.shape[0], mV.shape[1], mV.shape[0]),
                    stride=(mV.stride[2], mV.stride[3], mV.stride[1], mV.stride[0]),
                ),
            )
        else:
            mV = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))
        mO = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[1, 3, 2, 0]))
        mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))  # (sq, h, b)
        return mQ, mK, mV, mO, mLSE

    # ------------------------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mmas,  # tiled MMAs of Q·Kᵀ and P·V
        tmas,  # (TMA atom, coordinate tensor) of Q, K, V (loads) and O (store)
        mLSE: cute.Tensor,
        layouts,  # shared-memory layouts of Q, K, V, O and the TMEM layout of P
        softmax_scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        descales,  # fp8: (q, k, v) descale tensors; None otherwise
        features=None,  # feature builds: (softcap, the (rows, h) sink view or None)
        seqs=None,  # packed builds: (cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, O in the kernel's view)
    ):
        tiled_mma_qk, tiled_mma_pv = mmas
        (tma_atom_q, mQ), (tma_atom_k, mK), (tma_atom_v, mV), (tma_atom_o, mO) = tmas
        sQ_layout, sK_layout, sV_layout, tP_layout, sO_layout = layouts
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, head, batch = cute.arch.block_idx()
        if const_expr(self.use_2cta):
            cta_v = bidx % 2
            cluster_m = bidx // 2
        else:
            cta_v = 0
            cluster_m = bidx
        if const_expr(self.has_right):
            # Causal/windowed work grows with the query index: launch the heaviest clusters first.
            cluster_m = cute.arch.grid_dim()[0] // self.cta - 1 - cluster_m
        head_kv = head // (cute.size(mQ.shape[2]) // cute.size(mK.shape[2]))

        if warp_idx == LOAD_WARP:
            for atom in (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        cluster_shape = (self.cta, 1, 1)
        cta_layout_vmnk = cute.tiled_divide(cute.make_layout(cluster_shape), (tiled_mma_qk.thr_id.shape,))

        pipes = self.make_pipes(storage, cta_layout_vmnk)
        tmem_barrier = pipeline.NamedBarrier(barrier_id=TMEM_BARRIER_ID, num_threads=TMEM_USER_THREADS)
        tmem = cutlass.utils.TmemAllocator(
            storage.tmem_holding_buf.ptr,
            barrier_for_retrieve=tmem_barrier,
            allocator_warp_id=MMA_WARP,
            is_two_cta=self.use_2cta,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr,
        )
        pipeline_init_arrive(cluster_shape_mn=cta_layout_vmnk, is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        sStats = storage.stats.get_tensor(cute.make_layout(2 * Q_STAGES * M_BLOCK))

        thr_mma_qk = tiled_mma_qk.get_slice(cta_v)
        thr_mma_pv = tiled_mma_pv.get_slice(cta_v)
        # Layouts the other roles need from the tiled MMAs, derived once before the role branches.
        s_layout = thr_mma_qk.make_fragment_C(thr_mma_qk.partition_shape_C(self.mma_tiler_qk[:2])).layout
        o_layout = thr_mma_pv.make_fragment_C(thr_mma_pv.partition_shape_C(self.mma_tiler_pv[:2])).layout
        # sO holds only this CTA's 128 rows in either mode, so it is partitioned with the CTA-0 slice.
        epi_mma = tiled_mma_pv.get_slice(0)
        tOsO = [epi_mma.partition_C(sO[None, None, s]) for s in range(Q_STAGES)]
        tOcO = epi_mma.partition_C(cute.make_identity_tensor((M_BLOCK, self.head_dim_v)))

        seqlen_q = cute.size(mQ.shape[0])
        seqlen_k = cute.size(mK.shape[0])
        rows = ()
        if const_expr(self.varlen):
            seq = seq_rows(batch, seqs[0], seqs[1], seqs[2])
            seqlen_q, seqlen_k, rows = seq.seqlen_q, seq.seqlen_k, (seq.offset_q, seq.offset_k)
            batch = Int32(0)  # (the packed tensors' one batch entry)
        # The KV range is shared by every query row of the cluster (one MMA serves them all).
        cluster_blocks = BlockInfo(
            self.cfg.rows_per_cluster, N_BLOCK, self.spec.mask, seqlen_q, seqlen_k, window_left, window_right
        )
        n_block_min, n_block_max = cluster_blocks.kv_block_range(cluster_m)
        if const_expr(self.varlen):
            # A cluster past this sequence's queries (the grid covers the longest one) has no row to compute.
            n_block_max = n_block_max if cluster_m * self.cfg.rows_per_cluster < seqlen_q else n_block_min
        tile = ClusterTile(head, head_kv, batch, cluster_m, cta_v, seqlen_q, seqlen_k, n_block_min, n_block_max, *rows)

        pipeline_init_wait(cluster_shape_mn=cta_layout_vmnk)

        if warp_idx == LOAD_WARP:
            cute.arch.setmaxregister_decrease(self.cfg.regs_other)
            self.load_warp(thr_mma_qk, thr_mma_pv, tmas[:3], (sQ, sK, sV), pipes, tile)
        if warp_idx == EPILOGUE_WARP:
            cute.arch.setmaxregister_decrease(self.cfg.regs_other)
            self.epilogue_warp(tma_atom_o, seqs[4] if const_expr(self.varlen) else mO, sO, pipes.o_epi, tile)
        if warp_idx == NUM_WARPS - 1:
            cute.arch.setmaxregister_decrease(self.cfg.regs_other)
        if warp_idx < SOFTMAX_WARPS:
            cute.arch.setmaxregister_increase(self.cfg.regs_softmax)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.softmax_warpgroup(
                warp_idx // 4,
                s_layout,
                tmem_ptr,
                sStats,
                pipes,
                softmax_scale_log2,
                descales,
                tile,
                window_left,
                window_right,
                features,
            )
            tmem_barrier.arrive()
        if warp_idx >= CORRECTION_WARP0 and warp_idx < MMA_WARP:
            cute.arch.setmaxregister_decrease(self.cfg.regs_correction)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.correction_warpgroup(o_layout, tOsO, tOcO, tmem_ptr, sStats, mLSE, pipes, descales, tile, features, sV)
            tmem_barrier.arrive()
        if warp_idx == MMA_WARP:
            cute.arch.setmaxregister_decrease(self.cfg.regs_other)
            tmem.allocate(TMEM_COLUMNS)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            if cta_v == 0:
                self.mma_warp(
                    mmas,
                    thr_mma_pv,
                    (sQ, sK, sV),
                    tP_layout,
                    s_layout,
                    o_layout,
                    tmem_ptr,
                    pipes,
                    n_block_max - n_block_min,
                )
            tmem.relinquish_alloc_permit()
            tmem_barrier.arrive_and_wait()
            tmem.free(tmem_ptr)

    def make_pipes(self, storage, cta_layout_vmnk) -> Pipes:
        """The kernel's mbarrier pipelines, their initialisation deferred to pipeline_init_arrive / _wait."""
        vmnk = cta_layout_vmnk
        return Pipes(
            q=pipelines.tma_umma(Q_STAGES, self.q_tx_bytes, storage.mbar_q, vmnk),
            kv=pipelines.tma_umma(self.cfg.kv_stages, self.kv_tx_bytes, storage.mbar_kv, vmnk),
            # Released by one softmax warpgroup and the correction warpgroup of every CTA of the pair.
            s_p_o=pipelines.umma_async(Q_STAGES, 2 * WG_THREADS * self.cta, storage.mbar_s_p_o, vmnk),
            o_full=pipelines.umma_async(Q_STAGES, WG_THREADS * self.cta, storage.mbar_o_full, vmnk),
            stats=pipelines.thread_async(Q_STAGES, WG_THREADS, WG_THREADS, storage.mbar_stats),
            o_epi=pipelines.thread_async(Q_STAGES, WG_THREADS, 32, storage.mbar_o_epi),
        )

    # ------------------------------------------------------------------------------------------------------------
    # Load warp
    # ------------------------------------------------------------------------------------------------------------
    @cute.jit
    def load_warp(self, thr_mma_qk, thr_mma_pv, tmas, smem, pipes: Pipes, tile: ClusterTile):
        """Q (both stages) once, then K and V of every key block, last block first (tmas, smem: of Q, K, V)."""
        (tma_atom_q, mQ), (tma_atom_k, mK), (tma_atom_v, mV) = tmas
        sQ, sK, sV = smem
        head, head_kv, batch, cluster_m, _, _, _, n_block_min, n_block_max = tile[:9]
        pipe_q, pipe_kv = pipes.q, pipes.kv
        q_producer = pipe_q.make_producer()
        kv_producer = pipe_kv.make_producer()
        # Tiles of the MMA's M extent (256 rows in 2-CTA mode); partition_A keeps this CTA's 128 rows.
        mQ_h, mK_h, mV_h = mQ[None, None, head, batch], mK[None, None, head_kv, batch], mV[None, None, head_kv, batch]
        if const_expr(self.varlen):  # the sequence's rows (V is (dv, keys, ...): its keys are the second mode)
            mQ_h = cute.domain_offset((tile.row_q, 0), mQ_h)
            mK_h = cute.domain_offset((tile.row_k, 0), mK_h)
            mV_h = cute.domain_offset((0, tile.row_k), mV_h)
        gQ = cute.local_tile(mQ_h, cute.select(self.mma_tiler_qk, mode=[0, 2]), (None, 0))
        gK = cute.local_tile(mK_h, cute.select(self.mma_tiler_qk, mode=[1, 2]), (None, 0))
        gV = cute.local_tile(mV_h, cute.select(self.mma_tiler_pv, mode=[1, 2]), (0, None))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_q,
            0,
            cute.make_layout(1),
            cute.group_modes(sQ, 0, 3),
            cute.group_modes(thr_mma_qk.partition_A(gQ), 0, 3),
        )
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_k,
            0,
            cute.make_layout(1),
            cute.group_modes(sK, 0, 3),
            cute.group_modes(thr_mma_qk.partition_B(gK), 0, 3),
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma_atom_v,
            0,
            cute.make_layout(1),
            cute.group_modes(sV, 0, 3),
            cute.group_modes(thr_mma_pv.partition_B(gV), 0, 3),
        )
        n_blocks = n_block_max - n_block_min
        if n_blocks > 0:
            # Same order as the MMA warp consumes: K_last, Q0, Q1, V_last, then K, V per block downwards.
            n_block = n_block_max - 1
            handle = kv_producer.acquire_and_advance()
            cute.copy(tma_atom_k, tKgK[None, n_block], tKsK[None, handle.index], tma_bar_ptr=handle.barrier)
            for stage in cutlass.range_constexpr(Q_STAGES):
                q_handle = q_producer.acquire_and_advance()
                cute.copy(
                    tma_atom_q,
                    tQgQ[None, cluster_m * Q_STAGES + stage],
                    tQsQ[None, q_handle.index],
                    tma_bar_ptr=q_handle.barrier,
                )
            handle = kv_producer.acquire_and_advance()
            cute.copy(tma_atom_v, tVgV[None, n_block], tVsV[None, handle.index], tma_bar_ptr=handle.barrier)
            for i in cutlass.range(1, n_blocks, unroll=1):
                n_block_i = n_block_max - 1 - i
                k_handle = kv_producer.acquire_and_advance()
                cute.copy(tma_atom_k, tKgK[None, n_block_i], tKsK[None, k_handle.index], tma_bar_ptr=k_handle.barrier)
                v_handle = kv_producer.acquire_and_advance()
                cute.copy(tma_atom_v, tVgV[None, n_block_i], tVsV[None, v_handle.index], tma_bar_ptr=v_handle.barrier)
        # Wait until the MMA warp released every slot: no tcgen05.commit may still target this CTA after exit.
        kv_producer.tail()
        q_producer.tail()

    # ------------------------------------------------------------------------------------------------------------
    # MMA warp (leader CTA)
    # ------------------------------------------------------------------------------------------------------------
    @cute.jit
    def mma_warp(self, mmas, thr_mma_pv, smem, tP_layout, s_layout, o_layout, tmem_ptr, pipes: Pipes, n_blocks):
        tiled_mma_qk, tiled_mma_pv = mmas
        sQ, sK, sV = smem
        pipe_q, pipe_kv, pipe_s_p_o, pipe_o_full = pipes.q, pipes.kv, pipes.s_p_o, pipes.o_full
        tSrQ = tiled_mma_qk.make_fragment_A(sQ)
        tSrK = tiled_mma_qk.make_fragment_B(sK)
        tOrV = tiled_mma_pv.make_fragment_B(sV)
        tStS = [cute.make_tensor(tmem_ptr + self.tmem_s[s], s_layout) for s in range(Q_STAGES)]
        tOtO = [cute.make_tensor(tmem_ptr + self.tmem_o[s], o_layout) for s in range(Q_STAGES)]
        # P as the TMEM A operand of P @ V, in P's dtype, at the upper half of each S tile.
        p_frag = thr_mma_pv.make_fragment_A(cute.make_tensor(tmem_ptr, tP_layout.outer))[None, None, None, 0]
        tOrP = [
            cute.make_tensor(
                cute.recast_ptr(tmem_ptr + self.tmem_s[s] + self.tmem_s_to_p, dtype=p_frag.element_type),
                p_frag.layout,
            )
            for s in range(Q_STAGES)
        ]
        q_consumer = pipe_q.make_consumer()
        kv_consumer = pipe_kv.make_consumer()
        if n_blocks > 0:
            q_handles = [q_consumer.wait_and_advance() for _ in range(Q_STAGES)]
            k_handle = kv_consumer.wait_and_advance()
            for s in cutlass.range_constexpr(Q_STAGES):
                gemm(tiled_mma_qk, tStS[s], tSrQ[None, None, None, s], tSrK[None, None, None, k_handle.index], False)
                pipe_s_p_o.producer_commit(_stage_state(s, 0))
            k_handle.release()
            # The first wait for "P written and O rescaled" is on phase 0 (not the producer's usual 1): the
            # consumers have not released anything yet.
            p_phase = Int32(0)
            for i in cutlass.range(n_blocks - 1, unroll=1):
                v_handle = kv_consumer.wait_and_advance()
                k_next = v_handle
                for s in cutlass.range_constexpr(Q_STAGES):
                    pipe_s_p_o.producer_acquire(_stage_state(s, p_phase))
                    gemm(tiled_mma_pv, tOtO[s], tOrP[s], tOrV[None, None, None, v_handle.index], i > 0)
                    if const_expr(s == 0):
                        k_next = kv_consumer.wait_and_advance()
                    if const_expr(s == Q_STAGES - 1):
                        v_handle.release()
                    gemm(tiled_mma_qk, tStS[s], tSrQ[None, None, None, s], tSrK[None, None, None, k_next.index], False)
                    pipe_s_p_o.producer_commit(_stage_state(s, 0))
                k_next.release()
                p_phase ^= 1
            for h in q_handles:
                h.release()
            v_handle = kv_consumer.wait_and_advance()
            for s in cutlass.range_constexpr(Q_STAGES):
                pipe_s_p_o.producer_acquire(_stage_state(s, p_phase))
                gemm(tiled_mma_pv, tOtO[s], tOrP[s], tOrV[None, None, None, v_handle.index], n_blocks > 1)
                pipe_o_full.producer_commit(_stage_state(s, 0))
            v_handle.release()

    # ------------------------------------------------------------------------------------------------------------
    # Softmax warpgroups
    # ------------------------------------------------------------------------------------------------------------
    @cute.jit
    def softmax_warpgroup(
        self,
        stage,
        s_layout,
        tmem_ptr,
        sStats,
        pipes: Pipes,
        softmax_scale_log2,
        descales,
        tile: ClusterTile,
        window_left,
        window_right,
        features=None,
    ):
        head, head_kv, batch, cluster_m, cta_v, seqlen_q, seqlen_k, n_block_min, n_block_max = tile[:9]
        mDescaleQ, mDescaleK, _ = descales
        pipe_stats = pipes.stats
        tidx = cute.arch.thread_idx()[0] % WG_THREADS
        tSAcc = cute.make_tensor(tmem_ptr + stage * N_BLOCK, s_layout)[(None, None), 0, 0]  # (128, N) fp32
        load_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32)
        thr_load = tcgen05.make_tmem_copy(load_atom, tSAcc).get_slice(tidx)
        tStS_t2r = thr_load.partition_S(tSAcc)
        tScS_t2r = thr_load.partition_D(cute.make_identity_tensor((M_BLOCK, N_BLOCK)))
        # P in TMEM, viewed as 32-bit columns: 2 (16-bit) or 4 (fp8) probabilities per column.
        p_cols = N_BLOCK * self.v_dtype.width // 32
        tStP = cute.make_tensor(
            tSAcc.iterator + self.tmem_s_to_p, cute.composition(tSAcc.layout, cute.make_layout((M_BLOCK, p_cols)))
        )
        store_atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(p_cols // 4)), Float32)
        thr_store = tcgen05.make_tmem_copy(store_atom, tStP).get_slice(tidx)
        tStP_r2t = thr_store.partition_D(tStP)
        tPshape = thr_store.partition_S(cute.make_identity_tensor((M_BLOCK, p_cols))).shape
        copies = SoftmaxCopies(thr_load, tStS_t2r, tScS_t2r, thr_store, tStP_r2t, tPshape)

        # Query row of this thread, and its tile (of M_BLOCK rows) for the mask boundaries.
        m_tile = (cluster_m * Q_STAGES + stage) * self.cta + cta_v
        row = m_tile * M_BLOCK + tidx
        row_blocks = BlockInfo(M_BLOCK, N_BLOCK, self.spec.mask, seqlen_q, seqlen_k, window_left, window_right)
        n_right_masked = n_block_max
        if const_expr(self.has_right):
            n_right_masked = row_blocks.kv_right_masked_start(m_tile)
        n_left_masked = n_block_min
        if const_expr(self.has_left):
            n_left_masked = row_blocks.kv_left_masked_end(m_tile)
        # Column bounds of this row in key coordinates: [key_begin, key_end).
        key_end = seqlen_k
        if const_expr(self.has_right):
            key_end = cutlass.min(seqlen_k, row + row_blocks.offset + row_blocks.right + 1)
        key_begin = Int32(0)
        if const_expr(self.has_left):
            key_begin = row + row_blocks.offset - row_blocks.left

        # Scores are scaled into log2 units by softmax_scale * log2(e); fp8 adds this row's Q factor (one per
        # FP8_Q_SCALE_ROWS rows) and, per KV block, the block's K factor.
        # Clamped into [FLT_MIN, FLT_MAX] (common/online_softmax.py): a factor of 0 (softmax_scale = 0, or a scale
        # whose product with log2(e) underflows) would turn masked -inf scores into NaN.
        pre_tanh = None
        if const_expr(self.softcap):
            # T = tanh(S * softmax_scale / softcap) in place of S; the softmax of T runs with softcap * log2(e).
            pre_tanh, softmax_scale_log2 = softcap_factors(softmax_scale_log2 * (1.0 / LOG2_E), features[0])
        row_scale = clamp_scale_log2(softmax_scale_log2)
        if const_expr(self.is_fp8):
            q_block = cutlass.min(row // FP8_Q_SCALE_ROWS, cute.size(mDescaleQ.shape[2]) - 1)
            row_scale = clamp_scale_log2(row_scale * mDescaleQ[batch, head, q_block])

        softmax = TmemRowSoftmax(self.rescale_threshold, self.max_offset)
        softmax.reset()
        row_ctx = SoftmaxRow(stage, tidx, key_begin, key_end, softmax, copies, sStats, pipes, pre_tanh)
        s_phase = Int32(0)
        stats_phase = Int32(1)
        n_blocks = n_block_max - n_block_min
        for i in cutlass.range(n_blocks, unroll=1):
            n_block = n_block_max - 1 - i
            needs_mask = i == 0 or n_block >= n_right_masked or n_block < n_left_masked
            block_scale = row_scale
            if const_expr(self.is_fp8):
                block_scale = cute.arch.fmax(row_scale * mDescaleK[batch, head_kv, n_block], Float32(FLT_MIN))
            if needs_mask:
                self._softmax_step(row_ctx, n_block, s_phase, stats_phase, block_scale, masked=True, is_first=i == 0)
            else:
                self._softmax_step(row_ctx, n_block, s_phase, stats_phase, block_scale, masked=False, is_first=False)
            s_phase ^= 1
            stats_phase ^= 1
        if n_blocks > 0:
            pipe_stats.producer_acquire(_stage_state(stage, stats_phase))
            sStats[stage * M_BLOCK + tidx] = softmax.row_sum[0]
            sStats[(Q_STAGES + stage) * M_BLOCK + tidx] = softmax.row_max[0]
            pipe_stats.producer_commit(_stage_state(stage, 0))

    @cute.jit
    def _softmax_step(
        self,
        row: SoftmaxRow,
        n_block,
        s_phase,
        stats_phase,
        block_scale,
        masked: cutlass.Constexpr[bool],
        is_first,
    ):
        """One key block of one row: S from TMEM, mask, max, hand the O factor to correction, P back to TMEM, sum."""
        stage, tidx, key_begin, key_end, softmax, copies, sStats, pipes = row[:8]
        thr_load, tStS_t2r, tScS_t2r, thr_store, tStP_r2t, tPshape = copies
        pipe_s_p_o, pipe_stats = pipes.s_p_o, pipes.stats
        pipe_s_p_o.consumer_wait(_stage_state(stage, s_phase))
        tSrS = cute.make_rmem_tensor(tScS_t2r.shape, Float32)
        cute.copy(thr_load, tStS_t2r, tSrS)
        cute.arch.fence_view_async_tmem_load()
        if const_expr(self.softcap):
            apply_softcap(tSrS, row.pre_tanh)  # before the mask, which then sets -inf
        if const_expr(masked):
            block_start = n_block * N_BLOCK
            mask_row(tSrS, tScS_t2r, key_end - block_start, key_begin - block_start, self.has_left)
        bias, acc_scale = softmax.update_max(tSrS, block_scale, is_first)
        # Hand the O rescale factor to the correction warps (they rescale while we exponentiate).
        pipe_stats.producer_acquire(_stage_state(stage, stats_phase))
        sStats[stage * M_BLOCK + tidx] = acc_scale
        pipe_stats.producer_commit(_stage_state(stage, 0))

        tSrP_words = cute.make_rmem_tensor(tPshape, Float32)
        tSrP = cute.make_tensor(cute.recast_ptr(tSrP_words.iterator, dtype=self.v_dtype), tSrS.layout)
        softmax.exp2_convert(tSrS, tSrP, block_scale, bias)
        for j in cutlass.range_constexpr(cute.size(tStP_r2t, mode=[2])):
            cute.copy(thr_store, tSrP_words[None, None, j], tStP_r2t[None, None, j])
        cute.arch.fence_view_async_tmem_store()
        pipe_s_p_o.consumer_release(_stage_state(stage, 0))
        softmax.update_sum(tSrS, acc_scale)

    # ------------------------------------------------------------------------------------------------------------
    # Correction warpgroup
    # ------------------------------------------------------------------------------------------------------------
    @cute.jit
    def correction_warpgroup(
        self, o_layout, tOsO, tOcO, tmem_ptr, sStats, mLSE, pipes: Pipes, descales, tile: ClusterTile, features, sV
    ):
        _, head_kv, batch, _, _, _, _, n_block_min, n_block_max = tile[:9]
        mDescaleV = descales[2]
        pipe_s_p_o, pipe_o_full, pipe_stats, pipe_o_epi = pipes.s_p_o, pipes.o_full, pipes.stats, pipes.o_epi
        tidx = cute.arch.thread_idx()[0] % WG_THREADS
        tOtO = [cute.make_tensor(tmem_ptr + self.tmem_o[s], o_layout) for s in range(Q_STAGES)]
        n_blocks = n_block_max - n_block_min
        sinks_log2 = None
        if const_expr(self.sink):
            sinks_log2 = self._row_sinks(features[1], tile, tidx)
        if const_expr(self.varlen):
            if n_blocks > 0:
                self._zero_v_tail(sV, pipes.kv, tile, tidx)
        if n_blocks > 0:
            stats_phase = Int32(0)
            # fp8: O is kept in units of the current KV block's V factor. Before P_j V_j is added, O is rescaled by
            # v_descale[j-1] / v_descale[j] (together with the max correction); the epilogue multiplies by the last.
            v_scale = Float32(1.0)
            for i in cutlass.range(n_blocks, unroll=1):
                v_ratio = Float32(1.0)
                if const_expr(self.is_fp8):
                    v_scale_j = mDescaleV[batch, head_kv, n_block_max - 1 - i]
                    if i > 0:
                        v_ratio = v_scale / v_scale_j
                    v_scale = v_scale_j
                for s in cutlass.range_constexpr(Q_STAGES):
                    pipe_stats.consumer_wait(_stage_state(s, stats_phase))
                    scale = sStats[s * M_BLOCK + tidx] * v_ratio
                    pipe_stats.consumer_release(_stage_state(s, 0))
                    # The first block reports 1.0; O_s is only read back when some row of this warp needs a factor.
                    if cute.arch.vote_ballot_sync(scale != 1.0) != 0:
                        self._rescale_o(tOtO[s], tidx, scale)
                    pipe_s_p_o.consumer_release(_stage_state(s, 0))
                stats_phase ^= 1
            for s in cutlass.range_constexpr(Q_STAGES):
                pipe_stats.consumer_wait(_stage_state(s, stats_phase))
                row_sum = sStats[s * M_BLOCK + tidx]
                row_max = sStats[(Q_STAGES + s) * M_BLOCK + tidx]
                pipe_stats.consumer_release(_stage_state(s, 0))
                if const_expr(self.sink):
                    inv_sum, lse = finalize_row(row_sum, row_max, self.max_offset, sinks_log2[s])
                else:
                    inv_sum, lse = finalize_row(row_sum, row_max, self.max_offset)
                pipe_o_full.consumer_wait(_stage_state(s, 0))
                pipe_o_epi.producer_acquire(_stage_state(s, 1))
                self._write_o_tile(tOtO[s], tOsO[s], tOcO, tidx, inv_sum * v_scale, True)
                pipe_o_epi.producer_commit(_stage_state(s, 0))
                self._write_lse(mLSE, lse, tile, s, tidx)
        else:
            # No key is visible to any row of this tile: out = 0, lse = -inf (with a sink: the sink).
            for s in cutlass.range_constexpr(Q_STAGES):
                pipe_o_epi.producer_acquire(_stage_state(s, 1))
                self._write_o_tile(tOtO[s], tOsO[s], tOcO, tidx, Float32(0.0), False)
                pipe_o_epi.producer_commit(_stage_state(s, 0))
                empty_lse = -Float32.inf
                if const_expr(self.sink):
                    empty_lse = sinks_log2[s] * (1.0 / LOG2_E)
                self._write_lse(mLSE, empty_lse, tile, s, tidx)

    @cute.jit
    def _zero_v_tail(self, sV: cute.Tensor, pipe_kv, tile: ClusterTile, tidx):
        """Packed sequences: the keys of the first block walked (the right-most) past seqlen_k are the next
        sequence's rows as TMA loaded them (smem_tails.py); their V rows become 0 before any P·V reads them. The
        correction warpgroup does it while the softmax warps work on that block (it has nothing to rescale there):
        its release of s_p_o for q stage 0, which the first P·V waits for, follows the stores and their fence."""
        tail = tile.seqlen_k - (tile.n_block_max - 1) * N_BLOCK
        if tail < N_BLOCK:
            # The load order (load_warp): K of that block in ring slot 0, its V in slot 1, both in phase 0.
            pipe_kv.consumer_wait(pipeline.PipelineState(self.cfg.kv_stages, Int32(0), Int32(V_FIRST_SLOT), Int32(0)))
            zero_k_rows_from(sV[None, None, None, V_FIRST_SLOT], tail, tidx, WG_THREADS)
            cute.arch.fence_view_async_shared()

    @cute.jit
    def _row_sinks(self, mSink: cute.Tensor, tile: ClusterTile, tidx) -> cute.Tensor:
        """sink * log2(e) of this thread's row in each q stage, read from the (rows, h) view at [row, head]; rows past
        seqlen_q (never stored) read nothing and take 0."""
        sinks = cute.make_rmem_tensor((Q_STAGES,), Float32)
        for s in cutlass.range_constexpr(Q_STAGES):
            row = ((tile.cluster_m * Q_STAGES + s) * self.cta + tile.cta_v) * M_BLOCK + tidx
            sinks[s] = 0.0
            if row < tile.seqlen_q:
                sinks[s] = mSink[row, tile.head] * LOG2_E  # (the view's rows are within the sequence: arch/base.py)
        return sinks

    @cute.jit
    def _write_lse(self, mLSE, lse, tile: ClusterTile, stage: cutlass.Constexpr[int], tidx):
        row = ((tile.cluster_m * Q_STAGES + stage) * self.cta + tile.cta_v) * M_BLOCK + tidx
        if row < tile.seqlen_q:
            mLSE[tile.row_q + row, tile.head, tile.batch] = lse

    @cute.jit
    def _rescale_o(self, tOtO_s, tidx, scale):
        """O_s[row, :] *= scale for this thread's row, 16 columns at a time through registers."""
        cols = 16
        load_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(cols)), Float32)
        store_atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(cols)), Float32)
        tOtO_i = cute.composition(tOtO_s, cute.make_layout((M_BLOCK, cols)))
        thr_load = tcgen05.make_tmem_copy(load_atom, tOtO_i).get_slice(tidx)
        thr_store = tcgen05.make_tmem_copy(store_atom, tOtO_i).get_slice(tidx)
        tOtO_t2r = thr_load.partition_S(tOtO_i)
        tOtO_r2t = thr_store.partition_D(tOtO_i)
        frag_shape = thr_load.partition_D(cute.make_identity_tensor((M_BLOCK, cols))).shape
        for c in cutlass.range_constexpr(self.head_dim_v // cols):
            frag = cute.make_rmem_tensor(frag_shape, Float32)
            cute.copy(thr_load, cute.make_tensor(tOtO_t2r.iterator + c * cols, tOtO_t2r.layout), frag)
            for j in cutlass.range_constexpr(0, cute.size(frag), 2):
                frag[j], frag[j + 1] = cute.arch.mul_packed_f32x2((frag[j], frag[j + 1]), (scale, scale))
            cute.copy(thr_store, frag, cute.make_tensor(tOtO_r2t.iterator + c * cols, tOtO_r2t.layout))
        cute.arch.fence_view_async_tmem_store()

    @cute.jit
    def _write_o_tile(self, tOtO_s, tOsO, tOcO, tidx, scale, from_tmem: cutlass.Constexpr[bool]):
        """sO (this stage, MMA-partitioned) <- O_s * scale in the output dtype (or zeros), fenced for the TMA store."""
        cols = 32 * 8 // self.o_dtype.width  # 32 bytes of output per thread and step
        tOtO_i = cute.logical_divide(tOtO_s, cute.make_layout((M_BLOCK, cols)))
        tOsO_i = cute.logical_divide(tOsO, cute.make_layout((M_BLOCK, cols)))
        tOcO_i = cute.logical_divide(tOcO, cute.make_layout((M_BLOCK, cols)))
        load_atom = sm100_utils.get_tmem_load_op(
            self.mma_tiler_pv,
            cutlass.utils.LayoutEnum.ROW_MAJOR,
            self.o_dtype,
            Float32,
            (M_BLOCK, cols),
            self.use_2cta,
        )
        tiled_load = tcgen05.make_tmem_copy(load_atom, tOtO_i[(None, None), 0])
        thr_load = tiled_load.get_slice(tidx)
        smem_atom = sm100_utils.get_smem_store_op(cutlass.utils.LayoutEnum.ROW_MAJOR, self.o_dtype, Float32, tiled_load)
        tiled_smem_store = cute.make_tiled_copy_D(smem_atom, tiled_load)
        tOtO_t2r = thr_load.partition_S(tOtO_i[(None, None), None])
        tOsO_r2s = thr_load.partition_D(tOsO_i[(None, None), None])
        tOcO_t2r = thr_load.partition_D(tOcO_i[(None, None), None])
        for c in cutlass.range_constexpr(self.head_dim_v // cols):
            frag = cute.make_rmem_tensor(tOcO_t2r[None, 0, 0, c].shape, Float32)
            if const_expr(from_tmem):
                cute.copy(tiled_load, tOtO_t2r[None, 0, 0, c], frag)
                for j in cutlass.range_constexpr(0, cute.size(frag), 2):
                    frag[j], frag[j + 1] = cute.arch.mul_packed_f32x2((frag[j], frag[j + 1]), (scale, scale))
            else:
                frag.fill(0.0)
            out = cute.make_rmem_tensor(frag.shape, self.o_dtype)
            out.store(frag.load().to(self.o_dtype))
            cute.copy(tiled_smem_store, out, tOsO_r2s[None, 0, 0, c])
        # Make the generic-proxy smem writes visible to the TMA (async proxy) store.
        cute.arch.fence_view_async_shared()

    # ------------------------------------------------------------------------------------------------------------
    # Epilogue warp
    # ------------------------------------------------------------------------------------------------------------
    @cute.jit
    def epilogue_warp(self, tma_atom_o, mO, sO, pipe_o_epi, tile: ClusterTile):
        if const_expr(self.varlen):
            self._store_o_rows(mO, sO, pipe_o_epi, tile)
        else:
            self._store_o_tma(tma_atom_o, mO, sO, pipe_o_epi, tile)

    @cute.jit
    def _store_o_rows(self, mO, sO, pipe_o_epi, tile: ClusterTile):
        """Packed builds: each q stage's O tile from sO to the sequence's rows, 16 bytes per lane and step, only the
        rows inside the sequence (a TMA box would also write the next sequence's rows)."""
        vec = 128 // self.o_dtype.width  # elements per 16 bytes
        chunks = self.head_dim_v // vec  # per row
        lane = cute.arch.lane_idx()
        mO_h = cute.domain_offset((tile.row_q, 0), mO[None, None, tile.head, tile.batch])
        for s in cutlass.range_constexpr(Q_STAGES):
            pipe_o_epi.consumer_wait(_stage_state(s, 0))
            first = ((tile.cluster_m * Q_STAGES + s) * self.cta + tile.cta_v) * M_BLOCK
            rows = cutlass.min(tile.seqlen_q - first, M_BLOCK)
            sO_s = sO[None, None, s]
            for i in cutlass.range(lane, rows * chunks, 32, unroll=4):
                r, c = i // chunks, i % chunks
                src = cute.local_tile(sO_s, (1, vec), (r, c))
                dst = cute.local_tile(mO_h, (1, vec), (first + r, c))
                cute.autovec_copy(src, dst)

    @cute.jit
    def _store_o_tma(self, tma_atom_o, mO, sO, pipe_o_epi, tile: ClusterTile):
        """Each q stage's O tile from sO by one TMA store (rows past seqlen_q are clipped by the TMA unit)."""
        head, _, batch, cluster_m, cta_v, _, _, _, _ = tile[:9]
        gO = cute.local_tile(mO[None, None, head, batch], self.epi_tile, (None, 0))
        tOsO, tOgO = cpasync.tma_partition(
            tma_atom_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2)
        )
        for s in cutlass.range_constexpr(Q_STAGES):
            pipe_o_epi.consumer_wait(_stage_state(s, 0))
            # Rows past seqlen_q are clipped by the TMA unit.
            cute.copy(tma_atom_o, tOsO[None, s], tOgO[None, (cluster_m * Q_STAGES + s) * self.cta + cta_v])
            cute.arch.cp_async_bulk_commit_group()
        # sO must stay valid until the bulk stores have read it.
        cute.arch.cp_async_bulk_wait_group(0, read=True)

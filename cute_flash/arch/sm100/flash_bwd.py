"""The sm100 (Blackwell) attention backward kernel: tcgen05 MMAs, accumulators in tensor memory, one CTA per key tile.

A CTA owns one tile of N_BLOCK = 128 keys of one KV head and walks, for every query head of its group (GQA), the
query tiles of M_BLOCK = 128 rows that see some of its keys (BlockInfo.q_block_range). Everything is computed
transposed, keys on the TMEM lanes: one thread of a compute warpgroup owns one key row. dK and dV accumulate in TMEM
over the whole walk (all query heads of the group, so GQA needs no partial sums); each step's dQ tile goes out to a
float32 accumulator by a TMA reduce-add.

Sixteen warps, each with one job (setmaxnreg works per warpgroup):

  warps 0-7   compute   two warpgroups, each one half of the step's 128 query columns: S^T -> P^T (TMEM, over S^T),
                        dP^T -> dS^T (shared memory); after the walk dK, dV TMEM -> global
  warps 8-11  dQ        each step's dQ tile TMEM -> shared memory -> TMA reduce-add into the dQ accumulator
  warp  12    MMA       allocates TMEM and issues every tcgen05.mma
  warp  13    load      TMA: K and V once; per step Q with its rows' lse_log2 and D, and dO
  warps 14-15 tails     packed builds: zero the rows past the sequence's end in K, Q and dO (tail_warps); else idle

The five MMAs of a step (M x N x K; A, B from shared memory unless noted):

  S^T  = K Q^T      keys x queries x d        A K (K-major), B Q (K-major)
  dP^T = V dO^T     keys x queries x dv       A V (K-major), B dO (K-major)
  dV  += P^T dO     keys x dv x queries       A P^T from TMEM, B dO (MN-major view of the same buffer)
  dK  += dS^T Q     keys x d x queries        A dS^T (K-major), B Q (MN-major view)
  dQ   = dS K       queries x d x keys        A dS (MN-major view of dS^T's buffer), B K (MN-major view)

TMEM columns (fp32): dK [0, d) | dV [d, d + dv) | S^T [2d, 2d + 128) | dP^T [2d + 128, 2d + 256); P^T (16-bit, two per
column) overwrites the first 64 columns of S^T, and dQ (128 queries x d) the first d columns of dP^T: at d = 128 the
512 columns are exactly full.

MMA order (the overlaps rely on tcgen05.mma ops of one thread executing in issue order, as NVIDIA's CuTe DSL Blackwell
FMHA backward example and FlashAttention-4 do; not verified on hardware here):
  prologue  S(0), dP(0), dV(0)
  step i    S(i), dQ(i-1), dK(i-1), dP(i), dV(i)
  epilogue  dQ(last), dK(last), then "dK and dV final"
S(i) overwrites P(i-1) after dV(i-1) has been issued; dQ(i-1) overwrites dP(i-1) once dS(i-1) is in shared memory
(the compute warps read dP before they write dS); dP(i) overwrites dQ(i-1) once the dQ warps have read it out.

Every hand-off between a thread's tcgen05 operations and another thread's goes through a barrier or mbarrier framed
by tcgen05.fence::before_thread_sync / after_thread_sync (umma.py), after tcgen05.wait::ld / ::st where TMEM was read
or written.

Synchronisation (mbarrier pipelines; one stage unless noted):
  kv     TMA -> MMA            K and V tiles, loaded once
  q      TMA -> MMA            Q_STAGES slots of Q with lse_log2 and D of its rows; freed after dK(i), so the compute
                               warps (which also wait on its full barrier, without releasing) read the statistics
                               of step i (slot i % Q_STAGES) while it is live
  do     TMA -> MMA            cfg.do_stages slots of dO; freed after dV(i)
  s      MMA -> compute        S^T(i) in TMEM; released once P^T(i) is written
  p      compute -> MMA        P^T(i) in TMEM
  dp     MMA -> compute        dP^T(i) in TMEM
  ds     compute -> MMA        dS^T(i) in shared memory; freed after dK(i) and dQ(i)
  dq     MMA -> dQ warps       dQ(i) in TMEM; released once read out
  dkv    MMA -> compute        dK and dV final
  issued load -> tail warps    packed builds: a last query tile's Q and dO loads are issued (a phase per such step)
  tails  tail warps -> MMA     packed builds: a tile's rows past the sequence are zero (a phase per zeroing)

P = exp2(S * softmax_scale * log2(e) - lse_log2) with the preprocess's lse_log2 (+inf for padding and empty rows, so
their P is 0 without a mask) and dS = P (dP - D). dS is not scaled: the dQ conversion multiplies dQ by softmax_scale,
the epilogue dK. Query rows past seqlen_q and keys past seqlen_k arrive as zeros from the TMA (packed builds: the
tail warps zero them, and the compute warps give keys past seqlen_k dS = 0).

Deterministic builds (`deterministic`): the key tiles that see a query tile add its dQ in key-tile order, behind one
int32 semaphore per (batch, query head, query tile) (zeroed by the host): the dQ warp of key tile n waits until the
semaphore counts the tiles before it, adds, waits for its adds to complete and increments it. CTAs of one (KV head,
batch) start in key-tile order (blockIdx.x), so every wait is on a CTA that started earlier. dK and dV need no
order: they accumulate in TMEM.

Soft-capping (spec.softcap, the `features` entry): S becomes T = tanh(S * softmax_scale / softcap), P = exp2(T *
softcap * log2(e) - lse_log2), and dS gets the tanh's derivative (1 - T^2) (common/softcap.py).
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
from ...common.bulk_ptx import add_release_gpu, load_acquire_gpu
from ...common.online_softmax import LOG2_E
from ...common.packed import packed_pads, seq_rows
from ...common.softcap import apply_softcap, softcap_factors
from ...spec import AttentionSpec
from . import pipelines
from .smem_tails import zero_k_rows_from
from .tile_config import BWD_HEAD_DIMS, M_BLOCK, N_BLOCK, TMEM_COLUMNS, BwdTileConfig
from .tmem_softmax import mask_row
from .umma import fence_after_thread_sync, fence_before_thread_sync, gemm

# Warp roles.
COMPUTE_WARPS = 8  # warps 0..7
DQ_WARP0 = 8  # warps 8..11
MMA_WARP = 12
LOAD_WARP = 13
TAIL_WARP0 = 14  # warps 14..15: packed builds' tail rows (smem_tails.py); idle otherwise
NUM_WARPS = 16
THREADS = NUM_WARPS * 32
WG_THREADS = 128
COMPUTE_THREADS = COMPUTE_WARPS * 32
TAIL_THREADS = (NUM_WARPS - TAIL_WARP0) * 32

# Named barriers (0 is __syncthreads).
TMEM_BARRIER_ID = 1  # TMEM allocation handshake: the MMA warp and every TMEM user
COMPUTE_BARRIER_ID = 2  # the compute warpgroups: every S^T read before any P^T write (P^T overlaps S^T)
DQ_BARRIER_ID = 3  # the dQ warps: a staging slot is free / filled
TMEM_USER_THREADS = 32 * (1 + COMPUTE_WARPS + 4)

DQ_COLS = 32  # dQ columns per TMA reduce-add (a 128 x 32 fp32 staging slot, 16 KiB)
DQ_SLOTS = 2
Q_STAGES = 2
# Padded rows of the packed statistics and dQ sums (common/packed.py): whole query tiles.
PACKED_PAD = packed_pads(M_BLOCK, N_BLOCK)[0]
LAYOUT_NAMES = ("sK", "sKt", "sV", "sQ", "sQt", "sdO", "sdOt", "sdS", "sdSt", "tP", "sdQ")
HALF = M_BLOCK // 2  # query columns per compute warpgroup


class KeyTile(NamedTuple):
    """What one CTA works on: its key tile, KV head and batch index of the tensors (0 for packed sequences), the query
    heads per KV head, the query tiles [m_block_min, m_block_min + q_tiles) of each, the sequence lengths and, for
    packed sequences, the sequence's first query and key rows and its first row in the padded statistics and dQ sums
    (common/packed.py; 0 in a dense batch)."""

    n_block: Int32
    head_kv: Int32
    batch: Int32
    group: Int32
    m_block_min: Int32
    q_tiles: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    row_q: Int32
    row_k: Int32
    row_stats: Int32

    @property
    def steps(self):
        return self.group * self.q_tiles


class Pipes(NamedTuple):
    kv: pipeline.PipelineTmaUmma
    q: pipeline.PipelineTmaUmma
    do: pipeline.PipelineTmaUmma
    s: pipeline.PipelineUmmaAsync
    p: pipeline.PipelineAsyncUmma
    dp: pipeline.PipelineUmmaAsync
    ds: pipeline.PipelineAsyncUmma
    dq: pipeline.PipelineUmmaAsync
    dkv: pipeline.PipelineUmmaAsync
    issued: Optional[pipeline.PipelineAsync] = None  # packed builds: tail tiles' loads issued -> tail warps
    tails: Optional[pipeline.PipelineAsync] = None  # packed builds: tail rows zeroed -> MMA


class MmaOperands(NamedTuple):
    """The MMA warp's operand fragments and accumulators, by MMA: S^T, dP^T, dV, dK, dQ."""

    tSrK: cute.Tensor
    tSrQ: cute.Tensor
    tStS: cute.Tensor
    tPrV: cute.Tensor
    tPrdO: cute.Tensor
    tPtP: cute.Tensor
    tVrP: cute.Tensor
    tVrdOt: cute.Tensor
    tVtV: cute.Tensor
    tKrdSt: cute.Tensor
    tKrQt: cute.Tensor
    tKtK: cute.Tensor
    tQrdS: cute.Tensor
    tQrKt: cute.Tensor
    tQtQ: cute.Tensor


class Mmas(NamedTuple):
    s: cute.TiledMma
    dp: cute.TiledMma
    dv: cute.TiledMma
    dk: cute.TiledMma
    dq: cute.TiledMma


def _producer(stages):
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)


def _consumer(stages):
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)


def _one_slot(phase):
    """The position in a one-slot pipeline whose phase is tracked by hand (advanced inside runtime branches)."""
    return pipeline.PipelineState(1, Int32(0), Int32(0), phase)


class Sm100FlashBackward:
    """Builds (via `cute.compile`) the main backward kernel for one `AttentionSpec` and one `BwdTileConfig`."""

    def __init__(self, spec: AttentionSpec, cfg: BwdTileConfig, deterministic: bool = False):
        if spec.head_dim != spec.head_dim_v or spec.head_dim not in BWD_HEAD_DIMS:
            raise ValueError(f"the sm100 backward kernel is built for d = dv in (64, 128), not {spec}")
        self.spec = spec
        self.cfg = cfg
        self.deterministic = deterministic
        self.varlen = spec.varlen
        self.d = spec.head_dim
        self.has_right = spec.mask in ("causal", "local")
        self.has_left = spec.mask == "local"
        self.softcap = spec.softcap
        self.tiler_s = (N_BLOCK, M_BLOCK, self.d)  # S^T and dP^T
        self.tiler_dkv = (N_BLOCK, self.d, M_BLOCK)  # dV and dK
        self.tiler_dq = (M_BLOCK, self.d, N_BLOCK)
        self.tmem_dk = 0
        self.tmem_dv = self.d
        self.tmem_s = 2 * self.d
        self.tmem_dp = 2 * self.d + M_BLOCK
        self.tmem_dq = self.tmem_dp
        assert self.tmem_dp + M_BLOCK <= TMEM_COLUMNS

    # ------------------------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, sq, h, d)
        mK: cute.Tensor,  # (b, sk, h_kv, d)
        mV: cute.Tensor,  # (b, sk, h_kv, d)
        mdO: cute.Tensor,  # (b, sq, h, d)
        mLSE: cute.Tensor,  # (b, h, sq_pad) fp32 lse_log2 from the preprocess
        mD: cute.Tensor,  # (b, h, sq_pad) fp32 D = rowsum(dO * O)
        mdQaccum: cute.Tensor,  # (b, sq_pad, h, d) fp32, zeroed
        mdK: cute.Tensor,  # (b, sk, h_kv, d)
        mdV: cute.Tensor,  # (b, sk, h_kv, d)
        mdQsem: Optional[cute.Tensor],  # deterministic builds: (b, h, sq_pad / 128) int32, zeroed; else None
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        stream,
    ):
        self._launch(
            mQ, mK, mV, mdO, mLSE, mD, mdQaccum, mdK, mdV, mdQsem, softmax_scale, window_left, window_right, stream
        )

    @cute.jit
    def features(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mD: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mdQsem: Optional[cute.Tensor],
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        softcap: Float32,  # spec.softcap: the cap (> 0)
        stream,
    ):
        """The entry of spec.softcap builds."""
        self._launch(
            mQ, mK, mV, mdO, mLSE, mD, mdQaccum, mdK, mdV, mdQsem, softmax_scale, window_left, window_right, stream,
            softcap,
        )  # fmt: skip

    @cute.jit
    def packed(
        self,
        mQ: cute.Tensor,  # (1, total_q, h, d): packed sequences, sequence b from row cu_seqlens_q[b]
        mK: cute.Tensor,  # (1, total_k, h_kv, d)
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,  # (1, h, rows) in padded rows (common/packed.py, pad = PACKED_PAD)
        mD: cute.Tensor,
        mdQaccum: cute.Tensor,  # (1, rows, h, d) fp32, padded rows, zeroed
        mdK: cute.Tensor,  # (1, total_k, h_kv, d)
        mdV: cute.Tensor,
        mdQsem: Optional[cute.Tensor],  # deterministic builds: (1, h, rows / 128) int32, zeroed
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        mCuSeqlensQ: cute.Tensor,  # (batch + 1,) int32
        mCuSeqlensK: cute.Tensor,
        mSeqUsedK: Optional[cute.Tensor],  # (batch,) int32 keys used per sequence, or None
        max_seqlen_k: Int32,
        stream,
    ):
        """The entry of packed-sequence builds (spec.varlen)."""
        seqs = (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_k)
        self._launch(
            mQ, mK, mV, mdO, mLSE, mD, mdQaccum, mdK, mdV, mdQsem, softmax_scale, window_left, window_right, stream,
            None, seqs,
        )  # fmt: skip

    @cute.jit
    def packed_features(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mD: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mdQsem: Optional[cute.Tensor],
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        softcap: Float32,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mSeqUsedK: Optional[cute.Tensor],
        max_seqlen_k: Int32,
        stream,
    ):
        """The entry of packed builds with spec.softcap."""
        seqs = (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_k)
        self._launch(
            mQ, mK, mV, mdO, mLSE, mD, mdQaccum, mdK, mdV, mdQsem, softmax_scale, window_left, window_right, stream,
            softcap, seqs,
        )  # fmt: skip

    @cute.jit
    def _launch(
        self, mQ, mK, mV, mdO, mLSE, mD, mdQaccum, mdK, mdV, mdQsem, softmax_scale, window_left, window_right, stream,
        softcap=None, seqs=None,
    ):  # fmt: skip
        """Every entry; softcap: the cap of spec.softcap builds; seqs: (cu_seqlens_q, cu_seqlens_k, seqused_k,
        max_seqlen_k) of packed builds (their tensors have one batch entry)."""
        if const_expr(self.deterministic != (mdQsem is not None)):
            raise ValueError("deterministic builds take the dQ semaphores, others none")
        if const_expr(self.varlen != (seqs is not None)):
            raise ValueError("packed builds (spec.varlen) take the sequences, others none")
        dt = mQ.element_type
        self.dtype = dt
        if const_expr(mK.element_type != dt or mV.element_type != dt or mdO.element_type != dt):
            raise TypeError("q, k, v and dout must share one dtype")
        # (seqlen, d, head, batch) for the operands, (seqlen, head, batch) for the row statistics.
        seq_d = lambda t: cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))  # noqa: E731
        mQ, mK, mV, mdO, mdK, mdV, mdQaccum = (seq_d(t) for t in (mQ, mK, mV, mdO, mdK, mdV, mdQaccum))
        rows = lambda t: cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0]))  # noqa: E731
        mLSE, mD = rows(mLSE), rows(mD)

        one = tcgen05.CtaGroup.ONE
        K_, MN = OperandMajorMode.K, OperandMajorMode.MN
        mma = (
            lambda a, b, tiler, src=tcgen05.OperandSource.SMEM: sm100_utils.make_trivial_tiled_mma(  # noqa: E731
                dt, dt, a, b, Float32, one, tiler[:2], src
            )
        )
        mmas = Mmas(
            s=mma(K_, K_, self.tiler_s),
            dp=mma(K_, K_, self.tiler_s),
            dv=mma(K_, MN, self.tiler_dkv, tcgen05.OperandSource.TMEM),
            dk=mma(K_, MN, self.tiler_dkv),
            dq=mma(MN, MN, self.tiler_dq),
        )
        cta_layout_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (mmas.s.thr_id.shape,))

        a_layout = sm100_utils.make_smem_layout_a
        b_layout = sm100_utils.make_smem_layout_b
        do_stages = self.cfg.do_stages
        layouts = dict(
            sK=a_layout(mmas.s, self.tiler_s, dt, 1),
            sKt=b_layout(mmas.dq, self.tiler_dq, dt, 1),
            sV=a_layout(mmas.dp, self.tiler_s, dt, 1),
            sQ=b_layout(mmas.s, self.tiler_s, dt, Q_STAGES),
            sQt=b_layout(mmas.dk, self.tiler_dkv, dt, Q_STAGES),
            sdO=b_layout(mmas.dp, self.tiler_s, dt, do_stages),
            sdOt=b_layout(mmas.dv, self.tiler_dkv, dt, do_stages),
            sdS=a_layout(mmas.dq, self.tiler_dq, dt, 1),
            sdSt=a_layout(mmas.dk, self.tiler_dkv, dt, 1),
            tP=a_layout(mmas.dv, self.tiler_dkv, dt, 1),
        )
        dq_atom = sm100_utils.make_smem_layout_atom(
            sm100_utils.get_smem_layout_atom_ab(OperandMajorMode.K, Float32, (M_BLOCK, DQ_COLS)), Float32
        )
        layouts["sdQ"] = cute.tile_to_shape(dq_atom, (M_BLOCK, DQ_COLS, DQ_SLOTS), order=(1, 0, 2))

        g2s = cpasync.CopyBulkTensorTileG2SOp(one)
        one_stage = lambda name: cute.select(layouts[name], mode=[0, 1, 2])  # noqa: E731
        vmnk = cta_layout_vmnk.shape
        tma_k = cute.nvgpu.make_tiled_tma_atom_A(g2s, mK, one_stage("sK"), self.tiler_s, mmas.s, vmnk)
        tma_v = cute.nvgpu.make_tiled_tma_atom_A(g2s, mV, one_stage("sV"), self.tiler_s, mmas.dp, vmnk)
        tma_q = cute.nvgpu.make_tiled_tma_atom_B(g2s, mQ, one_stage("sQ"), self.tiler_s, mmas.s, vmnk)
        tma_do = cute.nvgpu.make_tiled_tma_atom_B(g2s, mdO, one_stage("sdO"), self.tiler_s, mmas.dp, vmnk)
        row_layout = cute.make_layout((M_BLOCK,))
        tma_lse = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mLSE, row_layout, (M_BLOCK,))
        tma_d = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mD, row_layout, (M_BLOCK,))
        tma_dq = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(),
            mdQaccum,
            cute.select(layouts["sdQ"], mode=[0, 1]),
            (M_BLOCK, DQ_COLS),
        )
        in_bytes = lambda name: cute.size_in_bytes(dt, one_stage(name))  # noqa: E731
        self.kv_tx_bytes = in_bytes("sK") + in_bytes("sV")
        self.q_tx_bytes = in_bytes("sQ") + 2 * M_BLOCK * 4  # Q with its rows' lse_log2 and D
        self.do_tx_bytes = in_bytes("sdO")

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[Int64, 2]
            mbar_q: cute.struct.MemRange[Int64, Q_STAGES * 2]
            mbar_do: cute.struct.MemRange[Int64, do_stages * 2]
            mbar_s: cute.struct.MemRange[Int64, 2]
            mbar_p: cute.struct.MemRange[Int64, 2]
            mbar_dp: cute.struct.MemRange[Int64, 2]
            mbar_ds: cute.struct.MemRange[Int64, 2]
            mbar_dq: cute.struct.MemRange[Int64, 2]
            mbar_dkv: cute.struct.MemRange[Int64, 2]
            if const_expr(self.varlen):
                mbar_issued: cute.struct.MemRange[Int64, 2]
                mbar_tails: cute.struct.MemRange[Int64, 2]
            tmem_holding_buf: Int32
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, M_BLOCK * Q_STAGES], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, M_BLOCK * Q_STAGES], 128]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(layouts["sK"])], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(layouts["sV"])], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(layouts["sQ"])], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(layouts["sdO"])], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(layouts["sdS"])], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(layouts["sdQ"])], 1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        if const_expr(self.smem_bytes > cutlass.memory.SmemAllocator.capacity_in_bytes("sm_100")):
            raise ValueError(f"shared memory {self.smem_bytes} B exceeds sm100's capacity (do_stages too deep)")

        grid = (cute.ceil_div(cute.size(mK.shape[0]), N_BLOCK), cute.size(mK.shape[2]), cute.size(mK.shape[3]))
        if const_expr(self.varlen):  # one CTA row per sequence, as many key tiles as the longest one has
            grid = (cute.ceil_div(seqs[3], N_BLOCK), cute.size(mK.shape[2]), cute.size(seqs[0].shape[0]) - 1)
        self.kernel(
            mmas,
            (tma_k, tma_v, tma_q, tma_do, tma_lse, tma_d, tma_dq),
            (mdK, mdV),
            mdQsem,
            tuple(layouts[name] for name in LAYOUT_NAMES),
            cute.size(mQ.shape[2]),
            softmax_scale,
            window_left,
            window_right,
            softcap,
            seqs,
        ).launch(grid=grid, block=[THREADS, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mmas: Mmas,
        tmas,  # (atom, coordinate tensor) of K, V, Q, dO, lse_log2, D (loads) and the dQ accumulator (reduce-add)
        grads,  # (mdK, mdV) in (sk, d, h_kv, b) order
        mdQsem,  # deterministic builds: (b, h, query tiles) int32, else None
        layout_list,  # shared-memory layouts (and P's TMEM operand layout) by LAYOUT_NAMES
        num_heads: Int32,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        softcap,
        seqs,  # packed builds: (cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_k), else None
    ):
        layouts = dict(zip(LAYOUT_NAMES, layout_list))
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_block, head_kv, batch = cute.arch.block_idx()
        if warp_idx == LOAD_WARP:
            for atom, _ in tmas[:6]:
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        cta_layout_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (mmas.s.thr_id.shape,))
        pipes = self.make_pipes(storage, cta_layout_vmnk)
        tmem_barrier = pipeline.NamedBarrier(barrier_id=TMEM_BARRIER_ID, num_threads=TMEM_USER_THREADS)
        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_holding_buf.ptr, barrier_for_retrieve=tmem_barrier, allocator_warp_id=MMA_WARP
        )
        pipeline_init_arrive(cluster_shape_mn=cta_layout_vmnk, is_relaxed=True)

        def smem(field, name):
            return field.get_tensor(layouts[name].outer, swizzle=layouts[name].inner)

        def view(t, name):
            """The same shared memory under another MMA's layout (the layouts agree element by element)."""
            return cute.make_tensor(cute.recast_ptr(t.iterator, layouts[name].inner), layouts[name].outer)

        sK, sV, sQ, sdO = (
            smem(storage.sK, "sK"),
            smem(storage.sV, "sV"),
            smem(storage.sQ, "sQ"),
            smem(storage.sdO, "sdO"),
        )
        sdS = smem(storage.sdS, "sdS")
        buffers = dict(
            sK=sK, sV=sV, sQ=sQ, sdO=sdO, sdS=sdS,
            sKt=view(sK, "sKt"), sQt=view(sQ, "sQt"), sdOt=view(sdO, "sdOt"), sdSt=view(sdS, "sdSt"),
            sdQ=smem(storage.sdQ, "sdQ"),
            tP_layout=layouts["tP"],
            sLSE=storage.sLSE.get_tensor(cute.make_layout((M_BLOCK, Q_STAGES))),
            sD=storage.sD.get_tensor(cute.make_layout((M_BLOCK, Q_STAGES))),
        )  # fmt: skip

        mK_shape = tmas[0][1].shape
        group = num_heads // cute.size(mK_shape[2])
        if const_expr(self.varlen):
            seq = seq_rows(batch, seqs[0], seqs[1], seqs[2])
            seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
            rows = (seq.offset_q, seq.offset_k, seq.padded_offset_q(PACKED_PAD))
            batch = Int32(0)  # (the packed tensors' one batch entry)
        else:
            seqlen_k = cute.size(mK_shape[0])
            seqlen_q = cute.size(tmas[2][1].shape[0])
            rows = (Int32(0), Int32(0), Int32(0))
        blocks = BlockInfo(M_BLOCK, N_BLOCK, self.spec.mask, seqlen_q, seqlen_k, window_left, window_right)
        m_block_min, m_block_max = blocks.q_block_range(n_block)
        q_tiles = cutlass.max(m_block_max - m_block_min, 0)
        if const_expr(self.varlen):
            # A key tile past this sequence's keys (the grid covers the longest sequence) has nothing to do.
            q_tiles = q_tiles if n_block * N_BLOCK < seqlen_k else Int32(0)
        tile = KeyTile(n_block, head_kv, batch, group, m_block_min, q_tiles, seqlen_q, seqlen_k, *rows)

        pipeline_init_wait(cluster_shape_mn=cta_layout_vmnk)

        if warp_idx >= MMA_WARP:
            cute.arch.setmaxregister_decrease(self.cfg.regs_other)
            if warp_idx == LOAD_WARP:
                self.load_warp(mmas, tmas, buffers, pipes, tile)
            if const_expr(self.varlen):
                if warp_idx >= TAIL_WARP0:
                    self.tail_warps(buffers, pipes, tile)
            if warp_idx == MMA_WARP:
                tmem.allocate(TMEM_COLUMNS)
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(Float32)
                self.mma_warp(mmas, buffers, tmem_ptr, pipes, tile)
                tmem.relinquish_alloc_permit()
                tmem_barrier.arrive_and_wait()
                tmem.free(tmem_ptr)
        if warp_idx < COMPUTE_WARPS:
            cute.arch.setmaxregister_increase(self.cfg.regs_compute)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.compute_warpgroup(
                warp_idx // 4, mmas, buffers, grads, tmem_ptr, pipes, tile, blocks, softmax_scale, softcap
            )
            tmem_barrier.arrive()
        if warp_idx >= DQ_WARP0 and warp_idx < MMA_WARP:
            cute.arch.setmaxregister_decrease(self.cfg.regs_dq)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.dq_warpgroup(warp_idx, mmas, tmas[6], buffers["sdQ"], tmem_ptr, pipes, tile, blocks, mdQsem)
            tmem_barrier.arrive()

    def make_pipes(self, storage, cta_layout_vmnk) -> Pipes:
        """The kernel's mbarrier pipelines, their initialisation deferred to pipeline_init_arrive / _wait."""
        vmnk = cta_layout_vmnk
        pipes = Pipes(
            kv=pipelines.tma_umma(1, self.kv_tx_bytes, storage.mbar_kv, vmnk),
            q=pipelines.tma_umma(Q_STAGES, self.q_tx_bytes, storage.mbar_q, vmnk),
            do=pipelines.tma_umma(self.cfg.do_stages, self.do_tx_bytes, storage.mbar_do, vmnk),
            s=pipelines.umma_async(1, COMPUTE_THREADS, storage.mbar_s, vmnk),
            p=pipelines.async_umma(1, COMPUTE_THREADS, storage.mbar_p, vmnk),
            dp=pipelines.umma_async(1, COMPUTE_THREADS, storage.mbar_dp, vmnk),
            ds=pipelines.async_umma(1, COMPUTE_THREADS, storage.mbar_ds, vmnk),
            dq=pipelines.umma_async(1, WG_THREADS, storage.mbar_dq, vmnk),
            dkv=pipelines.umma_async(1, COMPUTE_THREADS, storage.mbar_dkv, vmnk),
        )
        if const_expr(self.varlen):
            pipes = pipes._replace(
                issued=pipelines.thread_async(1, 32, TAIL_THREADS, storage.mbar_issued),
                tails=pipelines.thread_async(1, TAIL_THREADS, 32, storage.mbar_tails),
            )
        return pipes

    def _head_rows(self, t, head, tile: KeyTile, row):
        """The (rows, d) view of one head of a (rows, d, h, b) tensor; packed builds: from the sequence's `row`."""
        x = t[None, None, head, tile.batch]
        if const_expr(self.varlen):
            x = cute.domain_offset((row, 0), x)
        return x

    def _stat_rows(self, t, head, tile: KeyTile):
        """The (rows,) view of one head of the padded (rows, h, b) statistics; packed builds: from the sequence's
        padded offset."""
        x = t[None, head, tile.batch]
        if const_expr(self.varlen):
            x = cute.domain_offset((tile.row_stats,), x)
        return x

    @cute.jit
    def _step(self, tile: KeyTile, i):
        """(query head, query tile) of step i: the query tiles of one head, then the next head of the group."""
        h_r = i // tile.q_tiles
        return tile.head_kv * tile.group + h_r, tile.m_block_min + (i - h_r * tile.q_tiles)

    # ------------------------------------------------------------------------------------------------------------
    # Load warp
    # ------------------------------------------------------------------------------------------------------------
    @cute.jit
    def load_warp(self, mmas: Mmas, tmas, buffers, pipes: Pipes, tile: KeyTile):
        (atom_k, mK), (atom_v, mV), (atom_q, mQ), (atom_do, mdO), (atom_lse, mLSE), (atom_d, mD) = tmas[:6]
        thr_s, thr_dp = mmas.s.get_slice(0), mmas.dp.get_slice(0)
        part = lambda atom, s, g: cpasync.tma_partition(  # noqa: E731
            atom,
            0,
            cute.make_layout(1),
            cute.group_modes(s, 0, cute.rank(s) - 1),
            cute.group_modes(g, 0, cute.rank(g) - 1),
        )
        kv_producer = pipes.kv.make_producer()
        q_producer = pipes.q.make_producer()
        do_producer = pipes.do.make_producer()
        pipe_issued = pipes.issued
        issued_phase = Int32(1)
        if tile.steps > 0:
            keys = cute.select(self.tiler_s, mode=[0, 2])
            gK = cute.local_tile(self._head_rows(mK, tile.head_kv, tile, tile.row_k), keys, (None, 0))
            gV = cute.local_tile(self._head_rows(mV, tile.head_kv, tile, tile.row_k), keys, (None, 0))
            tKsK, tKgK = part(atom_k, buffers["sK"], thr_s.partition_A(gK))
            tVsV, tVgV = part(atom_v, buffers["sV"], thr_dp.partition_A(gV))
            handle = kv_producer.acquire_and_advance()
            cute.copy(atom_k, tKgK[None, tile.n_block], tKsK[None, 0], tma_bar_ptr=handle.barrier)
            cute.copy(atom_v, tVgV[None, tile.n_block], tVsV[None, 0], tma_bar_ptr=handle.barrier)
            for i in cutlass.range(tile.steps, unroll=1):
                head, m_block = self._step(tile, i)
                queries = cute.select(self.tiler_s, mode=[1, 2])
                gQ = cute.local_tile(self._head_rows(mQ, head, tile, tile.row_q), queries, (None, 0))
                gdO = cute.local_tile(self._head_rows(mdO, head, tile, tile.row_q), queries, (None, 0))
                gLSE = cute.local_tile(self._stat_rows(mLSE, head, tile), (M_BLOCK,), (None,))
                gD = cute.local_tile(self._stat_rows(mD, head, tile), (M_BLOCK,), (None,))
                tQsQ, tQgQ = part(atom_q, buffers["sQ"], thr_s.partition_B(gQ))
                tOsO, tOgO = part(atom_do, buffers["sdO"], thr_dp.partition_B(gdO))
                tLsL, tLgL = part(atom_lse, buffers["sLSE"], gLSE)
                tDsD, tDgD = part(atom_d, buffers["sD"], gD)
                q_handle = q_producer.acquire_and_advance()
                cute.copy(atom_q, tQgQ[None, m_block], tQsQ[None, q_handle.index], tma_bar_ptr=q_handle.barrier)
                cute.copy(atom_lse, tLgL[None, m_block], tLsL[None, q_handle.index], tma_bar_ptr=q_handle.barrier)
                cute.copy(atom_d, tDgD[None, m_block], tDsD[None, q_handle.index], tma_bar_ptr=q_handle.barrier)
                do_handle = do_producer.acquire_and_advance()
                cute.copy(atom_do, tOgO[None, m_block], tOsO[None, do_handle.index], tma_bar_ptr=do_handle.barrier)
                if const_expr(self.varlen):
                    if self._query_tail(tile, i) < M_BLOCK:  # (tail_warps: their waits are on these loads)
                        pipe_issued.producer_acquire(_one_slot(issued_phase))
                        pipe_issued.producer_commit(_one_slot(issued_phase))
                        issued_phase ^= 1
        # Wait until the MMA warp released every slot: no tcgen05.commit may still target this CTA after exit.
        kv_producer.tail()
        q_producer.tail()
        do_producer.tail()

    # ------------------------------------------------------------------------------------------------------------
    # Tail warps (packed builds)
    # ------------------------------------------------------------------------------------------------------------
    @cute.jit
    def _key_tail(self, tile: KeyTile):
        """Keys of this CTA's tile inside the sequence (< N_BLOCK: the rows after them hold another's)."""
        return tile.seqlen_k - tile.n_block * N_BLOCK

    @cute.jit
    def _query_tail(self, tile: KeyTile, i):
        """Query rows of step i's tile inside the sequence (< M_BLOCK only in its last tile)."""
        _, m_block = self._step(tile, i)
        return tile.seqlen_q - m_block * M_BLOCK

    @cute.jit
    def tail_warps(self, buffers, pipes: Pipes, tile: KeyTile):
        """Packed sequences: rows of a sequence's last tiles past its end are the next sequence's rows as TMA loaded
        them (smem_tails.py). Zeroed here, so that every product reads zeros there as in a dense batch: K's rows past
        seqlen_k once (dQ = dS K; their dS is 0, set by the compute warps, but 0 * NaN is not), Q's and dO's rows past
        seqlen_q in each step's last query tile (dK += dS^T Q and dV += P^T dO sum over the queries; S^T and dP^T of
        those queries then are 0 and their P^T is 0 through lse_log2 = +inf, as in a dense batch). Each zeroing
        follows its tile's TMA load (a wait on the load's barrier, never released here) and is handed to the MMA
        warp through `tails`, one phase per zeroing, in the order the MMA warp uses the tiles (K first, then the
        steps).

        A wait on a TMA barrier's phase parity is only unambiguous while that barrier is at the awaited load or the
        one before it: the load warp's `issued` (after it issued a tail step's Q and dO, so the previous loads of their
        slots have landed) bounds it from below, and the MMA warp's wait on `tails` before it uses (and later frees)
        those slots bounds it from above."""
        tidx = cute.arch.thread_idx()[0] - TAIL_WARP0 * 32
        pipe_kv, pipe_q, pipe_do, pipe_issued, pipe_tails = pipes.kv, pipes.q, pipes.do, pipes.issued, pipes.tails
        phase = Int32(1)  # (a producer's first wait on the empty barrier passes; one slot: the phase alone moves)
        issued_phase = Int32(0)
        if tile.steps > 0:
            key_tail = self._key_tail(tile)
            if key_tail < N_BLOCK:
                pipe_kv.consumer_wait(_consumer(1))
                pipe_tails.producer_acquire(_one_slot(phase))
                zero_k_rows_from(buffers["sKt"][None, None, None, 0], key_tail, tidx, TAIL_THREADS)
                cute.arch.fence_view_async_shared()
                pipe_tails.producer_commit(_one_slot(phase))
                phase ^= 1
            q_state, do_state = _consumer(Q_STAGES), _consumer(self.cfg.do_stages)
            for i in cutlass.range(tile.steps, unroll=1):
                q_tail = self._query_tail(tile, i)
                if q_tail < M_BLOCK:
                    pipe_issued.consumer_wait(_one_slot(issued_phase))
                    pipe_issued.consumer_release(_one_slot(issued_phase))
                    issued_phase ^= 1
                    pipe_q.consumer_wait(q_state)
                    pipe_do.consumer_wait(do_state)
                    pipe_tails.producer_acquire(_one_slot(phase))
                    zero_k_rows_from(buffers["sQt"][None, None, None, q_state.index], q_tail, tidx, TAIL_THREADS)
                    zero_k_rows_from(buffers["sdOt"][None, None, None, do_state.index], q_tail, tidx, TAIL_THREADS)
                    cute.arch.fence_view_async_shared()
                    pipe_tails.producer_commit(_one_slot(phase))
                    phase ^= 1
                q_state.advance()
                do_state.advance()

    @cute.jit
    def _wait_tails(self, pipe_tails, phase):
        """The MMA warp's side of `tail_warps`: the next zeroing has landed (it reads those tiles next); returns the
        next phase."""
        pipe_tails.consumer_wait(_one_slot(phase))
        pipe_tails.consumer_release(_one_slot(phase))
        return phase ^ 1

    # ------------------------------------------------------------------------------------------------------------
    # MMA warp
    # ------------------------------------------------------------------------------------------------------------
    def _acc(self, tiled_mma, tiler, tmem_ptr, offset):
        """The (MMA, MMA_M, MMA_N) accumulator of `tiled_mma` at TMEM column `offset`."""
        thr = tiled_mma.get_slice(0)
        layout = thr.make_fragment_C(thr.partition_shape_C(tiler[:2])).layout
        return cute.make_tensor(tmem_ptr + offset, layout)

    @cute.jit
    def mma_warp(self, mmas: Mmas, buffers, tmem_ptr, pipes: Pipes, tile: KeyTile):
        tSrK = mmas.s.make_fragment_A(buffers["sK"])
        tSrQ = mmas.s.make_fragment_B(buffers["sQ"])
        tPrV = mmas.dp.make_fragment_A(buffers["sV"])
        tPrdO = mmas.dp.make_fragment_B(buffers["sdO"])
        tVrdOt = mmas.dv.make_fragment_B(buffers["sdOt"])
        tKrdSt = mmas.dk.make_fragment_A(buffers["sdSt"])
        tKrQt = mmas.dk.make_fragment_B(buffers["sQt"])
        tQrdS = mmas.dq.make_fragment_A(buffers["sdS"])
        tQrKt = mmas.dq.make_fragment_B(buffers["sKt"])
        # P^T as the TMEM A operand of dV += P^T dO, in the input dtype, over the first half of S^T's columns.
        p_frag = mmas.dv.make_fragment_A(cute.make_tensor(tmem_ptr, buffers["tP_layout"].outer))[None, None, None, 0]
        tVrP = cute.make_tensor(cute.recast_ptr(tmem_ptr + self.tmem_s, dtype=p_frag.element_type), p_frag.layout)
        tStS = self._acc(mmas.s, self.tiler_s, tmem_ptr, self.tmem_s)
        tPtP = self._acc(mmas.dp, self.tiler_s, tmem_ptr, self.tmem_dp)
        tVtV = self._acc(mmas.dv, self.tiler_dkv, tmem_ptr, self.tmem_dv)
        tKtK = self._acc(mmas.dk, self.tiler_dkv, tmem_ptr, self.tmem_dk)
        tQtQ = self._acc(mmas.dq, self.tiler_dq, tmem_ptr, self.tmem_dq)

        # Pipelines by name: `pipes.x.f()` inside runtime control flow would make the DSL carry `pipes` through it.
        pipe_kv, pipe_q, pipe_do, pipe_dkv = pipes.kv, pipes.q, pipes.do, pipes.dkv
        ops = MmaOperands(
            tSrK, tSrQ, tStS, tPrV, tPrdO, tPtP, tVrP, tVrdOt, tVtV, tKrdSt, tKrQt, tKtK, tQrdS, tQrKt, tQtQ
        )
        kv_state, q_state, do_state = _consumer(1), _consumer(Q_STAGES), _consumer(self.cfg.do_stages)
        s_state, dp_state, dq_state, dkv_state = _producer(1), _producer(1), _producer(1), _producer(1)
        p_state, ds_state = _consumer(1), _consumer(1)
        q_done = _consumer(Q_STAGES)  # the slot of Q(i-1), freed after dK(i-1)
        pipe_tails = pipes.tails
        tails_phase = Int32(0)
        if tile.steps > 0:
            pipe_kv.consumer_wait(kv_state)
            if const_expr(self.varlen):
                if self._key_tail(tile) < N_BLOCK:
                    tails_phase = self._wait_tails(pipe_tails, tails_phase)
            pipe_q.consumer_wait(q_state)
            if const_expr(self.varlen):
                if self._query_tail(tile, 0) < M_BLOCK:
                    tails_phase = self._wait_tails(pipe_tails, tails_phase)
            self._qk(mmas, ops, pipes, s_state, q_state.index)
            q_state.advance()
            s_state.advance()
            pipe_do.consumer_wait(do_state)
            self._dp_dv(mmas, ops, pipes, dq_state, dp_state, p_state, do_state.index, False)
            pipe_do.consumer_release(do_state)
            do_state.advance()
            dp_state.advance()
            p_state.advance()
            for i in cutlass.range(1, tile.steps, unroll=1):
                pipe_q.consumer_wait(q_state)
                if const_expr(self.varlen):
                    if self._query_tail(tile, i) < M_BLOCK:
                        tails_phase = self._wait_tails(pipe_tails, tails_phase)
                self._qk(mmas, ops, pipes, s_state, q_state.index)
                q_state.advance()
                s_state.advance()
                self._dq_dk(mmas, ops, pipes, ds_state, dq_state, q_done.index, i > 1)
                pipe_q.consumer_release(q_done)
                q_done.advance()
                ds_state.advance()
                dq_state.advance()
                pipe_do.consumer_wait(do_state)
                self._dp_dv(mmas, ops, pipes, dq_state, dp_state, p_state, do_state.index, True)
                pipe_do.consumer_release(do_state)
                do_state.advance()
                dp_state.advance()
                p_state.advance()
            self._dq_dk(mmas, ops, pipes, ds_state, dq_state, q_done.index, tile.steps > 1)
            pipe_q.consumer_release(q_done)
            pipe_dkv.producer_acquire(dkv_state)
            pipe_dkv.producer_commit(dkv_state)  # tracks every MMA issued before it: dK and dV are final
            pipe_kv.consumer_release(kv_state)

    @cute.jit
    def _qk(self, mmas: Mmas, ops, pipes: Pipes, s_state, q_index):
        """S^T = K Q^T into TMEM."""
        pipes.s.producer_acquire(s_state)
        fence_after_thread_sync()
        gemm(mmas.s, ops.tStS, ops.tSrK[None, None, None, 0], ops.tSrQ[None, None, None, q_index], False)
        pipes.s.producer_commit(s_state)

    @cute.jit
    def _dp_dv(self, mmas: Mmas, ops, pipes: Pipes, dq_state, dp_state, p_state, do_index, accumulate):
        """dP^T = V dO^T, then (once P^T is in TMEM) dV += P^T dO."""
        pipes.dq.producer_acquire(dq_state)  # dP^T overwrites dQ(i-1): read out by the dQ warps
        pipes.dp.producer_acquire(dp_state)
        fence_after_thread_sync()
        gemm(mmas.dp, ops.tPtP, ops.tPrV[None, None, None, 0], ops.tPrdO[None, None, None, do_index], False)
        pipes.dp.producer_commit(dp_state)
        pipes.p.consumer_wait(p_state)
        fence_after_thread_sync()
        gemm(mmas.dv, ops.tVtV, ops.tVrP, ops.tVrdOt[None, None, None, do_index], accumulate)
        pipes.p.consumer_release(p_state)

    @cute.jit
    def _dq_dk(self, mmas: Mmas, ops, pipes: Pipes, ds_state, dq_state, q_index, accumulate):
        """Once dS^T is in shared memory: dQ = dS K into TMEM (over dP^T), dK += dS^T Q."""
        pipes.ds.consumer_wait(ds_state)
        gemm(mmas.dq, ops.tQtQ, ops.tQrdS[None, None, None, 0], ops.tQrKt[None, None, None, 0], False)
        pipes.dq.producer_commit(dq_state)
        gemm(mmas.dk, ops.tKtK, ops.tKrdSt[None, None, None, 0], ops.tKrQt[None, None, None, q_index], accumulate)
        pipes.ds.consumer_release(ds_state)

    # ------------------------------------------------------------------------------------------------------------
    # Compute warpgroups
    # ------------------------------------------------------------------------------------------------------------
    def _columns(self, acc_2d, offset_cols: int, cols: int):
        """The (128 lanes, cols) block of a 2-D TMEM accumulator view starting `offset_cols` columns further."""
        return cute.make_tensor(
            acc_2d.iterator + offset_cols, cute.composition(acc_2d.layout, cute.make_layout((M_BLOCK, cols)))
        )

    @cute.jit
    def compute_warpgroup(
        self, wg, mmas: Mmas, buffers, grads, tmem_ptr, pipes: Pipes, tile: KeyTile, blocks: BlockInfo,
        softmax_scale, softcap,
    ):  # fmt: skip
        tidx = cute.arch.thread_idx()[0] % WG_THREADS
        s_2d = self._acc(mmas.s, self.tiler_s, tmem_ptr, self.tmem_s)[(None, None), 0, 0]  # (keys, queries) fp32
        dp_2d = self._acc(mmas.dp, self.tiler_s, tmem_ptr, self.tmem_dp)[(None, None), 0, 0]
        col0 = wg * HALF  # this warpgroup's first query column
        tS = self._columns(s_2d, col0, HALF)
        load_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32)
        thr_load = tcgen05.make_tmem_copy(load_atom, tS).get_slice(tidx)
        tStS = thr_load.partition_S(tS)
        tScS = thr_load.partition_D(cute.make_identity_tensor((M_BLOCK, HALF)))
        # P^T as 32-bit words (two 16-bit probabilities each) over the first 64 columns of S^T.
        p_words = HALF * self.dtype.width // 32
        tP = self._columns(s_2d, wg * p_words, p_words)
        store_atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(p_words)), Float32)
        thr_store = tcgen05.make_tmem_copy(store_atom, tP).get_slice(tidx)
        tPtP = thr_store.partition_D(tP)
        p_shape = thr_store.partition_S(cute.make_identity_tensor((M_BLOCK, p_words))).shape
        # dP^T in two chunks of 32 columns (fewer live registers).
        chunk = 32
        tdP = [self._columns(dp_2d, col0 + c * chunk, chunk) for c in range(HALF // chunk)]
        thr_load_dp = tcgen05.make_tmem_copy(load_atom, tdP[0]).get_slice(tidx)
        dp_shape = thr_load_dp.partition_D(cute.make_identity_tensor((M_BLOCK, chunk))).shape
        # dS^T rows in shared memory: T[key, query] over dQ's MN-major A operand (queries contiguous).
        sdS = buffers["sdS"][None, None, None, 0]
        sdS_rows = cute.composition(sdS, cute.make_ordered_layout((N_BLOCK, M_BLOCK), order=(1, 0)))
        compute_barrier = pipeline.NamedBarrier(barrier_id=COMPUTE_BARRIER_ID, num_threads=COMPUTE_THREADS)

        scale_log2 = softmax_scale * LOG2_E
        pre_tanh = None
        if const_expr(self.softcap):
            pre_tanh, scale_log2 = softcap_factors(softmax_scale, softcap)
        key = tile.n_block * N_BLOCK + tidx  # this thread's key
        # This key's query columns, relative to the tile's first query: visible iff begin <= q < end.
        rel_begin = key - blocks.offset - blocks.right
        rel_end = key - blocks.offset + blocks.left + 1
        sLSE, sD = buffers["sLSE"], buffers["sD"]

        pipe_s, pipe_p, pipe_dp, pipe_ds, pipe_q = pipes.s, pipes.p, pipes.dp, pipes.ds, pipes.q
        s_state, dp_state, dkv_state = _consumer(1), _consumer(1), _consumer(1)
        p_state, ds_state = _producer(1), _producer(1)
        q_state = _consumer(Q_STAGES)  # waited on, never released here: the statistics ride with Q
        for i in cutlass.range(tile.steps, unroll=1):
            _, m_block = self._step(tile, i)
            slot = i % Q_STAGES
            q0 = m_block * M_BLOCK + col0
            # --- P^T = exp2(S^T * scale - lse) ---
            pipe_s.consumer_wait(s_state)
            fence_after_thread_sync()
            # lse_log2 and D of step i landed with Q(i): S(i) implies it, but wait on their own barrier (a wait
            # only; the MMA warp frees the slot after dK(i), which needs this step's dS).
            pipe_q.consumer_wait(q_state)
            q_state.advance()
            tSrS = cute.make_rmem_tensor(tScS.shape, Float32)
            cute.copy(thr_load, tStS, tSrS)
            cute.arch.fence_view_async_tmem_load()
            tSrT = None
            if const_expr(self.softcap):
                apply_softcap(tSrS, pre_tanh)
                tSrT = cute.make_rmem_tensor(tScS.shape, Float32)
                tSrT.store(tSrS.load())
            if blocks.tile_needs_mask(m_block, tile.n_block):
                col_end = Int32(M_BLOCK)
                if const_expr(self.has_left):
                    col_end = rel_end - q0
                if key >= tile.seqlen_k:
                    col_end = Int32(-1)
                col_begin = rel_begin - q0
                mask_row(tSrS, tScS, col_end, col_begin, self.has_right)
            for j in cutlass.range_constexpr(0, cute.size(tSrS), 2):
                c = tScS[j][1]
                lse = (sLSE[col0 + c, slot], sLSE[col0 + c + 1, slot])
                tSrS[j], tSrS[j + 1] = cute.arch.fma_packed_f32x2(
                    (tSrS[j], tSrS[j + 1]), (scale_log2, scale_log2), (-lse[0], -lse[1])
                )
                tSrS[j] = cute.math.exp2(tSrS[j], fastmath=True)
                tSrS[j + 1] = cute.math.exp2(tSrS[j + 1], fastmath=True)
            tSrP_words = cute.make_rmem_tensor(p_shape, Float32)
            tSrP = cute.make_tensor(cute.recast_ptr(tSrP_words.iterator, dtype=self.dtype), tSrS.layout)
            tSrP.store(tSrS.load().to(self.dtype))
            fence_before_thread_sync()
            compute_barrier.arrive_and_wait()  # every S^T read (P^T overwrites the other warpgroup's columns)
            fence_after_thread_sync()
            pipe_p.producer_acquire(p_state)
            cute.copy(thr_store, tSrP_words, tPtP)
            cute.arch.fence_view_async_tmem_store()
            fence_before_thread_sync()
            pipe_p.producer_commit(p_state)
            p_state.advance()
            pipe_s.consumer_release(s_state)
            s_state.advance()
            # --- dS^T = P^T (dP^T - D) ---
            pipe_dp.consumer_wait(dp_state)
            fence_after_thread_sync()
            pipe_ds.producer_acquire(ds_state)
            for c in cutlass.range_constexpr(HALF // chunk):
                tdPr = cute.make_rmem_tensor(dp_shape, Float32)
                cute.copy(thr_load_dp, thr_load_dp.partition_S(tdP[c]), tdPr)
                for j in cutlass.range_constexpr(0, chunk, 2):
                    col = col0 + c * chunk + j
                    tdPr[j], tdPr[j + 1] = cute.arch.add_packed_f32x2(
                        (tdPr[j], tdPr[j + 1]), (-sD[col, slot], -sD[col + 1, slot])
                    )
                    tdPr[j], tdPr[j + 1] = cute.arch.mul_packed_f32x2(
                        (tdPr[j], tdPr[j + 1]), (tSrS[c * chunk + j], tSrS[c * chunk + j + 1])
                    )
                    if const_expr(self.softcap):
                        t0, t1 = tSrT[c * chunk + j], tSrT[c * chunk + j + 1]
                        tdPr[j], tdPr[j + 1] = cute.arch.mul_packed_f32x2(
                            (tdPr[j], tdPr[j + 1]), (1.0 - t0 * t0, 1.0 - t1 * t1)
                        )
                dS = cute.make_rmem_tensor((chunk,), self.dtype)
                dS.store(tdPr.load().to(self.dtype))
                if const_expr(self.varlen):
                    if key >= tile.seqlen_k:  # (its dP^T read the rows past the sequence: tail_warps)
                        dS.fill(0.0)
                row = sdS_rows[tidx, None]
                cute.autovec_copy(dS, cute.logical_divide(row, cute.make_layout(chunk))[None, (col0 // chunk) + c])
            cute.arch.fence_view_async_tmem_load()
            fence_before_thread_sync()
            pipe_dp.consumer_release(dp_state)
            dp_state.advance()
            cute.arch.fence_view_async_shared()  # dS^T visible to the tensor core (async proxy)
            pipe_ds.producer_commit(ds_state)
            ds_state.advance()
        self._write_dkv(wg, tidx, mmas, grads, tmem_ptr, pipes, dkv_state, tile, softmax_scale)

    @cute.jit
    def _write_dkv(self, wg, tidx, mmas: Mmas, grads, tmem_ptr, pipes: Pipes, dkv_state, tile: KeyTile, softmax_scale):
        """dV, then dK * softmax_scale, TMEM -> global for this thread's key row and this warpgroup's half of the
        head dim; zeros for a key tile no query sees."""
        mdK, mdV = grads
        pipe_dkv = pipes.dkv
        half = self.d // 2
        key = tile.n_block * N_BLOCK + tidx
        if tile.steps > 0:
            pipe_dkv.consumer_wait(dkv_state)
            fence_after_thread_sync()
        load_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(half)), Float32)
        for name, offset, scale in (("dv", self.tmem_dv, None), ("dk", self.tmem_dk, softmax_scale)):
            acc_2d = self._acc(mmas.dv, self.tiler_dkv, tmem_ptr, offset)[(None, None), 0, 0]
            tA = self._columns(acc_2d, wg * half, half)
            thr = tcgen05.make_tmem_copy(load_atom, tA).get_slice(tidx)
            frag = cute.make_rmem_tensor(thr.partition_D(cute.make_identity_tensor((N_BLOCK, half))).shape, Float32)
            if tile.steps > 0:
                cute.copy(thr, thr.partition_S(tA), frag)
                if const_expr(scale is not None):
                    for j in cutlass.range_constexpr(0, cute.size(frag), 2):
                        frag[j], frag[j + 1] = cute.arch.mul_packed_f32x2((frag[j], frag[j + 1]), (scale, scale))
            else:
                frag.fill(0.0)
            out = cute.make_rmem_tensor((half,), self.dtype)
            out.store(frag.load().to(self.dtype))
            dst = mdV if name == "dv" else mdK
            if key < tile.seqlen_k:
                row = dst[tile.row_k + key, None, tile.head_kv, tile.batch]
                cute.autovec_copy(out, cute.logical_divide(row, cute.make_layout(half))[None, wg])
        if tile.steps > 0:
            cute.arch.fence_view_async_tmem_load()
            pipe_dkv.consumer_release(dkv_state)

    # ------------------------------------------------------------------------------------------------------------
    # dQ warpgroup
    # ------------------------------------------------------------------------------------------------------------
    @cute.jit
    def dq_warpgroup(
        self, warp_idx, mmas: Mmas, tma_dq, sdQ, tmem_ptr, pipes: Pipes, tile: KeyTile, blocks: BlockInfo, mdQsem
    ):
        atom_dq, mdQ = tma_dq
        tidx = cute.arch.thread_idx()[0] % WG_THREADS
        dq_2d = self._acc(mmas.dq, self.tiler_dq, tmem_ptr, self.tmem_dq)[(None, None), 0, 0]  # (queries, d)
        load_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(DQ_COLS)), Float32)
        tQ = [self._columns(dq_2d, c * DQ_COLS, DQ_COLS) for c in range(self.d // DQ_COLS)]
        thr = tcgen05.make_tmem_copy(load_atom, tQ[0]).get_slice(tidx)
        frag_shape = thr.partition_D(cute.make_identity_tensor((M_BLOCK, DQ_COLS))).shape
        barrier = pipeline.NamedBarrier(barrier_id=DQ_BARRIER_ID, num_threads=WG_THREADS)
        issuer = warp_idx == DQ_WARP0
        pipe_dq = pipes.dq
        dq_state = _consumer(1)
        slot = Int32(0)
        for i in cutlass.range(tile.steps, unroll=1):
            head, m_block = self._step(tile, i)
            gdQ = cute.local_tile(self._head_rows(mdQ, head, tile, tile.row_stats), (M_BLOCK, DQ_COLS), (None, None))
            tDsD, tDgD = cpasync.tma_partition(
                atom_dq, 0, cute.make_layout(1), cute.group_modes(sdQ, 0, 2), cute.group_modes(gdQ, 0, 2)
            )
            pipe_dq.consumer_wait(dq_state)
            fence_after_thread_sync()
            for c in cutlass.range_constexpr(self.d // DQ_COLS):
                frag = cute.make_rmem_tensor(frag_shape, Float32)
                cute.copy(thr, thr.partition_S(tQ[c]), frag)
                if const_expr(c == self.d // DQ_COLS - 1):
                    cute.arch.fence_view_async_tmem_load()
                    fence_before_thread_sync()
                    pipe_dq.consumer_release(dq_state)
                if issuer:
                    cute.arch.cp_async_bulk_wait_group(DQ_SLOTS - 1, read=True)  # this slot's last reduce has read it
                barrier.arrive_and_wait()
                flat = cute.make_tensor(frag.iterator, cute.make_layout(DQ_COLS))
                cute.autovec_copy(flat, sdQ[tidx, None, slot])
                cute.arch.fence_view_async_shared()  # visible to the TMA unit
                barrier.arrive_and_wait()
                if issuer:
                    if const_expr(self.deterministic and c == 0):
                        self._wait_turn(mdQsem, blocks, tile, head, m_block)
                    cute.copy(atom_dq, tDsD[None, slot], tDgD[None, m_block, c])
                    cute.arch.cp_async_bulk_commit_group()
                    if const_expr(self.deterministic and c == self.d // DQ_COLS - 1):
                        cute.arch.cp_async_bulk_wait_group(0, read=False)  # the adds are done, not only their reads
                        cute.arch.fence_proxy("async.global")  # ... and visible to the generic-proxy release below
                        with cute.arch.elect_one():
                            add_release_gpu(self._semaphore(mdQsem, tile, head, m_block), Int32(1))
                slot = (slot + 1) % DQ_SLOTS
            dq_state.advance()
        if issuer:
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # sdQ stays valid until the last reduce has read it

    @cute.jit
    def _wait_turn(self, mdQsem, blocks: BlockInfo, tile: KeyTile, head, m_block):
        """Deterministic builds: wait until the key tiles before this one that see query tile m_block have added
        their dQ (the semaphore counts them; every key tile of kv_block_range(m_block) sees it)."""
        sem = self._semaphore(mdQsem, tile, head, m_block)
        turn = tile.n_block - blocks.kv_block_range(m_block)[0]
        while load_acquire_gpu(sem) != turn:
            pass
        cute.arch.fence_proxy("async.global")  # the adds after this are async-proxy accesses

    def _semaphore(self, mdQsem, tile: KeyTile, head, m_block):
        """The dQ semaphore of (head, query tile m_block): one per tile of the (b, h, tiles) buffer; packed builds:
        from the sequence's padded offset / 128 of the (1, h, rows / 128) one."""
        first = tile.row_stats // M_BLOCK if const_expr(self.varlen) else 0
        return mdQsem[tile.batch, head, None].iterator + (first + m_block)

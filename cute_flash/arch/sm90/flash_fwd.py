"""The sm90 forward kernel: FlashAttention-3's Hopper design (TMA producer, wgmma consumers, ping-pong) in CuTe DSL.

One CTA computes `tile_m = 64 * num_consumer_wgs` query rows of one (batch, head):

  warpgroup 0 (producer, setmaxnreg.dec): warp 0 issues TMA loads of each consumer's 64-row Q slice once, then
      K and V tiles through `num_stages`-deep mbarrier rings, from the last key block down to the first.
  warpgroups 1.. (consumers, setmaxnreg.inc): consumer c owns query rows [64 c, 64 c + 64). Per key block j:
      S = Q·K_jᵀ by SS wgmma, mask (only on boundary blocks), online softmax, P_j converted in registers and
      O += P_j·V_j by RS wgmma (A from registers). Intra-warpgroup overlap: Q·K_{j-1}ᵀ and P_j·V_j are issued
      together, and the softmax of block j-1 runs while P_j·V_j is still on the tensor cores. Ping-pong: named
      barriers let the consumers issue their GEMMs in turn, so one's softmax overlaps the other's GEMMs.
  epilogue (per consumer): O normalised in registers, stored with stmatrix into the consumer's own Q slice of
      shared memory (its wgmmas are done reading it; each slice is max(d, dv) columns wide, so O fits whichever
      is wider) and written with one TMA store (clipped at seqlen_q); LSE straight from registers.

Global tensors are viewed as (seqlen, head_dim, heads, batch) so that TMA boxes never cross a (batch, head): rows past
seqlen are out of bounds of their own dimension, zero-filled on load and clipped on store. GQA/MQA index the K/V head
as head // (heads // heads_kv).
"""

from __future__ import annotations

from functools import partial
from typing import Type

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
import cutlass.utils.hopper_helpers as sm90_utils

from ...common.acc_views import rows_cols_view
from ...common.block_info import BlockInfo
from ...common.block_walk import walk_kv_blocks
from ...common.mask import apply_mask
from ...common.online_softmax import LOG2_E, OnlineSoftmax
from .barriers import WarpGroupTurns
from .cta import CtaWork, cta_work
from .epilogue import store_o_and_lse
from .loads import load_q_k_v
from .pipelines import consumer_state, consumer_wait, make_load_pipelines
from .tile_config import ROWS_PER_CONSUMER, WARPGROUP_THREADS, FwdTileConfig
from .views import seq_major_view, stats_view
from . import wgmma

SMEM_ALIGN = 1024  # 128-byte swizzle atoms repeat every 1 KiB


def _one(layout):
    """One stage (or one consumer slice) of a staged shared-memory layout."""
    return cute.select(layout, mode=[0, 1])


class Sm90FlashForward:
    """Callable compiled once per (dtype, head dims, mask kind, tile config); shapes and strides are runtime."""

    def __init__(
        self,
        dtype: Type[cutlass.Numeric],
        head_dim: int,
        head_dim_v: int,
        mask_kind: str,
        cfg: FwdTileConfig,
    ):
        assert dtype in (cutlass.BFloat16, cutlass.Float16)
        self.dtype = dtype
        self._init_cta(head_dim, head_dim_v, mask_kind, cfg)
        # O reuses each consumer's Q slice: one slot per consumer, as wide as the wider of the two, so that a consumer
        # writing its O never touches the Q another consumer may still be reading (head_dim != head_dim_v).
        self.slice_elems = ROWS_PER_CONSUMER * max(head_dim, head_dim_v)

    def _init_cta(self, head_dim: int, head_dim_v: int, mask_kind: str, cfg: FwdTileConfig) -> None:
        """What every sm90 forward kernel (this one and the FP8 subclass) knows about its CTA."""
        assert mask_kind in ("none", "causal", "local")
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.mask_kind = mask_kind
        self.causal = mask_kind == "causal"
        self.local = mask_kind == "local"
        self.cfg = cfg
        self.num_consumers = cfg.num_consumer_wgs
        self.tile_m = cfg.tile_m
        self.tile_n = cfg.tile_n
        self.num_stages = cfg.num_stages

    def tma_atoms(self, mQ, mK, mV, mO, sQ_layout, sK_layout, sV_layout, sO_layout, v_box):
        """TMA atoms and coordinate tensors: loads of one Q slice, one K and one V stage (`v_box`: the V tile as the
        kernel stores it), the store of one O slice."""
        rows = ROWS_PER_CONSUMER
        load = cpasync.CopyBulkTensorTileG2SOp()
        atom_q, tma_q = cpasync.make_tiled_tma_atom(load, mQ, _one(sQ_layout), (rows, self.head_dim))
        atom_k, tma_k = cpasync.make_tiled_tma_atom(load, mK, _one(sK_layout), (self.tile_n, self.head_dim))
        atom_v, tma_v = cpasync.make_tiled_tma_atom(load, mV, _one(sV_layout), v_box)
        atom_o, tma_o = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, _one(sO_layout), (rows, self.head_dim_v)
        )
        return (atom_q, atom_k, atom_v, atom_o), (tma_q, tma_k, tma_v, tma_o)

    def launch_shape(self, mQ: cute.Tensor) -> dict:
        """Grid (query tiles, heads, batch) and block of the launch."""
        num_m_blocks = cute.ceil_div(mQ.shape[0], self.tile_m)
        return dict(
            grid=[num_m_blocks, cute.size(mQ.shape[2]), cute.size(mQ.shape[3])],
            block=[self.cfg.num_threads, 1, 1],
            min_blocks_per_mp=1,
        )

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, sq, h, d)
        mK: cute.Tensor,  # (b, sk, h_kv, d)
        mV: cute.Tensor,  # (b, sk, h_kv, dv)
        mO: cute.Tensor,  # (b, sq, h, dv)
        mLSE: cute.Tensor,  # (b, h, sq) fp32
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        stream: cuda.CUstream,
    ):
        mQ, mK, mV, mO = [seq_major_view(t) for t in (mQ, mK, mV, mO)]
        mLSE = stats_view(mLSE)  # (sq, h, b)

        rows = ROWS_PER_CONSUMER
        sQ_layout = wgmma.k_major_smem_layout(self.dtype, rows, self.head_dim, self.num_consumers, self.slice_elems)
        sK_layout = wgmma.k_major_smem_layout(self.dtype, self.tile_n, self.head_dim, self.num_stages)
        sV_layout = wgmma.k_major_smem_layout(self.dtype, self.tile_n, self.head_dim_v, self.num_stages)
        sO_layout = wgmma.k_major_smem_layout(self.dtype, rows, self.head_dim_v, self.num_consumers, self.slice_elems)

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K,
            Float32,
            atom_layout_mnk=(1, 1, 1),
            tiler_mn=(rows, self.tile_n),
        )
        # B = Vᵀ (dv x keys) with dv contiguous: MN-major. A = P from registers.
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.MN,
            Float32,
            atom_layout_mnk=(1, 1, 1),
            tiler_mn=(rows, self.head_dim_v),
            a_source=warpgroup.OperandSource.RMEM,
        )

        atoms, tmas = self.tma_atoms(
            mQ, mK, mV, mO, sQ_layout, sK_layout, sV_layout, sO_layout, (self.tile_n, self.head_dim_v)
        )
        # Every consumer's slice, one barrier (not the layout's cosize: slices may be spaced wider than Q).
        self.bytes_q = cute.size_in_bytes(self.dtype, _one(sQ_layout)) * self.num_consumers
        self.bytes_k = cute.size_in_bytes(self.dtype, _one(sK_layout))
        self.bytes_v = cute.size_in_bytes(self.dtype, _one(sV_layout))

        q_elems = self.slice_elems * self.num_consumers

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, q_elems], SMEM_ALIGN]  # Q, then O
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], SMEM_ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], SMEM_ALIGN]

        layouts = (sQ_layout, sK_layout, sV_layout, sO_layout)
        self.kernel(
            tmas,
            mLSE,
            atoms,
            (tiled_mma_qk, tiled_mma_pv),
            layouts,
            softmax_scale,
            window_left,
            window_right,
            SharedStorage,
        ).launch(stream=stream, **self.launch_shape(mQ))

    @cute.kernel
    def kernel(
        self,
        tmas,  # TMA coordinate tensors of Q, K, V, O: (s, d, h, b)
        mLSE: cute.Tensor,  # (sq, h, b) fp32
        atoms,  # their TMA atoms
        mmas,  # (Q·Kᵀ, P·V) tiled MMAs
        layouts,  # shared-memory layouts of Q, K, V, O
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        SharedStorage: cutlass.Constexpr,
    ):
        mQ, mK, mV, mO = tmas
        atom_q, atom_k, atom_v, atom_o = atoms
        tiled_mma_qk, tiled_mma_pv = mmas
        sQ_layout, sK_layout, sV_layout, sO_layout = layouts
        warp_idx, tidx, storage, pipes = self.prologue((atom_q, atom_k, atom_v, atom_o), SharedStorage)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)  # see slice_elems

        self.run_roles(
            warp_idx,
            tidx,
            pipes,
            (atom_q, atom_k, atom_v),
            (mQ, mK, mV),
            (sQ, sK, sV),
            window_left,
            window_right,
            partial(self.consume, pipes, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, sO, mO, mLSE, atom_o, softmax_scale),
        )

    @cute.jit
    def prologue(self, atoms, SharedStorage: cutlass.Constexpr):
        """Descriptor prefetch, shared memory, the Q / K / V load rings (their init made visible later by
        pipeline_init_wait): the start every sm90 forward kernel shares."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        pipes = make_load_pipelines(
            storage.mbar_q.data_ptr(),
            storage.mbar_k.data_ptr(),
            storage.mbar_v.data_ptr(),
            num_stages=self.num_stages,
            num_consumer_threads=self.num_consumers * WARPGROUP_THREADS,
            q_bytes=self.bytes_q,
            k_bytes=self.bytes_k,
            v_bytes=self.bytes_v,
        )
        pipeline.pipeline_init_arrive(is_relaxed=True)
        return warp_idx, tidx, storage, pipes

    @cute.jit
    def run_roles(
        self,
        warp_idx: Int32,
        tidx: Int32,
        pipes,
        atoms,
        gmem,
        smem,
        window_left: Int32,
        window_right: Int32,
        consume: cutlass.Constexpr,
    ):
        """This CTA's work; then warpgroup 0 gives registers away and its warp 0 loads (atoms, gmem, smem: those of
        Q, K and V), while the others take them and consume(work, consumer index, thread index within the
        warpgroup, warp index within it)."""
        work = cta_work(gmem[0], gmem[1], self.tile_m, self.tile_n, self.mask_kind, window_left, window_right)

        pipeline.pipeline_init_wait()

        warp_group = warp_idx // 4
        if warp_group == 0:
            cute.arch.setmaxregister_decrease(self.cfg.producer_regs)
            if warp_idx == 0:
                self.produce(pipes, atoms, gmem, smem, work)
        else:
            cute.arch.setmaxregister_increase(self.cfg.consumer_regs)
            consumer = warp_group - 1
            consume(work, consumer, tidx % WARPGROUP_THREADS, warp_idx % 4)

    def v_tiles(self, mV: cute.Tensor, head_kv: Int32, batch: Int32) -> cute.Tensor:
        """This (batch, KV head)'s V tiles as the producer loads them, tile index last: (tile_n, dv, tiles)."""
        return cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, self.head_dim_v), (None, 0))

    @cute.jit
    def produce(self, pipes, atoms, gmem, smem, work: CtaWork):
        """The producer warp: Q once, then the K and V tiles of work's key range (loads.load_q_k_v)."""
        atom_q, atom_k, atom_v = atoms
        mQ, mK, mV = gmem
        sQ, sK, sV = smem
        m_block, head, head_kv, batch, _, _, n_min, n_max = work
        rows = ROWS_PER_CONSUMER
        gQ = cute.local_tile(mQ[None, None, head, batch], (rows, self.head_dim), (None, 0))
        gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.head_dim), (None, 0))
        gV = self.v_tiles(mV, head_kv, batch)
        load_q_k_v(
            pipes,
            atom_q,
            atom_k,
            atom_v,
            gQ,
            gK,
            gV,
            sQ,
            sK,
            sV,
            m_block * self.num_consumers,
            self.num_consumers,
            self.num_stages,
            n_min,
            n_max,
        )

    @cute.jit
    def consume(
        self,
        pipes,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sO: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        atom_o: cute.CopyAtom,
        softmax_scale: Float32,
        work: CtaWork,
        consumer: Int32,
        tidx: Int32,
        warp_in_wg: Int32,
    ):
        m_block, head, _, batch, seqlen_q, info, n_min, n_max = work
        rows = ROWS_PER_CONSUMER
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        sVt = cute.composition(
            sV, cute.make_ordered_layout((self.head_dim_v, self.tile_n, self.num_stages), order=(1, 0, 2))
        )
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))  # (MMA, 1, k-blocks, consumer)
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))  # (MMA, 1, k-blocks, stage)
        tOrVt = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))  # (MMA, 1, key k-blocks, stage)
        tOrP = thr_pv.make_fragment_A(thr_pv.partition_shape_A((rows, self.tile_n)))
        acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((rows, self.head_dim_v)), Float32)
        acc_O.fill(0.0)

        coords_rc, coords0_rc = self.score_coords(tiled_mma_qk, thr_qk, consumer)

        softmax = OnlineSoftmax.create(softmax_scale * LOG2_E, cute.size(rows_cols_view(acc_O), mode=[0]))
        turns = WarpGroupTurns(consumer, self.num_consumers, self.cfg.ping_pong)
        turns.prime()

        if n_max > n_min:
            self.mainloop(
                pipes,
                tiled_mma_qk,
                tiled_mma_pv,
                tSrQ[None, None, None, consumer],
                tSrK,
                tOrVt,
                tOrP,
                acc_O,
                softmax,
                turns,
                info,
                m_block,
                n_min,
                n_max,
                coords_rc,
                coords0_rc,
            )

        row_scale, lse = softmax.finalize()
        softmax.rescale(rows_cols_view(acc_O), row_scale)
        store_o_and_lse(
            acc_O,
            lse,
            self.dtype,
            self.head_dim_v,
            tiled_mma_pv,
            thr_pv,
            sO,
            mO,
            mLSE,
            atom_o,
            m_block * self.num_consumers + consumer,
            head,
            batch,
            seqlen_q,
            consumer,
            tidx,
            warp_in_wg,
        )

    def score_coords(self, tiled_mma_qk: cute.TiledMma, thr_qk, consumer: Int32):
        """(row, col) coordinates of this thread's scores within the CTA tile (rows offset by this consumer's slice),
        and thread 0's within a consumer tile (compile-time constants): what the mask compares."""
        rows = ROWS_PER_CONSUMER
        coords = cute.local_tile(
            cute.make_identity_tensor((self.tile_m, self.tile_n)), (rows, self.tile_n), (consumer, 0)
        )
        coords_rc = rows_cols_view(thr_qk.partition_C(coords))
        coords0_rc = rows_cols_view(
            tiled_mma_qk.get_slice(0).partition_C(cute.make_identity_tensor((rows, self.tile_n)))
        )
        return coords_rc, coords0_rc

    @cute.jit
    def first_scores(self, pipes, tiled_mma_qk, tSrQ, tSrK, kv, s_shape: cutlass.Constexpr, mask, n_first: Int32):
        """S of the right-most key tile (the seqlen_k tail and the diagonal live there), alone and masked."""
        consumer_wait(pipes.k, kv)
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        wgmma.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv.index], zero_init=True, wait=0)
        pipes.k.consumer_release(kv)
        mask(acc_S, n_first, True, self.causal or self.local)
        return acc_S

    @cute.jit
    def overlapped_gemms(
        self,
        kv: pipeline.PipelineState,
        n_block: Int32,
        mask_window: cutlass.Constexpr[bool],
        pipes,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tSrQ: cute.Tensor,
        tSrK: cute.Tensor,
        tOrVt: cute.Tensor,
        tOrP: cute.Tensor,
        acc_PV: cute.Tensor,
        pv_zero_init: cutlass.Constexpr[bool],
        s_shape: cutlass.Constexpr,
        turns: WarpGroupTurns,
        mask: cutlass.Constexpr,
    ):
        """S_n = Q·K_nᵀ issued together with P_{n+1}·V_{n+1} (into acc_PV), in this consumer's turn; returns once S_n
        is ready and masked (P·V may still run), with the K/V state of n and the V state of n + 1."""
        kv_v = kv.clone()  # the V stage of the previous (right-hand) block
        kv.advance()
        consumer_wait(pipes.k, kv)
        turns.wait_turn()
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        wgmma.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv.index], zero_init=True, wait=-1)
        consumer_wait(pipes.v, kv_v)
        wgmma.gemm(tiled_mma_pv, acc_PV, tOrP, tOrVt[None, None, None, kv_v.index], zero_init=pv_zero_init, wait=-1)
        turns.pass_turn()
        warpgroup.wait_group(1)  # S is ready; P·V may still run
        pipes.k.consumer_release(kv)
        if const_expr(mask_window):
            mask(acc_S, n_block, False, True)
        return kv, kv_v, acc_S

    @cute.jit
    def mainloop(
        self,
        pipes,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tSrQ: cute.Tensor,
        tSrK: cute.Tensor,
        tOrVt: cute.Tensor,
        tOrP: cute.Tensor,
        acc_O: cute.Tensor,
        softmax: OnlineSoftmax,
        turns: WarpGroupTurns,
        info: BlockInfo,
        m_block: Int32,
        n_min: Int32,
        n_max: Int32,
        coords_rc: cute.Tensor,
        coords0_rc: cute.Tensor,
    ):
        """All key blocks of one CTA tile, right to left, for one consumer warpgroup."""
        consumer_wait(pipes.q, consumer_state(1))
        kv = consumer_state(self.num_stages)
        s_shape = tiled_mma_qk.get_slice(0).partition_shape_C((ROWS_PER_CONSUMER, self.tile_n))

        mask = partial(self.mask_scores, coords_rc=coords_rc, coords0_rc=coords0_rc, info=info, m_block=m_block)

        n_first = n_max - 1
        acc_S = self.first_scores(pipes, tiled_mma_qk, tSrQ, tSrK, kv, s_shape, mask, n_first)
        softmax.update(rows_cols_view(acc_S), is_first=True)
        wgmma.store_p_operand(acc_S, tOrP)

        step = partial(
            self.step,
            pipes=pipes,
            tiled_mma_qk=tiled_mma_qk,
            tiled_mma_pv=tiled_mma_pv,
            tSrQ=tSrQ,
            tSrK=tSrK,
            tOrVt=tOrVt,
            tOrP=tOrP,
            acc_O=acc_O,
            s_shape=s_shape,
            softmax=softmax,
            turns=turns,
            mask=mask,
        )

        # Then the rest, right to left; only blocks crossing a window edge pay for masking.
        kv = walk_kv_blocks(info, m_block, n_min, n_first, step, kv)

        # The last P·V.
        consumer_wait(pipes.v, kv)
        wgmma.gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, kv.index], zero_init=False, wait=0)
        pipes.v.consumer_release(kv)

    @staticmethod
    @cute.jit
    def mask_scores(
        acc_S: cute.Tensor,
        n_block: Int32,
        mask_seqlen: cutlass.Constexpr[bool],
        mask_window: cutlass.Constexpr[bool],
        coords_rc: cute.Tensor,
        coords0_rc: cute.Tensor,
        info: BlockInfo,
        m_block: Int32,
    ):
        apply_mask(rows_cols_view(acc_S), coords_rc, coords0_rc, info, m_block, n_block, mask_seqlen, mask_window)

    @cute.jit
    def step(
        self,
        kv: pipeline.PipelineState,
        n_block: Int32,
        mask_window: cutlass.Constexpr[bool],
        pipes,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tSrQ: cute.Tensor,
        tSrK: cute.Tensor,
        tOrVt: cute.Tensor,
        tOrP: cute.Tensor,
        acc_O: cute.Tensor,
        s_shape: cutlass.Constexpr,
        softmax: OnlineSoftmax,
        turns: WarpGroupTurns,
        mask: cutlass.Constexpr,
    ) -> pipeline.PipelineState:
        """S_n = Q·K_nᵀ issued together with O += P_{n+1}·V_{n+1}; the softmax of S_n overlaps that P·V."""
        kv, kv_v, acc_S = self.overlapped_gemms(
            kv,
            n_block,
            mask_window,
            pipes,
            tiled_mma_qk,
            tiled_mma_pv,
            tSrQ,
            tSrK,
            tOrVt,
            tOrP,
            acc_O,
            False,
            s_shape,
            turns,
            mask,
        )
        row_scale = softmax.update(rows_cols_view(acc_S), is_first=False)
        warpgroup.wait_group(0)  # P·V done: the P registers and the V stage are free, O may be rescaled
        pipes.v.consumer_release(kv_v)
        wgmma.store_p_operand(acc_S, tOrP)
        softmax.rescale(rows_cols_view(acc_O), row_scale)
        return kv

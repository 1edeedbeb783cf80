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
      is wider) and written with one TMA store (clipped at seqlen_q); LSE straight from registers. The split-key
      build (split_kv) stores its fp32 partial O and LSE straight from registers instead (epilogue.py).

Global tensors are viewed as (seqlen, head_dim, heads, batch) so that TMA boxes never cross a (batch, head): rows past
seqlen are out of bounds of their own dimension, zero-filled on load and clipped on store. GQA/MQA index the K/V head
as head // (heads // heads_kv).

Packed sequences (spec.varlen, host entry `packed`, as the sm80 family's): q (total_q, h, d), k / v (total_k, h_kv,
d / dv), out (total_q, h, dv), lse (h, total_q), cu_seqlens_q / _k, seqused_k or None, max_seqlen_q. The views are
(total, dim, heads); a CTA offsets them to its sequence's first row (cta.py). Loads past the sequence's end read the
next sequence's rows: keys there are masked like any key past seqlen_k, query rows there are computed and not
stored (epilogue.py stores O row-predicated, not by TMA). The grid spans every sequence's query tiles in order
(cta.py; at most batch + 1 CTAs per head without work, twice that in clusters).

Soft-capping and learnable sinks (spec.softcap / spec.sink; the feature entries `features` / `packed_features`,
common/entries.py, which take the cap and the (rows, h) fp32 sink view after the window bounds) are consumer-side
only: each S tile becomes tanh(S * softmax_scale / softcap) in place right after its wgmma, before the mask
(`modify_scores`: one FMUL and one MUFU.TANH per score), and the online softmax runs with softcap * log2(e) as its
scale; each consumer thread reads the sink of its rows once before its walk (`row_sinks`) and finalize folds it into
the denominator and LSE (rows without keys: O 0, LSE the sink). A split build applies the cap and leaves the sink
to its combine.

Clusters (FwdTileConfig.cluster_m 2; packed d128 / d256 calls without a mask, tile_config.multicast_kv): two CTAs
share the query tiles of one (sequence, head), 64-row slices dealt out in turn (cta.py), and each loads half of every
K / V tile into both by TMA multicast (loads.py); the K / V rings count both CTAs' consumers (pipelines.py). Half the
L2 reads of K and V: the GPU runs at a higher clock under its power cap. A consumer whose slice has no rows takes
part in the rings and the ping-pong without computing (`drain_kv`).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
import cutlass.utils.hopper_helpers as sm90_utils

from ...common.acc_views import rows_cols_view
from ...common.block_info import BlockInfo
from ...common.block_walk import walk_key_list, walk_kv_blocks
from ...common.dsl_types import dsl_dtype
from ...common.entries import FwdEntries
from ...common.packed_tiles import packed_tiles_bound
from ...common.mask import apply_mask
from ...common.online_softmax import LOG2_E, OnlineSoftmax
from ...common.softcap import CappedSoftmax, apply_softcap, softcap_factors
from ...spec import AttentionSpec
from .barriers import WarpGroupTurns, warpgroup_sync
from .cta import CtaWork, cta_work
from .epilogue import store_o_and_lse, store_partial_o_and_lse, zero_rows_from
from .loads import load_q_k_v
from .pipelines import LoadPipelines, cluster_rings, consumer_state, consumer_wait, make_load_pipelines
from .tile_config import ROWS_PER_CONSUMER, WARPGROUP_THREADS, FwdTileConfig
from .views import head_tiles, packed_seq_major_view, packed_stats_view, seq_major_view, stats_view
from . import wgmma

SMEM_ALIGN = 1024  # 128-byte swizzle atoms repeat every 1 KiB


def one_stage(layout):
    """One stage (or one consumer slice) of a staged shared-memory layout."""
    return cute.select(layout, mode=[0, 1])


class ConsumerGemms(NamedTuple):
    """A consumer's two GEMMs and their wgmma operands: S = Q·Kᵀ (SS) and O += P·V (RS, P from registers)."""

    mma_qk: cute.TiledMma
    mma_pv: cute.TiledMma
    tSrQ: cute.Tensor  # (MMA, 1, k-blocks, consumer); one consumer's slice after for_consumer
    tSrK: cute.Tensor  # (MMA, 1, k-blocks, stage)
    tOrVt: cute.Tensor  # (MMA, 1, key k-blocks, stage)
    tOrP: cute.Tensor

    def for_consumer(self, consumer: Int32) -> "ConsumerGemms":
        return self._replace(tSrQ=self.tSrQ[None, None, None, consumer])


class TileLoop(NamedTuple):
    """What every step of a consumer's walk over the key blocks shares."""

    pipes: LoadPipelines
    gemms: ConsumerGemms
    acc_O: cute.Tensor
    acc_PV: cute.Tensor  # where P·V lands: acc_O, or the FP8 kernel's fresh accumulator (promote_pv)
    o_state: object  # the FP8 kernel's pending O / row-sum factors (promote_pv); None here
    s_shape: object  # a thread's S fragment
    softmax: object
    turns: WarpGroupTurns
    mask: Callable
    scales: Optional[Callable]  # the FP8 kernel's per-tile factors; None here
    score_ctx: object = None  # what modify_scores reads (score_setup: softcap's factor before the tanh, or None)


class Sm90FlashForward(FwdEntries):
    """Callable compiled once per (dtype, head dims, mask kind, tile config); shapes and strides are runtime.

    The consumer's walk over the key blocks (`mainloop`, `step`) is the skeleton of both sm90 forward kernels; what
    the FP8 subclass changes goes through the hooks below them (`tile_factors`, `softmax_update`, `store_p`,
    `loop_state`, `carry_kv`, `finish_step`, `finish_loop`)."""

    promote_pv = False  # P·V accumulates into O inside the wgmma (the FP8 kernel may promote it in fp32)
    split_kv = False  # (set per instance, below)
    softcap = False  # spec.softcap: scores soft-capped before the mask (set per instance, below)
    sink = False  # spec.sink: a learnable sink joins each row's denominator (set per instance, below)

    def __init__(self, spec: AttentionSpec, cfg: FwdTileConfig, split_kv: bool = False):
        dtype = dsl_dtype(spec.dtype)
        assert dtype in (cutlass.BFloat16, cutlass.Float16)
        self.dtype = dtype
        self.out_dtype = dtype
        self.mma_dtype = dtype  # of the Q / K / V tiles the GEMMs read (the KV-cache forward's fp8 cache: fp16)
        self._init_cta(spec, cfg)
        # split_kv: the key tiles of each query tile are shared among several CTAs (decoding, arch/split_kv.py), each
        # writing its normalised O and LSE in fp32 for the combine kernel; mO / mLSE are then (splits * b, sq, h, dv)
        # and (splits * b, h, sq) fp32 and the grid's third dimension spans them (cta.py).
        self.split_kv = split_kv
        assert self.cluster_m == 1 or not split_kv, "K / V multicast (cluster_m 2) and split keys do not combine"
        # Soft-capping and sinks (the feature entries, common/entries.py). A split build's partials leave the sink
        # out: the combine adds it once to the merged row (common/split_combine.py).
        self.softcap = spec.softcap
        self.softcap_wide = spec.softcap_wide
        self.sink = spec.sink and not split_kv
        # O reuses each consumer's Q slice: one slot per consumer, as wide as the wider of the two, so that a consumer
        # writing its O never touches the Q another consumer may still be reading (head_dim != head_dim_v).
        self.slice_elems = ROWS_PER_CONSUMER * max(spec.head_dim, spec.head_dim_v)

    def _init_cta(self, spec: AttentionSpec, cfg: FwdTileConfig) -> None:
        """What every sm90 forward kernel (this one and the FP8 subclass) knows about its CTA; spec.varlen: packed
        sequences (the `packed` entry)."""
        assert spec.mask in ("none", "causal", "local")
        self.head_dim = spec.head_dim
        self.head_dim_v = spec.head_dim_v
        self.mask_kind = spec.mask
        self.causal = spec.mask == "causal"
        self.local = spec.mask == "local"
        self.varlen = spec.varlen
        # Whether the V rows past seqlen_k in a walk's right-most key tile may hold anything but zeros (TMA fills rows
        # past a dense tensor with zeros; packed sequences and KV caches have other rows there): `zero_v_tail`.
        self.v_tail_dirty = spec.varlen or spec.kvcache
        self.cfg = cfg
        self.num_consumers = cfg.num_consumer_wgs
        self.tile_m = cfg.tile_m
        self.tile_n = cfg.tile_n
        self.num_stages = cfg.num_stages
        self.cluster_m = cfg.cluster_m
        assert (
            cfg.cluster_m == 1 or spec.mask == "none"
        ), "K / V multicast (cluster_m 2) needs every CTA of a cluster to walk the same key tiles: no mask"

    def tma_atoms(self, mQ, mK, mV, mO, sQ_layout, sK_layout, sV_layout, sO_layout, v_box):
        """TMA atoms and coordinate tensors: loads of one Q slice, one K and one V stage (`v_box`: the V tile as the
        kernel stores it; in a cluster each CTA's atom loads its part of the stage for all, loads.py), the store of
        one O slice."""
        rows = ROWS_PER_CONSUMER
        load = cpasync.CopyBulkTensorTileG2SOp()
        atom_q, tma_q = cpasync.make_tiled_tma_atom(load, mQ, one_stage(sQ_layout), (rows, self.head_dim))
        kv_load, mcast = load, {}
        if const_expr(self.cluster_m > 1):  # each CTA of the cluster loads a part of K / V for all (loads.py)
            kv_load, mcast = cpasync.CopyBulkTensorTileG2SMulticastOp(), {"num_multicast": self.cluster_m}
        k_box = (self.tile_n, self.head_dim)
        atom_k, tma_k = cpasync.make_tiled_tma_atom(kv_load, mK, one_stage(sK_layout), k_box, **mcast)
        atom_v, tma_v = cpasync.make_tiled_tma_atom(kv_load, mV, one_stage(sV_layout), v_box, **mcast)
        if const_expr(mO is None):  # O stored without TMA (split_kv: fp32 partials from registers)
            return (atom_q, atom_k, atom_v), (tma_q, tma_k, tma_v, None)
        atom_o, tma_o = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, one_stage(sO_layout), (rows, self.head_dim_v)
        )
        return (atom_q, atom_k, atom_v, atom_o), (tma_q, tma_k, tma_v, tma_o)

    def launch_shape(self, mQ: cute.Tensor, packed=None, mO=None) -> dict:
        """Grid (query tiles, heads, batch) and block of the launch (split_kv: (query tiles, heads, splits x batch),
        mO the partials' view); packed: (cu_seqlens_q, max_seqlen_q), grid (every sequence's query tiles, heads, 1)
        (cta.py)."""
        cluster_m = self.cluster_m  # whole clusters of query tiles per (sequence, head) (cta.py)
        if const_expr(packed is None):
            tiles = cute.ceil_div(mQ.shape[0], self.tile_m * cluster_m) * cluster_m
            grid = [tiles, cute.size(mQ.shape[2]), cute.size(mQ.shape[3])]
            if const_expr(self.split_kv):
                grid[2] = cute.size(mO.shape[3])  # (split, batch) pairs: mO's batch dimension
        else:
            mCuSeqlensQ, _ = packed
            tiles = packed_tiles_bound(mQ.shape[0], mCuSeqlensQ.shape[0] - 1, self.tile_m * cluster_m) * cluster_m
            grid = [tiles, cute.size(mQ.shape[2]), 1]
        cluster = {} if const_expr(cluster_m == 1) else {"cluster": [cluster_m, 1, 1]}
        return dict(grid=grid, block=[self.cfg.num_threads, 1, 1], min_blocks_per_mp=1, **cluster)

    @cute.jit
    def _launch(
        self, mQ, mK, mV, mO, mLSE, softmax_scale, window_left, window_right, stream, packed=None, features=None
    ):
        """Every entry: `__call__` (common/entries.py) on dense tensors, `packed` (packed: (cu_seqlens_q,
        cu_seqlens_k, seqused_k or None, max_seqlen_q)) on packed ones; `features` / `packed_features` (features:
        (softcap, the (rows, h) sink view or None)) for builds with soft-capping or sinks."""
        if const_expr(packed is None):
            mQ, mK, mV, mO = [seq_major_view(t) for t in (mQ, mK, mV, mO)]
            mLSE = stats_view(mLSE)  # (sq, h, b)
        else:
            mQ, mK, mV, mO = [packed_seq_major_view(t) for t in (mQ, mK, mV, mO)]
            mLSE = packed_stats_view(mLSE)  # (total_q, h)

        rows = ROWS_PER_CONSUMER
        sQ_layout = wgmma.k_major_smem_layout(self.dtype, rows, self.head_dim, self.num_consumers, self.slice_elems)
        sK_layout = wgmma.k_major_smem_layout(self.dtype, self.tile_n, self.head_dim, self.num_stages)
        sV_layout = wgmma.k_major_smem_layout(self.dtype, self.tile_n, self.head_dim_v, self.num_stages)
        sO_layout = wgmma.k_major_smem_layout(self.dtype, rows, self.head_dim_v, self.num_consumers, self.slice_elems)

        k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, k_major, k_major, Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(rows, self.tile_n)
        )
        # B = Vᵀ (dv x keys) with dv contiguous: MN-major. A = P from registers.
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            k_major,
            mn_major,
            Float32,
            atom_layout_mnk=(1, 1, 1),
            tiler_mn=(rows, self.head_dim_v),
            a_source=warpgroup.OperandSource.RMEM,
        )

        atoms, tmas = self.tma_atoms(
            mQ, mK, mV, None if const_expr(self.split_kv) else mO, sQ_layout, sK_layout, sV_layout, sO_layout,
            (self.tile_n, self.head_dim_v),
        )  # fmt: skip
        # Every consumer's slice, one barrier (not the layout's cosize: slices may be spaced wider than Q).
        self.bytes_q = cute.size_in_bytes(self.dtype, one_stage(sQ_layout)) * self.num_consumers
        self.bytes_k = cute.size_in_bytes(self.dtype, one_stage(sK_layout))
        self.bytes_v = cute.size_in_bytes(self.dtype, one_stage(sV_layout))

        q_elems = self.slice_elems * self.num_consumers

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, q_elems], SMEM_ALIGN]  # Q, then O
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], SMEM_ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], SMEM_ALIGN]

        mmas, layouts = (tiled_mma_qk, tiled_mma_pv), (sQ_layout, sK_layout, sV_layout, sO_layout)
        descales = ()  # the FP8 kernel's
        if const_expr(packed is None):
            if const_expr(self.split_kv):
                tmas = (*tmas[:3], mO)  # fp32 partials, stored from registers (epilogue.store_partial_o_and_lse)
            self.kernel(
                tmas, mLSE, descales, atoms, mmas, layouts, softmax_scale, window_left, window_right, SharedStorage,
                features=features,
            ).launch(stream=stream, **self.launch_shape(mQ, mO=mO))  # fmt: skip
        else:
            # O goes out by predicated stores (epilogue.py): the kernel gets the tensor itself, not O's TMA view.
            mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q = packed
            tmas = (*tmas[:3], mO)
            self.kernel(
                tmas,
                mLSE,
                descales,
                atoms,
                mmas,
                layouts,
                softmax_scale,
                window_left,
                window_right,
                SharedStorage,
                mCuSeqlensQ,
                mCuSeqlensK,
                mSeqUsedK,
                features=features,
            ).launch(stream=stream, **self.launch_shape(mQ, (mCuSeqlensQ, max_seqlen_q)))

    @cute.kernel
    def kernel(
        self,
        tmas,  # TMA coordinate tensors of Q, K, V (or Vᵀ), O
        mLSE: cute.Tensor,  # (sq, h, b) fp32
        descales,  # the FP8 kernel's (q, k, v) descales; () here
        atoms,  # their TMA atoms
        mmas,  # tiled MMAs: (Q·Kᵀ, P·V), the FP8 kernel's (Q·Kᵀ, P·[V | 1], O)
        layouts,  # shared-memory layouts of Q, K, V (or Vᵀ), O
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        SharedStorage: cutlass.Constexpr,
        mCuSeqlensQ: Optional[cute.Tensor] = None,  # packed sequences only
        mCuSeqlensK: Optional[cute.Tensor] = None,
        mSeqUsedK: Optional[cute.Tensor] = None,
        features=None,  # feature builds: (softcap, the (rows, h) sink view or None)
    ):
        mQ, mK, mV, mO = tmas
        atom_q, atom_k, atom_v = atoms[:3]
        atom_o = atoms[3] if const_expr(len(atoms) > 3) else None
        sQ_layout, sK_layout = layouts[:2]
        warp_idx, tidx, storage, pipes = self.prologue(atoms, SharedStorage)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV_load, sV, sO = self.v_and_o_smem(storage, layouts)
        consume = partial(self.consume, pipes, mmas, (sQ, sK, sV), (sO, mO, mLSE, atom_o), descales, softmax_scale)
        if const_expr(features is not None):
            consume = partial(consume, features=features)

        self.run_roles(
            warp_idx,
            tidx,
            pipes,
            (atom_q, atom_k, atom_v),
            (mQ, mK, mV),
            (sQ, sK, sV_load),
            window_left,
            window_right,
            consume,
            None if const_expr(not self.varlen) else (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK),
            features,
        )

    def refine_work(self, work: CtaWork, features) -> CtaWork:
        """A feature build's CTA work from the mask's (the block-sparse score_mod / mask_mod build narrows the key
        tiles to its list: flash_fwd_mods.py); unchanged here."""
        return work

    def v_and_o_smem(self, storage, layouts):
        """V's shared memory as the producer fills it and as consume takes it, and O's (in Q's slots: slice_elems)."""
        sV_layout, sO_layout = layouts[2:]
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        return sV, sV, sO

    @cute.jit
    def prologue(self, atoms, SharedStorage: cutlass.Constexpr):
        """Descriptor prefetch, shared memory, the Q / K / V load rings (their init made visible later by
        pipeline_init_wait): the start every sm90 forward kernel shares."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)
        if const_expr(self.split_kv):
            cute.arch.griddepcontrol_launch_dependents()  # the combine kernel (PDL) may launch now; it waits for us

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
            cluster_m=self.cluster_m,
        )
        pipeline.pipeline_init_arrive(self.cluster_shape(), is_relaxed=True)
        return warp_idx, tidx, storage, pipes

    def cluster_shape(self):
        """The (m, n) shape of a cluster where there are clusters (the multicast's barrier init is cluster-wide)."""
        return None if const_expr(self.cluster_m == 1) else (self.cluster_m, 1)

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
        packed=None,
        features=None,
    ):
        """This CTA's work (features: a feature build's, which `refine_work` may read); then warpgroup 0 gives
        registers away and its warp 0 loads (atoms, gmem, smem: those of Q, K and V), while the others take them
        and consume(work, consumer index, thread index within the warpgroup, warp index within it). packed: the
        cu_seqlens_q, cu_seqlens_k, seqused_k tensors of packed sequences (a CTA past its sequence's end does
        nothing, unless another CTA of its cluster has rows: then it still loads its part of K / V and drains the
        rings)."""
        work = cta_work(
            gmem[0], gmem[1], self.tile_m, self.tile_n, self.mask_kind, window_left, window_right, packed,
            self.split_kv, self.cluster_m,
        )  # fmt: skip
        if const_expr(features is not None):
            work = self.refine_work(work, features)

        pipeline.pipeline_init_wait(self.cluster_shape())

        if const_expr(self.cluster_m > 1):
            if work.cluster_active(self.tile_m, self.cluster_m):  # (no barrier before exit: pipelines.ClusterRing)
                self.roles(warp_idx, tidx, pipes, atoms, gmem, smem, consume, work)
        elif const_expr(packed is None):
            self.roles(warp_idx, tidx, pipes, atoms, gmem, smem, consume, work)
        else:
            if work.active(self.tile_m):
                self.roles(warp_idx, tidx, pipes, atoms, gmem, smem, consume, work)

    @cute.jit
    def roles(self, warp_idx: Int32, tidx: Int32, pipes, atoms, gmem, smem, consume: cutlass.Constexpr, work: CtaWork):
        warp_group = warp_idx // 4
        if warp_group == 0:
            cute.arch.setmaxregister_decrease(self.cfg.producer_regs)
            if warp_idx == 0:
                self.produce(pipes, atoms, gmem, smem, work)
        else:
            cute.arch.setmaxregister_increase(self.cfg.consumer_regs)
            consumer = warp_group - 1
            if const_expr(self.cluster_m == 1):
                consume(work, consumer, tidx % WARPGROUP_THREADS, warp_idx % 4)
            else:
                self.consume_or_drain(pipes, consume, work, consumer, tidx % WARPGROUP_THREADS, warp_idx % 4)

    @cute.jit
    def consume_or_drain(self, pipes, consume: cutlass.Constexpr, work: CtaWork, consumer, tidx, warp_in_wg):
        """In a cluster: consume where this consumer's 64-row slice has query rows; else take every K and V stage as
        it fills and release it at once (in the consumers' order, K_j before V_j; the last num_stages are not
        released, pipelines.ClusterRing), so that the multicast goes on."""
        if work.slice_active(consumer, self.num_consumers, self.cluster_m):
            consume(work, consumer, tidx, warp_in_wg)
        else:
            self.drain_kv(cluster_rings(pipes, work.n_max - work.n_min, self.num_stages), work, consumer)

    @cute.jit
    def drain_kv(self, pipes: LoadPipelines, work: CtaWork, consumer: Int32):
        """(consume_or_drain) The consumer also takes its GEMM turns as `mainloop` does (one per tile after the
        first), so that the other consumer of the CTA, which may have rows, goes on."""
        turns = WarpGroupTurns(consumer, self.num_consumers, self.cfg.ping_pong)
        turns.prime()
        take_turn_if = turns.take_turn_if  # (a function: the DSL's loop need not carry `turns`)
        kv = consumer_state(self.num_stages)
        for i in cutlass.range(work.n_max - work.n_min, unroll=1):
            consumer_wait(pipes.k, kv)
            pipes.k.consumer_release(kv)
            take_turn_if(i > 0)  # (mainloop: no turn for the first tile)
            consumer_wait(pipes.v, kv)
            pipes.v.consumer_release(kv)
            kv.advance()

    def v_tiles(self, mV: cute.Tensor, head_kv: Int32, batch: Int32, offset_k=None) -> cute.Tensor:
        """This (batch, KV head)'s V tiles as the producer loads them, tile index last: (tile_n, dv, tiles)."""
        return cute.local_tile(head_tiles(mV, head_kv, batch, offset_k), (self.tile_n, self.head_dim_v), (None, 0))

    @cute.jit
    def produce(self, pipes, atoms, gmem, smem, work: CtaWork):
        """The producer warp: Q once, then the K and V tiles of work's key range (loads.load_q_k_v)."""
        atom_q, atom_k, atom_v = atoms
        mQ, mK, mV = gmem
        sQ, sK, sV = smem
        head, head_kv, batch = work.head, work.head_kv, work.batch
        offset_q, offset_k, n_min, n_max = work.offset_q, work.offset_k, work.n_min, work.n_max
        rows = ROWS_PER_CONSUMER
        gQ = cute.local_tile(head_tiles(mQ, head, batch, offset_q), (rows, self.head_dim), (None, 0))
        gK = cute.local_tile(head_tiles(mK, head_kv, batch, offset_k), (self.tile_n, self.head_dim), (None, 0))
        gV = self.v_tiles(mV, head_kv, batch, offset_k)
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
            work.q_slice(0, self.num_consumers, self.cluster_m),
            self.num_consumers,
            self.num_stages,
            n_min,
            n_max,
            self.cluster_m,
            None if const_expr(self.cluster_m == 1) else work.slice_active(0, self.num_consumers, self.cluster_m),
            None if const_expr(work.key_tiles is None) else work.key_tile,
        )

    @cute.jit
    def consume(
        self, pipes, mmas, smem, out, descales, softmax_scale, work: CtaWork, consumer, tidx, warp_in_wg, features=None
    ):
        """One consumer warpgroup's query rows: mmas, smem (sQ, sK, sV) and out (sO, mO, mLSE, O's TMA atom) as
        kernel() packs them; descales: the FP8 kernel's (none here); features: (softcap, sink view) of a feature
        build."""
        if const_expr(self.cluster_m > 1):
            pipes = cluster_rings(pipes, work.n_max - work.n_min, self.num_stages)
        tiled_mma_qk, tiled_mma_pv = mmas
        sQ, sK, sV = smem
        n_min, n_max = work.n_min, work.n_max
        sVt = cute.composition(
            sV, cute.make_ordered_layout((self.head_dim_v, self.tile_n, self.num_stages), order=(1, 0, 2))
        )
        gemms, thr_qk, thr_pv = self.consumer_gemms(tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, tidx)
        acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((ROWS_PER_CONSUMER, self.head_dim_v)), Float32)
        acc_O.fill(0.0)

        coords = self.score_coords(tiled_mma_qk, thr_qk, consumer)
        score_ctx, scale_log2 = self.score_setup(softmax_scale, features, work, coords)
        softmax = self.row_softmax(scale_log2, cute.size(rows_cols_view(acc_O), mode=[0]))
        sinks_log2 = None
        if const_expr(self.sink):  # loaded here, so that the loads' latency hides behind the main loop
            sinks_log2 = self.row_sinks(features[1], thr_pv, work, consumer)
        turns = WarpGroupTurns(consumer, self.num_consumers, self.cfg.ping_pong)
        turns.prime()

        if n_max > n_min:
            zero_v = None
            if const_expr(self.v_tail_dirty):
                zero_v = partial(self.zero_v_tail, pipes, sV, work, consumer, tidx)
            self.mainloop(
                pipes, gemms.for_consumer(consumer), acc_O, softmax, turns, work, coords, None, zero_v, score_ctx
            )

        row_scale, lse = softmax.finalize(sinks_log2)
        softmax.rescale(rows_cols_view(acc_O), row_scale)
        self.store_output(acc_O, lse, tiled_mma_pv, thr_pv, out, work, consumer, tidx, warp_in_wg)

    def row_softmax(self, scale_log2: Float32, num_rows: int) -> OnlineSoftmax:
        """The softmax statistics of one consumer's rows: soft-capped bf16 scores within a fixed reference's range
        (spec.softcap, not spec.softcap_wide) need no running max (common/softcap.CappedSoftmax)."""
        # (P is rounded to the P·V operand's dtype: bf16 holds the fixed reference's range, fp16 does not.)
        if const_expr(self.softcap and not self.softcap_wide and self.mma_dtype == cutlass.BFloat16):
            return CappedSoftmax.create(scale_log2, num_rows, sequential_sum=True)
        return OnlineSoftmax.create(scale_log2, num_rows, sequential_sum=True)

    def score_setup(self, softmax_scale: Float32, features, work: CtaWork, coords):
        """(what `modify_scores` reads, the online softmax's scale in log2 units) of one consumer: soft-capping's
        factor before the tanh (T = tanh(S * pre_tanh) in place of S, whose softmax runs with softcap * log2(e) as
        its scale) where spec.softcap, else (None, softmax_scale * log2(e)). The score_mod build's override:
        flash_fwd_mods.py."""
        if const_expr(self.softcap):
            return softcap_factors(softmax_scale, features[0])
        return None, softmax_scale * LOG2_E

    @cute.jit
    def row_sinks(self, mSink: cute.Tensor, thr_o, work: CtaWork, consumer: Int32) -> cute.Tensor:
        """sink * log2(e) of each of this thread's query rows (OnlineSoftmax.finalize's sinks_log2), read from the
        (rows, h) view at the row's index within its sequence; rows past seqlen_q (never stored) read nothing and
        take 0."""
        rows = ROWS_PER_CONSUMER
        coords = rows_cols_view(thr_o.partition_C(cute.make_identity_tensor((rows, self.head_dim_v))))
        first = work.q_slice(consumer, self.num_consumers, self.cluster_m) * rows
        sinks = cute.make_rmem_tensor(cute.size(coords, mode=[0]), Float32)
        for r in cutlass.range_constexpr(cute.size(sinks)):
            row = first + coords[r, 0][0]
            sinks[r] = 0.0
            if row < work.seqlen_q:
                sinks[r] = mSink[row, work.head] * LOG2_E
        return sinks

    @cute.jit
    def zero_v_tail(self, pipes: LoadPipelines, sV: cute.Tensor, work: CtaWork, consumer: Int32, tidx: Int32):
        """Packed sequences: V rows of the right-most key tile past seqlen_k hold the next sequence's rows (or a KV
        cache's unused slots) as TMA loaded them. Their P is exactly 0, but 0 · Inf / NaN is NaN, so they are zeroed
        in shared memory before any P·V reads them (dense tensors: TMA fills rows past the tensor with zeros), after
        the first S product and its softmax (`mainloop`'s before_first_pv). Every consumer warpgroup zeroes the same
        rows (same values, no race) and fences its own stores for wgmma."""
        tail = work.info.seqlen_k - (work.n_max - 1) * self.tile_n
        if tail < self.tile_n:
            first = consumer_state(self.num_stages)
            consumer_wait(pipes.v, first)
            zero_rows_from(sV[None, None, first.index], tail, self.mma_dtype, self.tile_n, self.head_dim_v, tidx)
            cute.arch.fence_view_async_shared()
            warpgroup_sync(consumer)  # before the first P·V reads the tile

    def consumer_gemms(self, tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, tidx: Int32):
        """This thread's wgmma operands (Vᵀ: V viewed or stored dv x keys), and its MMA slices of Q·Kᵀ and P·V."""
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        gemms = ConsumerGemms(
            tiled_mma_qk,
            tiled_mma_pv,
            thr_qk.make_fragment_A(thr_qk.partition_A(sQ)),
            thr_qk.make_fragment_B(thr_qk.partition_B(sK)),
            thr_pv.make_fragment_B(thr_pv.partition_B(sVt)),
            thr_pv.make_fragment_A(thr_pv.partition_shape_A((ROWS_PER_CONSUMER, self.tile_n))),
        )
        return gemms, thr_qk, thr_pv

    @cute.jit
    def store_output(
        self, acc_O, lse, tiled_mma_o: cute.TiledMma, thr_o, out, work: CtaWork, consumer: Int32, tidx, warp_in_wg
    ):
        """O (normalised, in the MMA layout of tiled_mma_o) and LSE of this consumer's 64 rows."""
        sO, mO, mLSE, atom_o = out
        slice_idx = work.q_slice(consumer, self.num_consumers, self.cluster_m)
        if const_expr(self.split_kv):
            store_partial_o_and_lse(
                acc_O, lse, self.head_dim_v, thr_o, mO, mLSE, slice_idx, work.head, work.out_batch, work.seqlen_q
            )
            return
        store_o_and_lse(
            acc_O,
            lse,
            self.out_dtype,
            self.head_dim_v,
            tiled_mma_o,
            thr_o,
            sO,
            mO,
            mLSE,
            atom_o,
            slice_idx,
            work.head,
            work.batch,
            work.seqlen_q,
            consumer,
            tidx,
            warp_in_wg,
            work.offset_q,
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
    def first_scores(
        self, pipes, gemms: ConsumerGemms, kv, s_shape: cutlass.Constexpr, mask, n_first: Int32, score_ctx=None
    ):
        """S of the right-most key tile (the seqlen_k tail and the diagonal live there), alone and masked."""
        tile_ctx = self.key_tile_setup(n_first, score_ctx)
        consumer_wait(pipes.k, kv)
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        wgmma.gemm(gemms.mma_qk, acc_S, gemms.tSrQ, gemms.tSrK[None, None, None, kv.index], zero_init=True, wait=0)
        pipes.k.consumer_release(kv)
        self.modify_scores(acc_S, n_first, score_ctx, tile_ctx)
        mask(acc_S, n_first, True, self.causal or self.local)
        return acc_S

    def key_tile_setup(self, n_block: Int32, score_ctx):
        """What `modify_scores` reads of key tile n_block alone, read before the tile's GEMMs are issued so that its
        loads overlap them (nothing here)."""
        return None

    def modify_scores(self, acc_S: cute.Tensor, n_block: Int32, score_ctx, tile_ctx=None):
        """What happens to key tile n_block's raw scores before the mask (score_ctx: `score_setup`'s, tile_ctx:
        `key_tile_setup`'s): soft-capping where spec.softcap (one FMUL and one MUFU.TANH per score,
        common/softcap.py), nothing otherwise."""
        if const_expr(self.softcap):
            apply_softcap(acc_S, score_ctx)

    @cute.jit
    def overlapped_gemms(
        self, kv: pipeline.PipelineState, n_block: Int32, mask_window: cutlass.Constexpr[bool], loop: TileLoop
    ):
        """S_n = Q·K_nᵀ issued together with P_{n+1}·V_{n+1} (into loop.acc_PV), in this consumer's turn; returns once
        S_n is ready and masked (P·V may still run), with the K/V state of n and the V state of n + 1."""
        pipes, gemms = loop.pipes, loop.gemms
        tile_ctx = self.key_tile_setup(n_block, loop.score_ctx)
        kv_v = kv.clone()  # the V stage of the previous (right-hand) block
        kv.advance()
        consumer_wait(pipes.k, kv)
        loop.turns.wait_turn()
        acc_S = cute.make_rmem_tensor(loop.s_shape, Float32)
        wgmma.gemm(gemms.mma_qk, acc_S, gemms.tSrQ, gemms.tSrK[None, None, None, kv.index], zero_init=True, wait=-1)
        consumer_wait(pipes.v, kv_v)
        tOrVt = gemms.tOrVt[None, None, None, kv_v.index]
        wgmma.gemm(gemms.mma_pv, loop.acc_PV, gemms.tOrP, tOrVt, zero_init=self.promote_pv, wait=-1)
        loop.turns.pass_turn()
        warpgroup.wait_group(1)  # S is ready; P·V may still run
        pipes.k.consumer_release(kv)
        self.modify_scores(acc_S, n_block, loop.score_ctx, tile_ctx)
        if const_expr(mask_window):
            loop.mask(acc_S, n_block, False, True)
        return kv, kv_v, acc_S

    @cute.jit
    def mainloop(
        self,
        pipes: LoadPipelines,
        gemms: ConsumerGemms,
        acc_O: cute.Tensor,
        softmax,
        turns: WarpGroupTurns,
        work: CtaWork,
        coords,  # score_coords
        scales: cutlass.Constexpr,  # FP8: per-tile factors (tile_factors); None here
        before_first_pv=None,  # packed sequences: zero_v_tail, once the first tile's P is formed
        score_ctx=None,  # what modify_scores reads (score_setup)
    ):
        """All key blocks of one CTA tile, right to left, for one consumer warpgroup; returns what the walk carried
        (the K/V pipeline state, and the FP8 kernel's V descale of the last tile)."""
        consumer_wait(pipes.q, consumer_state(1))
        kv = consumer_state(self.num_stages)
        s_shape = gemms.mma_qk.get_slice(0).partition_shape_C((ROWS_PER_CONSUMER, self.tile_n))
        coords_rc, coords0_rc = coords
        mask = partial(
            self.mask_scores, coords_rc=coords_rc, coords0_rc=coords0_rc, info=work.info, m_block=work.m_block
        )

        n_first = work.n_max - 1
        first_tile = work.key_tile(n_first)
        factors = self.tile_factors(scales, first_tile)
        acc_S = self.first_scores(pipes, gemms, kv, s_shape, mask, first_tile, score_ctx)
        self.softmax_update(softmax, acc_S, factors, True)
        self.store_p(acc_S, gemms.tOrP)
        if const_expr(before_first_pv is not None):
            # Here rather than before the first S product: the first V tile's load overlaps that product and its
            # softmax, and nothing reads V before the first P·V (in the walk's first step, or below).
            before_first_pv()

        acc_PV, o_state, carry = self.loop_state(gemms, acc_O, softmax, kv, factors)
        loop = TileLoop(pipes, gemms, acc_O, acc_PV, o_state, s_shape, softmax, turns, mask, scales, score_ctx)
        # Then the rest, right to left; only blocks crossing a window edge pay for masking (a block-sparse list's
        # every tile: where it sits against the window is not known at compile time).
        step = partial(self.step, loop=loop)
        if const_expr(work.key_tiles is None):
            carry = walk_kv_blocks(work.info, work.m_block, work.n_min, n_first, step, carry)
        else:
            carry = walk_key_list(work.key_tiles, work.n_min, n_first, step, carry)

        # The last P·V.
        kv = self.carry_kv(carry)
        consumer_wait(pipes.v, kv)
        tOrVt = gemms.tOrVt[None, None, None, kv.index]
        wgmma.gemm(gemms.mma_pv, acc_PV, gemms.tOrP, tOrVt, zero_init=self.promote_pv, wait=0)
        pipes.v.consumer_release(kv)
        self.finish_loop(loop)
        return carry

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
    def step(self, carry, n_block: Int32, mask_window: cutlass.Constexpr[bool], loop: TileLoop):
        """S_n = Q·K_nᵀ issued together with P_{n+1}·V_{n+1}; the softmax of S_n overlaps that P·V; then O's update."""
        factors = self.tile_factors(loop.scales, n_block)
        kv, kv_v, acc_S = self.overlapped_gemms(self.carry_kv(carry), n_block, mask_window, loop)
        row_scale = self.softmax_update(loop.softmax, acc_S, factors, False)
        return self.finish_step(carry, kv, kv_v, acc_S, row_scale, factors, loop)

    # --- hooks: the bf16 / fp16 kernel's choices -------------------------------------------------------------------
    def tile_factors(self, scales, n_block: Int32):
        """Per-key-tile factors the softmax and O's update need (none here)."""
        return None

    def softmax_update(self, softmax, acc_S: cute.Tensor, factors, is_first: bool):
        return softmax.update(rows_cols_view(acc_S), is_first=is_first)

    def store_p(self, acc_S: cute.Tensor, tOrP: cute.Tensor):
        wgmma.store_p_operand(acc_S, tOrP)

    def loop_state(self, gemms: ConsumerGemms, acc_O: cute.Tensor, softmax, kv, factors):
        """(where P·V lands, O-update state, what the walk carries) after the first tile."""
        return acc_O, None, kv

    def carry_kv(self, carry) -> pipeline.PipelineState:
        return carry

    @cute.jit
    def finish_step(self, carry, kv, kv_v, acc_S: cute.Tensor, row_scale: cute.Tensor, factors, loop: TileLoop):
        """After S_n's softmax: wait for P_{n+1}·V_{n+1}, then P_n into registers and O rescaled; the new carry."""
        warpgroup.wait_group(0)  # P·V done: the P registers and the V stage are free, O may be rescaled
        loop.pipes.v.consumer_release(kv_v)
        self.store_p(acc_S, loop.gemms.tOrP)
        loop.softmax.rescale(rows_cols_view(loop.acc_O), row_scale)
        return kv

    def finish_loop(self, loop: TileLoop):
        """After the last P·V (nothing here)."""

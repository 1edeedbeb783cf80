"""The sm90 KV-cache forward kernel: the bf16 forward's consumers against a dense or paged cache.

A subclass of `..flash_fwd.Sm90FlashForward` that keeps its consumer side whole (the walk over the key tiles, the
GEMMs, the online softmax, the masks; whatever the forward's consumers gain, this kernel gains) and replaces what is
around it:

  CTA       grid (row tiles, h_kv, splits x b): a CTA owns `tile_m` rows of one (sequence, KV head), the (query
            token, query head) pairs of the group's heads (GQA in the tile: each K / V byte is read once per group;
            views.py), the key tiles [n_min, n_max) its rows see (BlockInfo with rows_per_query = group: the mask
            and the key range follow each row's token, bottom-right aligned with seqlens_k[b]) and, split, its run
            of them (arch/split_kv.py). Lengths come from the device (seqlens_k, cu_seqlens_q): nothing on the host
            depends on them, so a decode step replays in a CUDA graph with new lengths and page tables.
  producer  warp 0: K / V tiles by TMA boxes from their pages, page-table entries a tile ahead (loads.py); warp 1:
            the query rows by cp.async into the Q slices, then the Q ring's barrier (loads.load_q_rows).
  epilogue  O and LSE to their (token, head) places, row by row; split: fp32 partials for the combine
            (common/split_combine.py), which merges them exactly (epilogue.py).
  fp8 cache (spec.kv_fp8) TMA fills e4m3 stages of their own, warps 2-3 convert them into the 16-bit stages
            (convert.py); k_descale[b, h_kv] joins the CTA's softmax scale, v_descale[b, h_kv] its O (partials too).

Entry `kvcache(q, k_cache, v_cache, out, lse, seqlens_k, page_table, cu_seqlens_q, k_descale, v_descale,
max_seqlen_q, softmax_scale, window_left, window_right)`: q (b, sq, h, d) or packed (total_q, h, d) with
cu_seqlens_q (None for dense q); k_descale / v_descale (b, h_kv) fp32 for an fp8 cache (else None);
k_cache / v_cache (pages, page_size, h_kv, d), a dense cache (b, seqlen_cache, h_kv, d) with page_table None;
seqlens_k (b,) int32; page_table (b, max_pages) int32; out like q; lse (b, h, sq) or (h, total_q). Split builds:
out / lse are the fp32 partials (splits * b, sq, h, dv) / (splits * b, h, sq), packed q (splits, total_q, h, dv) /
(splits, h, total_q). max_seqlen_q: the longest sequence's query tokens (the grid; dense q: sq).

Soft-capping and learnable sinks (spec.softcap / spec.sink): entry `kvcache_features`, `kvcache`'s arguments then
softcap (Float32) and the (h,) fp32 sink logits (None without spec.sink, and in split builds, whose partials leave
the sink to the combine). They are the forward's consumer-side hooks, unchanged: the tanh right after each S
product (an fp8 cache's k_descale is already in the score scale there, so the cap bends the dequantised scores) and
the sinks folded in at finalize, read through `views.gqa_sink_view` (row s * group + j of KV head g: query head
g * group + j's sink).
"""

from __future__ import annotations

from functools import partial


import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
import cutlass.utils.hopper_helpers as sm90_utils

from ....spec import AttentionSpec
from ..cta import CtaWork
from ..flash_fwd import SMEM_ALIGN, Sm90FlashForward, one_stage
from ..tile_config import ROWS_PER_CONSUMER, WARPGROUP_THREADS
from .. import wgmma
from ..pipelines import WARP_THREADS, LoadPipelines, consumer_state, consumer_wait
from .convert import CONVERTER_WARPS, FIRST_CONVERTER_WARP, FP8, Staging, convert_cache_tiles, converting_ring
from .entries import KvCacheEntries
from .epilogue import store_lse_rows, store_o_rows, store_partial_o_rows
from .loads import cache_tiles, load_cache_tiles, load_q_rows, load_q_rows_as_fp16
from .tile_config import KvCacheTileConfig, chunk_rows
from .views import cache_view, gqa_rows_view, gqa_sink_view, gqa_stats_view
from .work import kvcache_cta_work


class Sm90FlashForwardKvCache(KvCacheEntries, Sm90FlashForward):
    """Compiled once per (spec: dtype, head dims, mask kind, page size, fp8 cache; tile config; dense or packed q;
    split or not); shapes, strides, lengths, page tables, descales and the split count are runtime.

    CtaWork as this kernel fills it: head = head_kv = the KV head; seqlen_q = the sequence's packed rows (tokens x
    group); offset_q = its first row in the packed views (cu_seqlens_q[b] x group; 0 for dense q); out_batch = the
    last index of the O / LSE views (b; split: split x b + b, or the split for packed q)."""

    def __init__(self, spec: AttentionSpec, cfg: KvCacheTileConfig, split_kv: bool = False, packed_q: bool = False):
        assert spec.kvcache and not spec.varlen and spec.head_dim == spec.head_dim_v
        super().__init__(spec, cfg, split_kv)
        self.page_size = spec.page_size
        self.chunk = chunk_rows(spec.page_size, cfg.tile_n)
        assert self.chunk % 8 == 0 and cfg.tile_n // self.chunk <= 32, "boxes of whole swizzle atoms, one per lane"
        self.packed_q = packed_q
        self.ctas_per_sm = cfg.ctas_per_sm
        self.kv_fp8 = spec.kv_fp8
        self.fp8_stages = cfg.fp8_stages
        assert self.kv_fp8 == (cfg.fp8_stages > 0), "an fp8 cache has e4m3 stages, a 16-bit one none"
        self.cache_dtype = FP8 if spec.kv_fp8 else self.dtype
        # An fp8 cache's GEMMs run in fp16 whatever q's dtype: e4m3 -> fp16 is one exact cvt per two values (bf16
        # would take three more instructions per two, and the converter warps bound the step). bf16 queries are
        # rounded to fp16 under a power-of-two scale the consumers fold into the score scale (load_q_rows_as_fp16).
        self.mma_dtype = cutlass.Float16 if spec.kv_fp8 else self.dtype
        self.q_to_fp16 = spec.kv_fp8 and self.dtype is cutlass.BFloat16
        self.v_by_consumers = cfg.fp8_v_by_consumers
        if self.v_by_consumers:
            assert spec.kv_fp8 and cfg.fp8_stages == cfg.num_stages and cfg.num_consumer_wgs == 1, cfg
            self.v_tail_dirty = False  # the converting ring zeroes the first V tile's rows past the sequence

    @cute.jit
    def _launch_kvcache(
        self, mQ, mK, mV, mO, mLSE, mSeqlensK, mPageTable, mCuSeqlensQ, mKDescale, mVDescale, max_seqlen_q,
        softmax_scale, window_left, window_right, stream, features=None,
    ):  # fmt: skip
        group = mQ.shape[cute.rank(mQ) - 2] // mK.shape[2]
        num_seqs = mSeqlensK.shape[0]
        if const_expr(features is not None and features[1] is not None):
            # The consumers read sink[row, head] (row_sinks) with the row within the sequence and head the KV head:
            # the (h,) logits seen as ((group, 1), h_kv), row s * group + j of KV head g at g * group + j.
            features = (features[0], gqa_sink_view(features[1], group))
        mQ = gqa_rows_view(mQ, group)
        mO = gqa_rows_view(mO, group)
        mLSE = gqa_stats_view(mLSE, group, packed=self.packed_q and not self.split_kv)
        mK, mV = cache_view(mK), cache_view(mV)

        rows = ROWS_PER_CONSUMER
        d = self.head_dim
        mma_dtype = self.mma_dtype
        sQ_layout = wgmma.k_major_smem_layout(mma_dtype, rows, d, self.num_consumers, self.slice_elems)
        sK_layout = wgmma.k_major_smem_layout(mma_dtype, self.tile_n, d, self.num_stages)
        sV_layout = wgmma.k_major_smem_layout(mma_dtype, self.tile_n, d, self.num_stages)
        sO_layout = wgmma.k_major_smem_layout(self.out_dtype, rows, d, self.num_consumers, self.slice_elems)
        # What TMA fills: the 16-bit stages, or an fp8 cache's e4m3 stages (convert.py).
        sKV_load_layout = sK_layout
        if const_expr(self.kv_fp8):
            sKV_load_layout = wgmma.k_major_smem_layout(FP8, self.tile_n, d, self.fp8_stages)

        k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            mma_dtype, mma_dtype, k_major, k_major, Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(rows, self.tile_n)
        )
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            mma_dtype, mma_dtype, k_major, mn_major, Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(rows, d),
            a_source=warpgroup.OperandSource.RMEM,
        )  # fmt: skip

        # One TMA box: `chunk` rows of a stage (loads.py), its layout the stage's rows [0, chunk).
        box = cute.composition(one_stage(sKV_load_layout), cute.make_layout((self.chunk, d), stride=(1, self.tile_n)))
        load = cpasync.CopyBulkTensorTileG2SOp()
        atom_k, tma_k = cpasync.make_tiled_tma_atom(load, mK, box, (self.chunk, d))
        atom_v, tma_v = cpasync.make_tiled_tma_atom(load, mV, box, (self.chunk, d))
        self.bytes_q = 0  # the Q ring's barrier completes on the row loader's arrival (loads.load_q_rows)
        self.box_bytes = self.chunk * d * self.cache_dtype.width // 8
        self.bytes_k = self.bytes_v = cute.size_in_bytes(self.cache_dtype, one_stage(sKV_load_layout))

        q_elems = self.slice_elems * self.num_consumers
        kv_elems = cute.cosize(sK_layout)

        @cute.struct
        class SharedStorage16:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, q_elems], SMEM_ALIGN]  # Q, then O
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, kv_elems], SMEM_ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, kv_elems], SMEM_ALIGN]

        SharedStorage = SharedStorage16
        if const_expr(self.kv_fp8):
            kv8_elems = cute.cosize(sKV_load_layout)

            @cute.struct
            class SharedStorage8:  # an fp8 cache: the e4m3 stages and their rings besides
                mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
                mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
                mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
                mbar_k8: cute.struct.MemRange[cutlass.Int64, 2 * self.fp8_stages]
                mbar_v8: cute.struct.MemRange[cutlass.Int64, 2 * self.fp8_stages]
                q_scale: cute.struct.MemRange[Float32, 2]  # [0]: load_q_rows_as_fp16's inverse factor
                sQ: cute.struct.Align[cute.struct.MemRange[mma_dtype, q_elems], SMEM_ALIGN]  # Q, then O
                sK: cute.struct.Align[cute.struct.MemRange[mma_dtype, kv_elems], SMEM_ALIGN]
                sV: cute.struct.Align[cute.struct.MemRange[mma_dtype, kv_elems], SMEM_ALIGN]
                sK8: cute.struct.Align[cute.struct.MemRange[FP8, kv8_elems], SMEM_ALIGN]
                sV8: cute.struct.Align[cute.struct.MemRange[FP8, kv8_elems], SMEM_ALIGN]

            SharedStorage = SharedStorage8

        splits = 1
        if const_expr(self.split_kv):
            splits = mO.shape[3] if const_expr(self.packed_q) else mO.shape[3] // num_seqs
        grid = [cute.ceil_div(max_seqlen_q * group, self.tile_m), mK.shape[2], splits * num_seqs]
        self.kernel_kvcache(
            (mQ, tma_k, tma_v, mO),
            (mSeqlensK, mPageTable, mCuSeqlensQ, mKDescale, mVDescale),
            mLSE,
            (atom_k, atom_v),
            (tiled_mma_qk, tiled_mma_pv),
            (sQ_layout, sK_layout, sV_layout, sO_layout, sKV_load_layout),
            softmax_scale,
            window_left,
            window_right,
            SharedStorage,
            features=features,
        ).launch(grid=grid, block=[self.cfg.num_threads, 1, 1], stream=stream, **self.residency())

    def residency(self) -> dict:
        """The launch's CTAs per SM; for several, shared memory takes all of the L1 / shared split (100%) that
        they may share an SM (and the launch needs no device query for the split)."""
        if self.ctas_per_sm == 1:
            return dict(min_blocks_per_mp=1)
        return dict(min_blocks_per_mp=self.ctas_per_sm, preferred_smem_carveout=100)

    @cute.kernel
    def kernel_kvcache(
        self,
        tensors,  # (mQ rows view, K's and V's TMA coordinate tensors, mO rows view)
        cache_args,  # (mSeqlensK, mPageTable or None, mCuSeqlensQ or None, mKDescale, mVDescale or None)
        mLSE: cute.Tensor,
        atoms,  # (K's, V's)
        mmas,
        layouts,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        SharedStorage: cutlass.Constexpr,
        features=None,  # feature builds: (softcap, the sink view of gqa_sink_view or None)
    ):
        mQ, mK, mV, mO = tensors
        mSeqlensK, mPageTable, mCuSeqlensQ, mKDescale, mVDescale = cache_args
        sQ_layout, sK_layout = layouts[:2]
        sKV_load_layout = layouts[4]
        staging = None
        if const_expr(self.kv_fp8):
            warp_idx, tidx, storage, pipes, rings8 = self.prologue_fp8(atoms, SharedStorage)
            sK8 = storage.sK8.get_tensor(sKV_load_layout.outer, swizzle=sKV_load_layout.inner)
            sV8 = storage.sV8.get_tensor(sKV_load_layout.outer, swizzle=sKV_load_layout.inner)
            q_scale = storage.q_scale.get_tensor(cute.make_layout(2))
            staging = Staging(rings8.k, rings8.v, sK8, sV8, q_scale)
        else:
            warp_idx, tidx, storage, pipes = self.prologue(atoms, SharedStorage)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        _, sV, sO = self.v_and_o_smem(storage, layouts[:4])
        if const_expr(self.mma_dtype is not self.out_dtype):  # O's 16-bit type in Q's fp16 slots
            sO_layout = layouts[3]
            sO = cute.make_tensor(
                cute.recast_ptr(storage.sQ.data_ptr(), sO_layout.inner, dtype=self.out_dtype), sO_layout.outer
            )

        # Keys a sequence can hold: a length past it reads as the capacity (a broken contract, undefined results),
        # so that no page-table entry past a sequence's row is read (TMA zero-fills what lies past a dense cache).
        capacity = mK.shape[0]
        if const_expr(mPageTable is not None):
            capacity = mPageTable.shape[1] * self.page_size
        work = self.kvcache_work(mQ, mSeqlensK, mCuSeqlensQ, capacity, window_left, window_right)
        pipeline.pipeline_init_wait(self.cluster_shape())
        if work.active(self.tile_m):
            consumer_pipes = pipes
            if const_expr(self.v_by_consumers):
                tail = work.info.seqlen_k - (work.n_max - 1) * self.tile_n
                v_ring = converting_ring(
                    staging.v, staging.sV8, sV, self.head_dim, tail, tidx % WARPGROUP_THREADS, 0,
                    self.cfg.fp8_loads_ahead,
                )  # fmt: skip
                consumer_pipes = LoadPipelines(pipes.q, pipes.k, v_ring)
            consume = partial(self.consume, consumer_pipes, mmas, (sQ, sK, sV), (sO, mO, mLSE, mVDescale), ())
            if const_expr(features is not None):
                consume = partial(consume, features=features)
            self.roles_kvcache(
                warp_idx, tidx, pipes, atoms, (mQ, mK, mV, mPageTable, mKDescale), (sQ, sK, sV), consume, work,
                softmax_scale, staging,
            )  # fmt: skip

    @cute.jit
    def prologue_fp8(self, atoms, SharedStorage: cutlass.Constexpr):
        """The forward's prologue (`prologue`) with an fp8 cache's rings: TMA -> converter warps (e4m3 stages) and
        converter warps -> consumers (the 16-bit stages, full on CONVERTER_WARPS arrivals)."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)
        if const_expr(self.split_kv):
            cute.arch.griddepcontrol_launch_dependents()  # the combine kernel (PDL) may launch now; it waits for us
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        consumer_warps = self.num_consumers * WARPGROUP_THREADS // WARP_THREADS

        def ring(ptr, stages, producers, consumers, tx):
            return pipeline.PipelineTmaAsync.create(
                barrier_storage=ptr,
                num_stages=stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producers),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumers),
                tx_count=tx,
                defer_sync=True,
            )

        pipes = LoadPipelines(
            ring(storage.mbar_q.data_ptr(), 1, 1, consumer_warps, 0),
            ring(storage.mbar_k.data_ptr(), self.num_stages, CONVERTER_WARPS, consumer_warps, 0),
            ring(storage.mbar_v.data_ptr(), self.num_stages, CONVERTER_WARPS, consumer_warps, 0),
        )
        rings8 = LoadPipelines(
            None,
            ring(storage.mbar_k8.data_ptr(), self.fp8_stages, 1, CONVERTER_WARPS, self.bytes_k),
            ring(
                storage.mbar_v8.data_ptr(),
                self.fp8_stages,
                1,
                consumer_warps if const_expr(self.v_by_consumers) else CONVERTER_WARPS,
                self.bytes_v,
            ),  # fmt: skip
        )
        pipeline.pipeline_init_arrive(self.cluster_shape(), is_relaxed=True)
        return warp_idx, tidx, storage, pipes, rings8

    @cute.jit
    def kvcache_work(
        self, mQ, mSeqlensK, mCuSeqlensQ, capacity: Int32, window_left: Int32, window_right: Int32
    ) -> CtaWork:
        """This CTA's rows and key tiles (work.kvcache_cta_work)."""
        return kvcache_cta_work(
            mQ, mSeqlensK, mCuSeqlensQ, capacity, window_left, window_right, self.tile_m, self.tile_n,
            self.mask_kind, self.packed_q, self.split_kv,
        )  # fmt: skip

    @cute.jit
    def roles_kvcache(
        self,
        warp_idx: Int32,
        tidx: Int32,
        pipes,
        atoms,
        gmem,
        smem,
        consume: cutlass.Constexpr,
        work: CtaWork,
        softmax_scale: Float32,
        staging,  # Staging of an fp8 cache, else None
    ):
        """Warp 0: K / V by TMA (into the e4m3 stages of an fp8 cache); warp 1: the query rows; warps 2-3 with an
        fp8 cache: the conversion; the consumer warpgroups: the forward's consumers."""
        warp_group = warp_idx // 4
        if warp_group == 0:
            cute.arch.setmaxregister_decrease(self.cfg.producer_regs)
            if warp_idx == 0:
                self.produce(pipes if const_expr(staging is None) else staging, atoms, gmem, smem, work, staging)
            if warp_idx == 1:
                if work.n_max > work.n_min:
                    mQ, sQ = gmem[0], smem[0]
                    first = work.m_block * self.tile_m
                    q_batch = 0 if const_expr(self.packed_q) else work.batch
                    if const_expr(self.q_to_fp16):
                        load_q_rows_as_fp16(
                            pipes.q, mQ[None, None, work.head_kv, q_batch], sQ, staging.q_scale,
                            work.offset_q + first, work.seqlen_q - first, self.head_dim, self.tile_m,
                        )  # fmt: skip
                    else:
                        load_q_rows(
                            pipes.q, mQ[None, None, work.head_kv, q_batch], sQ, work.offset_q + first,
                            work.seqlen_q - first, self.dtype, self.head_dim, self.tile_m,
                        )  # fmt: skip
            if const_expr(staging is not None):
                if warp_idx >= FIRST_CONVERTER_WARP:
                    convert_cache_tiles(
                        staging, pipes, smem[1], smem[2], work.n_min, work.n_max,
                        tidx - FIRST_CONVERTER_WARP * WARP_THREADS, self.mma_dtype, self.head_dim, self.num_stages,
                        self.fp8_stages, self.cfg.fp8_loads_ahead, self.v_by_consumers,
                    )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(self.cfg.consumer_regs)
            scale = softmax_scale
            if const_expr(self.kv_fp8):  # the K descale of this (sequence, KV head) joins the score scale
                scale = softmax_scale * gmem[4][work.batch, work.head_kv]
            if const_expr(self.q_to_fp16):  # and the inverse of the queries' factor, once they are in
                if work.n_max > work.n_min:
                    consumer_wait(pipes.q, consumer_state(1))
                    scale = scale * staging.q_scale[0]
            consume(scale, work, warp_group - 1, tidx % WARPGROUP_THREADS, warp_idx % 4)

    @cute.jit
    def produce(self, rings, atoms, gmem, smem, work: CtaWork, staging=None):
        """K / V tiles into the stages of `rings` (the consumers' rings, or an fp8 cache's e4m3 ones)."""
        atom_k, atom_v = atoms
        _, mK, mV, mPageTable, _ = gmem
        sK, sV = smem[1], smem[2]
        if const_expr(staging is not None):
            sK, sV = staging.sK8, staging.sV8
        d = self.head_dim
        stages = self.num_stages if const_expr(staging is None) else self.fp8_stages
        k_tiles = cache_tiles(rings.k, atom_k, mK, sK, work.head_kv, self.chunk, d, self.box_bytes)
        v_tiles = cache_tiles(rings.v, atom_v, mV, sV, work.head_kv, self.chunk, d, self.box_bytes)
        load_cache_tiles(
            k_tiles, v_tiles, mPageTable, work.batch, work.info.seqlen_k, work.n_min, work.n_max, self.tile_n,
            self.chunk, self.page_size, stages,
        )  # fmt: skip

    @cute.jit
    def store_output(
        self, acc_O, lse, tiled_mma_o: cute.TiledMma, thr_o, out, work: CtaWork, consumer: Int32, tidx, warp_in_wg
    ):
        """O and LSE of this consumer's 64 rows, to their (token, head) places (an fp8 cache: O times the V descale
        of this (sequence, KV head))."""
        sO, mO, mLSE, mVDescale = out
        if const_expr(self.kv_fp8):
            acc_O.store(acc_O.load() * mVDescale[work.batch, work.head_kv])
        first = work.m_block * self.tile_m + consumer * ROWS_PER_CONSUMER
        rows_left = work.seqlen_q - first
        mO_rows = mO[None, None, work.head_kv, work.out_batch]
        first_row = work.offset_q + first
        if const_expr(self.split_kv):
            store_partial_o_rows(acc_O, self.head_dim_v, thr_o, mO_rows, first_row, rows_left)
        else:
            store_o_rows(
                acc_O, self.out_dtype, self.head_dim_v, tiled_mma_o, sO[None, None, consumer], mO_rows, first_row,
                rows_left, consumer, tidx,
            )  # fmt: skip
        store_lse_rows(lse, self.head_dim_v, thr_o, mLSE[None, work.head_kv, work.out_batch], first_row, rows_left)

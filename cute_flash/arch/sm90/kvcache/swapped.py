"""The swapped fp8-cache decoder of the sm90 KV-cache forward: Sᵀ = K·Qᵀ and Oᵀ = Vᵀ·Pᵀ on mma.sync, keys on the
M side, the e4m3 cache converted in registers.

Why: decoding packs the few query rows of a KV head (group x tokens: 4 .. 16) into a tile. The wgmma kernel
(flash_fwd.py) pads them to 64 rows (16x the useful tensor work at group 4), and an fp8 cache must first be
converted to fp16 in shared memory (wgmma reads 16-bit operands from there); together they kept it near 1.15x the
bf16 cache's speed where its bytes allow 2x. With keys on M of an m16n8k16 mma.sync the rows are its n = 8 (2x
padding at group 4), and K / V fragments come from the e4m3 stages through registers: nothing goes back to shared
memory.

CTA (grid, rows, key ranges, splits: work.py, as the wgmma kernel's): warp 0 loads K / V tiles by TMA into e4m3
stages (loads.py: pages, boxes, the consumers' order); warps 1..W each take tile_n / W keys of every stage and keep
their own online softmax (m, l, Oᵀ) over them; the epilogue merges the warps' states exactly (the split combine's
algebra) in shared memory (the K stages, free by then) and writes each row's O and LSE, or a split's partials.

Fragments (one warp; g = lane / 4, q = lane % 4; an m-tile is 16 keys):
  Sᵀ = K·Qᵀ    A = K (16 keys x 16 d): thread (g, q) holds keys g and g + 8. The reduction dimension d is
               permuted: k-block kb's logical columns (2q, 2q+1, 2q+8, 2q+9) are d 32q + 4kb + (0, 1, 2, 3), so
               that one 16-byte load holds four of a key's k-blocks and one word one k-block's a0 / a2 (the cvt of
               its low / high half). B = Qᵀ, the same permutation, converted once: row g, d [32q, 32q + 32).
  softmax      Sᵀ's columns are query rows: thread (g, q) holds rows 2q, 2q + 1 of keys g, g + 8, and a row's keys
               live in the 8 lanes of one q (OnlineSoftmax with threads_per_row 8, lane_stride 4).
  Pᵀ           B of Oᵀ += Vᵀ·Pᵀ wants keys on k (2q..) and rows on n (g): movmatrix transposes each 8 x 8 block of
               the fp16 P words.
  Oᵀ = Vᵀ·Pᵀ   A = Vᵀ (16 d x 16 keys), d permuted: m-tile mt's logical rows g / g + 8 are d 16g + 2mt / 16g + 2mt
               + 1, so that thread (g, q) reads d [16g, 16g + 16) of keys 2q, 2q+1, 2q+8, 2q+9 (four 16-byte
               loads serve all 8 m-tiles) and a byte permute pairs two keys' bytes of one d for each cvt.
The stages are TMA's 128-byte-swizzled rows (16-byte chunk c of row r at chunk c ^ (r % 8)); each quarter warp's
16-byte loads hit 8 distinct chunks: no bank conflicts.

e4m3 -> fp16 is exact; bf16 queries are scaled into fp16 by a power of two (loads.fp16_exponent), whose inverse
joins the score scale with k_descale; v_descale joins O. Keys past seqlen_k are masked and, in the tile that
crosses it, their V rows zeroed in registers (a page's rows past the sequence and stale stage rows hold anything).
Soft-capping and learnable sinks (spec.softcap / spec.sink, the `kvcache_features` entry) as in the wgmma kernel: the
tanh right after each Sᵀ product (common/softcap.py; the descale and the queries' factor are in its scale), the
sink folded into each row's denominator when the warps' states are merged (split builds leave it to the combine).
"""

from __future__ import annotations


import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync

from ....common.dsl_types import dsl_dtype
from ....common.inline_ptx import bits_float
from ....common.online_softmax import LN2, LOG2_E, OnlineSoftmax, add_values, lane_group_reduce
from ....common.softcap import apply_softcap, softcap_factors
from ....spec import AttentionSpec
from .. import wgmma
from ..cta import CtaWork
from ..flash_fwd import SMEM_ALIGN, one_stage
from ..pipelines import consumer_state, consumer_wait
from .convert import FP8
from .entries import KvCacheEntries
from .loads import cache_tiles, fp16_exponent, load_cache_tiles
from .tile_config import SWAPPED_ROWS_PER_TILE, SwappedTileConfig, chunk_rows
from .views import cache_view, gqa_rows_view, gqa_sink_view, gqa_stats_view
from .warp_ops import byte_perm, e4m3x4_to_f16x2x2, load_shared_v4, mma_f16_m16n8k16, pack_f16x2, transpose_8x8
from .work import kvcache_cta_work

HEAD_DIM = 128  # one 128-byte swizzle row per e4m3 key: the address arithmetic below
KEYS_PER_MMA = 16
COMBINE_BARRIER = 1  # named barrier of the consumer warps (0 is __syncthreads)
# prmt selectors pairing byte 2m (or 2m + 1) of two keys' words: (a.b0, b.b0, a.b1, b.b1) and (a.b2, b.b2, a.b3, b.b3)
PAIR_LOW_BYTES, PAIR_HIGH_BYTES = 0x5140, 0x7362


class Sm90KvCacheSwapped(KvCacheEntries):
    """Compiled once per (spec: q dtype, mask kind, page size; tile config; dense or packed q; split or not); the
    `kvcache` entry and its tensors are the wgmma kernel's (flash_fwd.Sm90FlashForwardKvCache.kvcache)."""

    def __init__(self, spec: AttentionSpec, cfg: SwappedTileConfig, split_kv: bool = False, packed_q: bool = False):
        assert spec.kvcache and spec.kv_fp8 and spec.head_dim == spec.head_dim_v == HEAD_DIM
        assert spec.mask in ("none", "causal", "local")
        self.dtype = dsl_dtype(spec.dtype)
        assert self.dtype in (cutlass.BFloat16, cutlass.Float16)
        self.q_to_fp16 = self.dtype is cutlass.BFloat16
        self.cfg = cfg
        self.tile_m, self.tile_n, self.num_stages = cfg.tile_m, cfg.tile_n, cfg.num_stages
        self.warps = cfg.consumer_warps
        self.row_tiles = cfg.row_tiles
        self.keys_per_warp = cfg.tile_n // cfg.consumer_warps
        assert self.keys_per_warp % KEYS_PER_MMA == 0, cfg
        self.key_tiles = self.keys_per_warp // KEYS_PER_MMA
        self.mask_kind = spec.mask
        self.page_size = spec.page_size
        self.chunk = chunk_rows(spec.page_size, cfg.tile_n)
        assert self.chunk % 8 == 0 and cfg.tile_n // self.chunk <= 32, "boxes of whole swizzle atoms, one per lane"
        self.split_kv = split_kv
        self.packed_q = packed_q
        self.softcap = spec.softcap
        self.sink = spec.sink and not split_kv  # (a split build's partials leave the sink to the combine)
        self.stage_bytes = cfg.tile_n * HEAD_DIM
        # The epilogue's per-warp states (W x rows x (d + 2) fp32) fit the K stages they reuse.
        assert 4 * self.warps * self.tile_m * (HEAD_DIM + 2) <= self.num_stages * self.stage_bytes, cfg

    @cute.jit
    def _launch_kvcache(
        self, mQ, mK, mV, mO, mLSE, mSeqlensK, mPageTable, mCuSeqlensQ, mKDescale, mVDescale, max_seqlen_q,
        softmax_scale, window_left, window_right, stream, features=None,
    ):  # fmt: skip
        group = mQ.shape[cute.rank(mQ) - 2] // mK.shape[2]
        if const_expr(features is not None and features[1] is not None):
            features = (features[0], gqa_sink_view(features[1], group))  # sink[row, KV head] (views.py)
        num_seqs = mSeqlensK.shape[0]
        mQ = gqa_rows_view(mQ, group)
        mO = gqa_rows_view(mO, group)
        mLSE = gqa_stats_view(mLSE, group, packed=self.packed_q and not self.split_kv)
        mK, mV = cache_view(mK), cache_view(mV)
        d = HEAD_DIM
        s_layout = wgmma.k_major_smem_layout(FP8, self.tile_n, d, self.num_stages)
        # One TMA box: `chunk` rows of a stage (loads.py), its layout the stage's rows [0, chunk).
        box = cute.composition(one_stage(s_layout), cute.make_layout((self.chunk, d), stride=(1, self.tile_n)))
        load = cpasync.CopyBulkTensorTileG2SOp()
        atom_k, tma_k = cpasync.make_tiled_tma_atom(load, mK, box, (self.chunk, d))
        atom_v, tma_v = cpasync.make_tiled_tma_atom(load, mV, box, (self.chunk, d))
        kv_elems = cute.cosize(s_layout)

        @cute.struct
        class SharedStorage:
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            sK: cute.struct.Align[cute.struct.MemRange[FP8, kv_elems], SMEM_ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[FP8, kv_elems], SMEM_ALIGN]

        splits = 1
        if const_expr(self.split_kv):
            splits = mO.shape[3] if const_expr(self.packed_q) else mO.shape[3] // num_seqs
        grid = [cute.ceil_div(max_seqlen_q * group, self.tile_m), mK.shape[2], splits * num_seqs]
        residency = dict(min_blocks_per_mp=self.cfg.ctas_per_sm)
        if const_expr(self.cfg.ctas_per_sm > 1):  # all of the L1 / shared split, that the CTAs share an SM
            residency["preferred_smem_carveout"] = 100
        self.kernel(
            mQ, (tma_k, tma_v), mO, mLSE, (mSeqlensK, mPageTable, mCuSeqlensQ, mKDescale, mVDescale),
            (atom_k, atom_v), s_layout, softmax_scale, window_left, window_right, SharedStorage, features,
        ).launch(grid=grid, block=[self.cfg.num_threads, 1, 1], stream=stream, **residency)  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        tmas,  # K's and V's TMA coordinate tensors (page_size, d, h_kv, pages)
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        cache_args,  # (mSeqlensK, mPageTable or None, mCuSeqlensQ or None, mKDescale, mVDescale)
        atoms,
        s_layout: cute.ComposedLayout,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        SharedStorage: cutlass.Constexpr,
        features=None,  # feature builds: (softcap, the sink view of views.gqa_sink_view or None)
    ):
        mSeqlensK, mPageTable, mCuSeqlensQ, mKDescale, mVDescale = cache_args
        tma_k, tma_v = tmas
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)
        if const_expr(self.split_kv):
            cute.arch.griddepcontrol_launch_dependents()  # the combine kernel (PDL) may launch now; it waits for us
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)

        def ring(ptr):
            return pipeline.PipelineTmaAsync.create(
                barrier_storage=ptr,
                num_stages=self.num_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.warps),
                tx_count=self.stage_bytes,
                defer_sync=True,
            )

        ring_k, ring_v = ring(storage.mbar_k.data_ptr()), ring(storage.mbar_v.data_ptr())
        pipeline.pipeline_init_arrive(None, is_relaxed=True)
        sK = storage.sK.get_tensor(s_layout.outer, swizzle=s_layout.inner)
        sV = storage.sV.get_tensor(s_layout.outer, swizzle=s_layout.inner)
        # Keys a sequence can hold (flash_fwd.kernel_kvcache: a length past it reads as the capacity).
        capacity = tma_k.shape[0]
        if const_expr(mPageTable is not None):
            capacity = mPageTable.shape[1] * self.page_size
        work = kvcache_cta_work(
            mQ, mSeqlensK, mCuSeqlensQ, capacity, window_left, window_right, self.tile_m, self.tile_n,
            self.mask_kind, self.packed_q, self.split_kv,
        )  # fmt: skip
        pipeline.pipeline_init_wait(None)
        if work.active(self.tile_m):
            if warp_idx == 0:
                k_tiles = cache_tiles(
                    ring_k, atoms[0], tma_k, sK, work.head_kv, self.chunk, HEAD_DIM, self.chunk * HEAD_DIM
                )
                v_tiles = cache_tiles(
                    ring_v, atoms[1], tma_v, sV, work.head_kv, self.chunk, HEAD_DIM, self.chunk * HEAD_DIM
                )
                load_cache_tiles(
                    k_tiles, v_tiles, mPageTable, work.batch, work.info.seqlen_k, work.n_min, work.n_max,
                    self.tile_n, self.chunk, self.page_size, self.num_stages,
                )  # fmt: skip
            else:
                scale = softmax_scale * mKDescale[work.batch, work.head_kv]
                self.consume(
                    warp_idx - 1, (ring_k, ring_v), (storage.sK.data_ptr(), storage.sV.data_ptr()), mQ, mO, mLSE,
                    mVDescale[work.batch, work.head_kv], work, scale, features,
                )  # fmt: skip

    @cute.jit
    def load_q(self, mQ_rows: cute.Tensor, first_row: Int32, rows_left: Int32, lane: Int32):
        """This thread's Qᵀ fragments, (2 words, 8 k-blocks, row tiles) of fp16 pairs, and the factor to undo in
        the scores (1 for fp16 q; bf16: loads.fp16_exponent's power of two, the same for the CTA's rows)."""
        g, q = lane // 4, lane % 4
        vals = cute.make_rmem_tensor((32, self.row_tiles), Float32)
        vals.fill(0.0)
        for t in cutlass.range_constexpr(self.row_tiles):
            row = t * SWAPPED_ROWS_PER_TILE + g
            if row < rows_left:
                chunks = cute.zipped_divide(mQ_rows[first_row + row, None], (8,))  # ((8), d / 8)
                for i in cutlass.range_constexpr(4):
                    r = cute.make_fragment_like(chunks[None, 0])
                    cute.autovec_copy(chunks[None, 4 * q + i], r)
                    for j in cutlass.range_constexpr(8):
                        vals[8 * i + j, t] = r[j].to(Float32)
        factor, inverse = Float32(1.0), Float32(1.0)
        if const_expr(self.q_to_fp16):
            amax = Float32(0.0)
            for i in cutlass.range(cute.size(vals), unroll_full=True):
                amax = cute.arch.fmax(amax, abs(vals[i]))
            amax = lane_group_reduce(amax, cute.arch.fmax, 32)
            e = fp16_exponent(amax)
            factor = bits_float((127 + 127 + 14 - e) << 23)
            inverse = bits_float((e - 14) << 23)
        frags = cute.make_rmem_tensor((2, 8, self.row_tiles), Int32)
        for t in cutlass.range_constexpr(self.row_tiles):
            for kb in cutlass.range_constexpr(8):
                for w in cutlass.range_constexpr(2):
                    j = 4 * kb + 2 * w
                    frags[w, kb, t] = pack_f16x2(vals[j, t] * factor, vals[j + 1, t] * factor)
        return frags, inverse

    @cute.jit
    def consume(
        self,
        warp: Int32,  # 0 .. W - 1
        rings,
        stage_ptrs,  # the K and V stages' shared-memory pointers
        mQ: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        v_descale: Float32,
        work: CtaWork,
        scale: Float32,  # softmax_scale x k_descale
        features=None,
    ):
        ring_k, ring_v = rings
        lane = cute.arch.lane_idx()
        g, q = lane // 4, lane % 4
        rt, kt_n = self.row_tiles, self.key_tiles
        first = work.m_block * self.tile_m
        q_batch = 0 if const_expr(self.packed_q) else work.batch
        qb, q_inverse = self.load_q(
            mQ[None, None, work.head_kv, q_batch], work.offset_q + first, work.seqlen_q - first, lane
        )
        scale_log2 = scale * q_inverse * LOG2_E
        if const_expr(self.softcap):  # T = tanh(S * pre_tanh) in place of S; its softmax at softcap * log2(e)
            pre_tanh, scale_log2 = softcap_factors(scale * q_inverse, features[0])
        softmax = OnlineSoftmax.create(scale_log2, 2 * rt, threads_per_row=8, lane_stride=4)
        acc_o = cute.make_rmem_tensor((4, rt, 8), Float32)  # (value, row tile, m-tile): the Oᵀ accumulators
        acc_o.fill(0.0)
        s = cute.make_rmem_tensor((2 * rt, 2 * kt_n), Float32)  # rows (t, e) = 2t + e, keys (kt, h) = 2kt + h
        vw = cute.make_rmem_tensor((4, 4, kt_n), Int32)  # V words (word, key row, m-tile of keys)

        # Shared-memory byte offsets of this thread's loads in a stage (module docstring).
        warp_row = warp * self.keys_per_warp
        k_base = cute.arch.make_warp_uniform(Int32(stage_ptrs[0].toint()))
        v_base = cute.arch.make_warp_uniform(Int32(stage_ptrs[1].toint()))
        k_offs = [(warp_row + g) * HEAD_DIM + (((2 * q + j) ^ g) << 4) for j in range(2)]
        v_rows = [2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9]
        v_offs = [(warp_row + r) * HEAD_DIM + ((g ^ (r % 8)) << 4) for r in v_rows]

        info = work.info
        group = mQ.shape[0][0]
        # Each held row's diagonal: the key aligned with its token (bottom-right), for the element mask.
        diags = cute.make_rmem_tensor(2 * rt, Int32)
        for t in cutlass.range_constexpr(rt):
            for e in cutlass.range_constexpr(2):
                diags[2 * t + e] = (first + t * SWAPPED_ROWS_PER_TILE + 2 * q + e) // group + info.offset
        right_masked = info.kv_right_masked_start(work.m_block) if const_expr(info.has_right_bound) else 0
        left_masked = info.kv_left_masked_end(work.m_block) if const_expr(info.has_left_bound) else 0

        k_state, v_state = consumer_state(self.num_stages), consumer_state(self.num_stages)
        for i in cutlass.range(work.n_max - work.n_min, unroll=1):
            n = work.n_max - 1 - i
            key0 = n * self.tile_n + warp_row  # this warp's first key of the tile
            # Sᵀ = K·Qᵀ
            consumer_wait(ring_k, k_state)
            k_stage = k_base + k_state.index * self.stage_bytes
            kw = [
                [load_shared_v4(k_stage + k_offs[j] + (KEYS_PER_MMA * kt + 8 * h) * HEAD_DIM) for j in range(2)]
                for kt in range(kt_n)
                for h in range(2)
            ]
            ring_k.consumer_release(k_state)
            k_state.advance()
            for kt in cutlass.range_constexpr(kt_n):
                for t in cutlass.range_constexpr(rt):
                    acc = [Float32(0.0)] * 4
                    for kb in cutlass.range_constexpr(8):
                        a0, a2 = e4m3x4_to_f16x2x2(kw[2 * kt][kb // 4][kb % 4])
                        a1, a3 = e4m3x4_to_f16x2x2(kw[2 * kt + 1][kb // 4][kb % 4])
                        acc = mma_f16_m16n8k16([a0, a1, a2, a3], [qb[0, kb, t], qb[1, kb, t]], acc)
                    for v in cutlass.range_constexpr(4):  # (key g + 8 (v // 2), row 2q + v % 2)
                        s[2 * t + v % 2, 2 * kt + v // 2] = acc[v]
            if const_expr(self.softcap):
                apply_softcap(s, pre_tanh)
            tail = (n + 1) * self.tile_n > info.seqlen_k
            needs_mask = tail | (i == 0)  # (the walk's first tile: where the right edge is, whatever block_info says)
            if const_expr(info.has_right_bound):
                needs_mask = needs_mask | (n >= right_masked)
            if const_expr(info.has_left_bound):
                needs_mask = needs_mask | (n < left_masked)
            if needs_mask:
                self.mask_scores(s, diags, key0 + g, info)
            row_scale = softmax.update(s, False)
            for t in cutlass.range_constexpr(rt):
                for e in cutlass.range_constexpr(2):
                    for mt in cutlass.range_constexpr(8):
                        acc_o[e, t, mt] = acc_o[e, t, mt] * row_scale[2 * t + e]
                        acc_o[2 + e, t, mt] = acc_o[2 + e, t, mt] * row_scale[2 * t + e]
            # Pᵀ as B fragments: (keys 2q.., row g) words of each 8-key half
            pb = [
                [[transpose_8x8(pack_f16x2(s[2 * t, 2 * kt + h], s[2 * t + 1, 2 * kt + h])) for h in range(2)]
                 for t in range(rt)]
                for kt in range(kt_n)
            ]  # fmt: skip
            # Oᵀ += Vᵀ·Pᵀ
            consumer_wait(ring_v, v_state)
            v_stage = v_base + v_state.index * self.stage_bytes
            for kt in cutlass.range_constexpr(kt_n):
                for r in cutlass.range_constexpr(4):
                    words = load_shared_v4(v_stage + v_offs[r] + KEYS_PER_MMA * kt * HEAD_DIM)
                    for w in cutlass.range_constexpr(4):
                        vw[w, r, kt] = words[w]
            ring_v.consumer_release(v_state)
            v_state.advance()
            if tail:  # V rows past the sequence: zeros (P is 0 there, but 0 x NaN is not)
                limit = info.seqlen_k - key0
                for kt in cutlass.range_constexpr(kt_n):
                    for r in cutlass.range_constexpr(4):
                        keep = Int32(0) - Int32(KEYS_PER_MMA * kt + v_rows[r] < limit)
                        for w in cutlass.range_constexpr(4):
                            vw[w, r, kt] = vw[w, r, kt] & keep
            for kt in cutlass.range_constexpr(kt_n):
                for mt in cutlass.range_constexpr(8):
                    sel = PAIR_LOW_BYTES if mt % 2 == 0 else PAIR_HIGH_BYTES
                    a0, a1 = e4m3x4_to_f16x2x2(byte_perm(vw[mt // 2, 0, kt], vw[mt // 2, 1, kt], sel))
                    a2, a3 = e4m3x4_to_f16x2x2(byte_perm(vw[mt // 2, 2, kt], vw[mt // 2, 3, kt], sel))
                    for t in cutlass.range_constexpr(rt):
                        acc = [acc_o[v, t, mt] for v in range(4)]
                        acc = mma_f16_m16n8k16([a0, a1, a2, a3], pb[kt][t], acc)
                        for v in cutlass.range_constexpr(4):
                            acc_o[v, t, mt] = acc[v]
        sink = features[1] if const_expr(self.sink) else None
        self.epilogue(warp, lane, softmax, acc_o, stage_ptrs[0], mO, mLSE, v_descale, work, sink)

    @cute.jit
    def mask_scores(self, s: cute.Tensor, diags: cute.Tensor, key_g: Int32, info):
        """-inf where a held row must not see a held key (keys key_g + 16 kt + 8 h; block_info's rule)."""
        for kt in cutlass.range_constexpr(self.key_tiles):
            for h in cutlass.range_constexpr(2):
                key = key_g + KEYS_PER_MMA * kt + 8 * h
                for r in cutlass.range_constexpr(cute.size(diags)):
                    visible = key < info.seqlen_k
                    if const_expr(info.has_right_bound):
                        visible = visible & (key <= diags[r] + info.right)
                    if const_expr(info.has_left_bound):
                        visible = visible & (key >= diags[r] - info.left)
                    s[r, 2 * kt + h] = s[r, 2 * kt + h] if visible else -Float32.inf

    @cute.jit
    def epilogue(
        self, warp: Int32, lane: Int32, softmax: OnlineSoftmax, acc_o: cute.Tensor, combine_ptr, mO, mLSE,
        v_descale: Float32, work: CtaWork, mSink=None,
    ):  # fmt: skip
        """Merges the warps' (m, l, Oᵀ) in shared memory and writes O and LSE of the CTA's rows (split: the fp32
        partials, O normalised, 0 / -inf for rows without keys). A sink (mSink: the sink view, unsplit builds) is
        one more term of each row's denominator (OnlineSoftmax.finalize's algebra): a row without keys gets O 0
        and LSE the sink."""
        g, q = lane // 4, lane % 4
        rows, d, warps = self.tile_m, HEAD_DIM, self.warps
        threads = warps * 32
        part_layout = cute.make_layout((d, rows, warps), stride=(1, d, d * rows))
        sPart = cute.make_tensor(cute.recast_ptr(combine_ptr, dtype=Float32), part_layout)
        stats_ptr = cute.recast_ptr(combine_ptr, dtype=Float32) + d * rows * warps
        sStats = cute.make_tensor(stats_ptr, cute.make_layout((2, rows, warps), stride=(1, 2, 2 * rows)))
        cute.arch.barrier(barrier_id=COMBINE_BARRIER, number_of_threads=threads)  # every warp is done with sK
        for t in cutlass.range_constexpr(self.row_tiles):
            for e in cutlass.range_constexpr(2):
                r = 2 * t + e
                row = t * SWAPPED_ROWS_PER_TILE + 2 * q + e
                for mt in cutlass.range_constexpr(8):
                    sPart[16 * g + 2 * mt, row, warp] = acc_o[e, t, mt]
                    sPart[16 * g + 2 * mt + 1, row, warp] = acc_o[2 + e, t, mt]
                total = lane_group_reduce(softmax.row_sum[r], add_values, 8, 4)
                if g == 0:
                    sStats[0, row, warp] = softmax.row_max[r]  # the raw score maximum, -inf for a row without keys
                    sStats[1, row, warp] = total
        cute.arch.barrier(barrier_id=COMBINE_BARRIER, number_of_threads=threads)
        elems = 8  # per thread and piece: one row's 8 consecutive d
        pieces = rows * d // elems
        tid = warp * 32 + lane
        first = work.m_block * rows
        mO_rows = mO[None, None, work.head_kv, work.out_batch]
        mLSE_rows = mLSE[None, work.head_kv, work.out_batch]
        for p in cutlass.range_constexpr(-(-pieces // threads)):
            piece = p * threads + tid
            row, d0 = piece // (d // elems), piece % (d // elems) * elems
            if piece < pieces and first + row < work.seqlen_q:
                # The merge weighs warp w by exp2((m_w - M) * c) (the row maximum M, c the clamped scale_log2), the
                # difference before the product, which cannot overflow where m * c would (a warp's own P used its
                # row_exponent_scale factor there, a hard max: online_softmax's docstring). top: the log2 shift of
                # the denominator, M * c or the sink's logit if larger (finalize's algebra).
                c = softmax.scale_log2
                top_raw = sStats[0, row, 0]
                for w in cutlass.range_constexpr(1, warps):
                    top_raw = cute.arch.fmax(top_raw, sStats[0, row, w])
                keys_log2 = top_raw * c  # may overflow to +-inf in the hard-max regime although keys exist
                top = keys_log2
                shift = Float32(0.0)  # log2 weight of the keys' terms against top: 0 where the keys dominate
                if const_expr(mSink is not None):
                    sink_log2 = mSink[first + row, work.head_kv] * LOG2_E
                    top = cute.arch.fmax(keys_log2, sink_log2)
                    top = 0.0 if top == -Float32.inf else top
                    # keys_log2 >= top also holds for +inf (inf - inf would be NaN); -inf without keys or where
                    # the sink outweighs an overflowed key term: every key weight 0.
                    shift = 0.0 if keys_log2 >= top else keys_log2 - top
                top_raw = 0.0 if top_raw == -Float32.inf else top_raw
                o = cute.make_rmem_tensor(elems, Float32)
                o.fill(0.0)
                total = Float32(0.0)
                for w in cutlass.range_constexpr(warps):
                    weight = cute.math.exp2((sStats[0, row, w] - top_raw) * c + shift, fastmath=True)
                    total = total + sStats[1, row, w] * weight
                    for j in cutlass.range_constexpr(elems):
                        o[j] = o[j] + sPart[d0 + j, row, w] * weight
                if const_expr(mSink is not None):
                    total = total + cute.math.exp2(sink_log2 - top, fastmath=True)
                empty = total == 0.0
                factor = 0.0 if empty else v_descale * cute.arch.rcp_approx(total)
                log2_sum = cute.math.log2(1.0 if empty else total, fastmath=True)
                lse = -Float32.inf if empty else (top + log2_sum) * LN2
                out = mO_rows[work.offset_q + first + row, None]
                chunk = cute.zipped_divide(out, (elems,))[None, d0 // elems]
                r_out = cute.make_fragment_like(chunk)
                for j in cutlass.range_constexpr(elems):
                    r_out[j] = (o[j] * factor).to(r_out.element_type)
                cute.autovec_copy(r_out, chunk)
                if d0 == 0:
                    mLSE_rows[work.offset_q + first + row] = lse

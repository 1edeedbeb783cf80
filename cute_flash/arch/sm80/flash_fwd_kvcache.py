"""sm80 KV-cache forward (spec.kvcache, `attention_with_kvcache`: serving): the skeleton of flash_fwd.py with its
hooks replaced where the rows and the keys come from elsewhere.

Grid (row tiles, KV heads, splits x batch). A CTA serves one KV head g of one sequence b: its rows are the (query
token s, query head j) pairs r = s * group + j of the heads g * group .. g * group + group - 1 (GQA packing as in
FlashAttention-4's pack_gqa), so the cache's K / V bytes are read once per group. Q rows are gathered by the
threads that load them (16-byte cp.async per chunk, from q[b, s, head] or, packed, q[cu_seqlens_q[b] + s, head]);
O and LSE are stored row by row to their (s, head) places. The mask uses each row's query position s, bottom-right
aligned per sequence (off_b = seqlen_k[b] - seqlen_q[b]): kvcache_blocks.PackedGqaBlocks.

Keys: seqlens_k[b] of them. A dense cache (page_size 0, (b, seqlen_cache, h_kv, d)) is read like the dense forward's
K / V; a paged cache (num_pages, page_size, h_kv, d) through page_table[b, key // page_size]: every K / V row a thread
loads finds its page itself (page_size is a compile-time constant, any value 1..256), and only keys below seqlens_k[b]
look their page up, so no page-table entry past the sequence's length is read.

Split build (`split_kv`): the CTA at z = split * b + batch walks the split-th run of its row tile's key tiles and
writes its normalised partial O and LSE in fp32 (dense q: at batch index z of (splits * b, sq, h, dv) /
(splits * b, h, sq); packed q: at index split of (splits, total_q, h, dv) / (splits, h, total_q)), which
common/split_combine.py merges. A sink joins split 0's partial only (the other splits pass -FLT_MAX in its place,
which adds nothing): exp(lse_0) then holds its term exactly once, so the combine's softmax-weighted merge is the full
softmax with the sink, and the combine needs no sink of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass.cute.nvgpu import cpasync

from ...common.acc_views import rows_cols_view
from ...common.online_softmax import FLT_MAX, LOG2_E
from ...common.packed import SeqRows
from ...spec import AttentionSpec
from ...common.e4m3 import HIGH_PAIR, LOW_PAIR, e4m3x2_to_16bit
from .flash_fwd import COPY_BITS, FwdFeatures, FwdParams, Sm80FlashForward, column_predicate, KVLoader
from .kvcache_blocks import PackedGqaBlocks
from .tile_config import FwdTileConfig


class KvCacheArgs(NamedTuple):
    """The KV-cache build's tensors besides FwdParams' (None where the build has none)."""

    mSeqlensK: cute.Tensor  # (b,) int32
    mPageTable: Optional[cute.Tensor]  # (b, max_pages) int32 (paged caches)
    mCuSeqlensQ: Optional[cute.Tensor]  # (b + 1,) int32 (packed q)
    mKDescale: Optional[cute.Tensor]  # (b, h_kv) fp32 (fp8 caches)
    mVDescale: Optional[cute.Tensor]


class KvCacheCta(NamedTuple):
    """What the hooks of one CTA read: its sequence, query heads per KV head, the sequence's page-table row (paged
    caches), V's descale (fp8 caches: O's last factor) and the (h,) sinks."""

    seq: SeqRows
    group: Int32
    page_row: Optional[cute.Tensor]
    v_descale: Optional[Float32]
    mSink: Optional[cute.Tensor]


class Sm80KvCacheForward(Sm80FlashForward):
    """Host signature (TVM-FFI, torch's current stream): (q, k_cache, v_cache, out, lse, seqlens_k, page_table,
    cu_seqlens_q, k_descale, v_descale, softmax_scale, window_left, window_right, softcap, sink, max_seqlen_q):
    the tensors of arch/base.KvCacheTensors (None where the build has none: page_table for a dense cache,
    cu_seqlens_q for dense q, the descales without spec.kv_fp8, sink without spec.sink), softcap read only by
    spec.softcap builds, max_seqlen_q only with packed q (the grid spans it). The split build's out / lse are the
    fp32 partials of the module docstring."""

    def __init__(self, spec: AttentionSpec, tile: FwdTileConfig, split_kv: bool = False, packed_q: bool = False):
        assert spec.kvcache and not spec.varlen
        super().__init__(spec, tile, split_kv=split_kv)
        self.page_size = spec.page_size
        self.packed_q = packed_q
        self.kv_fp8 = spec.kv_fp8
        assert 0 <= self.page_size <= 256
        if self.kv_fp8:
            # cp.async lands e4m3 in stages of their own; each block is converted into one 16-bit stage.
            assert self.d_pad % 32 == 0 and self.dv_pad % 32 == 0, "fp8 caches need head dims that are multiples of 32"
            self.smem_stages = 1

    def _raw_layout(self, cols: int) -> cute.Layout:
        """An fp8 stage buffer (tile_n, cols, stages), row-major: each 16-byte chunk is written (cp.async) and read
        (the conversion) by the same thread only, so it needs no swizzle."""
        return cute.make_ordered_layout((self.tile_n, cols, self.num_stages), order=(1, 0, 2))

    def extra_smem(self) -> dict:
        if not self.kv_fp8:
            return {}
        fp8 = cutlass.Float8E4M3FN
        return {
            "sK8": (fp8, cute.cosize(self._raw_layout(self.d_pad))),
            "sV8": (fp8, cute.cosize(self._raw_layout(self.dv_pad))),
        }

    def _fp8_copy(self, cols: int, dtype, atom_op) -> cute.TiledCopy:
        """Threads over a (rows, cols) tile 16 elements each (one 16-byte cp.async of e4m3, or their 16-bit
        conversion): the same thread owns the same 16 columns of a row in both."""
        threads_per_row = next(t for t in (8, 4, 2) if cols // 16 % t == 0)
        layout = cute.make_ordered_layout((self.num_threads // threads_per_row, threads_per_row), order=(1, 0))
        atom = cute.make_copy_atom(atom_op, dtype, num_bits_per_copy=COPY_BITS)
        return cute.make_tiled_copy_tv(atom, layout, cute.make_layout((1, 16)))

    # ------------------------------------------------------------------------------------------------------------
    # Host side.
    # ------------------------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSeqlensK: cute.Tensor,
        mPageTable: Optional[cute.Tensor],
        mCuSeqlensQ: Optional[cute.Tensor],
        mKDescale: Optional[cute.Tensor],
        mVDescale: Optional[cute.Tensor],
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        softcap: Float32,
        mSink: Optional[cute.Tensor],
        max_seqlen_q: Int32,
        stream,
    ):
        scale_log2, features = self._feature_args(softmax_scale, (softcap, mSink))
        layouts = self._shared_layouts_and_copies()
        SharedStorage = layouts[-1]
        batch = mSeqlensK.shape[0]
        group = mQ.shape[-2] // mK.shape[2]
        seqlen_q = mQ.shape[1]
        if cutlass.const_expr(self.packed_q):
            seqlen_q = max_seqlen_q
        row_tiles = cute.ceil_div(seqlen_q * group, self.tile_m)
        ctas_z = batch
        if cutlass.const_expr(self.split_kv):
            # dense q: partials (splits * b, ...); packed q: (splits, ...)
            ctas_z = mO.shape[0] * batch if self.packed_q else mO.shape[0]
        params = FwdParams(mQ, mK, mV, mO, mLSE, scale_log2, window_left, window_right, *layouts)
        args = KvCacheArgs(mSeqlensK, mPageTable, mCuSeqlensQ, mKDescale, mVDescale)
        self.kernel(params, args, features).launch(
            grid=(row_tiles, cute.size(mK.shape[2]), ctas_z),
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    # ------------------------------------------------------------------------------------------------------------
    # Device side.
    # ------------------------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, params: FwdParams, args: KvCacheArgs, features: FwdFeatures):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head_kv, z = cute.arch.block_idx()
        nbatch = args.mSeqlensK.shape[0]
        batch = z
        split = None
        if cutlass.const_expr(self.split_kv):
            split_idx = z // nbatch
            batch = z - split_idx * nbatch
            # (split, the partials' batch index, splits)
            split = (split_idx, split_idx if self.packed_q else z, cute.arch.grid_dim()[2] // nbatch)
        if cutlass.const_expr(self.mask == "causal"):
            m_block = cute.arch.grid_dim()[0] - 1 - m_block  # the bottom rows see the most keys: start them first
        mQ, mK = params.mQ, params.mK
        group = mQ.shape[-2] // mK.shape[2]
        offset_q = None
        seqlen_q = mQ.shape[1]
        if cutlass.const_expr(self.packed_q):
            # cu_seqlens_q and the lengths are not checked on the host (that would need their values): clamped here,
            # the sequence's rows into [0, total_q) and its keys into [0, capacity], so that no value makes the
            # kernel read or write outside q, out / lse, the page table or the cache (the sm90 kernels' rule).
            total_q = mQ.shape[0]  # (packed q: (total_q, h, d))
            offset_q = cutlass.min(cutlass.max(args.mCuSeqlensQ[batch], 0), total_q)
            seqlen_q = cutlass.min(cutlass.max(args.mCuSeqlensQ[batch + 1], offset_q), total_q) - offset_q
        capacity = mK.shape[1]  # a dense cache's rows per sequence, or a page's
        if cutlass.const_expr(self.page_size > 0):
            capacity = mK.shape[1] * args.mPageTable.shape[1]
        seqlen_k = cutlass.max(cutlass.min(args.mSeqlensK[batch], capacity), 0)
        seq = SeqRows(offset_q, None, seqlen_q, seqlen_k, batch)
        page_row = None
        if cutlass.const_expr(self.page_size > 0):
            page_row = args.mPageTable[batch, None]
        v_descale = None
        if cutlass.const_expr(self.kv_fp8):
            # The per-(sequence, KV head) descales are scalars of the CTA: K's joins the scores' factor (before the
            # tanh with softcap), V's O's last factor.
            k_descale = args.mKDescale[batch, head_kv]
            v_descale = args.mVDescale[batch, head_kv]
            if cutlass.const_expr(self.softcap):
                features = features._replace(pre_tanh=features.pre_tanh * k_descale)
            else:
                params = params._replace(scale_log2=params.scale_log2 * k_descale)
        ctx = KvCacheCta(seq, group, page_row, v_descale, features.mSink)
        if m_block * self.tile_m < seqlen_q * group:
            self.cta(params, tidx, m_block, head_kv, head_kv, seq, split, features, ctx)

    # ---- hooks of the skeleton ----------------------------------------------------------------------------------
    def block_info(self, seq: SeqRows, window_left, window_right, tidx, m_block, tiled_mma, ctx: KvCacheCta):
        """The packed rows' block arithmetic, with this thread's accumulator rows' query positions for the mask."""
        coords = rows_cols_view(
            tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        )
        row_pos = cute.make_rmem_tensor(cute.size(coords, mode=[0]), Int32)
        for r in range(cute.size(coords, mode=[0])):  # plain Python: unrolled at trace time
            row_pos[r] = (m_block * self.tile_m + coords[r, 0][0]) // ctx.group
        return PackedGqaBlocks(
            self.tile_m, self.tile_n, self.mask, seq.seqlen_q, seq.seqlen_k, window_left, window_right, ctx.group,
            row_pos,
        )  # fmt: skip

    def global_tiles(self, mQ, mK, mV, m_block, head, head_kv, seq: SeqRows):
        """Q is gathered row by row; a dense cache's K / V are the dense forward's, a paged one's are gathered."""
        if cutlass.const_expr(self.page_size > 0 or self.kv_fp8):
            return None, None, None  # (an fp8 cache's loads have copies of their own: `_fp8_loader`)
        gK = cute.local_tile(mK[seq.batch, None, head_kv, None], (self.tile_n, self.d_pad), (None, 0))
        gV = cute.local_tile(mV[seq.batch, None, head_kv, None], (self.tile_n, self.dv_pad), (None, 0))
        return None, gK, gV

    @cute.jit
    def _row(self, mX, row: Int32, head_kv: Int32, seq: SeqRows, group: Int32, index: Optional[Int32] = None):
        """The (d,) view of packed row `row` (query token row // group, head head_kv * group + row % group) of q or
        out ((b, sq, h, d), or packed (total_q, h, d) from the sequence's first row); index: the partials' batch
        index of the split build (packed partials: (splits, total_q, h, dv))."""
        s = row // group
        head = head_kv * group + (row - s * group)
        if cutlass.const_expr(self.packed_q):
            if cutlass.const_expr(index is None):
                return mX[seq.offset_q + s, head, None]
            return mX[index, seq.offset_q + s, head, None]
        return mX[seq.batch if index is None else index, s, head, None]

    @cute.jit
    def load_q(self, mQ, copy_qk, tQgQ, tQsQ, tQcQ, t0QcQ, tQpQ, m_block: Int32, head: Int32, seq: SeqRows, ctx):
        """cp.async of the tile's rows inside the sequence, each from its own (token, head) row of q."""
        vec = COPY_BITS // self.dtype.width
        rows = seq.seqlen_q * ctx.group
        row0 = m_block * self.tile_m + tQcQ[0][0]
        for m in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
            row = row0 + t0QcQ[0, m, 0][0]
            if row < rows:
                src = cute.tiled_divide(self._row(mQ, row, head, seq, ctx.group), (vec,))
                for k in cutlass.range_constexpr(cute.size(tQsQ.shape[2])):
                    _copy_chunk(copy_qk, src[None, tQcQ[0, m, k][1] // vec], tQsQ[None, m, k], tQpQ, m, k)

    def kv_loader(
        self, storage, sK, sV, mK, mV, copy_qk, copy_v, tKgK, tKsK, tKcK, t0KcK, tKpK, tVgV, tVsV, tVcV, t0VcV, tVpV,
        head_kv, seq, ctx,
    ):  # fmt: skip
        if cutlass.const_expr(self.kv_fp8):
            return self._fp8_loader(storage, sK, sV, mK, mV, head_kv, seq, ctx)
        if cutlass.const_expr(self.page_size == 0):
            return KVLoader(
                self, copy_qk, copy_v, tKgK, tKsK, tKcK, t0KcK, tKpK, tVgV, tVsV, tVcV, t0VcV, tVpV, seq.seqlen_k
            )
        return _PagedKVLoader(
            self, copy_qk, copy_v, mK, mV, ctx.page_row, head_kv, tKsK, tKcK, t0KcK, tKpK, tVsV, tVcV, t0VcV, tVpV,
            seq.seqlen_k,
        )  # fmt: skip

    def _fp8_loader(self, storage, sK, sV, mK, mV, head_kv, seq, ctx):
        """An fp8 cache's loads (the dense or paged loader, on e4m3 copies into the fp8 stages) with the conversion of
        each landed stage into the 16-bit tiles sK / sV (stage 0)."""
        tidx, _, _ = cute.arch.thread_idx()
        fp8 = cutlass.Float8E4M3FN
        load_op = cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL)
        parts = []
        for cols, width, mX, sX, raw in (
            (self.d_pad, self.head_dim, mK, sK, storage.sK8.get_tensor(self._raw_layout(self.d_pad))),
            (self.dv_pad, self.head_dim_v, mV, sV, storage.sV8.get_tensor(self._raw_layout(self.dv_pad))),
        ):
            copy8 = self._fp8_copy(cols, fp8, load_op)
            to16 = self._fp8_copy(cols, self.dtype, cute.nvgpu.CopyUniversalOp())
            coords = cute.make_identity_tensor((self.tile_n, cols))
            thr = copy8.get_slice(tidx)
            tXcX = thr.partition_S(coords)
            gX = None
            if cutlass.const_expr(self.page_size == 0):
                gX = thr.partition_S(
                    cute.local_tile(mX[seq.batch, None, head_kv, None], (self.tile_n, cols), (None, 0))
                )
            part16 = to16.get_slice(tidx).partition_D(sX[None, None, 0])
            parts.append(
                (copy8, gX, thr.partition_D(raw), tXcX, copy8.get_slice(0).partition_S(coords),
                 column_predicate(tXcX, width, cols), to16, part16)
            )  # fmt: skip
        (
            (copy_k8, tKgK, tKsK, tKcK, t0KcK, tKpK, to16_k, tKs16),
            (copy_v8, tVgV, tVsV, tVcV, t0VcV, tVpV, to16_v, tVs16),
        ) = parts
        if cutlass.const_expr(self.page_size == 0):
            inner = KVLoader(
                self, copy_k8, copy_v8, tKgK, tKsK, tKcK, t0KcK, tKpK, tVgV, tVsV, tVcV, t0VcV, tVpV, seq.seqlen_k
            )
        else:
            inner = _PagedKVLoader(
                self, copy_k8, copy_v8, mK, mV, ctx.page_row, head_kv, tKsK, tKcK, t0KcK, tKpK, tVsV, tVcV, t0VcV,
                tVpV, seq.seqlen_k,
            )  # fmt: skip
        return _Fp8Stages(inner, self.dtype == cutlass.BFloat16, tKsK, tKs16, to16_k, tKpK, tVsV, tVs16, to16_v, tVpV)

    @cute.jit
    def mask_scores(self, acc_rc, tScS_rc, t0ScS_rc, info, m_block: Int32, n_block: Int32, mask_seqlen, mask_window):
        """-inf where a row's query position must not see a key of `n_block` (common/mask.py's forward test, with
        each row's own position in place of its row index)."""
        num_rows = cute.size(acc_rc, mode=[0])
        num_cols = cute.size(acc_rc, mode=[1])
        thread_col = tScS_rc[0, 0][1] - t0ScS_rc[0, 0][1]  # columns in thread 0's (compile-time) frame
        key_base = n_block * self.tile_n + thread_col
        seqlen_limit = info.seqlen_k - key_base  # columns c0 >= this are past the sequence's keys
        if cutlass.const_expr(not (mask_window and info.has_right_bound)):
            if cutlass.const_expr(mask_seqlen):
                for c in cutlass.range_constexpr(num_cols):
                    past_end = t0ScS_rc[0, c][1] >= seqlen_limit
                    for r in cutlass.range_constexpr(num_rows):
                        acc_rc[r, c] = -Float32.inf if past_end else acc_rc[r, c]
        else:
            for r in cutlass.range_constexpr(num_rows):
                diag = info.row_pos[r] + info.offset - key_base
                col_end = diag + info.right + 1  # exclusive
                if cutlass.const_expr(mask_seqlen):
                    col_end = cutlass.min(col_end, seqlen_limit)
                if cutlass.const_expr(info.has_left_bound):
                    col_begin = diag - info.left
                    for c in cutlass.range_constexpr(num_cols):
                        c0 = t0ScS_rc[0, c][1]
                        outside = c0 >= col_end or c0 < col_begin
                        acc_rc[r, c] = -Float32.inf if outside else acc_rc[r, c]
                else:
                    for c in cutlass.range_constexpr(num_cols):
                        outside = t0ScS_rc[0, c][1] >= col_end
                        acc_rc[r, c] = -Float32.inf if outside else acc_rc[r, c]

    def output_scale(self, row_scale, ctx: KvCacheCta):
        """fp8 caches: V's descale joins O's last factor (the LSE does not depend on V)."""
        if cutlass.const_expr(self.kv_fp8):
            for r in range(cute.size(row_scale)):  # plain Python: unrolled at trace time
                row_scale[r] = row_scale[r] * ctx.v_descale
        return row_scale

    @cute.jit
    def sinks_log2(self, mSink, tScS_rc, m_block: Int32, head: Int32, seq: SeqRows, split, ctx):
        """sink[head of the row] * log2(e) of this thread's rows; in the split build split 0's only, -FLT_MAX (no
        weight, and no -inf arithmetic in finalize) in the others (module docstring)."""
        sinks = cute.make_rmem_tensor(cute.size(tScS_rc, mode=[0]), Float32)
        rows = seq.seqlen_q * ctx.group
        for r in cutlass.range_constexpr(cute.size(tScS_rc, mode=[0])):
            row = m_block * self.tile_m + tScS_rc[r, 0][0]
            value = Float32(0.0)
            if row < rows:
                value = mSink[head * ctx.group + row % ctx.group] * LOG2_E
            if cutlass.const_expr(split is not None):
                value = value if split[0] == 0 else Float32(-FLT_MAX)
            sinks[r] = value
        return sinks

    @cute.jit
    def store_partials(self, acc_O, lse, mO, mLSE, tiled_mma, tidx, m_block, head, out_batch, seqlen_q, ctx=None):
        """The split build's normalised fp32 O and LSE of this CTA's run, from registers to each row's place in the
        partials (at batch index `out_batch`, module docstring)."""
        coords = rows_cols_view(
            tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((self.tile_m, self.dv_pad)))
        )
        acc = rows_cols_view(acc_O)
        rows = seqlen_q * ctx.group
        for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
            row = m_block * self.tile_m + coords[r, 0][0]
            if row < rows:
                gO = self._row(mO, row, head, ctx.seq, ctx.group, out_batch)
                for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                    if cutlass.const_expr(self.head_dim_v == self.dv_pad):
                        gO[coords[r, c][1]] = acc[r, c]
                    else:
                        if coords[r, c][1] < self.head_dim_v:
                            gO[coords[r, c][1]] = acc[r, c]
                if coords[0, 0][1] == 0:
                    gLSE = self._lse_row(mLSE, row, head, ctx.seq, ctx.group, out_batch)
                    gLSE[0] = lse[r]

    @cute.jit
    def _lse_row(self, mLSE, row: Int32, head_kv: Int32, seq: SeqRows, group: Int32, index: Optional[Int32] = None):
        """A (1,) view of packed row `row`'s LSE entry: lse[b, head, s] ((b, h, sq)), packed lse[head, cu_q[b] + s]
        ((h, total_q)), or the split build's partials at batch index `index` ((splits * b, h, sq) / (splits, h,
        total_q))."""
        s = row // group
        head = head_kv * group + (row - s * group)
        if cutlass.const_expr(self.packed_q):
            if cutlass.const_expr(index is None):
                return cute.domain_offset((seq.offset_q + s,), mLSE[head, None])
            return cute.domain_offset((seq.offset_q + s,), mLSE[index, head, None])
        return cute.domain_offset((s,), mLSE[seq.batch if index is None else index, head, None])

    @cute.jit
    def store_lse(self, mLSE, lse, tOcO_rc, m_block: Int32, head: Int32, batch, seqlen_q: Int32, offset_q, ctx):
        """This thread's rows' LSE at their (token, head) places, from the lane that holds their column 0."""
        rows = seqlen_q * ctx.group
        if tOcO_rc[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = m_block * self.tile_m + tOcO_rc[r, 0][0]
                if row < rows:
                    gLSE = self._lse_row(mLSE, row, head, ctx.seq, ctx.group)
                    gLSE[0] = lse[r]

    @cute.jit
    def store_o(self, mO, tOrO, copy_o, thr_copy_o, cO, m_block: Int32, head: Int32, batch, seqlen_q, offset_q, ctx):
        """16-byte global stores of this thread's rows of the O tile, each to its own (token, head) row of out."""
        vec = COPY_BITS // self.dtype.width
        tOcO = thr_copy_o.partition_S(cO)
        t0OcO = copy_o.get_slice(0).partition_S(cO)
        tOpO = column_predicate(tOcO, self.head_dim_v, self.dv_pad)
        rows = seqlen_q * ctx.group
        row0 = m_block * self.tile_m + tOcO[0][0]
        for m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
            row = row0 + t0OcO[0, m, 0][0]
            if row < rows:
                dst = cute.tiled_divide(self._row(mO, row, head, ctx.seq, ctx.group), (vec,))
                for k in cutlass.range_constexpr(cute.size(tOrO.shape[2])):
                    _copy_chunk(copy_o, tOrO[None, m, k], dst[None, tOcO[0, m, k][1] // vec], tOpO, m, k)


@cute.jit
def _copy_chunk(tiled_copy, src, dst, col_pred, row: cutlass.Constexpr[int], chunk: cutlass.Constexpr[int]):
    """One 16-byte chunk of a gathered row (src or dst a view of its own row, not a tile partition), skipped where
    col_pred (a `column_predicate`, or None) marks head-dim padding."""
    if cutlass.const_expr(col_pred is None):
        cute.copy(tiled_copy, src, dst)
    else:
        if col_pred[0, row, chunk]:
            cute.copy(tiled_copy, src, dst)


@dataclass(frozen=True)
class _PagedKVLoader:
    """cp.async loads of one K or V block of a paged cache into a shared-memory stage (`KVLoader`'s interface):
    each row a thread loads is key n_block * tile_n + its row, found at cache[page_row[key // page_size], key %
    page_size, head_kv]. The tail block stops at seqlen_k (K rows past it are masked, V rows zero-filled) without
    looking those keys' pages up."""

    k: Sm80KvCacheForward
    copy_qk: cute.TiledCopy
    copy_v: cute.TiledCopy
    mK: cute.Tensor  # (num_pages, page_size, h_kv, d)
    mV: cute.Tensor  # (num_pages, page_size, h_kv, dv)
    page_row: cute.Tensor  # (max_pages,) int32
    head_kv: Int32
    tKsK: cute.Tensor
    tKcK: cute.Tensor
    t0KcK: cute.Tensor
    tKpK: Optional[cute.Tensor]
    tVsV: cute.Tensor
    tVcV: cute.Tensor
    t0VcV: cute.Tensor
    tVpV: Optional[cute.Tensor]
    seqlen_k: Int32

    def convert_K(self, stage):
        return stage  # (loads land in the 16-bit tiles the MMAs read)

    def convert_V(self, stage):
        return stage

    @cute.jit
    def load_K(self, n_block: Int32, stage, tail: cutlass.Constexpr[bool]):
        self._load(self.copy_qk, self.mK, self.tKsK, self.tKcK, self.t0KcK, self.tKpK, n_block, stage, tail, False)

    @cute.jit
    def load_V(self, n_block: Int32, stage, tail: cutlass.Constexpr[bool]):
        # Rows past seqlen_k are zero-filled: P is 0 there, but 0 * (stale NaN) would still poison O.
        self._load(self.copy_v, self.mV, self.tVsV, self.tVcV, self.t0VcV, self.tVpV, n_block, stage, tail, True)

    @cute.jit
    def _load(
        self,
        tiled_copy: cute.TiledCopy,
        cache: cute.Tensor,
        smem: cute.Tensor,
        coords: cute.Tensor,
        coords_t0: cute.Tensor,
        col_pred,
        n_block: Int32,
        stage,
        tail: cutlass.Constexpr[bool],
        zero_fill: cutlass.Constexpr[bool],
    ):
        key0 = n_block * self.k.tile_n + coords[0][0]
        for n in cutlass.range_constexpr(cute.size(smem.shape[1])):
            key = key0 + coords_t0[0, n, 0][0]
            if cutlass.const_expr(tail):
                if key < self.seqlen_k:
                    self._load_row(tiled_copy, cache, smem, coords, col_pred, key, n, stage)
                else:
                    if cutlass.const_expr(zero_fill):
                        smem[None, n, None, stage].fill(0)
            else:
                self._load_row(tiled_copy, cache, smem, coords, col_pred, key, n, stage)

    @cute.jit
    def _load_row(self, tiled_copy, cache, smem, coords, col_pred, key: Int32, n: cutlass.Constexpr[int], stage):
        vec = COPY_BITS // cache.element_type.width
        page_size = self.k.page_size
        # (a page index outside [0, num_pages) reads a page of the cache, never memory outside it: undefined results)
        page = cutlass.min(cutlass.max(self.page_row[key // page_size], 0), cache.shape[0] - 1)
        src = cute.tiled_divide(cache[page, key % page_size, self.head_kv, None], (vec,))
        for k in cutlass.range_constexpr(cute.size(smem.shape[2])):
            _copy_chunk(tiled_copy, src[None, coords[0, n, k][1] // vec], smem[None, n, k, stage], col_pred, n, k)


@dataclass(frozen=True)
class _Fp8Stages:
    """An fp8 cache's K / V: `inner` (a dense or paged loader) lands e4m3 blocks in the fp8 stages; once a block's
    stage has landed (the main loop's wait), each thread converts the 16-byte chunks it loaded itself (no other thread
    touches them) into the 16-bit tile the MMAs read, and a barrier publishes it. The tile's previous readers are done:
    a barrier of the main loop lies between them and this conversion. Padding columns (head dim < its padded width)
    are never loaded nor converted: the 16-bit tiles keep the zeros written there up front."""

    inner: object
    bf16: bool
    tKsK8: cute.Tensor  # this thread's fp8 chunks of the K stages (16, rows, chunks, stages)
    tKs16: cute.Tensor  # the same chunks of the 16-bit K tile (16, rows, chunks)
    to16_k: cute.TiledCopy
    tKpK: Optional[cute.Tensor]  # padding-column predicate of the K chunks, or None
    tVsV8: cute.Tensor
    tVs16: cute.Tensor
    to16_v: cute.TiledCopy
    tVpV: Optional[cute.Tensor]

    @cute.jit
    def load_K(self, n_block: Int32, stage, tail: cutlass.Constexpr[bool]):
        self.inner.load_K(n_block, stage, tail)

    @cute.jit
    def load_V(self, n_block: Int32, stage, tail: cutlass.Constexpr[bool]):
        self.inner.load_V(n_block, stage, tail)

    def convert_K(self, stage):
        """Converts K of fp8 stage `stage` (landed) into the 16-bit tile; the scores read its stage 0."""
        self._convert(self.tKsK8, self.tKs16, self.to16_k, self.tKpK, stage)
        return 0

    def convert_V(self, stage):
        self._convert(self.tVsV8, self.tVs16, self.to16_v, self.tVpV, stage)
        return 0

    @cute.jit
    def _convert(self, raw, dst, to16, col_pred, stage):
        for n in cutlass.range_constexpr(cute.size(raw.shape[1])):
            for k in cutlass.range_constexpr(cute.size(raw.shape[2])):
                if cutlass.const_expr(col_pred is None):
                    self._convert_chunk(raw[None, n, k, stage], dst[None, n, k], to16)
                else:
                    if col_pred[0, n, k]:
                        self._convert_chunk(raw[None, n, k, stage], dst[None, n, k], to16)
        cute.arch.barrier()

    @cute.jit
    def _convert_chunk(self, raw_chunk, dst_chunk, to16):
        r8 = cute.make_fragment_like(raw_chunk)
        cute.autovec_copy(raw_chunk, r8)
        r16 = cute.make_fragment_like(dst_chunk)
        words8 = cute.recast_tensor(r8, Uint32)
        words16 = cute.recast_tensor(r16, Uint32)
        for w in cutlass.range_constexpr(cute.size(words8)):
            words16[2 * w] = e4m3x2_to_16bit(words8[w], LOW_PAIR, self.bf16)
            words16[2 * w + 1] = e4m3x2_to_16bit(words8[w], HIGH_PAIR, self.bf16)
        cute.copy(to16, r16, dst_chunk)

"""sm80 attention forward: FlashAttention-2's design in CuTe DSL.

One CTA computes one (query block, head, batch) tile of O and its LSE. Warps split the query rows (tile_m / warps
each) and every warp spans the whole head dim, so a row's softmax needs only shuffles within a quad of lanes.
Per KV block:

    wait for K[n] -> start loading V (cp.async) -> S = Q K^T (ldmatrix + mma.sync, fp32)
    -> mask (boundary blocks only) -> online softmax in registers, rescale O
    -> wait for V[n] -> start loading the next K -> O += P V (P stays in registers, V^T read with ldmatrix.trans)

K and V live in `num_stages` swizzled shared-memory stages, so one block's loads overlap the previous block's math.
KV blocks are visited from the last to the first: the seqlen_k tail and the causal diagonal come first (masked), the
interior blocks run without any mask arithmetic, and local windows end with masked blocks on their left edge.

Tails are handled by predication: Q/K/V rows past the sequence ends are not loaded (V's are zero-filled, K's are
masked to -inf), head-dim padding (see tile_config) is zero-filled once, and only in-range rows of O and LSE are
stored. GQA reads kv head (head // (h / h_kv)) directly.

Soft-capping and sinks (spec.softcap / spec.sink, the "feature" entries of common/entries.py): S becomes
tanh(S * softmax_scale / softcap) before the mask and the softmax runs with scale softcap (common/softcap.py); each
thread reads its rows' sink from the (rows, h) view at the end and `OnlineSoftmax.finalize` folds it into the
denominator and the LSE. The split build leaves the sink out (its combine adds it).

Hooks (`block_info`, `global_tiles`, `load_q`, `kv_loader`, `mask_scores`, `sinks_log2`, `output_scale`,
`store_lse`, `store_o`, `store_partials`) are where the KV-cache forward (flash_fwd_kvcache.py) differs; the
defaults are this kernel's own steps, so its code is the same with or without them.

Split-key build (`split_kv`, decoding: arch/split_kv.py): grid (query blocks, heads, splits x batch); the CTA at
z = split * batch + b walks the split-th run of its query block's KV blocks and stores its normalised O and LSE in
fp32 straight from registers at batch index z of the (splits * b, sq, h, dv) / (splits * b, h, sq) partials, which
the combine kernel (common/split_combine.py) merges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Type

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp

from ...common.acc_views import rows_cols_view, sm80_acc_as_a_operand
from ...common.dsl_types import dsl_dtype
from ...common.block_info import BlockInfo, split_kv_range
from ...common.block_walk import walk_kv_blocks
from ...common.entries import FwdEntries
from ...common.grid import block_grid
from ...common.mask import apply_mask
from ...common.online_softmax import LOG2_E, OnlineSoftmax
from ...common.packed import SeqRows, cta_sequence, head_rows, head_stats
from ...common.softcap import apply_softcap, softcap_factors
from ...spec import AttentionSpec
from .tile_config import FwdTileConfig, row_chunk_elems

COPY_BITS = 128  # one cp.async / vector store moves 16 bytes
_DENSE = (None, None, None, None)  # no cu_seqlens_q / cu_seqlens_k / seqused_k / max_seqlen_q: dense tensors


def smem_layout_atom(dtype: Type[cutlass.Numeric], row_elems: int) -> cute.ComposedLayout:
    """8-row swizzled atom for a row-major tile of `row_elems` (a multiple of 16) 16-bit elements.

    The atom's row is as wide as the tile allows up to 128 bytes; the XOR swizzle spreads the 16-byte chunks that
    one ldmatrix phase reads (8 rows, same column) over distinct banks.
    """
    chunk = row_chunk_elems(row_elems)
    bits = {64: 3, 32: 2, 16: 1}[chunk]
    base = int(math.log2(16 // (dtype.width // 8)))  # 16-byte vectors are the swizzle unit
    return cute.make_composed_layout(
        cute.make_swizzle(bits, base, base), 0, cute.make_ordered_layout((8, chunk), order=(1, 0))
    )


def shared_storage(**fields) -> type:
    """A `cute.struct` of 1024-byte aligned shared-memory buffers, field name -> (dtype, elements), in order. (The
    annotations are built as objects: this module's postponed annotations would leave a class body's as strings.)"""
    annotations = {name: cute.struct.Align[cute.struct.MemRange[dt, n], 1024] for name, (dt, n) in fields.items()}
    return cute.struct(type("SharedStorage", (), {"__annotations__": annotations}))


def _split_mode(t: cute.Tensor, mode: int, size: int) -> cute.Tensor:
    """Views mode `mode` of t as (size, rest) so that t[..., (None, g), ...] selects the g-th group of `size`."""
    tiler = tuple(size if i == mode else None for i in range(cute.rank(t.layout)))
    return cute.make_tensor(t.iterator, cute.logical_divide(t.layout, tiler))


@cute.jit
def _gemm_b_streamed(tiled_mma, acc, tCrA, tCrB, tCsB, copy_B, load_A):
    """acc += A B, k-block by k-block, with B read from shared memory one ldmatrix (one N group) ahead of its MMAs.

    Streaming B a group at a time rather than a whole k-block ahead keeps the loads overlapped with the math while
    holding only two groups of B in registers, which is what lets the full O accumulator, the score tile and the
    fragments share 255 registers. load_A(k) (or None when A is already in registers) fetches A's k-block k.
    """
    tCrB_view = copy_B.retile(tCrB)  # (V, N groups, K)
    num_k = cute.size(tCrA.shape[2])
    num_groups = cute.size(tCrB_view.shape[1])
    atoms_per_group = cute.size(tCrB.shape[1]) // num_groups
    acc_g = _split_mode(acc, 2, atoms_per_group)  # (V, M, (atoms, groups))
    tCrB_g = _split_mode(tCrB, 1, atoms_per_group)  # (V, (atoms, groups), K)
    if cutlass.const_expr(load_A is not None):
        load_A(0)
    cute.copy(copy_B, tCsB[None, 0, 0], tCrB_view[None, 0, 0])
    for k in cutlass.range_constexpr(num_k):
        if cutlass.const_expr(load_A is not None and k + 1 < num_k):
            load_A(k + 1)
        for g in cutlass.range_constexpr(num_groups):
            g_next, k_next = (g + 1, k) if g + 1 < num_groups else (0, k + 1)
            if cutlass.const_expr(k_next < num_k):
                cute.copy(copy_B, tCsB[None, g_next, k_next], tCrB_view[None, g_next, k_next])
            acc_group = acc_g[None, None, (None, g)]
            cute.gemm(tiled_mma, acc_group, tCrA[None, None, k], tCrB_g[None, (None, g), k], acc_group)


def gemm_smem_smem(tiled_mma, acc, tCrA, tCrB, tCsA, tCsB, copy_A, copy_B):
    """acc += A B with both operands read from shared memory (A one k-block ahead, B one N group ahead)."""
    tCrA_view = copy_A.retile(tCrA)

    def load_A(k):
        cute.copy(copy_A, tCsA[None, None, k], tCrA_view[None, None, k])

    _gemm_b_streamed(tiled_mma, acc, tCrA, tCrB, tCsB, copy_B, load_A)


def gemm_reg_smem(tiled_mma, acc, tCrA, tCrB, tCsB, copy_B):
    """acc += A B with A already in registers (P) and B read from shared memory (V^T)."""
    _gemm_b_streamed(tiled_mma, acc, tCrA, tCrB, tCsB, copy_B, None)


def column_predicate(coords: cute.Tensor, limit: int, padded: int):
    """Per (vector, column-step) predicate of a gmem-copy partition: column < limit (rows are tested separately).

    None when the tile has no padding columns (limit == padded): unpredicated copies keep registers free.
    """
    if limit == padded:
        return None
    pred = cute.make_rmem_tensor(
        cute.make_layout(
            (cute.size(coords, mode=[0, 1]), cute.size(coords, mode=[1]), cute.size(coords, mode=[2])),
            stride=(cute.size(coords, mode=[2]), 0, 1),
        ),
        cutlass.Boolean,
    )
    for v in range(pred.shape[0]):  # plain Python: unrolled at trace time
        for k in range(pred.shape[2]):
            pred[v, 0, k] = cute.elem_less(coords[(0, v), 0, k][1], limit)
    return pred


def _partition_S(thr_copy, tile):
    """thr_copy's source partition of a global tile, or None where the kernel gathers the rows itself."""
    return None if tile is None else thr_copy.partition_S(tile)


def _slice_rows(pred, row: int):
    return None if pred is None else pred[None, row, None]


class FwdParams(NamedTuple):
    """The kernel's parameters, built by the launch and passed to `kernel` and `cta` as one argument."""

    mQ: cute.Tensor
    mK: cute.Tensor
    mV: cute.Tensor
    mO: cute.Tensor
    mLSE: cute.Tensor
    scale_log2: Float32
    window_left: Int32
    window_right: Int32
    sQ_layout: cute.ComposedLayout
    sK_layout: cute.ComposedLayout
    sV_layout: cute.ComposedLayout
    sO_layout: cute.ComposedLayout
    copy_qk: cute.TiledCopy
    copy_v: cute.TiledCopy
    copy_o: cute.TiledCopy
    tiled_mma: cute.TiledMma
    SharedStorage: object


class FwdFeatures(NamedTuple):
    """The runtime values of spec.softcap / spec.sink builds (None where the build has no such feature): the scores'
    factor before the tanh (common/softcap.py) and the (rows, h) fp32 sink view (arch/base.py); mods: the score_mod
    / mask_mod build's softmax_scale and tables (flash_fwd_mods.py)."""

    pre_tanh: object = None
    mSink: object = None
    mods: object = None


class Sm80FlashForward(FwdEntries):
    """Compile-time configuration of one forward kernel; `__call__` is the @cute.jit host entry.

    Host signature (TVM-FFI, torch's current stream): (q, k, v, out, lse, softmax_scale, window_left, window_right)
    with q (b, sq, h, d), k (b, sk, h_kv, d), v (b, sk, h_kv, dv), out (b, sq, h, dv), lse (b, h, sq) fp32.
    window_left / window_right are read only by the "local" mask.

    Packed (spec.varlen, host entry `packed`): (q, k, v, out, lse, softmax_scale, window_left, window_right,
    cu_seqlens_q, cu_seqlens_k, seqused_k or None, max_seqlen_q) with q (total_q, h, d), k (total_k, h_kv, d),
    v (total_k, h_kv, dv), out (total_q, h, dv), lse (h, total_q) fp32. The grid spans max_seqlen_q's query blocks
    for every sequence; a CTA whose block lies past its sequence's end exits at once (see common/packed.py).
    """

    def __init__(self, spec: AttentionSpec, tile: FwdTileConfig, split_kv: bool = False):
        """spec.varlen: packed q/k/v/out/lse with cu_seqlens (entry point `packed`), else dense (`__call__`);
        split_kv: the split-key build (dense only: out / lse are the fp32 partials)."""
        dtype, head_dim, head_dim_v = dsl_dtype(spec.dtype), spec.head_dim, spec.head_dim_v
        if dtype not in (cutlass.Float16, cutlass.BFloat16):
            raise TypeError("the sm80 forward kernel computes in fp16 or bf16")
        if head_dim % 8 or head_dim_v % 8:
            raise ValueError("head dims must be multiples of 8 (16-byte rows)")
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.mask = spec.mask
        self.tile = tile
        self.tile_m, self.tile_n = tile.tile_m, tile.tile_n
        self.d_pad, self.dv_pad = tile.head_dim_pad, tile.head_dim_v_pad
        self.num_threads = tile.num_threads
        self.num_stages = tile.num_stages
        # Stages of the 16-bit K / V tiles the MMAs read: the pipeline's, unless a subclass loads K / V into buffers
        # of their own and converts them into one stage (the KV-cache forward's fp8 caches).
        self.smem_stages = self.num_stages
        self.varlen = spec.varlen
        self.split_kv = split_kv
        self.softcap = spec.softcap
        self.sink = spec.sink
        assert not (split_kv and spec.varlen)
        assert self.tile_n % 16 == 0 and self.tile_m % (16 * tile.num_warps) == 0

    # ------------------------------------------------------------------------------------------------------------
    # Host side: layouts, copy atoms, MMA, launch.
    # ------------------------------------------------------------------------------------------------------------
    def _gmem_tiled_copy(self, atom_op, row_elems: int) -> cute.TiledCopy:
        """Threads tile a (rows, chunk) block 16 bytes each; chunk matches the smem atom width (no bank conflicts)."""
        vec = COPY_BITS // self.dtype.width
        threads_per_row = row_chunk_elems(row_elems) // vec
        thread_layout = cute.make_ordered_layout((self.num_threads // threads_per_row, threads_per_row), order=(1, 0))
        atom = cute.make_copy_atom(atom_op, self.dtype, num_bits_per_copy=COPY_BITS)
        return cute.make_tiled_copy_tv(atom, thread_layout, cute.make_layout((1, vec)))

    @cute.jit
    def _launch(
        self, mQ, mK, mV, mO, mLSE, softmax_scale, window_left, window_right, stream, packed=_DENSE, features=None
    ):
        """Every entry (`__call__`, `packed` and their `features` twins, common/entries.py); packed: (mCuSeqlensQ,
        mCuSeqlensK, mSeqUsedK, max_seqlen_q), all None for dense tensors; features: (softcap, mSink) of builds for
        spec.softcap / spec.sink (mSink None in the split build: its combine adds the sink)."""
        mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q = packed
        scale_log2, extras = self._feature_args(softmax_scale, features)
        layouts = self._shared_layouts_and_copies()
        SharedStorage = layouts[-1]
        num_m_blocks, heads, batch = block_grid(mQ, mQ, self.tile_m, mCuSeqlensQ, max_seqlen_q)
        grid = (num_m_blocks, cute.size(heads), cute.size(batch))
        if cutlass.const_expr(self.split_kv):
            grid = (num_m_blocks, cute.size(heads), cute.size(mO.shape[0]))  # (split, batch) pairs
        params = FwdParams(mQ, mK, mV, mO, mLSE, scale_log2, window_left, window_right, *layouts)
        self.kernel(params, (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK), extras).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream
        )

    def _shared_layouts_and_copies(self) -> tuple:
        """FwdParams' compile-time part: (sQ, sK, sV, sO layouts, copy_qk, copy_v, copy_o, tiled_mma, SharedStorage)."""
        qk_atom = smem_layout_atom(self.dtype, self.d_pad)
        v_atom = smem_layout_atom(self.dtype, self.dv_pad)
        sQ_layout = cute.tile_to_shape(qk_atom, (self.tile_m, self.d_pad), (0, 1))
        sK_layout = cute.tile_to_shape(qk_atom, (self.tile_n, self.d_pad, self.smem_stages), (0, 1, 2))
        sV_layout = cute.tile_to_shape(v_atom, (self.tile_n, self.dv_pad, self.smem_stages), (0, 1, 2))
        sO_layout = cute.tile_to_shape(v_atom, (self.tile_m, self.dv_pad), (0, 1))

        q_elems = max(cute.cosize(sQ_layout), cute.cosize(sO_layout))  # O is staged through Q's buffer

        SharedStorage = shared_storage(
            sQ=(self.dtype, q_elems), sK=(self.dtype, cute.cosize(sK_layout)), sV=(self.dtype, cute.cosize(sV_layout)),
            **self.extra_smem(),
        )  # fmt: skip

        load_op = cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL)
        copy_qk = self._gmem_tiled_copy(load_op, self.d_pad)
        copy_v = self._gmem_tiled_copy(load_op, self.dv_pad)
        copy_o = self._gmem_tiled_copy(cute.nvgpu.CopyUniversalOp(), self.dv_pad)

        # Warps stack along M; the N permutation of 16 lets one ldmatrix.x4 feed two n8 MMAs of the B operand.
        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)),
            (self.tile.num_warps, 1, 1),
            permutation_mnk=(self.tile.num_warps * 16, 16, 16),
        )
        return sQ_layout, sK_layout, sV_layout, sO_layout, copy_qk, copy_v, copy_o, tiled_mma, SharedStorage

    def extra_smem(self) -> dict:
        """Shared-memory buffers a subclass adds (`shared_storage`'s fields)."""
        return {}

    def _feature_args(self, softmax_scale, features):
        """(scale_log2, FwdFeatures) of the softmax: softmax_scale * log2(e), or with softcap the tanh's factors."""
        if cutlass.const_expr(features is None):
            return softmax_scale * LOG2_E, FwdFeatures()
        softcap, mSink = features
        if cutlass.const_expr(self.softcap):
            pre_tanh, scale_log2 = softcap_factors(softmax_scale, softcap)
            return scale_log2, FwdFeatures(pre_tanh, mSink)
        return softmax_scale * LOG2_E, FwdFeatures(None, mSink)

    # ------------------------------------------------------------------------------------------------------------
    # Device side.
    # ------------------------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, params: FwdParams, packed: tuple, features: FwdFeatures):
        """packed: (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK) of packed sequences, or three None."""
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        split = None
        if cutlass.const_expr(self.split_kv):
            # (split, batch index of the partials, splits)
            nbatch = params.mQ.shape[0]
            split = (batch // nbatch, batch, cute.arch.grid_dim()[2] // nbatch)
            batch = batch - split[0] * nbatch
        if cutlass.const_expr(self.mask == "causal"):
            # Bottom query blocks see the most keys: start them first so the short ones fill the tail of the grid.
            m_block = cute.arch.grid_dim()[0] - 1 - m_block
        seq, head_kv = cta_sequence(self.varlen, batch, head, params.mQ, params.mK, *packed)
        if cutlass.const_expr(self.varlen):
            # The grid spans the longest sequence's query blocks: the others' surplus blocks exit here.
            if m_block * self.tile_m < seq.seqlen_q:
                self.cta(params, tidx, m_block, head, head_kv, seq, None, features)
        else:
            self.cta(params, tidx, m_block, head, head_kv, seq, split, features)

    @cute.jit
    def cta(
        self,
        params: FwdParams,
        tidx: Int32,
        m_block: Int32,
        head: Int32,
        head_kv: Int32,
        seq: SeqRows,
        split=None,
        features: FwdFeatures = FwdFeatures(),
        ctx=None,
    ):
        """One (query block, head, sequence) tile; seq.offset_q / offset_k: the sequence's first rows in packed
        tensors (None: dense tensors, indexed by batch); split: the split-key build's (split, partials' batch
        index, splits); features: softcap's factor and the sink view (None where the build has none); ctx: what a
        subclass's hooks read besides (None here)."""
        (
            mQ, mK, mV, mO, mLSE, scale_log2, window_left, window_right, sQ_layout, sK_layout, sV_layout, sO_layout,
            copy_qk, copy_v, copy_o, tiled_mma, SharedStorage,
        ) = params  # fmt: skip
        batch, offset_q, seqlen_q = seq.batch, seq.offset_q, seq.seqlen_q
        info = self.block_info(seq, window_left, window_right, tidx, m_block, tiled_mma, ctx)
        n_block_min, n_block_max = info.kv_block_range(m_block)
        if cutlass.const_expr(split is not None):
            n_block_min, n_block_max = split_kv_range(n_block_min, n_block_max, split[0], split[2])

        # ---- global tiles of this CTA (None where a subclass gathers the rows itself) -------------------------------
        gQ, gK, gV = self.global_tiles(mQ, mK, mV, m_block, head, head_kv, seq)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sK_layout)
        sV = storage.sV.get_tensor(sV_layout)
        # V^T (dv, tile_n, stage): the B operand of O += P V, read with transposing ldmatrix.
        vt_layout = cute.make_ordered_layout((self.dv_pad, self.tile_n, self.smem_stages), order=(1, 0, 2))
        sVt = cute.composition(sV, vt_layout)

        # ---- gmem -> smem copies and their predicates ---------------------------------------------------------------
        thr_copy_qk = copy_qk.get_slice(tidx)
        thr_copy_v = copy_v.get_slice(tidx)
        tQgQ, tQsQ = _partition_S(thr_copy_qk, gQ), thr_copy_qk.partition_D(sQ)
        tKgK, tKsK = _partition_S(thr_copy_qk, gK), thr_copy_qk.partition_D(sK)
        tVgV, tVsV = _partition_S(thr_copy_v, gV), thr_copy_v.partition_D(sV)
        cQK = cute.make_identity_tensor((self.tile_m, self.d_pad))
        cKV = cute.make_identity_tensor((self.tile_n, self.d_pad))
        cV = cute.make_identity_tensor((self.tile_n, self.dv_pad))
        tQcQ = thr_copy_qk.partition_S(cQK)
        tKcK = thr_copy_qk.partition_S(cKV)
        tVcV = thr_copy_v.partition_S(cV)
        # Thread 0's coordinates are compile-time constants; comparing them with a limit shifted by this thread's
        # offset keeps the row tests to one compare each.
        t0QcQ = copy_qk.get_slice(0).partition_S(cQK)
        t0KcK = copy_qk.get_slice(0).partition_S(cKV)
        t0VcV = copy_v.get_slice(0).partition_S(cV)
        tQpQ = column_predicate(tQcQ, self.head_dim, self.d_pad)
        tKpK = column_predicate(tKcK, self.head_dim, self.d_pad)
        tVpV = column_predicate(tVcV, self.head_dim_v, self.dv_pad)

        if cutlass.const_expr(self.head_dim != self.d_pad):
            # Q K^T sums over the padded head dim: those columns must be zero in Q and in every K stage. cp.async never
            # writes them (predicated off), so zeroing them once up front is enough.
            for m in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
                for k in cutlass.range_constexpr(cute.size(tQsQ.shape[2])):
                    if not tQpQ[0, m, k]:
                        tQsQ[None, m, k].fill(0)
            for s in cutlass.range_constexpr(self.smem_stages):
                for n in cutlass.range_constexpr(cute.size(tKsK.shape[1])):
                    for k in cutlass.range_constexpr(cute.size(tKsK.shape[2])):
                        if not tKpK[0, n, k]:
                            tKsK[None, n, k, s].fill(0)

        # ---- MMA partitions and register fragments ----------------------------------------------------------------
        thr_mma = tiled_mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK[None, None, 0]))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt[None, None, 0]))
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.dv_pad)), Float32)
        acc_O.fill(0.0)

        ldsm = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
        ldsm_t = warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4)
        smem_copy_Q = cute.make_tiled_copy_A(cute.make_copy_atom(ldsm, self.dtype), tiled_mma).get_slice(tidx)
        smem_copy_K = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm, self.dtype), tiled_mma).get_slice(tidx)
        smem_copy_V = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm_t, self.dtype), tiled_mma).get_slice(tidx)
        tSsQ = smem_copy_Q.partition_S(sQ)
        tSsK = smem_copy_K.partition_S(sK)
        tOsVt = smem_copy_V.partition_S(sVt)

        # Coordinates of the score tile, partitioned like the accumulator (for masking).
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS_rc = rows_cols_view(thr_mma.partition_C(cS))
        t0ScS_rc = rows_cols_view(tiled_mma.get_slice(0).partition_C(cS))

        softmax = OnlineSoftmax.create(scale_log2, cute.size(rows_cols_view(acc_O), mode=[0]))

        # ---- prologue: Q, then the first stages of K and V ---------------------------------------------------------
        self.load_q(mQ, copy_qk, tQgQ, tQsQ, tQcQ, t0QcQ, tQpQ, m_block, head, seq, ctx)
        cute.arch.cp_async_commit_group()

        kv = self.kv_loader(
            storage, sK, sV, mK, mV, copy_qk, copy_v, tKgK, tKsK, tKcK, t0KcK, tKpK, tVgV, tVsV, tVcV, t0VcV, tVpV,
            head_kv, seq, ctx,
        )  # fmt: skip
        n_block_last = n_block_max - 1
        has_work = n_block_max > n_block_min
        for s in cutlass.range_constexpr(self.num_stages):
            if has_work and n_block_last - s >= n_block_min:
                kv.load_K(n_block_last - s, s, s == 0)
            cute.arch.cp_async_commit_group()
            if cutlass.const_expr(s < self.num_stages - 1):
                if has_work and n_block_last - s >= n_block_min:
                    kv.load_V(n_block_last - s, s, s == 0)
                cute.arch.cp_async_commit_group()

        step = _BlockStep(
            self, tiled_mma, thr_mma, kv, softmax, acc_O, tSrQ, tSrK, tOrVt, tSsQ, tSsK, tOsVt,
            smem_copy_Q, smem_copy_K, smem_copy_V, tScS_rc, t0ScS_rc, info, m_block, n_block_min, features.pre_tanh,
            self.score_context(features, head, seq),
        )  # fmt: skip

        # ---- main loop over KV blocks, last to first ------------------------------------------------------------
        read_stage = Int32(0)
        if has_work:
            # The last block is the seqlen_k tail (and on the diagonal for causal/local): always masked.
            read_stage = step.run(n_block_last, read_stage, is_first=True, mask_seqlen=True, mask_window=True)
            # Then blocks [n_block_min, n_block_last), right to left; only those crossing a window edge are masked.
            read_stage = walk_kv_blocks(info, m_block, n_block_min, n_block_last, step.walk_step, read_stage)

        # ---- epilogue: normalise, write LSE and O ------------------------------------------------------------------
        sinks_log2 = None
        if cutlass.const_expr(features.mSink is not None):
            sinks_log2 = self.sinks_log2(features.mSink, tScS_rc, m_block, head, seq, split, ctx)
        row_scale, lse = softmax.finalize(sinks_log2)
        softmax.rescale(rows_cols_view(acc_O), self.output_scale(row_scale, ctx))
        if cutlass.const_expr(split is not None):
            cute.arch.cp_async_wait_group(0)  # (a CTA with no KV block never waited for its Q load)
            self.store_partials(acc_O, lse, mO, mLSE, tiled_mma, tidx, m_block, head, split[1], seqlen_q, ctx)
        else:
            self.epilogue(
                acc_O, lse, mO, mLSE, sQ, sO_layout, copy_o, tiled_mma, tidx, m_block, head, batch, seqlen_q, offset_q,
                ctx,
            )  # fmt: skip

    # ---- hooks: what a subclass (the KV-cache forward, flash_fwd_kvcache.py) replaces ---------------------------
    def score_context(self, features, head, seq: SeqRows):
        """What `modify_scores` reads besides the tile (None here; the score_mod / mask_mod build's indices and
        tables, flash_fwd_mods.py)."""
        return None

    def modify_scores(self, acc_S: cute.Tensor, n_block: Int32, step: "_BlockStep"):
        """What happens to a tile's raw scores before the mask: soft-capping where spec.softcap (common/softcap.py),
        nothing otherwise."""
        if cutlass.const_expr(step.pre_tanh is not None):
            apply_softcap(acc_S, step.pre_tanh)  # before the mask: masked scores stay -inf

    def block_info(self, seq: SeqRows, window_left, window_right, tidx, m_block, tiled_mma, ctx):
        """Which key tiles the query tile visits and which need masking (common/block_info.py)."""
        return BlockInfo(self.tile_m, self.tile_n, self.mask, seq.seqlen_q, seq.seqlen_k, window_left, window_right)

    def global_tiles(self, mQ, mK, mV, m_block, head, head_kv, seq: SeqRows):
        """This CTA's Q tile and the K / V tiles of its (sequence, KV head), indexed by key tile."""
        batch, offset_q, offset_k = seq.batch, seq.offset_q, seq.offset_k
        gQ = cute.local_tile(head_rows(mQ, batch, head, offset_q), (self.tile_m, self.d_pad), (m_block, 0))
        gK = cute.local_tile(head_rows(mK, batch, head_kv, offset_k), (self.tile_n, self.d_pad), (None, 0))
        gV = cute.local_tile(head_rows(mV, batch, head_kv, offset_k), (self.tile_n, self.dv_pad), (None, 0))
        return gQ, gK, gV

    @cute.jit
    def load_q(self, mQ, copy_qk, tQgQ, tQsQ, tQcQ, t0QcQ, tQpQ, m_block: Int32, head: Int32, seq: SeqRows, ctx):
        """cp.async of the Q tile's rows inside the sequence."""
        q_row_limit = seq.seqlen_q - m_block * self.tile_m - tQcQ[0][0]
        for m in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
            if t0QcQ[0, m, 0][0] < q_row_limit:
                cute.copy(copy_qk, tQgQ[None, m, None], tQsQ[None, m, None], pred=_slice_rows(tQpQ, m))

    def kv_loader(
        self, storage, sK, sV, mK, mV, copy_qk, copy_v, tKgK, tKsK, tKcK, t0KcK, tKpK, tVgV, tVsV, tVcV, t0VcV, tVpV,
        head_kv, seq, ctx,
    ):  # fmt: skip
        """The K / V block loads of the main loop (`KVLoader`'s interface) into the 16-bit tiles sK / sV."""
        return KVLoader(
            self, copy_qk, copy_v, tKgK, tKsK, tKcK, t0KcK, tKpK, tVgV, tVsV, tVcV, t0VcV, tVpV, seq.seqlen_k
        )

    def output_scale(self, row_scale, ctx):
        """O's per-row factor at the end (1 / l, from finalize)."""
        return row_scale

    @cute.jit
    def mask_scores(self, acc_rc, tScS_rc, t0ScS_rc, info, m_block: Int32, n_block: Int32, mask_seqlen, mask_window):
        """-inf where a query row must not see a key of `n_block` (common/mask.py)."""
        apply_mask(acc_rc, tScS_rc, t0ScS_rc, info, m_block, n_block, mask_seqlen, mask_window)

    @cute.jit
    def sinks_log2(
        self, mSink: cute.Tensor, tScS_rc: cute.Tensor, m_block: Int32, head: Int32, seq: SeqRows, split, ctx
    ):
        """sink[row, head] * log2(e) of this thread's rows (`OnlineSoftmax.finalize`); mSink is the (rows, h) view
        of arch/base.py, its rows those of a dense sequence or of the packed (total_q, h) batch. Rows past the
        sequence's end (never stored) read nothing."""
        sinks = cute.make_rmem_tensor(cute.size(tScS_rc, mode=[0]), Float32)
        for r in cutlass.range_constexpr(cute.size(tScS_rc, mode=[0])):
            row = m_block * self.tile_m + tScS_rc[r, 0][0]
            index = row
            if cutlass.const_expr(seq.offset_q is not None):
                index = row + seq.offset_q
            value = Float32(0.0)
            if row < seq.seqlen_q:
                value = mSink[index, head]
            sinks[r] = value * LOG2_E
        return sinks

    @cute.jit
    def store_partials(self, acc_O, lse, mO, mLSE, tiled_mma, tidx, m_block, head, out_batch, seqlen_q, ctx=None):
        """The split-key build's normalised O and LSE of this CTA's run, fp32 straight from registers (few rows:
        decoding), at batch index `out_batch` of the partials."""
        coords = rows_cols_view(
            tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((self.tile_m, self.dv_pad)))
        )
        acc = rows_cols_view(acc_O)
        gO = head_rows(mO, out_batch, head)
        gLSE = head_stats(mLSE, out_batch, head)
        row_base = m_block * self.tile_m
        for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
            row = row_base + coords[r, 0][0]
            if row < seqlen_q:
                for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                    if cutlass.const_expr(self.head_dim_v == self.dv_pad):
                        gO[row, coords[r, c][1]] = acc[r, c]
                    else:
                        if coords[r, c][1] < self.head_dim_v:
                            gO[row, coords[r, c][1]] = acc[r, c]
                if coords[0, 0][1] == 0:
                    gLSE[row] = lse[r]

    @cute.jit
    def epilogue(
        self, acc_O, lse, mO, mLSE, sQ, sO_layout, copy_o, tiled_mma, tidx, m_block, head, batch, seqlen_q, offset_q,
        ctx=None,
    ):  # fmt: skip
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        sO = cute.make_tensor(sQ.iterator, sO_layout)
        thr_mma = tiled_mma.get_slice(tidx)

        # LSE: the lane holding column 0 of a row writes it.
        cO = cute.make_identity_tensor((self.tile_m, self.dv_pad))
        tOcO_rc = rows_cols_view(thr_mma.partition_C(cO))
        self.store_lse(mLSE, lse, tOcO_rc, m_block, head, batch, seqlen_q, offset_q, ctx)

        # O: registers -> smem (reusing Q's buffer once every warp is done with Q and V) -> 16-byte global stores.
        # A CTA with no KV block never waited for its Q load: drain it before its buffer is reused.
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype)
        smem_copy_O = cute.make_tiled_copy_C(store_atom, tiled_mma).get_slice(tidx)
        cute.copy(store_atom, smem_copy_O.retile(rO), smem_copy_O.partition_D(sO))
        cute.arch.barrier()

        thr_copy_o = copy_o.get_slice(tidx)
        tOsO = thr_copy_o.partition_S(sO)
        tOrO = cute.make_fragment_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, tOrO)
        self.store_o(mO, tOrO, copy_o, thr_copy_o, cO, m_block, head, batch, seqlen_q, offset_q, ctx)

    @cute.jit
    def store_lse(self, mLSE, lse, tOcO_rc, m_block: Int32, head: Int32, batch, seqlen_q: Int32, offset_q, ctx):
        """This thread's rows' LSE, from the lane that holds their column 0."""
        gLSE = head_stats(mLSE, batch, head, offset_q)
        row_base = m_block * self.tile_m
        if tOcO_rc[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = row_base + tOcO_rc[r, 0][0]
                if row < seqlen_q:
                    gLSE[row] = lse[r]

    @cute.jit
    def store_o(self, mO, tOrO, copy_o, thr_copy_o, cO, m_block: Int32, head: Int32, batch, seqlen_q, offset_q, ctx):
        """16-byte global stores of this thread's part of the O tile (tOrO, copy_o's partition), rows inside the
        sequence."""
        gO = cute.local_tile(head_rows(mO, batch, head, offset_q), (self.tile_m, self.dv_pad), (m_block, 0))
        tOgO = thr_copy_o.partition_D(gO)
        tOcO = thr_copy_o.partition_S(cO)
        t0OcO = copy_o.get_slice(0).partition_S(cO)
        tOpO = column_predicate(tOcO, self.head_dim_v, self.dv_pad)
        row_limit = seqlen_q - m_block * self.tile_m - tOcO[0][0]
        for m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
            if t0OcO[0, m, 0][0] < row_limit:
                cute.copy(copy_o, tOrO[None, m, None], tOgO[None, m, None], pred=_slice_rows(tOpO, m))


# The two helpers below are frozen dataclasses: the DSL treats calls on frozen objects inside runtime branches and
# loops as reads, whereas a mutable object there would have to be carried as loop state.
@dataclass(frozen=True)
class KVLoader:
    """cp.async loads of one K or V block into a shared-memory stage, predicated on seqlen_k for the tail block."""

    k: Sm80FlashForward
    copy_qk: cute.TiledCopy
    copy_v: cute.TiledCopy
    tKgK: cute.Tensor
    tKsK: cute.Tensor
    tKcK: cute.Tensor
    t0KcK: cute.Tensor
    tKpK: cute.Tensor
    tVgV: cute.Tensor
    tVsV: cute.Tensor
    tVcV: cute.Tensor
    t0VcV: cute.Tensor
    tVpV: cute.Tensor
    seqlen_k: Int32

    def convert_K(self, stage):
        """The 16-bit stage the scores read once K of `stage` has landed: the same (loads go to the MMAs' tiles)."""
        return stage

    def convert_V(self, stage):
        return stage

    @cute.jit
    def load_K(self, n_block: Int32, stage, tail: cutlass.Constexpr[bool]):
        # Rows past seqlen_k are skipped: their scores are masked to -inf, so stale smem there is harmless.
        self._load(self.copy_qk, self.tKgK, self.tKsK, self.tKcK, self.t0KcK, self.tKpK, n_block, stage, tail, False)

    @cute.jit
    def load_V(self, n_block: Int32, stage, tail: cutlass.Constexpr[bool]):
        # Rows past seqlen_k are zero-filled: P is 0 there, but 0 * (stale NaN) would still poison O.
        self._load(self.copy_v, self.tVgV, self.tVsV, self.tVcV, self.t0VcV, self.tVpV, n_block, stage, tail, True)

    @cute.jit
    def _load(
        self,
        tiled_copy: cute.TiledCopy,
        gmem: cute.Tensor,
        smem: cute.Tensor,
        coords: cute.Tensor,
        coords_t0: cute.Tensor,
        col_pred,
        n_block: Int32,
        stage,
        tail: cutlass.Constexpr[bool],
        zero_fill: cutlass.Constexpr[bool],
    ):
        """Block n_block of one operand (its copy partitions, coordinates, thread 0's coordinates, column predicate)
        into `stage`; the tail block only up to seqlen_k, its other rows zero-filled or left alone."""
        if cutlass.const_expr(tail):
            row_limit = self.seqlen_k - n_block * self.k.tile_n - coords[0][0]
            for n in cutlass.range_constexpr(cute.size(smem.shape[1])):
                if coords_t0[0, n, 0][0] < row_limit:
                    cute.copy(
                        tiled_copy,
                        gmem[None, n, None, n_block],
                        smem[None, n, None, stage],
                        pred=_slice_rows(col_pred, n),
                    )
                else:
                    if cutlass.const_expr(zero_fill):
                        smem[None, n, None, stage].fill(0)
        else:
            src, dst = gmem[None, None, None, n_block], smem[None, None, None, stage]
            cute.copy(tiled_copy, src, dst, pred=col_pred)


@dataclass(frozen=True)
class _BlockStep:
    """One KV block of the main loop: S = Q K^T, mask, online softmax, O += P V, with the K/V loads interleaved."""

    k: Sm80FlashForward
    tiled_mma: cute.TiledMma
    thr_mma: object
    kv: KVLoader
    softmax: OnlineSoftmax
    acc_O: cute.Tensor
    tSrQ: cute.Tensor
    tSrK: cute.Tensor
    tOrVt: cute.Tensor
    tSsQ: cute.Tensor
    tSsK: cute.Tensor
    tOsVt: cute.Tensor
    smem_copy_Q: object
    smem_copy_K: object
    smem_copy_V: object
    tScS_rc: cute.Tensor
    t0ScS_rc: cute.Tensor
    info: BlockInfo
    m_block: Int32
    n_block_min: Int32
    pre_tanh: object = None  # spec.softcap: softmax_scale / softcap, the scores' factor before the tanh
    score_ctx: object = None  # Sm80FlashForward.score_context: what modify_scores reads besides the tile

    @cute.jit
    def _wait_stage(self):
        # Groups are committed in the order Q, K, V, K, V, ...; leaving the newest 2*(stages-1) in flight means the
        # block about to be read has landed. The barrier also tells every warp that the others finished reading.
        cute.arch.cp_async_wait_group(2 * self.k.num_stages - 2)
        cute.arch.barrier()

    def walk_step(self, read_stage: Int32, n_block: Int32, mask_window: bool) -> Int32:
        """`run` for a block after the first, in the form `common.block_walk.walk_kv_blocks` calls."""
        return self.run(n_block, read_stage, is_first=False, mask_seqlen=False, mask_window=mask_window)

    @cute.jit
    def run(
        self,
        n_block: Int32,
        read_stage: Int32,
        is_first: cutlass.Constexpr[bool],
        mask_seqlen: cutlass.Constexpr[bool],
        mask_window: cutlass.Constexpr[bool],
    ) -> Int32:
        """Processes `n_block` from stage `read_stage`; returns the stage the next block will be read from."""
        stages = self.k.num_stages
        # The stage whose V was consumed one block ago receives V[n - stages + 1]; K[n - stages] reuses this block's K
        # stage right after Q K^T has read it.
        v_write_stage = read_stage
        next_read_stage = read_stage
        if cutlass.const_expr(stages > 1):
            v_write_stage = (read_stage + stages - 1) % stages
            next_read_stage = (read_stage + 1) % stages

        acc_S = cute.make_rmem_tensor(self.thr_mma.partition_shape_C((self.k.tile_m, self.k.tile_n)), Float32)
        acc_S.fill(0.0)
        self._wait_stage()
        k_stage = self.kv.convert_K(read_stage)
        n_v = n_block - (stages - 1)
        if n_v >= self.n_block_min:
            self.kv.load_V(n_v, v_write_stage, is_first and stages == 1)
        cute.arch.cp_async_commit_group()

        gemm_smem_smem(
            self.tiled_mma,
            acc_S,
            self.tSrQ,
            self.tSrK,
            self.tSsQ,
            self.tSsK[None, None, None, k_stage],
            self.smem_copy_Q,
            self.smem_copy_K,
        )

        if cutlass.const_expr(stages == 1):
            self._wait_stage()
            v_stage = self.kv.convert_V(read_stage)
            self._load_next_K(n_block, read_stage)

        self.k.modify_scores(acc_S, n_block, self)
        if cutlass.const_expr(mask_seqlen or (mask_window and self.info.has_right_bound)):
            self.k.mask_scores(
                rows_cols_view(acc_S),
                self.tScS_rc,
                self.t0ScS_rc,
                self.info,
                self.m_block,
                n_block,
                mask_seqlen,
                mask_window,
            )
        row_scale = self.softmax.update(rows_cols_view(acc_S), is_first)
        if cutlass.const_expr(not is_first):
            self.softmax.rescale(rows_cols_view(self.acc_O), row_scale)
        rP = cute.make_fragment_like(acc_S, self.k.dtype)
        rP.store(acc_S.load().to(self.k.dtype))

        if cutlass.const_expr(stages > 1):
            self._wait_stage()
            v_stage = self.kv.convert_V(read_stage)
            self._load_next_K(n_block, read_stage)

        gemm_reg_smem(
            self.tiled_mma,
            self.acc_O,
            sm80_acc_as_a_operand(rP),
            self.tOrVt,
            self.tOsVt[None, None, None, v_stage],
            self.smem_copy_V,
        )
        return next_read_stage

    @cute.jit
    def _load_next_K(self, n_block: Int32, stage: Int32):
        n_k = n_block - self.k.num_stages
        if n_k >= self.n_block_min:
            self.kv.load_K(n_k, stage, False)
        cute.arch.cp_async_commit_group()

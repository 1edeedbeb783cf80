"""The sm90 backward main kernel with a score_mod and / or a mask_mod (cute_flash/mods; the forward is
flash_fwd_mods.py): `Sm90ModsBackward`, the dense fp16 / bf16 backward (flash_bwd.py: TMA producer, wgmma consumers)
whose score hooks recompute each tile's modified, masked scores and fold score_mod's derivative into dS.

Per score, as in the forward: s = S · softmax_scale, s' = score_mod(s, b, h, q_idx, kv_idx), the exponent
s' · log2(e) − lse_log2 (without a score_mod: S · softmax_scale · log2(e) − lse_log2), −inf where not
mask_mod(b, h, q_idx, kv_idx) (applied to the exponent, after the scale: a scale of 0 never meets −inf · 0), then the
kernel's own causal / window / sequence-end masks. dS = P ⊙ (dP − D) ⊙ dscore_mod/ds (s): dQ and dK keep their
softmax_scale factor (ds / dS). The derivative (mods.score_derivative, forward-mode through the graph) is computed
where it costs least:

  - a constant (an added bias, ALiBi, T5: 1): a product by it (nothing for 1);
  - a function of the positions only (a score scaled per head): recomputed from them when dS is formed;
  - a function of the score (softcap as a score_mod): computed from S before the score_mod replaces it and kept in
    registers through the step (one more fragment the size of S).

A masked entry has P = 0: its dS is 0 whatever the derivative there (a select, where the derivative is not a
constant). The tables are the `mods` entry's a0 .. a3, score_mod's first (its derivative reads the same slots), then
mask_mod's.

Block-sparse builds (spec.block_sparse; a block mask, mods/call.tile_lists by key tile): the key tiles are taken with
the longest lists first and each walks its list of query tiles (`refine_work`; BwdWork.query_tiles: the producer,
the dQ warp and the consumers read the same list), masking every listed tile with the kernel's own mask, and
skipping the mask_mod on the tiles the block mask marks full (the flag loaded before the tile's products: a branch
uniform over the CTA). Without a block mask every key tile walks the query tiles of its causal / window range, with
the mask_mod on every tile. Packed sequences (spec.varlen, the `packed_mods` entry; no block lists): b is the
sequence, q_idx / kv_idx positions within it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ...common.acc_views import rows_cols_view
from ...common.mods_scores import ModsGraphs, ScoreContext
from ...mods.codegen import emit
from ...mods.graph import constant_result, score_derivative
from ...spec import ModsSpec
from .flash_bwd import BwdWork, Sm90FlashBackward, StepLoop
from .tile_config import BwdTileConfig


class KeyTileScores(NamedTuple):
    """The score hooks' context (StepLoop.score_ctx): the mods context and, in block-sparse builds, this key tile's
    full flags by query tile ((M,) int32), else None."""

    mods: ScoreContext
    full: object = None


class Sm90ModsBackward(ModsGraphs, Sm90FlashBackward):
    def __init__(self, spec: ModsSpec, cfg: BwdTileConfig, gqa: bool):
        assert not spec.softcap and not spec.sink, "score_mod / mask_mod builds without softcap / sinks"
        assert not (spec.varlen and spec.block_sparse), "packed builds take no block lists"
        super().__init__(spec, cfg, gqa, deterministic=False)
        self.init_graphs(spec)
        self.takes_features = True  # (the tables a0 .. a3, the block lists)
        self.block_sparse = spec.block_sparse
        # (a listed walk need not alternate query-tile parity: one dQ buffer)
        assert not spec.block_sparse or cfg.dq_red or cfg.dq_buffers == 1
        self.deriv_graph, self.deriv_constant = None, 1.0
        if self.score_graph is not None:
            deriv = score_derivative(self.score_graph)
            self.deriv_constant = constant_result(deriv)
            self.deriv_graph = deriv if self.deriv_constant is None else None
        # Where the derivative is kept: "score" (computed from S, a fragment through the step), "positions"
        # (recomputed with dS), or None (a constant).
        self.deriv_from = None
        if self.deriv_graph is not None:
            self.deriv_from = "score" if self.deriv_graph.uses("score") else "positions"

    @cute.jit
    def mods(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSElog2: cute.Tensor,
        mdPsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        a0: Optional[cute.Tensor],
        a1: Optional[cute.Tensor],
        a2: Optional[cute.Tensor],
        a3: Optional[cute.Tensor],
        mBlockCount: Optional[cute.Tensor],
        mBlockIndex: Optional[cute.Tensor],
        mBlockFull: Optional[cute.Tensor],
        mBlockTiles: Optional[cute.Tensor],
        stream: cuda.CUstream,
    ):
        """a0 .. a3: the graphs' tables (None past them); the block lists of a block-sparse build (mods/call.py's
        TileLists by key tile: counts (B, H, N) and query tiles (B, H, N, M) by launch position, full flags (B, H, N,
        M) by key tile, the key tile of each launch position (B, H, N), int32), else None."""
        tensors = (mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV)
        features = (softmax_scale, a0, a1, a2, a3, mBlockCount, mBlockIndex, mBlockFull, mBlockTiles)
        self._launch(tensors, softmax_scale, window_left, window_right, stream, None, (None, None), features=features)

    @cute.jit
    def packed_mods(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSElog2: cute.Tensor,
        mdPsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        a0: Optional[cute.Tensor],
        a1: Optional[cute.Tensor],
        a2: Optional[cute.Tensor],
        a3: Optional[cute.Tensor],
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mSeqUsedK: Optional[cute.Tensor],
        max_seqlen_k: Int32,
        stream: cuda.CUstream,
    ):
        """Packed sequences (spec.varlen; tensors as common/entries.BwdEntries.packed's, no semaphores, no block
        lists): the callables see b = the sequence, q_idx / kv_idx = positions within it."""
        tensors = (mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV)
        features = (softmax_scale, a0, a1, a2, a3, None, None, None, None)
        packed = (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_k)
        self._launch(tensors, softmax_scale, window_left, window_right, stream, packed, (None, None), features=features)

    def refine_work(self, work: BwdWork, features) -> BwdWork:
        """Block-sparse builds: the key tile at this CTA's launch position (the longest lists first) and its list of
        query tiles, right-aligned in the row (steps [tiles - count, tiles))."""
        if const_expr(not self.block_sparse):
            return work
        mCount, mIndex, _, mTiles = features[5:9]
        b = cutlass.min(work.batch, mCount.shape[0] - 1)
        h = cutlass.min(work.head, mCount.shape[1] - 1)
        position = cute.arch.block_idx()[0]
        tiles = Int32(mIndex.shape[3])
        count = cutlass.min(mCount[b, h, position], tiles)
        return work._replace(n_block=mTiles[b, h, position], m_min=tiles - count, m_max=tiles,
                             query_tiles=mIndex[b, h, position, None])  # fmt: skip

    def score_factors(self, softmax_scale: Float32, features, work: BwdWork):
        scale, *tables = features[:5]
        info = work.info
        ctx = self.mods_context(scale, tables, work.head, work.batch, info.seqlen_q, info.seqlen_k)
        full = None
        if const_expr(self.block_sparse and self.mask_graph is not None):
            mFull = features[7]
            b = cutlass.min(work.batch, mFull.shape[0] - 1)
            h = cutlass.min(work.head, mFull.shape[1] - 1)
            full = mFull[b, h, work.n_block, None]
        return self.mods_scale_log2(softmax_scale), None, None, KeyTileScores(ctx, full)

    def query_tile_setup(self, m_block: Int32, loop: StepLoop):
        """Block-sparse builds: whether query tile m_block is full for this key tile (no mask_mod there)."""
        full = loop.score_ctx.full
        return None if const_expr(full is None) else full[m_block] != 0

    def _bases(self, m_block: Int32, loop: StepLoop):
        return m_block * self.tile_m, loop.n_block * self.tile_n

    def modify_scores(self, acc_S: cute.Tensor, m_block: Int32, loop: StepLoop):
        """S -> score_mod(S · softmax_scale) in place; the derivative's fragment where it reads the score."""
        if const_expr(self.score_graph is None):
            return None
        s_rc = rows_cols_view(acc_S)
        factor, deriv = None, None
        if const_expr(self.deriv_from == "score"):
            factor = cute.make_fragment_like(acc_S)
            deriv = (self.deriv_graph, rows_cols_view(factor))
        q_base, k_base = self._bases(m_block, loop)
        kor = self.keys_on_rows
        self._mods_pass(s_rc, loop.coords_rc, q_base, k_base, loop.score_ctx.mods, self.score_graph, None, kor, deriv)
        return factor

    def mask_scores(self, s_rc: cute.Tensor, m_block: Int32, loop: StepLoop, tile_ctx=None) -> None:
        """The exponent -inf where mask_mod is False (except on a block mask's full tiles: tile_ctx)."""
        if const_expr(self.mask_graph is not None):
            q_base, k_base = self._bases(m_block, loop)
            kor, ctx = self.keys_on_rows, loop.score_ctx.mods
            if const_expr(tile_ctx is None):
                self._mods_pass(s_rc, loop.coords_rc, q_base, k_base, ctx, None, self.mask_graph, kor)
            else:
                self._masked_pass(s_rc, loop.coords_rc, q_base, k_base, ctx, tile_ctx, kor)

    def modify_score_grads(self, p_rc: cute.Tensor, ds_rc: cute.Tensor, m_block: Int32, factor, loop: StepLoop):
        """dS times score_mod's derivative (see the module docstring), 0 where P is."""
        if const_expr(self.deriv_from is None):
            if const_expr(self.deriv_constant != 1.0):
                for r in range(cute.size(ds_rc, mode=[0])):
                    for c in range(cute.size(ds_rc, mode=[1])):
                        ds_rc[r, c] = ds_rc[r, c] * Float32(self.deriv_constant)
        elif const_expr(self.deriv_from == "score"):
            f_rc = rows_cols_view(factor)
            for r in range(cute.size(ds_rc, mode=[0])):
                for c in range(cute.size(ds_rc, mode=[1])):
                    ds_rc[r, c] = _masked_product(p_rc[r, c], ds_rc[r, c], f_rc[r, c])
        else:
            ctx = loop.score_ctx.mods
            tables = ctx.tables[: self.score_tables]

            def one(r, c, idx, shared):
                d = emit(self.deriv_graph, idx, tables, shared)
                ds_rc[r, c] = _masked_product(p_rc[r, c], ds_rc[r, c], d)

            q_base, k_base = self._bases(m_block, loop)
            self.for_each_score(ds_rc, loop.coords_rc, q_base, k_base, ctx, self.keys_on_rows, one)


def _masked_product(p: Float32, ds: Float32, d: Float32) -> Float32:
    # (a masked score's P is 0: its gradient is 0 even where the derivative is not finite there)
    return Float32(cutlass.select_(p > Float32(0.0), ds * d, Float32(0.0)))

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
mask_mod's. A block mask's lists do not reach this kernel: every key tile walks the query tiles its causal / window
range gives, with the mask_mod on every tile.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ...common.acc_views import rows_cols_view
from ...common.mods_scores import ModsGraphs
from ...mods.codegen import emit
from ...mods.graph import constant_result, score_derivative
from ...spec import ModsSpec
from .flash_bwd import BwdWork, Sm90FlashBackward, StepLoop
from .tile_config import BwdTileConfig


class Sm90ModsBackward(ModsGraphs, Sm90FlashBackward):
    def __init__(self, spec: ModsSpec, cfg: BwdTileConfig, gqa: bool):
        assert not spec.varlen and not spec.softcap and not spec.sink, "dense score_mod / mask_mod builds only"
        super().__init__(spec, cfg, gqa, deterministic=False)
        self.init_graphs(spec)
        self.takes_features = True  # (the tables a0 .. a3)
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
        stream: cuda.CUstream,
    ):
        tensors = (mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV)
        tables = (softmax_scale, a0, a1, a2, a3)
        self._launch(tensors, softmax_scale, window_left, window_right, stream, None, (None, None), features=tables)

    def score_factors(self, softmax_scale: Float32, features, work: BwdWork):
        scale, *tables = features
        info = work.info
        ctx = self.mods_context(scale, tables, work.head, work.batch, info.seqlen_q, info.seqlen_k)
        return self.mods_scale_log2(softmax_scale), None, None, ctx

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
        self._mods_pass(s_rc, loop.coords_rc, q_base, k_base, loop.score_ctx, self.score_graph, None, kor, deriv)
        return factor

    def mask_scores(self, s_rc: cute.Tensor, m_block: Int32, loop: StepLoop) -> None:
        """The exponent -inf where mask_mod is False."""
        if const_expr(self.mask_graph is not None):
            q_base, k_base = self._bases(m_block, loop)
            kor = self.keys_on_rows
            self._mods_pass(s_rc, loop.coords_rc, q_base, k_base, loop.score_ctx, None, self.mask_graph, kor)

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
            ctx = loop.score_ctx
            tables = ctx.tables[: self.score_tables]

            def one(r, c, idx, shared):
                d = emit(self.deriv_graph, idx, tables, shared)
                ds_rc[r, c] = _masked_product(p_rc[r, c], ds_rc[r, c], d)

            q_base, k_base = self._bases(m_block, loop)
            self.for_each_score(ds_rc, loop.coords_rc, q_base, k_base, ctx, self.keys_on_rows, one)


def _masked_product(p: Float32, ds: Float32, d: Float32) -> Float32:
    # (a masked score's P is 0: its gradient is 0 even where the derivative is not finite there)
    return Float32(cutlass.select_(p > Float32(0.0), ds * d, Float32(0.0)))

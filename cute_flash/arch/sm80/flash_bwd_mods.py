"""The sm80 backward main kernel with a score_mod and / or a mask_mod (cute_flash/mods; the forward is
flash_fwd_mods.py): `Sm80ModsBackward`, whose `probs` hook recomputes the modified, masked scores of a tile and
folds score_mod's derivative into P.

Per score, as in the forward: s = S * softmax_scale, s' = score_mod(s, b, h, q_idx, kv_idx), -inf where not
mask_mod(b, h, q_idx, kv_idx) or outside the kernel's own mask; P = exp2(s' * log2(e) - lse_log2). Then
dS = P * dscore_mod/ds (s) * (dP - D): the derivative (mods.score_derivative, forward-mode through the graph) is
folded into the factor the kernel multiplies (dP - D) by, and dQ / dK keep their softmax_scale factor (ds / dS).
A masked score has P = 0, so its gradient is 0 whatever the derivative. The tables are the `mods` entry's a0 .. a3,
score_mod's first (its derivative reads the same slots), then mask_mod's.

Packed sequences (spec.varlen, the `packed_mods` entry: the plain packed backward's tensors and sequences, no
semaphores): b is the sequence, q_idx / kv_idx positions within it (the kernel's per-sequence tiles).
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ...mods.codegen import emit
from ...mods.graph import score_derivative
from ...spec import ModsSpec
from .flash_bwd import Sm80FlashBackward, acc_rows_cols
from ...common.mods_scores import ModsGraphs
from .tile_config import BwdTileConfig


class Sm80ModsBackward(ModsGraphs, Sm80FlashBackward):
    def __init__(self, spec: ModsSpec, config: BwdTileConfig, gqa: bool):
        super().__init__(spec, config, gqa)
        self.init_graphs(spec)
        self.deriv_graph = score_derivative(self.score_graph) if self.score_graph is not None else None

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
        self._launch(
            tensors, softmax_scale, window_left, window_right, stream, features=("mods", softmax_scale, a0, a1, a2, a3)
        )

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
        """Packed sequences (spec.varlen; tensors as common/entries.BwdEntries.packed's, no semaphores): the
        callables see b = the sequence, q_idx / kv_idx = positions within it."""
        assert self.varlen
        tensors = (mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV)
        packed = (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_k)
        features = ("mods", softmax_scale, a0, a1, a2, a3)
        self._launch(tensors, softmax_scale, window_left, window_right, stream, packed, features=features)

    def score_factors(self, softmax_scale, features):
        """(the softmax's scale_log2, the score context the kernel hands `probs`): with a score_mod the scores are
        scaled before it, so the softmax runs with log2(e)."""
        _, scale, *tables = features
        return self.mods_scale_log2(softmax_scale), (scale, *tables[: self.score_tables + self.mask_tables])

    @cute.jit
    def probs(
        self, acc_S, lse, scale_log2, tScS, m_block, n_block, blocks, seqlen_q, seqlen_k, window_left, window_right,
        head, batch, score_ctx,
    ):  # fmt: skip
        scale = score_ctx[0]
        tables = score_ctx[1:]
        score_tables = tables[: self.score_tables]
        mask_tables = tables[self.score_tables :]
        acc = acc_rows_cols(acc_S)
        factor = cute.make_fragment_like(acc_S)
        factor_rc = acc_rows_cols(factor)
        last_q = cutlass.max(seqlen_q - 1, 0)
        last_k = cutlass.max(seqlen_k - 1, 0)
        for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
            q_idx = cutlass.min(m_block * self.cfg.block_m + tScS[r, 0][0], last_q)
            for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                kv_idx = cutlass.min(n_block * self.cfg.block_n + tScS[0, c][1], last_k)
                idx = {"b": batch, "h": head, "q_idx": q_idx, "kv_idx": kv_idx}
                s = acc[r, c]
                d = Float32(1.0)
                if cutlass.const_expr(self.score_graph is not None):
                    scaled = {**idx, "score": s * scale}
                    d = emit(self.deriv_graph, scaled, score_tables)
                    s = emit(self.score_graph, scaled, score_tables)
                if cutlass.const_expr(self.mask_graph is not None):
                    s = Float32(cutlass.select_(emit(self.mask_graph, idx, mask_tables), s, -Float32.inf))
                acc[r, c] = s
                factor_rc[r, c] = d
        if blocks.tile_needs_mask(m_block, n_block):
            self._apply_mask(acc_S, tScS, m_block, n_block, seqlen_q, seqlen_k, window_left, window_right)
        probs = cute.make_fragment_like(acc_S)
        probs_rc = acc_rows_cols(probs)
        for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                p = cute.math.exp2(acc[r, c] * scale_log2 - lse[r], fastmath=True)
                probs_rc[r, c] = p
                # (a masked score's P is 0: its gradient is 0 even where the derivative is not finite there)
                acc[r, c] = Float32(cutlass.select_(p > Float32(0.0), p * factor_rc[r, c], Float32(0.0)))
        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(probs.load().to(self.dtype))
        return rP

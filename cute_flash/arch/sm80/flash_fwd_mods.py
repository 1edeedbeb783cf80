"""The sm80 forward with a score_mod and / or a mask_mod (cute_flash/mods): `Sm80ModsForward`, the dense forward
whose `modify_scores` hook applies the traced callables to every score of every key tile (codegen.emit, one scalar
expression per element), before the kernel's own causal / window / sequence-end masks.

Per score: s = S * softmax_scale; s = score_mod(s, b, h, q_idx, kv_idx); s = -inf where not mask_mod(b, h, q_idx,
kv_idx). The softmax then runs with log2(e) as its scale (the scores are scaled already). q_idx / kv_idx are the
positions within the sequence, clamped to the last row / key before the callables read their tables (positions past
the sequence are masked by the kernel anyway), h the query head, b the batch index. Every key tile the causal /
window range leaves is visited (no block mask yet), and the build is dense and unsplit (its backward:
flash_bwd_mods.py).

The captured tensors are the `mods` entry's a0 .. a3 (None past the graphs' tables), stored as the graphs read them
(float32, int32, or uint8 for booleans: mods/call.py converts them), score_mod's tables first, then mask_mod's.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ...common.acc_views import rows_cols_view
from ...common.online_softmax import LOG2_E
from ...mods.codegen import emit
from ...mods.graph import MAX_TABLES, ModGraph, Node
from ...spec import ModsSpec
from .flash_fwd import FwdFeatures, Sm80FlashForward
from .tile_config import FwdTileConfig


class ScoreContext(NamedTuple):
    scale: object
    tables: tuple
    head: object
    batch: object
    last_q: object
    last_k: object


def graph_of(key: Optional[tuple]) -> Optional[ModGraph]:
    """A ModGraph from its key (spec.score_mod / spec.mask_mod): the nodes and tables' types, no values."""
    if key is None:
        return None
    kind, nodes, aux_types = key
    return ModGraph(kind, tuple(Node(*n) if not isinstance(n, Node) else n for n in nodes), (), aux_types)


class ModsGraphs:
    """What both mods kernels (this forward, flash_bwd_mods.py's backward) read of a ModsSpec: its graphs and how
    many of the tables a0 .. a3 each one takes."""

    def init_graphs(self, spec: ModsSpec) -> None:
        self.score_graph = graph_of(spec.score_mod)
        self.mask_graph = graph_of(spec.mask_mod)
        self.score_tables = len(self.score_graph.aux_types) if self.score_graph is not None else 0
        self.mask_tables = len(self.mask_graph.aux_types) if self.mask_graph is not None else 0
        assert self.score_tables + self.mask_tables <= MAX_TABLES


class Sm80ModsForward(ModsGraphs, Sm80FlashForward):
    def __init__(self, spec: ModsSpec, tile: FwdTileConfig):
        super().__init__(spec, tile)
        self.init_graphs(spec)

    @cute.jit
    def mods(
        self,
        mQ: cute.Tensor,  # q: batch x seqlen_q x heads x head_dim
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        a0: Optional[cute.Tensor],
        a1: Optional[cute.Tensor],
        a2: Optional[cute.Tensor],
        a3: Optional[cute.Tensor],
        stream: cuda.CUstream,
    ):
        self._launch(
            mQ, mK, mV, mO, mLSE, softmax_scale, window_left, window_right, stream,
            features=(softmax_scale, a0, a1, a2, a3),
        )  # fmt: skip

    def _feature_args(self, softmax_scale, features):
        scale, a0, a1, a2, a3 = features
        scale_log2 = Float32(LOG2_E) if self.score_graph is not None else softmax_scale * LOG2_E
        return scale_log2, FwdFeatures(None, None, (scale, a0, a1, a2, a3))

    def score_context(self, features, head, seq):
        scale, *tables = features.mods
        last_q = cutlass.max(seq.seqlen_q - 1, 0)
        last_k = cutlass.max(seq.seqlen_k - 1, 0)
        return ScoreContext(scale, tuple(tables[: self.score_tables + self.mask_tables]), head, seq.batch, last_q,
                            last_k)  # fmt: skip

    def modify_scores(self, acc_S: cute.Tensor, n_block: Int32, step):
        ctx: ScoreContext = step.score_ctx
        acc_rc = rows_cols_view(acc_S)
        coords = step.tScS_rc
        score_tables = ctx.tables[: self.score_tables]
        mask_tables = ctx.tables[self.score_tables :]
        q_base = step.m_block * self.tile_m
        k_base = n_block * self.tile_n
        for r in range(cute.size(acc_rc, mode=[0])):  # (plain loops: this hook runs at trace time, unrolled)
            q_idx = cutlass.min(q_base + coords[r, 0][0], ctx.last_q)
            for c in range(cute.size(acc_rc, mode=[1])):
                kv_idx = cutlass.min(k_base + coords[r, c][1], ctx.last_k)
                idx = {"b": ctx.batch, "h": ctx.head, "q_idx": q_idx, "kv_idx": kv_idx}
                s = acc_rc[r, c]
                if self.score_graph is not None:
                    s = emit(self.score_graph, {**idx, "score": s * ctx.scale}, score_tables)
                if self.mask_graph is not None:
                    visible = emit(self.mask_graph, idx, mask_tables)
                    s = Float32(cutlass.select_(visible, s, -Float32.inf))
                acc_rc[r, c] = s

"""The score_mod / mask_mod step every mods forward kernel shares (cute_flash/mods; the sm80 and sm90 kernels'
`modify_scores` hooks): the graphs a ModsSpec carries, and their application to one tile of scores.

Per score: s = S * softmax_scale; s = score_mod(s, b, h, q_idx, kv_idx); s = -inf where not mask_mod(b, h, q_idx,
kv_idx). The kernel's softmax then runs with log2(e) as its scale where a score_mod is present (the scores are scaled
already). q_idx / kv_idx are positions within the sequence, clamped to its last row / key before the callables read
their tables (positions past the sequence are masked by the kernel anyway).

The captured tensors are the `mods` entries' a0 .. a3 (None past the graphs' tables), stored as the graphs read them
(float32, int32, or uint8 for booleans: mods/call.py converts them), score_mod's tables first, then mask_mod's.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from ..mods.codegen import emit
from ..mods.graph import MAX_TABLES, ModGraph, Node
from ..spec import ModsSpec
from .acc_views import rows_cols_view
from .online_softmax import LOG2_E


class ScoreContext(NamedTuple):
    """What `ModsGraphs.apply_mods` reads besides the scores: softmax_scale, the tables, the (batch, head) and
    the last query row / key of the sequence (the clamp)."""

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
    """What the mods kernels read of a ModsSpec: its graphs and how many of the tables a0 .. a3 each one takes."""

    def init_graphs(self, spec: ModsSpec) -> None:
        self.score_graph = graph_of(spec.score_mod)
        self.mask_graph = graph_of(spec.mask_mod)
        self.score_tables = len(self.score_graph.aux_types) if self.score_graph is not None else 0
        self.mask_tables = len(self.mask_graph.aux_types) if self.mask_graph is not None else 0
        assert self.score_tables + self.mask_tables <= MAX_TABLES

    def mods_scale_log2(self, softmax_scale):
        """The softmax's scale in log2 units: log2(e) where a score_mod sees (and returns) scaled scores."""
        return Float32(LOG2_E) if self.score_graph is not None else softmax_scale * LOG2_E

    def mods_context(self, softmax_scale, tables, head, batch, seqlen_q, seqlen_k) -> ScoreContext:
        last_q = cutlass.max(seqlen_q - 1, 0)
        last_k = cutlass.max(seqlen_k - 1, 0)
        used = tuple(tables[: self.score_tables + self.mask_tables])
        return ScoreContext(softmax_scale, used, head, batch, last_q, last_k)

    def apply_mods(
        self, acc_S: cute.Tensor, coords_rc: cute.Tensor, q_base, k_base, ctx: ScoreContext, full=None
    ) -> None:
        """score_mod, then mask_mod, on every score of a tile in registers: coords_rc holds each score's (row, col)
        within the tile (rows_cols_view layout), q_base / k_base the tile's first query row and key; full (a
        run-time Boolean, block-sparse builds) skips the mask_mod on a tile the block mask marks full. Plain loops:
        this runs at trace time, unrolled (one scalar expression per score, codegen.emit)."""
        acc_rc = rows_cols_view(acc_S)
        if const_expr(full is None or self.mask_graph is None):
            self._mods_pass(acc_rc, coords_rc, q_base, k_base, ctx, self.score_graph, self.mask_graph)
        else:
            if const_expr(self.score_graph is not None):
                self._mods_pass(acc_rc, coords_rc, q_base, k_base, ctx, self.score_graph, None)
            self._masked_pass(acc_rc, coords_rc, q_base, k_base, ctx, full)

    @cute.jit
    def _masked_pass(
        self, acc_rc: cute.Tensor, coords_rc: cute.Tensor, q_base, k_base, ctx: ScoreContext, full,
        keys_on_rows: cutlass.Constexpr[bool] = False,
    ):  # fmt: skip
        """The mask_mod alone, unless `full` (a run-time Boolean uniform over the CTA: the block mask's full tile)."""
        if not full:
            self._mods_pass(acc_rc, coords_rc, q_base, k_base, ctx, None, self.mask_graph, keys_on_rows)

    def _mods_pass(
        self, acc_rc, coords_rc, q_base, k_base, ctx: ScoreContext, score_graph, mask_graph, keys_on_rows=False,
        deriv=None,
    ) -> None:  # fmt: skip
        """score_graph, then mask_graph (either may be None), on every entry of a tile (see `for_each_score`);
        deriv: (the score_mod's derivative graph, a tensor of the tile's shape in rows_cols_view), filled with
        the derivative at each entry's score before the score_mod changes it (backward kernels)."""
        score_tables = ctx.tables[: self.score_tables]
        mask_tables = ctx.tables[self.score_tables :]

        def one(r, c, idx, shared):
            s = acc_rc[r, c]
            if deriv is not None:
                d_graph, d_rc = deriv
                d_rc[r, c] = emit(d_graph, {**idx, "score": s * ctx.scale}, score_tables, shared)
            if score_graph is not None:
                s = emit(score_graph, {**idx, "score": s * ctx.scale}, score_tables, shared)
            if mask_graph is not None:
                visible = emit(mask_graph, idx, mask_tables, shared)
                s = Float32(cutlass.select_(visible, s, -Float32.inf))
            acc_rc[r, c] = s

        self.for_each_score(acc_rc, coords_rc, q_base, k_base, ctx, keys_on_rows, one)

    @staticmethod
    def for_each_score(acc_rc, coords_rc, q_base, k_base, ctx: ScoreContext, keys_on_rows: bool, fn) -> None:
        """fn(r, c, indices, shared) for every entry (r, c) of a tile in registers (trace time, unrolled): indices the
        callables' inputs b, h, q_idx, kv_idx (positions clamped to the sequence), shared codegen.emit's cache of
        what one row or one column shares. coords_rc: each entry's (row, col) within the tile (rows_cols_view
        layout), rows queries from q_base and columns keys from k_base, or with keys_on_rows the transpose."""
        rows, cols = cute.size(acc_rc, mode=[0]), cute.size(acc_rc, mode=[1])
        # A score's row coordinate does not depend on its column nor its column on its row (MMA fragments), so
        # whatever reads the row's position only is computed once per row, the column's once per column
        # (codegen.emit `shared`); column by column, so that a column's values die with it (a thread holds few rows,
        # many columns).
        if keys_on_rows:
            row_base, row_last, col_base, col_last, names = k_base, ctx.last_k, q_base, ctx.last_q, ("kv_idx", "q_idx")
        else:
            row_base, row_last, col_base, col_last, names = q_base, ctx.last_q, k_base, ctx.last_k, ("q_idx", "kv_idx")
        row_pos = [cutlass.min(row_base + coords_rc[r, 0][0], row_last) for r in range(rows)]
        cache = {}
        for c in range(cols):
            col_pos = cutlass.min(col_base + coords_rc[0, c][1], col_last)
            for r in range(rows):
                idx = {"b": ctx.batch, "h": ctx.head, names[0]: row_pos[r], names[1]: col_pos}
                fn(r, c, idx, (cache, {names[0]: r, names[1]: c}))

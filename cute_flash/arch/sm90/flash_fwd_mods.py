"""The sm90 forward with a score_mod and / or a mask_mod (cute_flash/mods): `Sm90ModsForward`, the dense bf16 /
fp16 forward (flash_fwd.py: TMA, wgmma, ping-pong consumers) whose `modify_scores` hook applies the traced callables
to every score of every key tile right after its Q·Kᵀ wgmma (common/mods_scores.py: one scalar expression per
element), before the kernel's own causal / window / sequence-end masks. Its softmax runs with log2(e) as its scale
where a score_mod is present (the scores are scaled before it).

Block-sparse builds (spec.block_sparse; a block mask, mods/block_mask.py) take the query tiles longest list first and
walk each query tile's list of key tiles in place of the mask's key range (`refine_work`; CtaWork.key_tile: the
producer loads and the consumers read the same list), masking every listed tile with the kernel's own mask, and skip
the mask_mod on the tiles the block mask marks full (a branch uniform over the CTA: the flag is per key tile). Unsplit;
dense, or packed sequences (spec.varlen, the `packed_mods` entry: b is the sequence, q_idx / kv_idx positions within
it; no block lists). The backward of these calls: flash_bwd_mods.py.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ...common.entries import ModsFwdEntry
from ...common.mods_scores import ModsGraphs, ScoreContext
from ...spec import ModsSpec
from .cta import CtaWork
from .flash_fwd import Sm90FlashForward
from .tile_config import FwdTileConfig


class TileScores(NamedTuple):
    """What `modify_scores` reads: the mods context, this thread's score coordinates within the CTA tile and the
    tile's first query row."""

    mods: ScoreContext
    coords_rc: cute.Tensor
    q_base: object
    full: object = None  # block-sparse builds: this query tile's full flags by key tile ((N,) int32)


class Sm90ModsForward(ModsGraphs, ModsFwdEntry, Sm90FlashForward):
    def __init__(self, spec: ModsSpec, cfg: FwdTileConfig):
        assert not spec.softcap and not spec.sink, "score_mod / mask_mod builds without softcap / sinks"
        assert not (spec.varlen and spec.block_sparse), "packed builds take no block lists"
        super().__init__(spec, cfg)
        assert self.cluster_m == 1
        self.init_graphs(spec)
        self.block_sparse = spec.block_sparse

    def refine_work(self, work: CtaWork, features) -> CtaWork:
        """Block-sparse builds: the CTA's query tile is the one at its launch position (the longest lists first:
        mods/call.KeyTileLists), its key tiles that tile's list (every tile of which is masked by the kernel's own
        mask as well: exact whatever the list holds beyond the visible tiles)."""
        if const_expr(not self.block_sparse):
            return work
        mCount, mIndex, _, mTiles = features[5:9]
        b = cutlass.min(work.batch, mCount.shape[0] - 1)
        h = cutlass.min(work.head, mCount.shape[1] - 1)
        position = cute.arch.block_idx()[0]  # (not work.m_block: cta_work reverses causal grids)
        tiles = Int32(mIndex.shape[3])  # (the list fills the row's last count entries)
        count = cutlass.min(mCount[b, h, position], tiles)
        return work._replace(m_block=mTiles[b, h, position], n_min=tiles - count, n_max=tiles,
                             key_tiles=mIndex[b, h, position, None])  # fmt: skip

    def score_setup(self, softmax_scale: Float32, features, work: CtaWork, coords):
        scale, *tables = features[:5]
        ctx = self.mods_context(scale, tables, work.head, work.batch, work.seqlen_q, work.info.seqlen_k)
        full = None
        if const_expr(self.block_sparse):
            mFull = features[7]
            b = cutlass.min(work.batch, mFull.shape[0] - 1)
            h = cutlass.min(work.head, mFull.shape[1] - 1)
            full = mFull[b, h, work.m_block, None]
        return TileScores(ctx, coords[0], work.m_block * self.tile_m, full), self.mods_scale_log2(softmax_scale)

    def key_tile_setup(self, n_block: Int32, score_ctx: TileScores):
        """Block-sparse builds: whether key tile n_block is full, loaded before the tile's GEMMs (the softmax waits
        on the branch it decides)."""
        return None if const_expr(score_ctx.full is None) else score_ctx.full[n_block] != 0

    def modify_scores(self, acc_S: cute.Tensor, n_block: Int32, score_ctx: TileScores, tile_ctx=None):
        self.apply_mods(acc_S, score_ctx.coords_rc, score_ctx.q_base, n_block * self.tile_n, score_ctx.mods, tile_ctx)

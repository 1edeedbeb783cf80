"""Split-key decoding: a query tile's keys shared among several CTAs, their partial results combined.

A decoding call (one query row per sequence, or a few: packed GQA query heads, speculative tokens, short chunks)
has one query tile per (batch, head). At small batch that is fewer CTAs than the GPU has SMs, and each walks its
whole key range alone: at batch 1 with 8 KV heads, 8 of 132 SMs read the cache. Here the key tiles of each query
tile are cut into `splits` equal runs, one CTA each (grid (1, heads, splits x batch), cta.py); each writes its
normalised O and LSE in fp32 (epilogue.store_partial_o_and_lse), and `split_combine.SplitCombine` merges them into
out and lse (FlashAttention-2/3's split-KV decoding; the launcher: arch/base.SplitForward). The result is the same
softmax up to fp32 rounding order.

When (`num_splits`): fp16 / bf16 dense calls whose query rows fit one tile, with at most a third as many CTAs as
SMs; splits = the CTAs that fill the SMs once, capped by the key tiles (MIN_TILES_PER_SPLIT each) and MAX_SPLITS,
and only when that is at least MIN_SPLITS.
"""

from __future__ import annotations

from ...common.block_info import BlockInfo
from ...spec import AttentionSpec
from ...validation import Problem
from .tile_config import FwdTileConfig, fwd_tile_config

MIN_TILES_PER_SPLIT = 2  # key tiles per CTA: fewer leaves each CTA mostly its pipeline's start-up
MIN_SPLITS = 3  # below, the combine's launch and the partials cost about what the split gains (H100, docs)
MAX_SPLITS = 64


def split_tile_config(spec: AttentionSpec) -> FwdTileConfig:
    """The tile configuration of `spec`'s split build."""
    return fwd_tile_config(spec)


def splittable(spec: AttentionSpec) -> bool:
    """Whether calls of `spec` may run split (its split build exists): fp16 / bf16 on dense tensors."""
    return spec.dtype in ("fp16", "bf16") and not spec.varlen


def num_splits(problem: Problem, sm_count: int) -> int:
    """How many CTAs share each query tile's keys (1: the call runs unsplit)."""
    p = problem
    if not splittable(p.spec):
        return 1
    cfg = split_tile_config(p.spec)
    ctas = p.batch * p.nheads
    if not (0 < p.seqlen_q <= cfg.tile_m) or ctas == 0 or MIN_SPLITS * ctas > sm_count:
        return 1
    info = BlockInfo(cfg.tile_m, cfg.tile_n, p.mask.kind, p.seqlen_q, p.seqlen_k, p.mask.left, p.mask.right)
    n_min, n_max = info.kv_block_range(0)
    splits = min(sm_count // ctas, (n_max - n_min) // MIN_TILES_PER_SPLIT, MAX_SPLITS)
    return splits if splits >= MIN_SPLITS else 1

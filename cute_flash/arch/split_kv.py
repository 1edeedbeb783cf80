"""Split-key decoding, the part every kernel family shares: when a call splits, and the combine kernel.

A decoding call (one query row per sequence, or a few: packed GQA query heads, speculative tokens, short chunks)
has one query tile per (batch, head). At small batch that is fewer CTAs than the GPU has SMs, and each walks its
whole key range alone: at batch 1 with 8 KV heads, 8 of 132 SMs read the cache. A family with `split_keys` cuts the
key tiles of each query tile into `splits` equal runs, one CTA each (grid (query tiles, heads, splits x batch); the
CTA at z = split * batch + b walks the split-th run, none when the tile has fewer key tiles than that), writes each
run's normalised O and natural-log LSE in fp32 to (splits * b, sq, h, dv) / (splits * b, h, sq) buffers, and
`common/split_combine.SplitCombine` merges them into out and lse (FlashAttention-2/3's split-KV decoding; the
launcher: arch/base.SplitForward). The result is the same softmax up to fp32 rounding order.

When (`num_splits`): fp16 / bf16 dense calls whose query rows fit one tile, with at most a third (the sm80 family:
half) as many CTAs as SMs; splits = the CTAs that fill the SMs once, capped by the key tiles (MIN_TILES_PER_SPLIT
each) and MAX_SPLITS, and only when that is at least MIN_SPLITS (sm80: 2, its backend's SPLIT_MIN_SPLITS).
"""

from __future__ import annotations

from .. import compile_cache
from ..common.block_info import BlockInfo
from ..spec import AttentionSpec, ModsSpec
from ..problem import KVCACHE_MAX_SPLITS, MAX_SPLIT_SCALE  # noqa: F401  (the KV-cache families read it here)
from ..validation import Problem

MIN_TILES_PER_SPLIT = 2  # key tiles per CTA: fewer leaves each CTA mostly its pipeline's start-up
MIN_SPLITS = 3  # sm90: below, the combine's launch and the partials cost about what the split gains (H100, docs)
MAX_SPLITS = 64


def splittable(spec: AttentionSpec) -> bool:
    """Whether calls of `spec` may run split (a family's split build exists): fp16 / bf16 on dense tensors."""
    return spec.dtype in ("fp16", "bf16") and not spec.varlen and not isinstance(spec, ModsSpec)


def num_splits(problem: Problem, tile_m: int, tile_n: int, sm_count: int, min_splits: int = 0) -> int:
    """How many CTAs share each query tile's keys (1: the call runs unsplit), for a kernel of tile_m x tile_n
    tiles; min_splits: the fewest worth a split (default MIN_SPLITS; a family whose unsplit CTAs read the cache
    slowly gains from 2). (The kernels derive each run from the split count and their own tiles, so the answer
    affects speed only.)"""
    p = problem
    min_splits = min_splits or MIN_SPLITS
    if not splittable(p.spec) or p.softmax_scale > MAX_SPLIT_SCALE:
        return 1
    ctas = p.batch * p.nheads
    if not (0 < p.seqlen_q <= tile_m) or ctas == 0 or min_splits * ctas > sm_count:
        return 1
    info = BlockInfo(tile_m, tile_n, p.mask.kind, p.seqlen_q, p.seqlen_k, p.mask.left, p.mask.right)
    n_min, n_max = info.kv_block_range(0)
    splits = min(sm_count // ctas, (n_max - n_min) // MIN_TILES_PER_SPLIT, MAX_SPLITS)
    return splits if splits >= min_splits else 1


# The KV-cache forward (attention_with_kvcache; its families' kvcache_splits): splits chosen for the grid's waves.
FILLED = 0.8  # a grid with this many CTAs per CTA slot of the GPU runs unsplit (FlashAttention-3's rule)
FILL_SLACK = 0.95  # the fewest splits whose waves fill the slots within this of the best count's


def auto_kvcache_splits(backend, problem, sm_count: int) -> int:
    """num_splits=0's split count for a KV-cache call: the family's choice (backend.kvcache_splits), 1 for a
    softmax_scale above MAX_SPLIT_SCALE (the split combine could not weigh a hard max's partials)."""
    if problem.softmax_scale > MAX_SPLIT_SCALE:
        return 1
    return max(1, backend.kvcache_splits(problem, sm_count))


def splits_to_fill(ctas: int, slots: int, key_tiles: int, max_splits: int = MAX_SPLITS) -> int:
    """Splits per query tile for a grid of `ctas` CTAs per split on `slots` CTA slots (SMs x CTAs per SM) whose
    query tiles walk at most `key_tiles` key tiles: 1 when the grid fills the slots already, else the fewest splits
    (of MIN_TILES_PER_SPLIT key tiles at least, max_splits at most) whose last wave is filled within FILL_SLACK as
    well as with the best count: fill(s) = ctas s / (slots ceil(ctas s / slots)) (wave quantisation)."""
    if ctas <= 0 or slots <= 0 or ctas >= FILLED * slots:
        return 1
    cap = min(max_splits, key_tiles // MIN_TILES_PER_SPLIT)
    if cap < 2:
        return 1
    fill = [ctas * s / (slots * -(-(ctas * s) // slots)) for s in range(1, cap + 1)]
    best = max(fill)
    return next(s for s, f in enumerate(fill, start=1) if f >= FILL_SLACK * best)


def combine_kernel(spec: AttentionSpec, target: str):
    """The compiled combine for `spec`'s output dtype and dv on `target`: fn(o_part, lse_part, out, lse), or with
    spec.sink fn(o_part, lse_part, out, lse, sink) (the sink joins the merged rows there). One build serves every
    family, mask and head dim with that (dtype, dv, sink)."""
    key = ("split_kv", target, "split_combine", spec.out_dtype, spec.head_dim_v) + (("sink",) if spec.sink else ())

    def build():
        from ..common.split_combine import compile_split_combine  # imports cutlass: only when built

        return compile_split_combine(spec.out_dtype, spec.head_dim_v, target, sink=spec.sink)

    return compile_cache.get_or_compile(key, build)

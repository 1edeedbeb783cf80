"""Ahead-of-time builds of score_mod / mask_mod kernels: `cute_flash.mods.warmup` cross-compiles (no GPU needed)
the kernels a call with these callables would build and writes them to the disk kernel cache (cute_flash/warmup.py,
docs/cache.md), under the keys the call path looks up: the callables' traced graphs, not their tables' values, so
that every call whose tensors have other contents loads them."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

from ..spec import AttentionSpec, ModsSpec, normalize_mask
from .graph import trace_mask_mod, trace_score_mod


def warmup(
    score_mod: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    *,
    head_dim: int,
    head_dim_v: Optional[int] = None,
    dtype: str = "bf16",
    causal: bool = False,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    block_mask: bool = False,
    backward: bool = False,
    gqa: bool = False,
    capability: Tuple[int, int] = (9, 0),
) -> dict:
    """Builds the kernels of `attention(q, k, v, score_mod=..., mask_mod=..., causal=..., window_size=...,
    block_mask=<a BlockMask> if block_mask)` on a GPU of `capability` (the forward; with backward=True also the
    backward, gqa: with fewer KV heads than query heads) into the disk kernel cache; returns warmup.run's summary.
    Run it in a process that has not compiled for another target (CuTe DSL fixes its target at import)."""
    from .. import warmup as warm
    from ..routing import route

    if score_mod is None and mask_mod is None:
        raise ValueError("warmup needs a score_mod or a mask_mod (plain calls: python -m cute_flash warmup)")
    if dtype not in ("fp16", "bf16"):
        raise ValueError(f"score_mod / mask_mod calls take fp16 or bf16, got dtype={dtype!r}")
    if block_mask and mask_mod is None:
        raise ValueError("block_mask needs the mask_mod it covers")
    kind = normalize_mask(causal, window_size).kind
    base = AttentionSpec(dtype, head_dim, head_dim if head_dim_v is None else head_dim_v, kind, dtype)
    spec = ModsSpec(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(AttentionSpec)},
        score_mod=trace_score_mod(score_mod).key if score_mod is not None else None,
        mask_mod=trace_mask_mod(mask_mod).key if mask_mod is not None else None,
        block_sparse=block_mask,
    )
    forward = route(spec, capability, False, False)
    if block_mask and forward.family is not None and forward.backend.mods_key_tiles(spec) is None:
        spec = dataclasses.replace(spec, block_sparse=False)  # (as the call: that family visits every tile)
    configs = [warm.Config(spec)]
    if backward:  # (block-sparse where that family's backward takes the lists: mods/call.py)
        back = route(spec, capability, True, False)
        sparse = block_mask and back.family is not None and back.backend.mods_query_tiles(spec) is not None
        configs.append(warm.Config(dataclasses.replace(spec, block_sparse=sparse), backward=True, gqa=gqa))
    return warm.run(configs, capability)

"""score_mod / mask_mod (FlexAttention-style callables) and block masks: tracing, the float64 reference, block
classification, the generated code; `cute_flash.attention(score_mod=, mask_mod=)` (experimental: docs/mods.md)."""

from .block_mask import BlockMask, create_block_mask
from .graph import ModError, ModGraph, score_derivative, trace_mask_mod, trace_score_mod
from .warmup import warmup

__all__ = ["BlockMask", "ModError", "ModGraph", "create_block_mask", "score_derivative", "trace_mask_mod",
           "trace_score_mod", "warmup"]  # fmt: skip

"""The one map from cute-flash's dtype names (`AttentionSpec.dtype`, `.out_dtype`) to CuTe DSL numeric types.

Imports cutlass on first use only, so that modules which name a dtype can be imported without it."""

from __future__ import annotations


def dsl_dtype(name: str):
    """ "bf16" -> cutlass.BFloat16, "fp16" -> cutlass.Float16, "fp8" -> cutlass.Float8E4M3FN."""
    import cutlass

    return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp8": cutlass.Float8E4M3FN}[name]

"""Keeping LLVM from sinking computations into the branch that consumes them."""

from __future__ import annotations

from cutlass import Float32
from cutlass.cutlass_dsl import dsl_user_op

from .inline_ptx import ptx_asm


@dsl_user_op
def pin_values(values: list, *, loc=None, ip=None) -> None:
    """An empty asm statement that reads `values`: they must be computed before this point.

    LLVM moves a load whose only use sits inside an `if` into that branch; with one branch per row, each load then
    waits for the previous row's store, one memory latency per row. Pinning the loaded values ahead of the first
    branch keeps every load in flight at once. Emits no instruction."""
    ptx_asm(
        None,
        [Float32(v).ir_value(loc=loc, ip=ip) for v in values],
        "",
        ",".join(["f"] * len(values)),
        side_effects=True,
        loc=loc,
        ip=ip,
    )

"""The one spelling of an inline PTX statement: `llvm.inline_asm` with the options every kernel here uses (AT&T
dialect, no stack realignment), so that a wrapper states only its result type, operands, PTX and constraints."""

from __future__ import annotations

from cutlass._mlir.dialects import llvm


def ptx_asm(result_type, operands: list, body: str, constraints: str, *, side_effects: bool = False, loc=None, ip=None):
    """The IR value of `body` (PTX, operands as $0.. after the result) applied to `operands` (IR values); result_type
    None for a statement without a result."""
    return llvm.inline_asm(
        result_type,
        operands,
        body,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )

"""The one spelling of an inline PTX statement: `llvm.inline_asm` with the options every kernel here uses (AT&T
dialect, no stack realignment), so that a wrapper states only its result type, operands, PTX and constraints."""

from __future__ import annotations

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


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


@dsl_user_op
def float_bits(x: Float32, *, loc=None, ip=None) -> Int32:
    """The IEEE bits of an fp32 value."""
    return Int32(ptx_asm(T.i32(), [Float32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,f", loc=loc, ip=ip))


@dsl_user_op
def bits_float(bits: Int32, *, loc=None, ip=None) -> Float32:
    """The fp32 value of IEEE bits."""
    return Float32(ptx_asm(T.f32(), [Int32(bits).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=f,r", loc=loc, ip=ip))

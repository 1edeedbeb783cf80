"""The one float -> e4m3 conversion every FP8 kernel here uses (imports cutlass; kernels only)."""

from __future__ import annotations

from cutlass import Float32, Uint32
from cutlass.cutlass_dsl import T, dsl_user_op

from ..common.inline_ptx import ptx_asm


@dsl_user_op
def e4m3x4(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> Uint32:
    """Four floats -> four e4m3 bytes in one register, `a` in the lowest byte; round to nearest even, saturating at
    ±448 (`cvt.rn.satfinite`, two values per instruction)."""
    args = [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)]
    return Uint32(
        ptx_asm(
            T.i32(),
            args,
            "{\n.reg .b16 lo, hi;\n"
            "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
            "mov.b32 $0, {lo, hi};\n}",
            "=r,f,f,f,f",
            loc=loc,
            ip=ip,
        )
    )

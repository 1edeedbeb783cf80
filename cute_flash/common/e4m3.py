"""Exact float8_e4m3fn -> fp16 / bf16 conversion by integer arithmetic and one 16-bit multiply, for the KV-cache
forward of the sm80 family's fp8 caches.

An e4m3 byte s EEEE MMM is the value (-1)^s 2^(E-7) (1 + M/8) (E > 0) or (-1)^s 2^-6 M/8 (E = 0). Placed below the
sign of a 16-bit float, E M read as that float's low exponent bits and top mantissa bits: in an fp16 as
s 0EEEE MMM0000000 it is the e4m3 value times 2^-8, in a bf16 as s 0000EEEE MMM0000 the value times 2^-120, in both
cases for E = 0 too (the bits then read as a subnormal of the same scale). One multiply by 2^8 / 2^120 of both halves
gives the value, exactly: no rounding, and 16-bit multiplies keep subnormal inputs. fp16 and bf16 hold every e4m3
value. The byte 0x7f / 0xff (e4m3's NaN) becomes +-480: a cache holds no NaN.

Why integers: sm_8x has no e4m3 conversion instruction (cvt.rn.f16x2.e4m3x2 needs sm_89). The sm90 converter
warps use that instruction instead (arch/sm90/kvcache/convert.py): fewer instructions there, measured faster.

Two bytes of a 32-bit word become one f16x2 / bf16x2 word: a byte permute puts them in the high bytes of the two
halves, a shift and masks move E M below the sign, and the multiply scales both halves at once.
"""

from __future__ import annotations

from cutlass import Uint32
from cutlass.cutlass_dsl import T, dsl_user_op

from .inline_ptx import ptx_asm

# prmt selectors: bytes (0, 1) or (2, 3) of the word into the high bytes of the two 16-bit halves, zeros below.
LOW_PAIR = 0x1404
HIGH_PAIR = 0x3424

# (shift right of a byte's E M from the half's high byte, mask of E M in both halves, the scale in both halves)
_FP16 = (1, 0x3F803F80, 0x5C005C00)  # 2^8 in fp16
_BF16 = (4, 0x07F007F0, 0x7B807B80)  # 2^120 in bf16


@dsl_user_op
def e4m3x2_to_16bit(word: Uint32, pair: int, bf16: bool, *, loc=None, ip=None) -> Uint32:
    """Bytes `pair` (LOW_PAIR: 0 and 1, HIGH_PAIR: 2 and 3) of `word` as an f16x2 (bf16x2 with `bf16`) word, the
    lower byte in the lower half."""
    shift, mask, scale = _BF16 if bf16 else _FP16
    kind = "bf16x2" if bf16 else "f16x2"
    body = (
        "{\n.reg .b32 x, s, y, z;\n"
        f"prmt.b32 x, $1, 0, {pair};\n"
        "and.b32 s, x, 0x80008000;\n"
        f"shr.b32 y, x, {shift};\n"
        f"and.b32 y, y, {mask};\n"
        "or.b32 x, y, s;\n"
        f"mov.b32 y, {scale};\n"
        "mov.b32 z, 0x80008000;\n"  # -0.0 in both halves: x * y + (-0) is x * y, signed zeros kept
        f"fma.rn.{kind} x, x, y, z;\n"
        "mov.b32 $0, x;\n}"
    )
    return Uint32(ptx_asm(T.i32(), [Uint32(word).ir_value(loc=loc, ip=ip)], body, "=r,r", loc=loc, ip=ip))

"""Exact float8_e4m3fn -> fp16 / bf16 conversion by integer arithmetic, for the KV-cache forward's fp8 caches on every
sm80-family target (sm_80 has no fp8 conversion instruction).

An e4m3 byte s EEEE MMM is the value (-1)^s 2^(E-7) (1 + M/8) (E > 0) or (-1)^s 2^-6 M/8 (E = 0). Placed into an fp16's
bits as s 0EEEE MMM0000000 it reads (-1)^s 2^(E-15) (1 + M/8), or for E = 0 the fp16 subnormal 2^-14 M/8: in both
cases the e4m3 value times 2^-8, so one fp16 multiply by 256 (exact: no rounding, and fp16 multiplies keep
subnormal inputs) gives the value. fp16 holds every e4m3 value, and each fp16 of at most 4 significant bits converts to
bf16 exactly (through fp32). The byte 0x7f / 0xff (e4m3's NaN) becomes +-480: a cache holds no NaN.

Two bytes of a 32-bit word become one f16x2 / bf16x2 word: a byte permute puts them in the high bytes of the two
halves, a shift and masks move E M below the sign, and the multiply scales both halves at once.
"""

from __future__ import annotations

from cutlass import Uint32
from cutlass.cutlass_dsl import T, dsl_user_op

from ...common.inline_ptx import ptx_asm

# prmt selectors: bytes (0, 1) or (2, 3) of the word into the high bytes of the two 16-bit halves, zeros below.
LOW_PAIR = 0x1404
HIGH_PAIR = 0x3424


@dsl_user_op
def e4m3x2_to_16bit(word: Uint32, pair: int, bf16: bool, *, loc=None, ip=None) -> Uint32:
    """Bytes `pair` (LOW_PAIR: 0 and 1, HIGH_PAIR: 2 and 3) of `word` as an f16x2 (bf16x2 with `bf16`) word, the
    lower byte in the lower half."""
    to_bf16 = "mov.b32 {h0, h1}, x;\ncvt.f32.f16 f0, h0;\ncvt.f32.f16 f1, h1;\ncvt.rn.bf16x2.f32 x, f1, f0;\n"
    body = (
        "{\n.reg .b32 x, s, y;\n.reg .b16 h0, h1;\n.reg .f32 f0, f1;\n"
        f"prmt.b32 x, $1, 0, {pair};\n"
        "and.b32 s, x, 0x80008000;\n"
        "shr.b32 y, x, 1;\n"
        "and.b32 y, y, 0x3F803F80;\n"
        "or.b32 x, y, s;\n"
        "mov.b32 y, 0x5C005C00;\n"  # 256.0 in both fp16 halves
        "mul.rn.f16x2 x, x, y;\n" + (to_bf16 if bf16 else "") + "mov.b32 $0, x;\n}"
    )
    return Uint32(ptx_asm(T.i32(), [Uint32(word).ir_value(loc=loc, ip=ip)], body, "=r,r", loc=loc, ip=ip))

"""Warp-level PTX of the swapped fp8-cache decoder (swapped.py) that CuTe DSL 4.8.1 does not wrap as plain values:
the m16n8k16 fp16 mma.sync on register words, movmatrix, byte permutes, 16-byte shared-memory loads at computed
(swizzled) addresses, and the e4m3 / fp32 -> f16x2 conversions.

Register words are Int32 holding two fp16 values (low half: the lower column / key), as mma.sync reads them."""

from __future__ import annotations

from typing import List, Sequence

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from ....common.inline_ptx import ptx_asm


def _words(values, loc, ip) -> list:
    return [Int32(v).ir_value(loc=loc, ip=ip) for v in values]


@dsl_user_op
def mma_f16_m16n8k16(
    a: Sequence[Int32], b: Sequence[Int32], c: Sequence[Float32], *, loc=None, ip=None
) -> List[Float32]:
    """d = a·b + c for one m16n8k16 fp16 tile with fp32 accumulation: a 4 words (rows g / g + 8, columns 2q.. and
    2q + 8..), b 2 words (k rows 2q.. / 2q + 8.., column g), c / d 4 floats (rows g / g + 8, columns 2q, 2q + 1),
    g = lane / 4, q = lane % 4."""
    operands = _words(a, loc, ip) + _words(b, loc, ip) + [Float32(x).ir_value(loc=loc, ip=ip) for x in c]
    result = ptx_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        operands,
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
        "{$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3",
        loc=loc,
        ip=ip,
    )
    return [Float32(llvm.extractvalue(T.f32(), result, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def transpose_8x8(word: Int32, *, loc=None, ip=None) -> Int32:
    """movmatrix: the warp's 8 x 8 matrix of 16-bit values (lane holds row lane / 4, columns 2 (lane % 4) + 0..1)
    transposed, in the same distribution."""
    body = "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;"
    return Int32(ptx_asm(T.i32(), _words([word], loc, ip), body, "=r,r", loc=loc, ip=ip))


@dsl_user_op
def byte_perm(a: Int32, b: Int32, selector: int, *, loc=None, ip=None) -> Int32:
    """prmt.b32: result byte i = byte (selector >> 4 i) & 7 of the pair (b:a) (a's bytes 0-3, b's 4-7)."""
    body = f"prmt.b32 $0, $1, $2, {selector};"
    return Int32(ptx_asm(T.i32(), _words([a, b], loc, ip), body, "=r,r,r", loc=loc, ip=ip))


@dsl_user_op
def load_shared_v4(address: Int32, *, loc=None, ip=None) -> List[Int32]:
    """The 16 bytes at a shared-memory address (16-byte aligned) as 4 words. A side effect for the compiler, so
    that it stays between the waits and releases of the stage it reads."""
    result = ptx_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        _words([address], loc, ip),
        "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r",
        side_effects=True,
        loc=loc,
        ip=ip,
    )
    return [Int32(llvm.extractvalue(T.i32(), result, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def e4m3x4_to_f16x2x2(word: Int32, *, loc=None, ip=None) -> List[Int32]:
    """Four e4m3 values (bytes 0-3) as two f16x2 words: (bytes 0, 1) and (bytes 2, 3). Exact."""
    result = ptx_asm(
        llvm.StructType.get_literal([T.i32()] * 2),
        _words([word], loc, ip),
        "{\n.reg .b16 l, h;\nmov.b32 {l, h}, $2;\ncvt.rn.f16x2.e4m3x2 $0, l;\ncvt.rn.f16x2.e4m3x2 $1, h;\n}",
        "=r,=r,r",
        loc=loc,
        ip=ip,
    )
    return [Int32(llvm.extractvalue(T.i32(), result, [i], loc=loc, ip=ip)) for i in range(2)]


@dsl_user_op
def pack_f16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int32:
    """Two floats rounded to fp16 in one word (lo in the low half)."""
    operands = [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)]
    return Int32(ptx_asm(T.i32(), operands, "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", loc=loc, ip=ip))

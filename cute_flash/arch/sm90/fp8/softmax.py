"""Online softmax for FP8 scores: a per-tile exponent scale, and P in [0, 256].

The scores of key tile n come out of the e4m3 wgmma unscaled: S = q8·k8ᵀ. The real logits times log2(e) are
S · c_n with c_n = softmax_scale · log2(e) · q_descale · k_descale[n], a per-tile factor (block scales). So the running
row max is kept in that scaled log2 domain:
    m_new = max(m_old, c_n · max_j S_j)            (c_n > 0)
    P_j   = 2^(S_j · c_n − m_new + 8)              (one FFMA + ex2 per score, as in bf16)
    scale = 2^(m_old − m_new);  l = l · scale + Σ_j P_j
P lies in [0, 256] rather than [0, 1]: e4m3 is subnormal below 2^-6, so without the offset every probability under
~1/64 of the row max would lose precision, and under 2^-10 would vanish; with it they stay normal down to 2^-14.
l carries the same factor 2^8, so O / l is unchanged; LSE = (m + log2 l − 8) · ln 2.
Row maxima are reduced over the 4 lanes of a quad every tile (the common module's helpers); sums stay per-thread.
With `sum_in_mma` the kernel takes each tile's Σ_j P_j from its P·V wgmma (a column of ones next to V) and adds it
with `absorb_row_sums`; those sums are already complete rows, so `finalize` skips the quad reduction.

With `exp2_poly_per_row` = k > 0 the last k values of each row (per thread and tile) are computed by `exp2_poly`
(FMA pipe) instead of MUFU.EX2. It clamps its argument at -126, so a masked score gives ~2^-126
instead of 0: it still rounds to an e4m3 zero, and an empty row is recognised by its sum staying below 1 (a row that
saw a key has sum >= ~256, the 2^8 of its maximum).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cutlass_dsl import T, dsl_user_op

from ....common.online_softmax import LN2, add_values, lane_group_reduce, tree_reduce
from ....common.inline_ptx import ptx_asm

P_OFFSET_LOG2 = 8.0
MIN_TILE_SCALE = 1e-30  # keeps c_n > 0 (a zero descale would turn masked -inf scores into NaN)

# 2^f on [0, 1): the degree-3 minimax fit in relative error (max 7.5e-5), evaluated by Horner's rule.
EXP2_POLY = (0.9999251961708069, 0.6958335638046265, 0.22606714069843292, 0.07802452892065048)


def _f32_hex(x: float) -> str:
    import struct

    return "0f%08X" % struct.unpack("<I", struct.pack("<f", x))[0]


@dsl_user_op
def exp2_poly(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x without MUFU: floor(x) by adding 1.5·2^23 rounding down (the integer lands in the low mantissa bits), a
    cubic for the fraction, the integer added to the exponent field (t's bits · 2^23 keep exactly floor(x) · 2^23).
    x is clamped at -126 (−inf → ~2^-126; at -127 a p(0) < 1 would underflow the exponent field into NaN bits)."""
    c0, c1, c2, c3 = (_f32_hex(c) for c in EXP2_POLY)
    magic = _f32_hex(12582912.0)
    return Float32(
        ptx_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip)],
            "{\n.reg .f32 xc, t, j, f, p;\n.reg .b32 tb, pb;\n"
            "max.f32 xc, $1, 0fC2FC0000;\n"
            f"add.rm.f32 t, xc, {magic};\n"
            f"sub.f32 j, t, {magic};\n"
            "sub.f32 f, xc, j;\n"
            f"fma.rn.f32 p, f, {c3}, {c2};\n"
            f"fma.rn.f32 p, p, f, {c1};\n"
            f"fma.rn.f32 p, p, f, {c0};\n"
            "mov.b32 tb, t;\nmov.b32 pb, p;\n"
            "mad.lo.u32 pb, tb, 8388608, pb;\n"
            "mov.b32 $0, pb;\n}",
            "=f,f",
            loc=loc,
            ip=ip,
        )
    )


@dataclass(frozen=True)
class Fp8OnlineSoftmax:
    num_rows: int
    threads_per_row: int
    row_max: cute.Tensor  # scaled log2 domain
    row_sum: cute.Tensor
    exp2_poly_per_row: int = 0
    sum_in_mma: bool = False

    @staticmethod
    def create(
        num_rows: int, threads_per_row: int = 4, exp2_poly_per_row: int = 0, sum_in_mma: bool = False
    ) -> "Fp8OnlineSoftmax":
        row_max = cute.make_rmem_tensor(num_rows, Float32)
        row_sum = cute.make_rmem_tensor(num_rows, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        return Fp8OnlineSoftmax(num_rows, threads_per_row, row_max, row_sum, exp2_poly_per_row, sum_in_mma)

    @cute.jit
    def absorb_row_sums(self, tile_sums: cute.Tensor, factor: cute.Tensor):
        """l = l · factor + Σ P of one tile (sum_in_mma): the tile's sums arrive one step after its update, like O."""
        for r in cutlass.range_constexpr(self.num_rows):
            self.row_sum[r] = self.row_sum[r] * factor[r] + tile_sums[r]

    @cute.jit
    def update(self, acc_rc: cute.Tensor, tile_scale: Float32, is_first: cutlass.Constexpr[bool]) -> cute.Tensor:
        """Scores of one tile -> P (in place, fp32, in [0, 256]); returns each row's factor for the older O."""
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            row = acc_rc[r, None]
            raw_max = tree_reduce(row, cute.arch.fmax, None)
            raw_max = lane_group_reduce(raw_max, cute.arch.fmax, self.threads_per_row)
            prev_max = self.row_max[r]
            new_max = raw_max * tile_scale
            if cutlass.const_expr(not is_first):
                new_max = cute.arch.fmax(new_max, prev_max)
            self.row_max[r] = new_max
            # A row with no visible key so far keeps max -inf; use 0 instead so P = 2^-inf = 0, not NaN.
            safe_max = 0.0 if new_max == -Float32.inf else new_max
            bias = P_OFFSET_LOG2 - safe_max
            if cutlass.const_expr(self.exp2_poly_per_row == 0):
                row.store(cute.math.exp2(row.load() * tile_scale + bias, fastmath=True))
            else:
                row.store(row.load() * tile_scale + bias)
                n = cute.size(row)
                for j in cutlass.range_constexpr(n):
                    if cutlass.const_expr(j < n - self.exp2_poly_per_row):
                        row[j] = cute.math.exp2(row[j], fastmath=True)
                    else:
                        row[j] = exp2_poly(row[j])
            if cutlass.const_expr(is_first):
                row_scale[r] = 1.0
                if cutlass.const_expr(not self.sum_in_mma):
                    self.row_sum[r] = tree_reduce(row, add_values, None)
            else:
                scale = cute.math.exp2(prev_max - safe_max, fastmath=True)
                row_scale[r] = scale
                if cutlass.const_expr(not self.sum_in_mma):
                    self.row_sum[r] = tree_reduce(row, add_values, self.row_sum[r] * scale)
        return row_scale

    @cute.jit
    def finalize(self, out_scale: Float32) -> tuple:
        """(row factor for O, lse): out_scale / l (0 for rows that saw no key) and the natural-log LSE."""
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        lse = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            total = self.row_sum[r]
            if cutlass.const_expr(not self.sum_in_mma):
                total = lane_group_reduce(total, add_values, self.threads_per_row)
            empty = total == 0.0
            if cutlass.const_expr(self.exp2_poly_per_row > 0):
                empty = total < 1.0
            row_scale[r] = 0.0 if empty else out_scale * cute.arch.rcp_approx(total)
            log2_sum = cute.math.log2(1.0 if empty else total, fastmath=True)
            lse[r] = -Float32.inf if empty else (self.row_max[r] + log2_sum - P_OFFSET_LOG2) * LN2
        return row_scale, lse

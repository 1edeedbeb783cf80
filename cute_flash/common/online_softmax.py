"""The online-softmax recurrence of FlashAttention, on a (rows, cols) view of a float32 score accumulator.

For each KV block with scores S (already masked, -inf where a key is hidden), per query row:
    m_new   = max(m_old, max_j S_j)
    P_j     = exp2(S_j * scale_log2 - m_new * scale_log2)        (written back into the accumulator)
    scale   = exp2((m_old - m_new) * scale_log2)                 (the caller multiplies its O rows by it)
    l_new   = l_old * scale + sum_j P_j
and at the end O /= l, LSE = (m * scale_log2 + log2 l) * ln 2 (natural log, -inf for a row that saw no key).

Layout contract: `acc_rc[r, None]` is this thread's part of row r (see `acc_views.rows_cols_view`) and the other
parts of that row live in the `threads_per_row` neighbouring lanes of the same warp (lane ids differing in the low
bits) — 4 for both the mma.sync (m16n8k16) and the WGMMA accumulators. Row maxima are reduced across those lanes
every block; row sums stay per-thread partial sums until `finalize` (the rescale factors are identical across the
lanes, so the partial sums stay consistent).

The max is taken over raw scores, which equals the max of the scaled ones only for scale_log2 >= 0: callers must
reject negative softmax scales (the front end's validation does).

Rows that have seen only -inf keep m = -inf; the exponent then uses 0 in its place so that P = 0 and the rescale
factor is 0 instead of NaN. `finalize` gives such rows scale 0 and LSE -inf, hence the 0 / -inf contract.

Extreme scales, all handled per kernel or per row, never per score:
  * scale_log2 is clamped into [FLT_MIN, FLT_MAX] once (`clamp_scale_log2`). A masked score is -inf, and
    -inf * 0 = NaN: with softmax_scale = 0 (uniform attention over the visible keys) or a scale whose product with
    log2(e) is 0 or subnormal in fp32 (flushed to 0 by .ftz arithmetic), every masked score used to turn P into NaN.
    At FLT_MIN = 2^-126 a masked score still gives -inf and a visible one S * 2^-126 - m * 2^-126, which is 0 in
    fp32 (P = 1 exactly, uniform attention) for every |S| < 2^100: the clamp changes no result that fp32 can show.
    Scales above FLT_MAX / log2(e) would make scale_log2 infinite; FLT_MAX keeps the hard-max limit they mean.
  * m * scale_log2 overflows fp32 when |scale * max score| exceeds ~2.4e38, and the exponent S * c - m * c became
    inf - inf = NaN (or -inf for every key: a row of zeros). `row_exponent_scale` gives each row its own factor
    c_r = c * 2^-k, with k >= 0 the least that keeps |m * c_r| < 2^25 (k = 0, c_r = c, for every realistic row:
    |m * c| < 2^24). Beyond 2^24 the fp32 scores themselves carry less than one bit of exponent (their rounding
    times c is >= 1), and such a row is a hard max: every key whose score is not within ~2^-19 relative of the
    row max gets P < 2^-32 with c_r as with c. So the row keeps the exact answer to the resolution of its fp32
    scores instead of overflowing. It costs two dependent integer instructions per row and block, none per score.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cutlass_dsl import T, dsl_user_op

from .inline_ptx import ptx_asm

LN2 = math.log(2.0)
LOG2_E = math.log2(math.e)
FLT_MIN = 2.0**-126  # smallest normal fp32
FLT_MAX = (2.0 - 2.0**-23) * 2.0**127
# |max * c_r| stays below 2^(ROW_EXPONENT_LIMIT_LOG2 + 1) (see row_exponent_scale).
ROW_EXPONENT_LIMIT_LOG2 = 24


@cute.jit
def clamp_scale_log2(scale_log2: Float32) -> Float32:
    """softmax_scale * log2(e) clamped into [FLT_MIN, FLT_MAX]: never 0 (masked -inf scores times 0 would be NaN),
    never subnormal (flushed to 0 by .ftz arithmetic), never inf. See the module docstring for why it is exact."""
    return cute.arch.fmin(cute.arch.fmax(scale_log2, Float32(FLT_MIN)), Float32(FLT_MAX))


@cute.jit
def max_limit_bits(scale_log2: Float32) -> Int32:
    """bits(scale_log2) + the exponent bits of 2^24 / scale_log2 (the largest |row max| whose scaled value stays below
    ~2^25; all ones (inf) when scale_log2 is so small that no row can overflow), computed once per thread for
    `row_exponent_scale`. An unsigned 32-bit value (negative read as Int32): the two exponent fields add up to 256..278
    (times 2^23), so it stays below 2^32 and above any row max's exponent field."""
    limit = Float32(2.0**ROW_EXPONENT_LIMIT_LOG2) / scale_log2
    return _exponent_bits(limit) + _bits(scale_log2)


@dsl_user_op
def _bits(x: Float32, *, loc=None, ip=None) -> Int32:
    """The bit pattern of an fp32 value."""
    return Int32(ptx_asm(T.i32(), [Float32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,f", loc=loc, ip=ip))


def _exponent_bits(x: Float32) -> Int32:
    """The exponent field of an fp32 value, in place (bits 23..30)."""
    return _bits(x) & Int32(0x7F800000)


@dsl_user_op
def row_exponent_scale(scale_log2: Float32, row_max: Float32, limit_bits: Int32, *, loc=None, ip=None) -> Float32:
    """scale_log2 * 2^-k for one row, k = max(0, exponent(|row_max|) - exponent(limit)): scale_log2 itself unless
    |row_max * scale_log2| could reach 2^25, else reduced by the power of two that brings it back into [2^23, 2^25).

    Integer arithmetic on the exponent fields: bits(scale_log2) - max(0, e_m - e_limit) computed as
    min(limit_bits - e_m, bits(scale_log2)) with limit_bits = bits(scale_log2) + e_limit (`max_limit_bits`), in
    unsigned 32-bit arithmetic (no operand wraps: e_m <= e_limit + bits(scale_log2)). Two dependent instructions
    (and; sub + min, which ptxas fuses into one VIADDMNMX) where the row max's exponentials wait for them, not
    three. The result stays a normal float because scale_log2 >= FLT_MIN and k is at most what the clamp leaves
    room for."""
    return Float32(
        ptx_asm(
            T.f32(),
            [
                Float32(scale_log2).ir_value(loc=loc, ip=ip),
                Float32(row_max).ir_value(loc=loc, ip=ip),
                Int32(limit_bits).ir_value(loc=loc, ip=ip),
            ],
            "{\n.reg .b32 cb, mb;\n"
            "mov.b32 mb, $2;\n"
            "and.b32 mb, mb, 2139095040;\n"
            "sub.u32 mb, $3, mb;\n"
            "mov.b32 cb, $1;\n"
            "min.u32 cb, mb, cb;\n"
            "mov.b32 $0, cb;\n}",
            "=f,f,f,r",
            loc=loc,
            ip=ip,
        )
    )


def tree_reduce(row: cute.Tensor, op, init):
    """op-reduction of a register row through 4 independent chains (shorter dependency chains than a linear scan).

    Plain Python on purpose: it only unrolls at trace time, so it needs no DSL control flow.
    """
    n = cute.size(row)
    chains = [row[i] for i in range(min(4, n))]
    for i in range(4, n):
        chains[i % 4] = op(chains[i % 4], row[i])
    while len(chains) > 1:
        merged = [op(chains[i], chains[i + 1]) for i in range(0, len(chains) - 1, 2)]
        if len(chains) % 2 == 1:
            merged.append(chains[-1])
        chains = merged
    return chains[0] if init is None else op(chains[0], init)


def sequential_reduce(row: cute.Tensor, op, init):
    """op-reduction of a register row in one chain, from init (first element when None)."""
    acc = row[0] if init is None else op(init, row[0])
    for i in range(1, cute.size(row)):
        acc = op(acc, row[i])
    return acc


def add_values(a, b):
    return a + b


def lane_group_reduce(value: Float32, op, threads_per_row: int, lane_stride: int = 1) -> Float32:
    """op over the `threads_per_row` lanes that share a row: lanes whose ids differ in multiples of lane_stride."""
    offset = threads_per_row // 2
    while offset > 0:
        value = op(value, cute.arch.shuffle_sync_bfly(value, offset=offset * lane_stride))
        offset //= 2
    return value


@dataclass(frozen=True)
class OnlineSoftmax:
    """Running row statistics of one thread's rows. Build with `OnlineSoftmax.create` inside the kernel.

    Frozen so that kernels may call its methods inside runtime loops and branches (the DSL carries mutable Python
    objects through those as state); the statistics themselves live in the register tensors row_max / row_sum.
    """

    scale_log2: Float32  # softmax_scale * log2(e), a runtime value, clamped into [FLT_MIN, FLT_MAX]
    limit_bits: Int32  # bits(scale_log2) + the exponent bits of 2^24 / scale_log2, unsigned (row_exponent_scale)
    num_rows: int  # rows this thread holds: size of mode 0 of the rows_cols view
    threads_per_row: int  # lanes sharing a row: 4 for mma.sync and WGMMA accumulators
    row_max: cute.Tensor
    row_sum: cute.Tensor
    # Row sums in one chain instead of four. The sm90 forward takes it: with the 4-chain sums ptxas moves the wait
    # for the P·V wgmma ahead of the whole softmax; with one chain the maxima, the scale FFMAs and the first
    # exponentials run while that wgmma is still in flight, as in FA4's build. Timed against the 4-chain build
    # (H200, 2026-11-26): within the noise (d128 1k -0.5 / 0.0% no mask / causal, three runs).
    sequential_sum: bool = False
    # Lanes of a row differ by multiples of this (1: the neighbouring lanes above; the swapped decoder's Sᵀ tiles,
    # keys on rows, hold a query row in the 8 lanes of one lane % 4: threads_per_row 8, lane_stride 4).
    lane_stride: int = 1

    @staticmethod
    def create(
        scale_log2: Float32,
        num_rows: int,
        threads_per_row: int = 4,
        sequential_sum: bool = False,
        lane_stride: int = 1,
    ) -> "OnlineSoftmax":
        row_max = cute.make_rmem_tensor(num_rows, Float32)
        row_sum = cute.make_rmem_tensor(num_rows, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        scale_log2 = clamp_scale_log2(scale_log2)
        return OnlineSoftmax(
            scale_log2, max_limit_bits(scale_log2), num_rows, threads_per_row, row_max, row_sum, sequential_sum,
            lane_stride,
        )  # fmt: skip

    @cute.jit
    def update(self, acc_rc: cute.Tensor, is_first: cutlass.Constexpr[bool]) -> cute.Tensor:
        """Turns the scores of one block into P in place; returns the per-row factor to rescale O by.

        is_first: the first block of the row (statistics still empty) — skips the rescale arithmetic.
        """
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        sum_reduce = sequential_reduce if cutlass.const_expr(self.sequential_sum) else tree_reduce
        for r in cutlass.range_constexpr(self.num_rows):
            row = acc_rc[r, None]
            prev_max = self.row_max[r]
            new_max = tree_reduce(row, cute.arch.fmax, None if cutlass.const_expr(is_first) else prev_max)
            new_max = lane_group_reduce(new_max, cute.arch.fmax, self.threads_per_row, self.lane_stride)
            self.row_max[r] = new_max
            # A row with no visible key so far keeps max -inf; subtract 0 instead so P = exp2(-inf) = 0.
            safe_max = 0.0 if new_max == -Float32.inf else new_max
            # This row's exponent factor: scale_log2, unless |max * scale_log2| would overflow fp32's exponent range.
            # From the max itself, not safe_max, so that it does not wait for the -inf test: a -inf max gives some
            # positive normal factor (>= FLT_MIN), and with safe_max 0 every P and rescale factor is still exp2(-inf).
            c_row = row_exponent_scale(self.scale_log2, new_max, self.limit_bits)
            max_scaled = safe_max * c_row
            p = cute.math.exp2(row.load() * c_row - max_scaled, fastmath=True)
            row.store(p)
            if cutlass.const_expr(is_first):
                row_scale[r] = 1.0
                self.row_sum[r] = sum_reduce(row, add_values, None)
            else:
                scale = cute.math.exp2(prev_max * c_row - max_scaled, fastmath=True)
                row_scale[r] = scale
                self.row_sum[r] = sum_reduce(row, add_values, self.row_sum[r] * scale)
        return row_scale

    @cute.jit
    def rescale(self, acc_rc: cute.Tensor, row_scale: cute.Tensor):
        """Multiplies each row of an accumulator (O) by its factor."""
        for r in cutlass.range_constexpr(self.num_rows):
            acc_rc[r, None].store(acc_rc[r, None].load() * row_scale[r])

    @cute.jit
    def finalize(self, sinks_log2: cutlass.Constexpr = None) -> tuple:
        """Returns (row_scale, lse): 1/l to normalise O by (0 for rows that saw no key) and the natural-log LSE.

        sinks_log2: a register tensor of this thread's rows' sink logits times log2(e) (spec.sink), or None. A sink
        is one more term of the row's denominator, exp2(sink_log2 - M) with M = max(m * scale_log2, sink_log2), that
        adds nothing to O: O's factor becomes exp2(m * scale_log2 - M) / l' and the LSE (M + log2 l') ln 2, with
        l' = l exp2(m * scale_log2 - M) + exp2(sink_log2 - M). A row without keys gets O 0 and the sink as its LSE.
        """
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        lse = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            total = lane_group_reduce(self.row_sum[r], add_values, self.threads_per_row, self.lane_stride)
            if cutlass.const_expr(sinks_log2 is None):
                empty = total == 0.0
                row_scale[r] = 0.0 if empty else cute.arch.rcp_approx(total)
                log2_sum = cute.math.log2(1.0 if empty else total, fastmath=True)
                lse[r] = -Float32.inf if empty else (self.row_max[r] * self.scale_log2 + log2_sum) * LN2
            else:
                sink = sinks_log2[r]
                # A row without keys has total 0 (and m = -inf, except in CappedSoftmax, whose m is a fixed
                # reference): its LSE is the sink's alone, exactly. A -inf sink (no sink) on such a row leaves nothing
                # at all: shift by 0 there, and give it O 0 and LSE -inf.
                max_scaled = -Float32.inf if total == 0.0 else self.row_max[r] * self.scale_log2
                top = cute.arch.fmax(max_scaled, sink)
                top = 0.0 if top == -Float32.inf else top
                # 1 where the keys dominate, +inf included (a hard max whose m * scale_log2 overflowed: inf - inf
                # would be NaN).
                keys_weight = 1.0 if max_scaled >= top else cute.math.exp2(max_scaled - top, fastmath=True)
                denom = total * keys_weight + cute.math.exp2(sink - top, fastmath=True)
                row_scale[r] = 0.0 if denom == 0.0 else keys_weight * cute.arch.rcp_approx(denom)
                lse[r] = (top + cute.math.log2(denom, fastmath=True)) * LN2
        return row_scale, lse

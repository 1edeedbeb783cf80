"""Online softmax over scores read from tensor memory, one query row per thread.

A `tcgen05.ld.32x32b` of a 128-lane accumulator gives thread t of a warpgroup the whole of TMEM lane t, i.e. every
score of query row t in the current KV block. Row max and row sum are therefore thread-local: no shuffles, no shared
memory. The state (running max, running sum) lives in one-element register tensors so that it survives the dynamic
KV loop without being threaded through it.

Numerics (all in base 2): the running max is kept in scaled units, max over blocks of (block scale * raw score),
where the block scale is softmax_scale * log2(e), times the Q and K dequantisation factors on the fp8 path (the K
factor changes from KV block to KV block, so raw maxima of different blocks are not comparable). Scales are > 0.
  * a row that has seen no key yet keeps max = -inf; its exponent base is then 0, so P = exp2(-inf) = 0 and the
    row sum stays 0 (the epilogue turns that into out = 0, lse = -inf);
  * `rescale_threshold` (16-bit P only): while the new max exceeds the old one by less than 2^threshold in P units,
    keep the old max. P then reaches at most 2^threshold (256 for 8), well inside fp16/bf16, and the correction
    warps skip rescaling O; the final normalisation divides by a row sum built with the same stale max, so the
    result is unchanged;
  * `max_offset` (fp8 P): P is computed as exp2(x - max + max_offset) so that the largest probability lands at
    2^max_offset instead of 1, using e4m3's range above 1 (max 448); row sum and LSE account for the factor.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


class TmemRowSoftmax:
    """Running max (scaled units) and sum of the score row this thread owns."""

    def __init__(self, rescale_threshold: float = 0.0, max_offset: float = 0.0):
        self.rescale_threshold = rescale_threshold
        self.max_offset = max_offset
        self.row_max = cute.make_rmem_tensor((1,), Float32)
        self.row_sum = cute.make_rmem_tensor((1,), Float32)

    def reset(self) -> None:
        self.row_max[0] = -Float32.inf
        self.row_sum[0] = Float32(0.0)

    @cute.jit
    def update_max(self, s: cute.Tensor, block_scale: Float32, is_first: cutlass.Boolean):
        """Folds the block's raw scores, times `block_scale` (> 0), into the running max.

        Returns (exponent bias for this block, factor by which O and the row sum must be rescaled).
        """
        n = cute.size(s)
        # Four independent max chains keep the FMNMX dependency depth at n/4.
        m0 = s[n - 1]
        m1 = s[0]
        m2 = s[1]
        m3 = s[2]
        for i in cutlass.range_constexpr(3, n - 1, 4):
            m0 = cute.arch.fmax(m0, s[i])
            m1 = cute.arch.fmax(m1, s[i + 1])
            m2 = cute.arch.fmax(m2, s[i + 2])
            m3 = cute.arch.fmax(m3, s[i + 3])
        block_max = cute.arch.fmax(cute.arch.fmax(m0, m1), cute.arch.fmax(m2, m3))

        row_max_old = self.row_max[0]
        row_max_new = cute.arch.fmax(row_max_old, block_max * block_scale)
        row_max_safe = row_max_new if row_max_new != -Float32.inf else Float32(0.0)
        old_minus_new = row_max_old - row_max_safe  # -inf while the row has seen nothing
        acc_scale = cute.math.exp2(old_minus_new, fastmath=True)
        if cutlass.const_expr(self.rescale_threshold > 0.0):
            if old_minus_new >= -self.rescale_threshold:
                row_max_new = row_max_old
                row_max_safe = row_max_old
                acc_scale = Float32(1.0)
        if is_first:
            acc_scale = Float32(1.0)
        self.row_max[0] = row_max_new
        bias = Float32(self.max_offset) - row_max_safe
        return bias, acc_scale

    @cute.jit
    def exp2_convert(self, s: cute.Tensor, p: cute.Tensor, block_scale: Float32, bias: Float32):
        """s <- exp2(s * block_scale + bias) in place (fp32, for the row sum); p <- the same in P's dtype."""
        n = cute.size(s)
        frag = 32
        s_frg = cute.logical_divide(s, cute.make_layout(frag))
        p_frg = cute.logical_divide(p, cute.make_layout(frag))
        for j in cutlass.range_constexpr(n // frag):
            for k in cutlass.range_constexpr(0, frag, 2):
                s_frg[k, j], s_frg[k + 1, j] = cute.arch.fma_packed_f32x2(
                    (s_frg[k, j], s_frg[k + 1, j]), (block_scale, block_scale), (bias, bias)
                )
                s_frg[k, j] = cute.math.exp2(s_frg[k, j], fastmath=True)
                s_frg[k + 1, j] = cute.math.exp2(s_frg[k + 1, j], fastmath=True)
            p_frg[None, j].store(s_frg[None, j].load().to(p.element_type))

    @cute.jit
    def update_sum(self, p_fp32: cute.Tensor, acc_scale: Float32):
        """row_sum <- row_sum * acc_scale + sum(p): the fp32 probabilities of this block."""
        n = cute.size(p_fp32)
        acc = (self.row_sum[0] * acc_scale, Float32(0.0))
        acc2 = (Float32(0.0), Float32(0.0))
        for i in cutlass.range_constexpr(0, n, 4):
            acc = cute.arch.add_packed_f32x2(acc, (p_fp32[i], p_fp32[i + 1]))
            acc2 = cute.arch.add_packed_f32x2(acc2, (p_fp32[i + 2], p_fp32[i + 3]))
        acc = cute.arch.add_packed_f32x2(acc, acc2)
        self.row_sum[0] = acc[0] + acc[1]


@cute.jit
def mask_row(
    s: cute.Tensor,
    cols: cute.Tensor,
    col_end: Int32,
    col_begin: Int32,
    check_begin: cutlass.Constexpr[bool],
):
    """Sets s[i] = -inf where the score's column (in block coordinates) is >= col_end or, if check_begin, < col_begin.

    `cols` holds the (row, column) coordinates of the thread's fragment, partitioned exactly like `s`; the column
    parts are compile-time constants, so each element costs one or two integer compares and a select.
    """
    for i in cutlass.range_constexpr(cute.size(s)):
        c = cols[i][1]
        if cutlass.const_expr(check_begin):
            s[i] = -Float32.inf if (c >= col_end or c < col_begin) else s[i]
        else:
            s[i] = -Float32.inf if c >= col_end else s[i]


@cute.jit
def finalize_row(row_sum: Float32, row_max: Float32, max_offset: float, sink_log2: cutlass.Constexpr = None):
    """(1 / row_sum or 0 for an empty row, natural-log LSE or -inf for an empty row); row_max in scaled units.

    sink_log2 (spec.sink, 16-bit P: max_offset 0): the row's sink logit times log2(e), one more term of the
    denominator that adds nothing to O (common/online_softmax.OnlineSoftmax.finalize): O's factor becomes
    exp2(row_max - M) / l' and the LSE (M + log2 l') ln 2, M = max(row_max, sink_log2),
    l' = row_sum exp2(row_max - M) + exp2(sink_log2 - M); a row without keys gets O 0 and the sink as its LSE."""
    LN2 = 0.6931471805599453
    if cutlass.const_expr(sink_log2 is None):
        empty = row_sum == 0.0 or row_sum != row_sum
        inv = cute.arch.rcp_approx(row_sum if not empty else Float32(1.0))
        lse = (row_max + cute.math.log2(row_sum, fastmath=True) - Float32(max_offset)) * Float32(LN2)
        if empty:
            inv = Float32(0.0)
            lse = -Float32.inf
        return inv, lse
    top = cute.arch.fmax(row_max, sink_log2)
    top = Float32(0.0) if top == -Float32.inf else top  # (no keys and a -inf sink: O 0, LSE -inf)
    keys_weight = cute.math.exp2(row_max - top, fastmath=True)
    denom = row_sum * keys_weight + cute.math.exp2(sink_log2 - top, fastmath=True)
    inv = Float32(0.0) if denom == 0.0 else keys_weight * cute.arch.rcp_approx(denom)
    return inv, (top + cute.math.log2(denom, fastmath=True)) * Float32(LN2)

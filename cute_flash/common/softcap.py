"""Soft-capping of attention scores (Gemma 2; FlashAttention's definition), for any score accumulator.

A capped score is softcap * tanh(score * softmax_scale / softcap). Kernels fold the two factors around the tanh:
the accumulator of raw scores S becomes T = tanh(S * (softmax_scale / softcap)) in place, before the mask, and the
online softmax then runs on T with softcap as its scale (scale_log2 = softcap * log2(e)), so that the mask, the
row maxima and LSE are those of the capped scores. The backward differentiates through the tanh:
d(capped) / dS = softmax_scale * (1 - T²), i.e. dS = P * (dP - D) * (1 - T²) before the kernels' usual
softmax_scale factor (`softcap_grad`).

tanh.approx.f32 (one MUFU op) has a relative error of about 2^-11, far below the bf16 / fp16 scores' rounding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cutlass_dsl import T, dsl_user_op

from .inline_ptx import ptx_asm
from .online_softmax import OnlineSoftmax, add_values, sequential_reduce, tree_reduce

# softcap == 0 means "off"; a finite cap > 0 is what callers pass when spec.softcap.


@dsl_user_op
def tanh_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """tanh(x) by the hardware approximation (MUFU.TANH, sm_75 and newer)."""
    return Float32(
        ptx_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "tanh.approx.f32 $0, $1;", "=f,f", loc=loc, ip=ip)
    )


def softcap_factors(softmax_scale: Float32, softcap: Float32):
    """(pre_tanh, scale_log2) for a kernel's softcap build: scores are multiplied by pre_tanh = softmax_scale /
    softcap before the tanh, and the softmax runs with scale_log2 = softcap * log2(e) on the tanh's values."""
    from .online_softmax import LOG2_E

    return softmax_scale / softcap, softcap * LOG2_E


@cute.jit
def apply_softcap(acc: cute.Tensor, pre_tanh: Float32):
    """acc = tanh(acc * pre_tanh), element by element, in place (any register tensor of fp32 scores)."""
    for i in cutlass.range_constexpr(cute.size(acc)):
        acc[i] = tanh_approx(acc[i] * pre_tanh)


@cute.jit
def softcap_grad(acc_ds: cute.Tensor, acc_t: cute.Tensor):
    """acc_ds *= 1 - T², element by element, in place: the tanh's derivative for the backward, where acc_t holds the
    capped scores' tanh T of the same elements (`apply_softcap` on the recomputed S)."""
    for i in cutlass.range_constexpr(cute.size(acc_ds)):
        t = acc_t[i]
        acc_ds[i] = acc_ds[i] * (1.0 - t * t)


# The least P that CappedSoftmax gives a visible key: normal in fp32 and bf16, clear of the ex2's flush to zero at
# 2^-126. Its largest P is then 2^(2k - 120) for k > 60, within 2^64 (sums and O of up to 2^27 keys x |v| <= 2^16 stay
# finite in fp32) while k <= 92.
P_FLOOR_LOG2 = -120.0


@dataclass(frozen=True)
class CappedSoftmax(OnlineSoftmax):
    """The online softmax of soft-capped bf16 scores without a running maximum.

    The kernel's scores are T = tanh(S * softmax_scale / softcap) in [-1, 1] (or -inf where masked), run with
    scale_log2 = k = softcap * log2(e): every logit T * k lies in [-k, k], known before any key is seen. So each row
    takes one fixed reference b in place of its running max, P = 2^(T * k - b), and O is never rescaled: no row max
    (one FMNMX per score and a quad shuffle per row), no per-tile exp2 of the rescale factor, no FMUL per O element
    per tile. b = k * min(1, 120 / k - 1) keeps every P of a visible key in [2^-120, 2^64] (b = k, P <= 1, for caps
    up to 41.6): normal in fp32 and in bf16, whose exponent range is fp32's, so P loses nothing against the running
    max's P <= 1 (floating point: relative precision does not depend on the scale). A row's statistics then read as
    OnlineSoftmax's with a constant row_max = b / k, so `finalize` (sinks included) is the parent's: O / l, and
    LSE = (b + log2 l) ln 2; a row without keys has l = 0 (out 0, LSE -inf).

    Valid for k <= 92 (softcap <= 63.8: spec.WIDE_SOFTCAP routes larger caps to the running max) and for bf16 P
    only: fp16's exponent range (2^-24 .. 2^16) cannot hold P away from the row max.
    """

    @staticmethod
    def create(scale_log2: Float32, num_rows: int, threads_per_row: int = 4, sequential_sum: bool = False,
               lane_stride: int = 1) -> "CappedSoftmax":  # fmt: skip
        base = OnlineSoftmax.create(scale_log2, num_rows, threads_per_row, sequential_sum, lane_stride)
        # b / k: the lowest logit -k lands on 2^P_FLOOR_LOG2 once k > -P_FLOOR_LOG2 / 2 (the highest on 2^(2k - 120)).
        base.row_max.fill(cute.arch.fmin(Float32(1.0), Float32(-P_FLOOR_LOG2) / base.scale_log2 - 1.0))
        return CappedSoftmax(*(getattr(base, f.name) for f in dataclasses.fields(OnlineSoftmax)))

    @cute.jit
    def update(self, acc_rc: cute.Tensor, is_first: cutlass.Constexpr[bool]):
        """Scores of one block -> P in place and the row sums; returns None: O keeps its scale (`rescale` skips)."""
        sum_reduce = sequential_reduce if cutlass.const_expr(self.sequential_sum) else tree_reduce
        bias = self.row_max[0] * self.scale_log2  # b, the same product finalize forms
        for r in cutlass.range_constexpr(self.num_rows):
            row = acc_rc[r, None]
            row.store(cute.math.exp2(row.load() * self.scale_log2 - bias, fastmath=True))
            self.row_sum[r] = sum_reduce(row, add_values, None if cutlass.const_expr(is_first) else self.row_sum[r])
        return None

    def rescale(self, acc_rc: cute.Tensor, row_scale):
        """O's factor from `finalize`; the None of `update` leaves O as it is."""
        if row_scale is not None:
            OnlineSoftmax.rescale(self, acc_rc, row_scale)

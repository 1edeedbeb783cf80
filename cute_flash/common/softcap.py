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

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cutlass_dsl import T, dsl_user_op

from .inline_ptx import ptx_asm

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

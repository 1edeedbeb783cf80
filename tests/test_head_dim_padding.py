"""CPU: backwards at a wider head dim than the call's (arch/padded_head_dims.py), as the sm80 backward runs
head_dim != head_dim_v and the sm90 backward every head dim without a tile of its own: kernels built for the wider
head dim on zero-padded operands. Here a float64 reference backward stands in for the kernels at that width, and the
gradients it gives through the padding must equal the reference gradients of the unpadded problem (the padding's zero
columns change neither S, dP nor D, and their gradients are dropped)."""

from __future__ import annotations

import pytest
import torch

from cute_flash.arch.base import BwdTensors, Grads
from cute_flash.arch.padded_head_dims import padded_launcher, widened_problem
from cute_flash.arch.sm80 import backward as sm80_backward
from cute_flash.arch.sm90 import backward as sm90_backward
from cute_flash.arch.sm90.tile_config import bwd_head_dims
from cute_flash.reference import attention_reference
from cute_flash.spec import AttentionSpec, normalize_mask
from cute_flash.validation import Problem


def _reference_grads(q, k, v, dout, dlse, scale, causal):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = attention_reference(*leaves, causal=causal, softmax_scale=scale, return_lse=True)
    grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    return out.detach(), lse.detach(), grads


# (d, dv, family): the families' widths: sm80 the wider head dim, sm90 the narrowest tile at least that wide; or
# (d, dv, (d', dv')): the launcher alone padding each operand to its own kernel width.
CASES = [(192, 128, "sm80"), (128, 64, "sm80"), (64, 128, "sm80"), (96, 256, "sm80"), (160, 128, "sm90"),
         (176, 176, "sm90"), (200, 200, "sm90"), (72, 72, "sm90"), (16, 40, "sm90"), (136, 96, "sm90"),
         (160, 96, (192, 128)), (40, 128, (64, 128))]  # fmt: skip


@pytest.mark.parametrize("d, dv, family", CASES)
def test_padded_head_dims_give_the_unpadded_gradients(d, dv, family):
    g = torch.Generator().manual_seed(d + dv)
    b, sq, sk, h, h_kv = 2, 9, 13, 4, 2
    q = torch.randn(b, sq, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, sk, h_kv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, sk, h_kv, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(b, sq, h, dv, generator=g, dtype=torch.float64)
    dlse = torch.randn(b, h, sq, generator=g, dtype=torch.float64)
    scale = d**-0.5  # the call's scale, from the real head dim; the padded run must keep it
    out, lse, want = _reference_grads(q, k, v, dout, dlse, scale, causal=True)

    spec = AttentionSpec("bf16", d, dv, "causal")
    mask = normalize_mask(True, (None, None))
    problem = Problem(b, sq, sk, h, h_kv, d, dv, mask, scale, spec)
    if isinstance(family, tuple):
        dims = family
    else:
        backward = sm80_backward if family == "sm80" else sm90_backward
        width = backward.kernel_spec(spec).head_dim
        assert backward.kernel_spec(spec) == AttentionSpec("bf16", width, width, "causal")
        dims = (width, width)
        assert width == (max(d, dv) if family == "sm80" else min(w for w in bwd_head_dims() if w >= max(d, dv)))
        assert backward.backward_unsupported_reason(spec) is None
    wide = widened_problem(problem, dims)
    assert (wide.head_dim, wide.head_dim_v, wide.spec.head_dim, wide.spec.head_dim_v) == (*dims, *dims)
    assert wide.softmax_scale == scale
    seen = {}

    def kernels_at_the_wider_head_dim(t: BwdTensors, grads: Grads):
        assert all(x.shape[-1] == dims[0] for x in (t.q, t.k, grads.dq, grads.dk))
        assert all(x.shape[-1] == dims[1] for x in (t.dout, t.v, t.out, grads.dv))
        seen["zero_columns"] = all(
            bool((x[..., n:] == 0).all()) for x, n in ((t.q, d), (t.k, d), (t.v, dv), (t.dout, dv), (t.out, dv))
        )
        wide_out, wide_lse, wide = _reference_grads(t.q, t.k, t.v, t.dout, t.dlse, scale, causal=True)
        seen["out"], seen["lse"] = wide_out, wide_lse
        for dst, src in zip(grads, wide):
            dst.copy_(src)

    grads = Grads(*(torch.full_like(x, float("nan")) for x in (q, k, v)))
    padded_launcher(dims, kernels_at_the_wider_head_dim)(BwdTensors(dout, q, k, v, out, lse, dlse), grads)
    assert seen["zero_columns"]
    torch.testing.assert_close(seen["out"][..., :dv], out)  # the padded forward is the unpadded one
    torch.testing.assert_close(seen["lse"], lse)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_wider_head_dim_must_be_one_the_kernels_build():
    assert sm80_backward.backward_unsupported_reason(AttentionSpec("bf16", 72, 64, "none")) is None  # at 96
    assert sm80_backward.kernel_width(AttentionSpec("bf16", 72, 64, "none")) == 96
    assert sm80_backward.kernel_width(AttentionSpec("bf16", 8, 8, "none")) == 32
    assert "(288, 128)" in sm80_backward.backward_unsupported_reason(AttentionSpec("bf16", 288, 128, "none"))
    assert "(288, 128)" in sm90_backward.backward_unsupported_reason(AttentionSpec("bf16", 288, 128, "none"))

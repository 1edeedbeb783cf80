"""GPU regression tests of issue 13, all in one file (one command runs them; each skips without a GPU that runs it):

  1. every finite softmax_scale >= 0 gives the reference's answer: 0 (uniform attention over the visible keys), tiny
     scales (1e-30, subnormal and zero in fp32), and logits whose scaled value overflows fp32 (a hard max);
  2. any gradient autograd hands the backward (expanded by out.sum(), broadcast, transposed, offset) works;
  3. on Hopper every documented head dim gets an answer: the sm90 family where it has a kernel (padded, for the
     backward), else sm80, per call and per direction; a backward no family has would raise NotImplementedError
     naming each family's reason;
  4. a loss of lse (alone or with out) gets its gradients, and a second backward through the gradients raises.

Outputs and gradients follow FlashAttention's rule against the float64 reference (cute_flash.testing), except where
that rule has no finite baseline (a scale beyond the input dtype's range): there the hard max is checked row by row.
Items 1, 2 and 4 run once per family: `sm80` (Ampere or later; on Hopper the marker forces the sm80 family) and `sm90`.

Run: python -m pytest -q tests/test_correctness_gpu.py      (a few minutes on an H100, mostly compiling kernels)
"""

from __future__ import annotations

import pytest
import torch

import cute_flash
from cute_flash.testing import check_backward, check_forward, check_hard_max, random_qkv

FAMILIES = [pytest.param("sm80", marks=pytest.mark.sm80), pytest.param("sm90", marks=pytest.mark.sm90)]
HEAD_DIM = {"sm80": 64, "sm90": 128}  # one head dim per family keeps the compiles few
MASKS = {"full": {}, "causal": {"causal": True}, "window": {"window_size": (40, 7)}}


def _inputs(family, dtype=torch.bfloat16, seed=0, sq=300, sk=517, requires_grad=False, d=None):
    # seqlen_q < seqlen_k and > seqlen_k both appear below; several key blocks on every family (rescaling runs).
    return random_qkv(2, sq, sk, 4, 2, d or HEAD_DIM[family], dtype=dtype, seed=seed, requires_grad=requires_grad)


def _route_backward_freely(monkeypatch, family):
    """The sm90 marker forces CUTE_FLASH_ARCH=sm90; on Hopper a backward goes to whichever family has a kernel for it
    (sm90's own, or sm80's), so for sm90 the family is left to the router (its forward stays sm90 at these specs)."""
    if family == "sm90":
        monkeypatch.delenv("CUTE_FLASH_ARCH", raising=False)


# --- 1. softmax scales ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("scale", [0.0, 1e-30, 1e-39, 1e-50, 1e-6, 1e6, 1e30])
@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_scale(family, scale, mask):
    q, k, v = _inputs(family, seed=1)
    out, lse = cute_flash.attention(q, k, v, softmax_scale=scale, return_lse=True, **MASKS[mask])
    check_forward(q, k, v, out, lse, softmax_scale=scale, **MASKS[mask])


@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_scale_zero_fp16_with_empty_rows(family):
    # seqlen_q > seqlen_k, causal: the first 180 rows see no key (out 0, lse -inf); the others average v.
    q, k, v = _inputs(family, dtype=torch.float16, seed=2, sq=300, sk=120)
    out, lse = cute_flash.attention(q, k, v, softmax_scale=0.0, causal=True, return_lse=True)
    assert torch.equal(out[:, :180], torch.zeros_like(out[:, :180])) and torch.isneginf(lse[:, :, :180]).all()
    check_forward(q, k, v, out, lse, softmax_scale=0.0, causal=True)


@pytest.mark.parametrize("mask", ["full", "causal"])
@pytest.mark.parametrize("scale", [1e38, 1e300])
@pytest.mark.parametrize("family", FAMILIES)
def test_scaled_logits_overflowing_fp32(family, scale, mask):
    # scale * log2(e) * max score > FLT_MAX (1e300 is not even an fp32): the answer is the hard max, not NaN or 0.
    q, k, v = _inputs(family, seed=3, sq=200, sk=300)
    out = cute_flash.attention(q, k, v, softmax_scale=scale, **MASKS[mask])
    check_hard_max(q, k, v, out, **MASKS[mask])
    if scale < 3e38:  # the bf16 baseline is finite: FlashAttention's rule applies as well (lse overflows: not checked)
        check_forward(q, k, v, out, softmax_scale=scale, **MASKS[mask])


@pytest.mark.parametrize("family", FAMILIES)
def test_large_inputs(family):
    # |q|, |k| ~ 1e15: scores ~ 1e31 in fp32, far past where their rounding leaves a meaningful exponent.
    q, k, v = _inputs(family, seed=4, sq=200, sk=300)
    q, k = q * 1e15, k * 1e15
    out, lse = cute_flash.attention(q, k, v, causal=True, return_lse=True)
    check_hard_max(q, k, v, out, causal=True)
    check_forward(q, k, v, out, lse, causal=True)


@pytest.mark.parametrize("scale", [0.0, 1e-30])
@pytest.mark.parametrize("family", FAMILIES)
def test_backward_small_scales(monkeypatch, family, scale):
    _route_backward_freely(monkeypatch, family)
    q, k, v = _inputs(family, seed=5, sq=200, sk=300, requires_grad=True)
    out = cute_flash.attention(q, k, v, softmax_scale=scale, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    check_backward(q, k, v, dout, (q.grad, k.grad, v.grad), softmax_scale=scale, causal=True)


# --- 2. gradients of any layout -------------------------------------------------------------------------------------
def _weights(shape, seed, layout=lambda w: w):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return layout(torch.randn(*shape, generator=gen, device="cuda"))


LOSSES = {
    # d(out.sum())/d(out) is one scalar expanded to out's shape: every stride 0.
    "sum": lambda out: out.sum(),
    # Reduced over heads first: the gradient is broadcast over heads (stride 0 in that dimension only).
    "broadcast_heads": lambda out: (out.sum(dim=2).float() * _weights(out.shape[:2] + out.shape[3:], 1)).sum(),
    # Weights stored (b, s, d, h): the gradient comes back with head_dim not unit-stride.
    "transposed": lambda out: (
        out.float() * _weights(out.shape[:2] + out.shape[:1:-1], 2, lambda w: w.transpose(2, 3))
    ).sum(),
    # A slice of a larger gradient at a 2-byte offset (torch.cat's backward): a misaligned base.
    "offset": lambda out: (torch.cat([out.new_ones(1), out.flatten()]).float() * _weights((out.numel() + 1,), 3)).sum(),
    # A (b, h, s, d) gradient seen as (b, s, h, d): strided but usable, handed over without a copy.
    "strided": lambda out: (out.transpose(1, 2).contiguous().float() * _weights(out.transpose(1, 2).shape, 4)).sum(),
}


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("family", FAMILIES)
def test_backward_of_any_gradient_layout(monkeypatch, family, loss):
    _route_backward_freely(monkeypatch, family)
    q, k, v = _inputs(family, seed=6, sq=200, sk=300, requires_grad=True)
    out = cute_flash.attention(q, k, v, causal=True)
    LOSSES[loss](out).backward()
    # The gradient autograd handed over, materialised, is what the reference gets.
    out_ref = out.detach().clone().requires_grad_(True)
    LOSSES[loss](out_ref).backward()
    check_backward(q, k, v, out_ref.grad, (q.grad, k.grad, v.grad), causal=True)


# --- 3. every documented head dim on Hopper -------------------------------------------------------------------------
# (d, dv, forward family): sm90 serves head_dim != head_dim_v where both are sm90 head dims; the backward: the sm90
# family's tiles ((192, 128) has its own), padded where the call has none of its own (d16, d32, d72, d160, (128, 80),
# (128, 64); sm90.backward.kernel_dims).
HOPPER_SHAPES = [
    (16, 16, "sm80"),
    (32, 32, "sm80"),
    (72, 72, "sm80"),
    (160, 160, "sm80"),
    (128, 80, "sm80"),
    (128, 64, "sm90"),
    (192, 128, "sm90"),
]


@pytest.mark.sm90
@pytest.mark.parametrize("d, dv, family", HOPPER_SHAPES, ids=[f"d{d}_dv{dv}" for d, dv, _ in HOPPER_SHAPES])
def test_hopper_serves_every_documented_shape(monkeypatch, d, dv, family):
    monkeypatch.delenv("CUTE_FLASH_ARCH", raising=False)  # routing, not the marker's forced family
    q, k, v = random_qkv(2, 200, 300, 4, 2, d, dv, dtype=torch.bfloat16, seed=d + dv, requires_grad=True)
    route = cute_flash.explain(q, k, v, causal=True)
    assert route.forward_family == family, str(route)
    if family == "sm80":
        assert route.forward.skipped[0][0] == "sm90", str(route)
    out, lse = cute_flash.attention(q, k, v, causal=True, return_lse=True)
    check_forward(q, k, v, out, lse, causal=True)
    dout = torch.randn_like(out)
    if route.backward_family is None:
        with pytest.raises(NotImplementedError, match=r"no backward kernel.*sm90: .*sm80: "):
            out.backward(dout)
    else:
        out.backward(dout)
        check_backward(q, k, v, dout, (q.grad, k.grad, v.grad), causal=True)


@pytest.mark.sm80
@pytest.mark.parametrize("d, dv", [(80, 80), (40, 40), (72, 64), (200, 200)], ids=lambda x: str(x))
def test_sm80_backward_pads_head_dims_to_a_multiple_of_32(d, dv):
    """The sm80 family's backward (Ampere's, and the fallback on Hopper and Blackwell) runs any head dim up to 256 at
    the wider one rounded up to a multiple of 32, on zero-padded operands (sm80.backward.kernel_width)."""
    q, k, v = random_qkv(2, 200, 300, 4, 2, d, dv, dtype=torch.bfloat16, seed=d * 3 + dv, requires_grad=True)
    out = cute_flash.attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    check_backward(q, k, v, dout, (q.grad, k.grad, v.grad), causal=True)


@pytest.mark.sm90
def test_hopper_keeps_sm90_where_it_has_a_kernel(monkeypatch):
    monkeypatch.delenv("CUTE_FLASH_ARCH", raising=False)
    q, k, v = random_qkv(2, 200, 300, 4, 2, 128, dtype=torch.bfloat16, seed=9)
    assert cute_flash.explain(q, k, v).forward_family == "sm90"
    assert cute_flash.backend() == "sm90"


# --- 4. gradients through lse, and gradients of gradients -----------------------------------------------------------
@pytest.mark.parametrize("uses", ["lse", "out_and_lse"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("family", FAMILIES)
def test_backward_through_lse(monkeypatch, family, mask, uses):
    """A loss of lse (alone, or with out): its gradient folds into the backward's D (arch/base.fold_lse_grad), and
    the gradients follow the rule against float64 autograd through the reference's lse. seqlen_q > seqlen_k, so the
    causal mask leaves rows without keys (lse -inf; the loss gives them a zero gradient)."""
    _route_backward_freely(monkeypatch, family)
    q, k, v = _inputs(family, seed=21, sq=517, sk=300, requires_grad=True)
    kw = MASKS[mask]
    out, lse = cute_flash.attention(q, k, v, return_lse=True, **kw)
    g = torch.Generator(device="cuda").manual_seed(22)
    dlse = torch.randn(lse.shape, generator=g, device="cuda")
    dlse = torch.where(torch.isfinite(lse), dlse, torch.zeros_like(dlse))
    dout = torch.randn(out.shape, generator=g, device="cuda").to(out.dtype)
    if uses == "lse":
        dout = torch.zeros_like(out)
        grads = torch.autograd.grad(lse, (q, k, v), dlse, allow_unused=True)
        grads = [torch.zeros_like(t) if gr is None else gr for t, gr in zip((q, k, v), grads)]
    else:
        grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    check_backward(q, k, v, dout, grads, dlse=dlse, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_double_backward_raises(monkeypatch, family):
    """create_graph=True gives the same first-order gradients; a second backward through them raises."""
    _route_backward_freely(monkeypatch, family)
    q, k, v = _inputs(family, requires_grad=True)
    out = cute_flash.attention(q, k, v, causal=True)
    value = out.float().square().sum()
    grads = torch.autograd.grad(value, (q, k, v), create_graph=True, retain_graph=True)
    check_backward(q, k, v, (2 * out.float()).to(out.dtype).detach(), [g.detach() for g in grads], causal=True)
    with pytest.raises(NotImplementedError, match="double"):
        grads[0].float().square().sum().backward()

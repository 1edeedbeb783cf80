"""The online softmax's fp32 arithmetic (common/online_softmax.py), emulated in torch on the CPU, at extreme scales.

The kernels cannot run here, but their arithmetic can: the exponent factor's clamp, the per-row factor of
`row_exponent_scale` (the same integer operations on the same bits), the FMA-then-ex2.approx.ftz exponent and the
block-by-block rescaling. These tests pin the claims of that module's docstring: scale 0 is uniform attention, tiny
scales give no NaN, and rows whose scaled max overflows fp32 keep the hard-max answer.
"""

import math

import pytest
import torch

from cute_flash.reference import attention_reference, visible_keys
from cute_flash.spec import normalize_mask

FLT_MIN = 2.0**-126
FLT_MAX = (2.0 - 2.0**-23) * 2.0**127
EXP_MASK = 0x7F800000


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).view(torch.int32).to(torch.int64)


def _float(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int32).view(torch.float32)


def clamp_scale_log2(c: float) -> torch.Tensor:
    return torch.tensor(c, dtype=torch.float32).clamp(FLT_MIN, FLT_MAX)


def limit_bits(c: torch.Tensor) -> torch.Tensor:
    """max_limit_bits: bits(c) + the exponent bits of 2^24 / c, an unsigned 32-bit value (int64 here)."""
    return (_bits(torch.tensor(2.0**24, dtype=torch.float32) / c) & EXP_MASK) + _bits(c)


def row_exponent_scale(c: torch.Tensor, row_max: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """The kernel's two unsigned 32-bit operations: min(limit - (bits(row_max) & EXP), bits(c))."""
    diff = limit - (_bits(row_max) & EXP_MASK)
    assert (diff >= 0).all() and (diff < 2**32).all()  # no unsigned wrap
    return _float(torch.minimum(diff, _bits(c).expand_as(diff)))


def _ftz(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x.abs() < FLT_MIN, torch.zeros_like(x), x)


def _ex2(x: torch.Tensor) -> torch.Tensor:
    """ex2.approx.ftz.f32: a subnormal input or output is 0."""
    return _ftz(torch.exp2(_ftz(x).double()).to(torch.float32))


def _fma(a, b, c):
    """fp32 fma: the product of two fp32 values is exact in float64, then one rounding (to float64, then fp32)."""
    return (a.double() * b.double() + c.double()).to(torch.float32)


def kernel_softmax(scores: torch.Tensor, scale: float, block_n: int = 64):
    """The weights the kernel applies to each key (its O accumulator, with one column per key instead of V) and the
    natural-log lse, one key block at a time as OnlineSoftmax.update / finalize. scores: (rows, keys) fp32, -inf
    where masked."""
    c = clamp_scale_log2(scale * math.log2(math.e))
    limit = limit_bits(c)
    rows, keys = scores.shape
    row_max = torch.full((rows,), float("-inf"))
    row_sum = torch.zeros(rows)
    weights = torch.zeros(rows, keys, dtype=torch.float64)  # the O accumulator, one column per key
    for n0 in range(0, keys, block_n):
        s = scores[:, n0 : n0 + block_n]
        prev = row_max
        new = torch.maximum(prev, s.amax(dim=1))
        row_max = new
        safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
        c_row = row_exponent_scale(c, new, limit)  # the raw max, as the kernel (-inf: any normal factor)
        max_scaled = (safe * c_row).to(torch.float32)
        p = _ex2(_fma(s, c_row[:, None], -max_scaled[:, None]))
        factor = _ex2(_fma(prev, c_row, -max_scaled))
        assert torch.isfinite(p).all() and torch.isfinite(factor).all()
        row_sum = row_sum * factor + p.sum(dim=1)
        weights = weights * factor[:, None].double()
        weights[:, n0 : n0 + block_n] = p.double()
    empty = row_sum == 0
    out_w = torch.where(empty[:, None], torch.zeros_like(weights), weights / row_sum[:, None].double())
    log2_sum = torch.log2(torch.where(empty, torch.ones_like(row_sum), row_sum))
    lse = torch.where(empty, torch.full_like(row_sum, float("-inf")), (_fma(row_max, c, log2_sum)) * math.log(2.0))
    return out_w, lse


def _case(sq, sk, d, seed, causal, input_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, sq, 1, d, generator=g) * input_scale).to(torch.bfloat16)
    k = (torch.randn(1, sk, 1, d, generator=g) * input_scale).to(torch.bfloat16)
    v = torch.randn(1, sk, 1, d, generator=g).to(torch.bfloat16)
    raw = torch.einsum("qd,kd->qk", q[0, :, 0].float(), k[0, :, 0].float())  # fp32 scores, as the MMA gives
    hidden = ~visible_keys(sq, sk, normalize_mask(causal, (None, None)))
    return q, k, v, raw.masked_fill(hidden, float("-inf"))


def _kernel_out(scores, v, scale):
    w, lse = kernel_softmax(scores, scale)
    return w @ v[0, :, 0].double(), lse


@pytest.mark.parametrize("scale", [0.0, 1e-50, 1e-39, 1e-30, 1e-6])
@pytest.mark.parametrize("causal", [False, True])
def test_tiny_scales_are_uniform_and_finite(scale, causal):
    q, k, v, scores = _case(150, 100, 64, seed=1, causal=causal)  # causal: the first 50 rows see no key
    out, lse = _kernel_out(scores, v, scale)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref[0, :, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.float(), ref_lse[0, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "scale, input_scale",
    [
        (1.0, 1.0),
        (1.0, 10.0),
        (1e3, 1.0),
        (1e6, 1.0),
        (1e9, 1.0),
        (1e30, 1.0),
        (1e38, 1.0),
        (1e300, 1.0),
        (0.125, 1e15),
    ],
)
def test_every_scale_matches_the_exact_softmax_of_the_fp32_scores(scale, input_scale):
    """Against softmax computed in float64 from the kernel's own fp32 scores (what the arithmetic after the MMA can
    at best achieve): the per-row factor keeps rows whose scaled max leaves fp32's range exact, and the rest as
    exact as before. Where the scale makes a hard max, the answer is v at the best key."""
    q, k, v, scores = _case(100, 300, 64, seed=2, causal=True, input_scale=input_scale)
    out, _ = _kernel_out(scores, v, scale)
    assert torch.isfinite(out).all()
    z = (scores.double() - scores.double().amax(dim=1, keepdim=True)) * scale
    exact = torch.softmax(z, dim=1) @ v[0, :, 0].double()
    assert (out - exact).abs().max() <= 1e-4
    if scale * input_scale**2 >= 1e20:
        top = scores.topk(2, dim=1)
        clear = (top.values[:, 0] - top.values[:, 1]) > 1e-3 * top.values[:, 0].abs()
        assert clear.float().mean() > 0.9
        assert (out[clear] - v[0, top.indices[:, 0], 0].double()[clear]).abs().max() <= 1e-6


@pytest.mark.parametrize("scale", [0.0, 0.125, 1.0, 1e10, 1e38])
def test_row_factor_keeps_scaled_max_in_range(scale):
    c = clamp_scale_log2(scale * math.log2(math.e))
    limit = limit_bits(c)
    m = torch.cat(
        [torch.tensor([0.0, FLT_MIN, 1e-30, 1.0, 3.0, 1e10, 1e30, FLT_MAX]), torch.logspace(-38, 38, 200)]
    ).to(torch.float32)
    m = torch.cat([m, -m])
    c_row = row_exponent_scale(c, m, limit)
    assert (c_row > 0).all() and (c_row >= FLT_MIN).all() and torch.isfinite(c_row).all()
    scaled = (m.double() * c_row.double()).abs()
    assert (scaled < 2.0**25).all()
    unchanged = (m.double().abs() * float(c)) < 2.0**23
    assert torch.equal(c_row[unchanged], c.expand_as(c_row)[unchanged])
    # A reduced factor is c times a power of two (exact scaling).
    ratio = c.double() / c_row.double()
    assert torch.equal(torch.exp2(torch.round(torch.log2(ratio))), ratio)


@pytest.mark.parametrize("scale", [0.0, 1e-30, 0.088, 1.0, 1e10, 1e38, 1e300])
def test_two_op_row_factor_equals_the_clamped_exponent_difference(scale):
    """The kernel's min(limit - e_m, bits(c)) is bits(c) - max(0, e_m - e_limit) for every row max (the kernel passes
    the raw max: -inf too), and a positive normal float."""
    c = clamp_scale_log2(scale * math.log2(math.e))
    e_limit = _bits(torch.tensor(2.0**24, dtype=torch.float32) / c) & EXP_MASK
    m = torch.cat([torch.tensor([0.0, FLT_MIN, FLT_MAX, 1e-45]), torch.logspace(-38, 38, 400)]).to(torch.float32)
    m = torch.cat([m, -m, torch.tensor([float("inf"), float("-inf"), float("nan")])])  # exponent field 255 too
    expected = _float(_bits(c) - ((_bits(m) & EXP_MASK) - e_limit).clamp_min(0))
    got = row_exponent_scale(c, m, limit_bits(c))
    assert torch.equal(got, expected)
    assert (got >= FLT_MIN).all() and torch.isfinite(got).all()

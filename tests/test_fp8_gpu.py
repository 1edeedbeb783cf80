"""GPU (Hopper): the FP8 pre-pass against its torch reference, and FP8 attention against float64 within the budget.

Error budget (docs/fp8.md): FP8 attention is compared with the same arithmetic emulated in torch
(`cute_flash.fp8.emulate`, the kernel's quantisation, tile order and P rounding) and with float64:
  RMSE(kernel − float64) <= 1.25 · RMSE(emulated − float64) + 1e-4
  max |kernel − float64| <= 2 · max |emulated − float64| + 2e-3
and for already quantised inputs the same two bounds against float64 on the dequantised inputs, the emulation then
rounding only P (scheme GIVEN).
Rows that see no key must give out 0 and lse -inf exactly.
"""

import pytest
import torch

import cute_flash
from cute_flash.arch.sm90.fp8.tile_config import kv_scale_block
from cute_flash.fp8 import quantize
from cute_flash.fp8.emulate import GIVEN, emulated_attention
from cute_flash.testing import FP8_ABS_SLACK
from cute_flash.fp8.hadamard import DEFAULT_SEED, hadamard_signs, unrotate
from cute_flash.fp8.prepare import BLOCK_M, BLOCK_N, prepare_fp8_inputs
from cute_flash.reference import attention_reference
from tests.forward_suite import FP8_CASES

pytestmark = pytest.mark.sm90


def _qkv(b, sq, sk, h, hkv, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda s, n: torch.randn(b, s, n, d, generator=g, device="cuda").to(dtype)  # noqa: E731
    return mk(sq, h), mk(sk, hkv), mk(sk, hkv)


def _rmse(a, b):
    return (a.double() - b.double()).pow(2).mean().sqrt().item()


# --- the pre-pass -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [96, 128])
@pytest.mark.parametrize("rotate", [True, False])
def test_prepass_matches_torch_reference(d, rotate):
    q, k, v = _qkv(2, 300, 1000, 4, 2, d, seed=d)
    k[1, 517, 1, 3] = 40.0  # an outlier in one block
    got = prepare_fp8_inputs(q, k, v, rotate=rotate)
    signs = hadamard_signs(d, DEFAULT_SEED, "cuda") if rotate else None
    for name, x, block, x8 in (("q", q, BLOCK_M, got.q), ("k", k, BLOCK_N, got.k)):
        ref8, ref_d = quantize.quantize_blocks(x, block, signs)
        descale = got.q_descale if name == "q" else got.k_descale
        torch.testing.assert_close(descale, ref_d, rtol=1e-6, atol=0, msg=f"{name} descale")
        a, r = x8.float(), ref8.float()
        differ = (a != r).float().mean().item()
        # Same arithmetic in the same order: at most a rare 1-ulp difference where fp32 sums differ.
        assert differ < 1e-3, f"{name}: {differ:.2%} of e4m3 values differ"
        assert ((a - r).abs() <= r.abs() * 2.0**-3 + 2.0**-9).all(), f"{name}: a difference beyond one e4m3 ulp"
    ref_vt, ref_vd = quantize.quantize_v_transposed(v, BLOCK_N)
    torch.testing.assert_close(got.v_descale, ref_vd, rtol=1e-6, atol=0)
    assert got.v_t.shape == ref_vt.shape
    # V is not rotated: the same fp32 multiply and the same rounding, so every value must match (compared as values,
    # so that a zero's sign does not count).
    assert torch.equal(got.v_t.float(), ref_vt.float()), "transposed V differs"


def test_prepass_hadamard_round_trip():
    q, k, v = _qkv(1, 256, 256, 2, 2, 128, seed=3)
    got = prepare_fp8_inputs(q, k, v, rotate=True)
    back = unrotate(
        quantize.dequantize_blocks(got.q, got.q_descale, BLOCK_M), hadamard_signs(128, DEFAULT_SEED, "cuda")
    )
    assert _rmse(back, q.float()) < 0.04 * q.float().pow(2).mean().sqrt().item()


# --- FP8 attention ----------------------------------------------------------------------------------------------------
CASES = FP8_CASES + [
    (1, 400, 900, 2, 1, 256, True, (None, None)),
]


def _sums_rounded_p(head_dim: int, head_dim_v: int, causal: bool, window=(None, None)) -> bool:
    # With row_sum_mma the kernel normalises by the sum of the e4m3-rounded P (what the P·V wgmma sees).
    from cute_flash.arch.sm90.fp8.tile_config import fp8_fwd_config
    from cute_flash.spec import normalize_mask

    return fp8_fwd_config(head_dim, head_dim_v, normalize_mask(causal, window).kind).row_sum_mma


def _check_against_emulation(q, k, v, out, lse, causal, window, rotate=True):
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window_size=window, return_lse=True)
    scheme = "fp8_block_rotate" if rotate else "fp8_block"
    emu = emulated_attention(
        q,
        k,
        v,
        scheme=scheme,
        causal=causal,
        window_size=window,
        block_m=BLOCK_M,
        block_n=kv_scale_block(q.shape[-1], v.shape[-1]),
        sum_rounded_p=_sums_rounded_p(q.shape[-1], v.shape[-1], causal, window),
    )
    assert torch.isfinite(out).all()
    err, emu_err = _rmse(out, ref), _rmse(emu, ref)
    max_err = (out.double() - ref).abs().max().item()
    emu_max = (emu.double() - ref).abs().max().item()
    assert err <= 1.25 * emu_err + 1e-4, f"rmse {err:.3e} vs emulated {emu_err:.3e}"
    assert max_err <= 2 * emu_max + FP8_ABS_SLACK, f"max {max_err:.3e} vs emulated {emu_max:.3e}"
    masked = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), masked), "rows with no key must have lse = -inf"
    if masked.any():
        rows = masked.permute(0, 2, 1)  # (b, sq, h)
        assert (out[rows] == 0).all(), "rows with no key must be 0"
    keep = ~masked
    assert (lse[keep] - ref_lse[keep]).abs().mean().item() < 0.05
    return err, emu_err


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: "b{}_sq{}_sk{}_h{}/{}_d{}_{}_{}".format(*c[:6], "causal" if c[6] else "full", c[7])
)
def test_fp8_attention_matches_budget(case):
    b, sq, sk, h, hkv, d, causal, window = case
    q, k, v = _qkv(b, sq, sk, h, hkv, d, seed=sq + sk)
    out, lse = cute_flash.attention(q, k, v, causal=causal, window_size=window, dtype="fp8", return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == (b, sq, h, d)
    _check_against_emulation(q, k, v, out, lse, causal, window)


@pytest.mark.parametrize("rotate", [True, False])
def test_fp8_fp16_inputs_and_rotation_switch(rotate):
    q, k, v = _qkv(1, 384, 384, 2, 2, 128, dtype=torch.float16, seed=5)
    out, lse = cute_flash.attention(q, k, v, causal=True, dtype="fp8", fp8_rotate=rotate, return_lse=True)
    assert out.dtype == torch.float16
    _check_against_emulation(q, k, v, out, lse, True, (None, None), rotate=rotate)


@pytest.mark.parametrize("per_block", [False, True])
def test_prequantized_inputs(per_block):
    b, s, h, hkv, d = 2, 600, 4, 2, 128
    q, k, v = _qkv(b, s, s, h, hkv, d, seed=11)
    block_n = kv_scale_block(d, d)  # what the sm90 kernel reads per block at this head dim
    (q8, k8, v8), (qd, kd, vd), deq = quantize.quantize_qkv(q, k, v, BLOCK_M, block_n, per_block)
    out, lse = cute_flash.attention(q8, k8, v8, causal=True, descale=(qd, kd, vd), return_lse=True)
    assert out.dtype == torch.bfloat16
    # Against float64 on the dequantised inputs; only P's rounding (and fp32 order) remains, which the model has.
    ref = attention_reference(*deq, causal=True)
    emu = emulated_attention(
        *deq,
        scheme=GIVEN,
        causal=True,
        block_m=BLOCK_M,
        block_n=block_n,
        sum_rounded_p=_sums_rounded_p(q.shape[-1], v.shape[-1], True),
    )
    err, emu_err = _rmse(out, ref), _rmse(emu, ref)
    assert err <= 1.25 * emu_err + 1e-4, f"rmse {err:.3e} vs emulated {emu_err:.3e}"
    max_err = (out.double() - ref).abs().max().item()
    assert max_err <= 2 * (emu.double() - ref).abs().max().item() + FP8_ABS_SLACK


def test_fp8_gradient_raises():
    q, k, v = _qkv(1, 128, 128, 2, 2, 128, seed=1)
    q.requires_grad_(True)
    out = cute_flash.attention(q, k, v, dtype="fp8")
    with pytest.raises(NotImplementedError, match="forward-only"):
        out.sum().backward()
    _, lse = cute_flash.attention(q, k, v, dtype="fp8", return_lse=True)
    with pytest.raises(NotImplementedError, match="forward-only"):  # (a loss of lse alone: not silently dropped)
        (lse.sum() + q.float().square().sum()).backward()

"""CPU tests of the FP8 pre-pass references: the randomised Hadamard transform and block-scaled e4m3 quantisation."""

import math

import pytest
import torch

from cute_flash.fp8 import hadamard, quantize
from cute_flash.fp8.emulate import emulated_attention
from cute_flash.reference import attention_reference


@pytest.mark.parametrize("d", [8, 64, 96, 128, 192, 256])
def test_hadamard_is_orthonormal_and_an_involution(d):
    x = torch.randn(3, 5, d, dtype=torch.float64)
    y = hadamard.walsh_hadamard(x)
    assert torch.allclose(hadamard.walsh_hadamard(y), x, atol=1e-12)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-12)


def test_hadamard_matches_sylvester_matrix():
    n = 16
    idx = torch.arange(n)
    popcount = torch.tensor([bin(int(i & j)).count("1") for i in idx for j in idx]).reshape(n, n)
    h = (1.0 - 2.0 * (popcount % 2)).double() / math.sqrt(n)
    x = torch.randn(4, n, dtype=torch.float64)
    assert torch.allclose(hadamard.walsh_hadamard(x), x @ h, atol=1e-12)


@pytest.mark.parametrize("d,block", [(128, 128), (96, 32), (192, 64), (80, 16), (72, 8)])
def test_block_size(d, block):
    assert hadamard.hadamard_block_size(d) == block


def test_signs_depend_only_on_seed():
    a = hadamard.hadamard_signs(128, seed=7)
    assert torch.equal(a, hadamard.hadamard_signs(128, seed=7))
    assert not torch.equal(a, hadamard.hadamard_signs(128, seed=8))
    assert set(a.tolist()) == {-1.0, 1.0}


def test_rotation_round_trip_and_preserves_scores():
    signs = hadamard.hadamard_signs(128, seed=3)
    q = torch.randn(2, 9, 3, 128, dtype=torch.float64)
    k = torch.randn(2, 11, 3, 128, dtype=torch.float64)
    qr, kr = hadamard.rotate(q, signs), hadamard.rotate(k, signs)
    assert qr.dtype == torch.float64
    assert torch.allclose(hadamard.unrotate(qr, signs), q, atol=1e-12)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k)
    assert torch.allclose(torch.einsum("bqhd,bkhd->bhqk", qr, kr), s, atol=1e-10)


def test_rotation_spreads_an_outlier():
    x = torch.zeros(1, 1, 1, 128)
    x[..., 5] = 100.0
    y = hadamard.rotate(x, hadamard.hadamard_signs(128))
    assert torch.allclose(y.abs(), torch.full_like(y, 100.0 / math.sqrt(128)))


def test_block_amax_and_scales():
    x = torch.randn(2, 70, 3, 16)
    x[1, 65, 2, 4] = -50.0
    amax = quantize.block_amax(x, 32)
    assert amax.shape == (2, 3, 3)
    assert amax[1, 2, 2] == 50.0
    ref = x[0, 32:64, 1].abs().max()
    assert amax[0, 1, 1] == ref
    mult, descale = quantize.quant_factors(torch.tensor([0.0, 448.0, 1.0]))
    assert mult.tolist() == [1.0, 1.0, 448.0]
    assert torch.equal(descale, torch.tensor([1.0, 1.0, 1.0 / 448.0], dtype=torch.float32))


def test_block_quantisation_error_and_saturation():
    x = torch.randn(2, 200, 4, 64, dtype=torch.bfloat16)
    x8, descale = quantize.quantize_blocks(x, 64)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == x.shape and descale.shape == (2, 4, 4)
    # Every block uses the top of e4m3's range: its largest entry becomes ±448.
    top = quantize.block_amax(x8.float(), 64)
    assert torch.all(top == 448.0)
    back = quantize.dequantize_blocks(x8, descale, 64)
    rel = (back - x.float()).abs() / x.float().abs().clamp_min(1e-3)
    assert rel[x.float().abs() > 0.05].max() <= 2.0**-4 + 1e-6  # half an ulp of a 3-bit mantissa
    assert torch.isfinite(back).all()


def test_zero_block_gives_unit_descale():
    x = torch.zeros(1, 64, 1, 32)
    x8, descale = quantize.quantize_blocks(x, 64)
    assert descale.item() == 1.0 and torch.all(x8.float() == 0)


def test_transposed_v_layout():
    v = torch.randn(2, 37, 3, 24)
    v8, descale = quantize.quantize_v_transposed(v, 16)
    assert v8.shape == (2, 3, 24, 48) and v8.dtype == torch.float8_e4m3fn and v8.stride(-1) == 1
    plain, _ = quantize.quantize_blocks(v, 16)
    assert torch.equal(quantize.untranspose_v(v8, 37).float(), plain.float())
    # Column 16 j + p holds key 16 j + PERM[p]; padding keys (>= 37) are zero wherever they landed.
    assert torch.equal(v8[0, 1, 5, 16 + 2].float(), plain[0, 16 + 8, 1, 5].float())
    order = quantize.v_key_order(48)
    assert torch.all(v8[..., order >= 37].float() == 0)


def test_v_key_permutation_is_a_permutation():
    assert sorted(quantize.V_KEY_PERM16) == list(range(16))
    assert quantize.V_KEY_PERM16[:8] == (0, 1, 8, 9, 2, 3, 10, 11)


@pytest.mark.parametrize("causal", [False, True])
def test_emulated_fp8_attention_is_close(causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 200, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    ref = attention_reference(q, k, v, causal=causal)
    # Max error: a causal row that sees one key returns that key's V row, rounded to e4m3 (2^-4 relative).
    for scheme, max_tol, rms_tol in (("bf16", 4e-3, 1e-3), ("fp8_block", 0.2, 0.02), ("fp8_block_rotate", 0.2, 0.02)):
        out = emulated_attention(q, k, v, scheme=scheme, causal=causal, block_m=64, block_n=64)
        err = out.double() - ref
        assert err.abs().max() < max_tol and err.pow(2).mean().sqrt() < rms_tol, scheme


def test_prepare_on_cpu_matches_the_reference_layout():
    from cute_flash.fp8.prepare import BLOCK_M, BLOCK_N, prepare_fp8_inputs

    q = torch.randn(2, 100, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 300, 2, 64, dtype=torch.bfloat16)
    v = torch.randn(2, 300, 2, 32, dtype=torch.bfloat16)
    f = prepare_fp8_inputs(q, k, v, rotate=True, seed=1)
    assert f.q.shape == q.shape and f.k.shape == k.shape and f.v_t.shape == (2, 2, 32, 304)
    assert f.q_descale.shape == (2, 4, 2) and f.k_descale.shape == (2, 2, 3) and f.v_descale.shape == (2, 2, 3)
    assert f.block_m == BLOCK_M and f.block_n == BLOCK_N
    # Rotation leaves the scores alone: dequantised scores track the exact ones.
    qf = quantize.dequantize_blocks(f.q, f.q_descale, BLOCK_M)
    kf = quantize.dequantize_blocks(f.k, f.k_descale, BLOCK_N)
    s8 = torch.einsum("bqhd,bkhd->bhqk", qf, kf.repeat_interleave(2, dim=2))
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(2, dim=2))
    assert (s8 - s).pow(2).mean().sqrt() < 0.05 * s.pow(2).mean().sqrt()


def test_check_prequantized_descale_forms():
    from cute_flash.fp8.prepare import check_prequantized

    b, sq, sk, h, hkv, d = 2, 70, 130, 4, 2, 64
    q8 = torch.randn(b, sq, h, d).to(torch.float8_e4m3fn)
    k8 = torch.randn(b, sk, hkv, d).to(torch.float8_e4m3fn)
    v8 = torch.randn(b, sk, hkv, d).to(torch.float8_e4m3fn)
    per_head = torch.arange(b * hkv, dtype=torch.float32).reshape(b, hkv) + 1
    f = check_prequantized(q8, k8, v8, (per_head, per_head, per_head))
    assert f.q_descale.shape == (b, h, 2) and f.k_descale.shape == (b, hkv, 2)
    assert f.q_descale[1, 3, 1] == per_head[1, 1]  # query head 3 reads kv head 1
    assert torch.equal(quantize.untranspose_v(f.v_t, sk).float(), v8.float())
    per_block = torch.ones(b, h, 2), torch.ones(b, hkv, 2), torch.ones(b, hkv, 2)
    check_prequantized(q8, k8, v8, per_block)
    with pytest.raises(ValueError, match=r"k_descale has shape \(2, 2, 3\)"):
        check_prequantized(q8, k8, v8, (per_head, torch.ones(b, hkv, 3), per_head))
    with pytest.raises(ValueError, match="must be float32"):
        check_prequantized(q8, k8, v8, (per_head.double(), per_head, per_head))


# --- API validation of the FP8 keywords (meta tensors stand in for CUDA tensors; no kernel runs) ----------------------
@pytest.fixture
def meta_gpu(monkeypatch):
    from cute_flash import validation
    from cute_flash.core import device

    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "meta"))
    monkeypatch.delenv("CUTE_FLASH_ARCH", raising=False)
    monkeypatch.setattr(device, "capability", lambda t: (8, 0))  # an Ampere GPU: no FP8 kernel


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_fp8_on_a_family_without_fp8_kernel_is_not_implemented(meta_gpu):
    import cute_flash

    q, k, v = _meta(1, 64, 2, 64), _meta(1, 64, 2, 64), _meta(1, 64, 2, 64)
    with pytest.raises(NotImplementedError, match="fp8"):
        cute_flash.attention(q, k, v, dtype="fp8")


def test_fp8_inputs_need_descale(meta_gpu):
    import cute_flash

    q, k, v = (_meta(1, 64, 2, 64, dtype=torch.float8_e4m3fn) for _ in range(3))
    with pytest.raises(ValueError, match="pass descale="):
        cute_flash.attention(q, k, v)
    d = _meta(1, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"k_descale has shape \(1, 3\)"):
        cute_flash.attention(q, k, v, descale=(d, _meta(1, 3, dtype=torch.float32), d))
    with pytest.raises(NotImplementedError, match="fp8"):  # valid call, but sm80 has no FP8 kernel
        cute_flash.attention(q, k, v, descale=(d, d, d))


def test_descale_only_with_fp8_inputs(meta_gpu):
    import cute_flash

    q, k, v = _meta(1, 64, 2, 64), _meta(1, 64, 2, 64), _meta(1, 64, 2, 64)
    d = _meta(1, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match="descale is only for float8_e4m3fn inputs"):
        cute_flash.attention(q, k, v, dtype="fp8", descale=(d, d, d))
    with pytest.raises(TypeError, match="fp8_rotate must be a bool"):
        cute_flash.attention(q, k, v, dtype="fp8", fp8_rotate=1)


def test_fp8_spec_output_dtypes(meta_gpu):
    from cute_flash.validation import validate

    q, k, v = (
        _meta(1, 64, 2, 64, dtype=torch.float16),
        _meta(1, 64, 2, 64, dtype=torch.float16),
        _meta(1, 64, 2, 64, dtype=torch.float16),
    )
    p = validate(q, k, v, causal=False, softmax_scale=None, window_size=(None, None), dtype="fp8")
    assert p.spec.dtype == "fp8" and p.spec.out_dtype == "fp16"
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    d = _meta(1, 2, dtype=torch.float32)
    p = validate(q8, k8, v8, causal=True, softmax_scale=None, window_size=(None, None), dtype=None, descale=(d, d, d))
    assert p.spec.dtype == "fp8" and p.spec.out_dtype == "bf16" and p.spec.mask == "causal"

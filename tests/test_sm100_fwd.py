"""GPU (Blackwell, compute capability 10.x): the sm100 forward against the float64 reference with FlashAttention's
rule (max |out - ref| <= 2 * max |torch in the input dtype - ref| + 1e-5; LSE likewise, -inf rows exactly).

Run: pytest -m sm100 tests/test_sm100_fwd.py  (skips without a compute capability 10.x GPU).

The matrix is the sm90 one with the head dims sm100 builds (64, 96, 128; 192 and 256 raise NotImplementedError).
seqlen_q > 256 at d=128 runs the 2-CTA kernel, shorter ones the 1-CTA kernel (config.choose_config);
`test_one_and_two_cta_agree` runs both on the same inputs.
"""

import pytest
import torch

from cute_flash import attention
from cute_flash.arch.sm100 import tile_config as sm100_config
from cute_flash.reference import attention_reference
from cute_flash.spec import AttentionSpec
from cute_flash.testing import attention_and_check, check_forward, random_qkv
from tests.forward_suite import FP8_CASES as SHARED_FP8_CASES, forward_suite

pytestmark = pytest.mark.sm100

HEAD_DIMS = [64, 96, 128]
_run = attention_and_check


test_forward_matrix, test_forward_long, test_fully_masked_rows, test_forward_strided_views = forward_suite(HEAD_DIMS)


@pytest.mark.parametrize("window", [(0, 0), (100, 30), (None, 5), (7, None), (300, 300)])
def test_local_windows(window):
    q, k, v = random_qkv(2, 777, 901, 4, 4, 128, dtype=torch.bfloat16, seed=11)
    _run(q, k, v, window_size=window)
    _run(q, k, v, causal=True, window_size=window)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_one_and_two_cta_agree(monkeypatch, causal):
    q, k, v = random_qkv(2, 1000, 1111, 4, 2, 128, dtype=torch.bfloat16, seed=5)
    spec = AttentionSpec("bf16", 128, 128, "causal" if causal else "none")
    outs = []
    for use_2cta in (False, True):
        monkeypatch.setattr(
            sm100_config, "choose_config", lambda spec_, seqlen_q, u=use_2cta: sm100_config.make_config(spec_, u)
        )
        out, lse = attention(q, k, v, causal=causal, return_lse=True)
        check_forward(q, k, v, out, lse, causal=causal)
        outs.append((out, lse))
    assert sm100_config.two_cta_eligible(spec)
    # Same arithmetic in both (only the MMA grouping differs): results agree to the last bits of the output dtype.
    assert (outs[0][0].float() - outs[1][0].float()).abs().max().item() <= 2 * 2.0**-8
    assert torch.allclose(outs[0][1], outs[1][1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("head_dim", [192, 256])
def test_unbuilt_head_dims_say_so(head_dim):
    q, k, v = random_qkv(1, 64, 64, 2, 2, head_dim, dtype=torch.bfloat16, seed=1)
    with pytest.raises(NotImplementedError, match="head_dim"):
        attention(q, k, v)


# --- FP8 (kind::f8f6f4) through the front end -------------------------------------------------------------------------
# Budget of docs/fp8.md (the same as tests/test_fp8_gpu.py): against float64, the kernel may be at most 1.25x the RMSE
# and 2x the max error of the same quantisation emulated in torch (cute_flash.fp8.emulate); pre-quantised inputs are
# compared with float64 on the dequantised values. Rows that see no key: out 0, lse -inf.
FP8_CASES = SHARED_FP8_CASES + [
    (1, 333, 517, 4, 2, 96, False, (None, None)),
]


def _rmse(a, b):
    return (a.double() - b.double()).pow(2).mean().sqrt().item()


def _check_fp8(q, k, v, out, lse, causal, window, rotate=True):
    from cute_flash.arch.sm100.tile_config import FP8_KV_SCALE_KEYS as BLOCK_N, FP8_Q_SCALE_ROWS as BLOCK_M
    from cute_flash.fp8.emulate import emulated_attention

    ref, ref_lse = attention_reference(q, k, v, causal=causal, window_size=window, return_lse=True)
    emu = emulated_attention(
        q,
        k,
        v,
        scheme="fp8_block_rotate" if rotate else "fp8_block",
        causal=causal,
        window_size=window,
        block_m=BLOCK_M,
        block_n=BLOCK_N,
    )
    assert torch.isfinite(out).all()
    err, emu_err = _rmse(out, ref), _rmse(emu, ref)
    max_err = (out.double() - ref).abs().max().item()
    emu_max = (emu.double() - ref).abs().max().item()
    assert err <= 1.25 * emu_err + 1e-4, f"rmse {err:.3e} vs emulated {emu_err:.3e}"
    assert max_err <= 2 * emu_max + 2e-3, f"max {max_err:.3e} vs emulated {emu_max:.3e}"
    masked = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), masked), "rows with no key must have lse = -inf"
    if masked.any():
        assert (out[masked.permute(0, 2, 1)] == 0).all(), "rows with no key must be 0"
    keep = ~masked
    assert (lse[keep] - ref_lse[keep]).abs().mean().item() < 0.05


@pytest.mark.parametrize(
    "case",
    FP8_CASES,
    ids=lambda c: "b{}_sq{}_sk{}_h{}/{}_d{}_{}_{}".format(*c[:6], "causal" if c[6] else "full", c[7]),
)
def test_fp8_attention_matches_budget(case):
    b, sq, sk, h, hkv, d, causal, window = case
    q, k, v = random_qkv(b, sq, sk, h, hkv, d, dtype=torch.bfloat16, seed=sq + sk)
    out, lse = attention(q, k, v, causal=causal, window_size=window, dtype="fp8", return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == (b, sq, h, d)
    _check_fp8(q, k, v, out, lse, causal, window)


@pytest.mark.parametrize("per_block", [False, True])
def test_fp8_prequantized_inputs(per_block):
    from cute_flash.arch.sm100.tile_config import FP8_KV_SCALE_KEYS as BLOCK_N, FP8_Q_SCALE_ROWS as BLOCK_M
    from cute_flash.fp8 import quantize

    b, s, h, hkv, d = 2, 600, 4, 2, 128
    q, k, v = random_qkv(b, s, s, h, hkv, d, dtype=torch.bfloat16, seed=11)
    (q8, k8, v8), (qd, kd, vd), deq = quantize.quantize_qkv(q, k, v, BLOCK_M, BLOCK_N, per_block)
    out, lse = attention(q8, k8, v8, causal=True, descale=(qd, kd, vd), return_lse=True)
    assert out.dtype == torch.bfloat16
    ref = attention_reference(*deq, causal=True)
    # Only P's e4m3 rounding remains (the K and V factors change from block to block when per_block).
    assert _rmse(out, ref) <= 0.01 * ref.pow(2).mean().sqrt().item() + 1e-4
    assert (out.double() - ref).abs().max().item() <= 2.0**-3 * deq[2].abs().max().item()

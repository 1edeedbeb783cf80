"""GPU (Hopper): the sm90 forward against the float64 reference with FlashAttention's rule
(max |out - ref| <= 2 * max |torch in the input dtype - ref| + 1e-5; LSE likewise, -inf rows exactly).

Run: pytest -m sm90 tests/test_sm90_fwd.py  (skips without a compute capability 9.0 GPU).
"""

import pytest
import torch

import cute_flash
from cute_flash import attention
from cute_flash.testing import MATRIX_DTYPES, MATRIX_MASKS, attention_and_check, check_backward, random_qkv
from tests.forward_suite import forward_suite

pytestmark = pytest.mark.sm90

HEAD_DIMS = [64, 128, 256]
MASKS, DTYPES = MATRIX_MASKS, MATRIX_DTYPES
_run = attention_and_check


test_forward_matrix, test_forward_long, test_fully_masked_rows, test_forward_strided_views = forward_suite(HEAD_DIMS)


@pytest.mark.parametrize("head_dim", [96, 192])
def test_forward_other_head_dims(head_dim):
    q, k, v = random_qkv(2, 333, 517, 6, 2, head_dim, dtype=torch.bfloat16, seed=head_dim)
    _run(q, k, v)
    _run(q, k, v, causal=True)


# head_dim != head_dim_v: DeepSeek-style (192, 128) on its own tile (tile_config._BY_HEAD_DIMS), dv < d and dv > d on
# the tiles of their wider head dim (O then fills only part of, or more than, the Q slice it reuses).
DV_SHAPES = [(192, 128), (128, 64), (64, 256)]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("heads", [(6, 6), (6, 2)], ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("seqlens", [(113, 203), (1023, 1024), (1000, 333)], ids=lambda s: f"q{s[0]}k{s[1]}")
@pytest.mark.parametrize("d, dv", DV_SHAPES, ids=[f"d{d}_dv{dv}" for d, dv in DV_SHAPES])
def test_forward_dv_differs(d, dv, seqlens, heads, mask, dtype):
    q, k, v = random_qkv(2, *seqlens, *heads, d, dv, dtype=DTYPES[dtype], seed=d + dv + seqlens[0])
    assert cute_flash.explain(q, k, v, **MASKS[mask]).forward_family == "sm90"
    _run(q, k, v, **MASKS[mask])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_dv_differs_long(causal):
    q, k, v = random_qkv(1, 8192, 8192, 2, 1, 192, 128, dtype=torch.bfloat16, seed=8192)
    _run(q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim, backward_family", [(128, "sm90"), (256, "sm90"), (192, "sm90")])
def test_training_routes(monkeypatch, head_dim, backward_family, causal):
    """Training on Hopper: forward by the sm90 kernel, backward by the sm90 backward's own tile for each head dim,
    chosen by the router."""
    monkeypatch.delenv("CUTE_FLASH_ARCH", raising=False)
    q, k, v = random_qkv(2, 300, 431, 4, 2, head_dim, dtype=torch.bfloat16, seed=3, requires_grad=True)
    route = cute_flash.explain(q, k, v, causal=causal)
    assert (route.forward_family, route.backward_family) == ("sm90", backward_family), str(route)
    out = attention(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    check_backward(q, k, v, dout, (q.grad, k.grad, v.grad), causal=causal)

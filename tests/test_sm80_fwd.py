"""GPU: the sm80 forward (FlashAttention-2 design) against the float64 reference with FlashAttention's rule:
max |out - ref| <= 2 * max |plain torch in the input dtype - ref| + 1e-5, LSE likewise, fully masked rows exactly
0 / -inf.

Run: pytest -m sm80 tests/test_sm80_fwd.py  (any GPU of compute capability >= 8.0; on Hopper the conftest forces the
sm80 backend through CUTE_FLASH_ARCH).
"""

import pytest
import torch

from cute_flash import attention
from cute_flash.testing import (
    MATRIX_DTYPES,
    MATRIX_HEADS,
    MATRIX_MASKS,
    MATRIX_SEQLENS,
    attention_and_check,
    check_forward,
    matrix_inputs,
    random_qkv,
)

pytestmark = pytest.mark.sm80

HEAD_DIMS = [64, 128, 256]
SEQLENS, HEADS, MASKS, DTYPES = MATRIX_SEQLENS, MATRIX_HEADS, MATRIX_MASKS, MATRIX_DTYPES
_run = attention_and_check


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"q{s[0]}k{s[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_forward_matrix(head_dim, seqlens, heads, mask, dtype):
    _run(*matrix_inputs(head_dim, seqlens, heads, dtype), **MASKS[mask])


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_fully_masked_rows(head_dim):
    # Causal with seqlen_q > seqlen_k: query i sees key j iff j <= i - 200, so rows 0..199 see nothing (whole query
    # blocks with no KV block at all, and a block mixing empty and non-empty rows).
    q, k, v = random_qkv(2, 300, 100, 4, 2, head_dim, dtype=torch.bfloat16, seed=7)
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out[:, :200], torch.zeros_like(out[:, :200]))
    assert torch.isneginf(lse[:, :, :200]).all()
    check_forward(q, k, v, out, lse, causal=True)
    # A sliding window over a short K: rows 0..(sq - sk - 1) are empty.
    q, k, v = random_qkv(1, 257, 64, 2, 2, head_dim, dtype=torch.float16, seed=8)
    out, lse = attention(q, k, v, window_size=(16, 0), return_lse=True)
    assert torch.equal(out[:, :193], torch.zeros_like(out[:, :193]))
    check_forward(q, k, v, out, lse, window_size=(16, 0))


@pytest.mark.parametrize(
    "window", [(0, 0), (1, 1), (100, 50), (None, 7), (31, None), (300, 0)], ids=lambda w: f"w{w[0]}_{w[1]}"
)
def test_local_windows(window):
    # Windows narrower than a KV tile, wider than several, unbounded on one side, with sq != sk both ways.
    for seqlen_q, seqlen_k in ((517, 333), (333, 517)):
        q, k, v = random_qkv(1, seqlen_q, seqlen_k, 4, 4, 128, dtype=torch.bfloat16, seed=seqlen_q)
        _run(q, k, v, window_size=window)


def test_forward_strided_views():
    # q, k, v cut from one packed (b, s, 3, h, d) tensor: row strides are 3 * h * d, not h * d.
    qkv = torch.randn(2, 517, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(dim=2)
    _run(q, k, v)
    _run(q, k, v, causal=True)


@pytest.mark.parametrize("head_dim,head_dim_v", [(72, 72), (96, 96), (192, 192), (128, 64)])
def test_forward_other_head_dims(head_dim, head_dim_v):
    # 72 is padded to the MMA k of 16 (zero-filled columns); dv != d exercises separate V / O tiles.
    q, k, v = random_qkv(2, 333, 517, 6, 2, head_dim, head_dim_v, dtype=torch.bfloat16, seed=head_dim)
    _run(q, k, v)
    _run(q, k, v, causal=True)


def test_repeated_calls_reuse_the_compiled_kernel():
    from cute_flash import compile_cache

    q, k, v = random_qkv(1, 300, 300, 2, 2, 64, dtype=torch.bfloat16, seed=1)
    attention(q, k, v)
    before = len(compile_cache.cache_info())
    for seqlen in (100, 1000):  # new shapes, same spec: no new compile
        q, k, v = random_qkv(3, seqlen, seqlen + 5, 4, 1, 64, dtype=torch.bfloat16, seed=seqlen)
        _run(q, k, v)
    assert len(compile_cache.cache_info()) == before

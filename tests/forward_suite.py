"""The GPU forward tests every kernel family runs against the float64 reference (FlashAttention's rule, see
cute_flash.testing): the shared matrix, long sequences, fully masked rows and strided views, for the head dims a
family builds. A family's test file binds them to its names and marker:

    test_forward_matrix, test_forward_long, test_fully_masked_rows, test_forward_strided_views = forward_suite(dims)
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

# FP8 attention cases every FP8 family runs (b, sq, sk, h, hkv, d, causal, window); each adds its own head dims.
FP8_CASES = [
    (2, 512, 512, 4, 4, 128, False, (None, None)),
    (1, 1000, 1000, 4, 2, 128, True, (None, None)),  # tails, GQA
    (2, 300, 700, 6, 2, 128, False, (None, None)),  # sq != sk
    (1, 700, 300, 2, 1, 128, True, (None, None)),  # sq > sk: the first rows see no key
    (1, 640, 640, 4, 4, 128, False, (100, 20)),  # local window
    (1, 500, 2048, 2, 2, 64, True, (None, None)),
]


def forward_suite(head_dims):
    """(test_forward_matrix, test_forward_long, test_fully_masked_rows, test_forward_strided_views) over head_dims."""

    @pytest.mark.parametrize("dtype", list(MATRIX_DTYPES))
    @pytest.mark.parametrize("mask", list(MATRIX_MASKS))
    @pytest.mark.parametrize("heads", MATRIX_HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
    @pytest.mark.parametrize("seqlens", MATRIX_SEQLENS, ids=lambda s: f"q{s[0]}k{s[1]}")
    @pytest.mark.parametrize("head_dim", head_dims)
    def test_forward_matrix(head_dim, seqlens, heads, mask, dtype):
        attention_and_check(*matrix_inputs(head_dim, seqlens, heads, dtype), **MATRIX_MASKS[mask])

    # Long sequences: the float64 reference builds its scores one block of query rows at a time
    # (reference.REFERENCE_BLOCK_ELEMS), so each of these holds about a GiB and needs no xdist worker of its own.
    @pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
    @pytest.mark.parametrize("seqlen", [8192, 16384])
    @pytest.mark.parametrize("head_dim", head_dims)
    def test_forward_long(head_dim, seqlen, causal):
        q, k, v = random_qkv(1, seqlen, seqlen, 2, 1, head_dim, dtype=torch.bfloat16, seed=seqlen)
        attention_and_check(q, k, v, causal=causal)

    @pytest.mark.parametrize("head_dim", head_dims)
    def test_fully_masked_rows(head_dim):
        # Causal with seqlen_q > seqlen_k: query i sees key j iff j <= i - 200, so rows 0..199 see nothing.
        q, k, v = random_qkv(2, 300, 100, 4, 2, head_dim, dtype=torch.bfloat16, seed=7)
        out, lse = attention(q, k, v, causal=True, return_lse=True)
        assert torch.equal(out[:, :200], torch.zeros_like(out[:, :200]))
        assert torch.isneginf(lse[:, :, :200]).all()
        check_forward(q, k, v, out, lse, causal=True)
        # A window that no key of a short K reaches from the first rows: rows 0..(sq - sk - 1) are empty.
        q, k, v = random_qkv(1, 257, 64, 2, 2, head_dim, dtype=torch.float16, seed=8)
        attention_and_check(q, k, v, window_size=(16, 0))
        # Every row of whole tiles sees nothing: those CTAs run no MMA at all and write 0 / -inf directly.
        q, k, v = random_qkv(1, 1200, 64, 2, 1, head_dim, dtype=torch.bfloat16, seed=9)
        attention_and_check(q, k, v, causal=True)

    def test_forward_strided_views():
        # q, k, v cut from one packed (b, s, 3, h, d) tensor: row strides are 3 * h * d, not h * d.
        qkv = torch.randn(2, 517, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv.unbind(dim=2)
        attention_and_check(q, k, v)
        attention_and_check(q, k, v, causal=True)

    return test_forward_matrix, test_forward_long, test_fully_masked_rows, test_forward_strided_views

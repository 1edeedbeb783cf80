"""The sm80 score_mod / mask_mod kernels over packed sequences (arch/sm80/flash_fwd_mods.py, flash_bwd_mods.py: the
`packed_mods` entries; attention_varlen(score_mod=, mask_mod=) on Ampere, and Hopper / Blackwell with the sm80
family forced): out, lse and gradients by FlashAttention's rule against the packed float64 reference, lengths 0 / 1 /
odd, seqlen_q != seqlen_k, with and without seqused_k, GQA and MQA."""

from __future__ import annotations

import zlib

import pytest
import torch

import cute_flash

from . import test_mods as examples
from .test_mods_gpu import check_packed

pytestmark = pytest.mark.sm80  # (conftest forces the sm80 family on Hopper and Blackwell)

LENS_Q, LENS_K = [77, 0, 300, 1, 129], [77, 5, 517, 40, 0]


def _mods(score, mask, monkeypatch):
    for name in ("SLOPES", "T5_TABLE", "HEAD_SCALES", "DOC", "PREFIX", "RANDOM_BLOCKS"):
        monkeypatch.setattr(examples, name, getattr(examples, name).cuda())
    return (getattr(examples, score) if score else None), (getattr(examples, mask) if mask else None)


@pytest.mark.parametrize("score, mask", [("alibi", None), (None, "causal"), ("t5_bias", "sliding"),
                                         ("softcap30", "strided"), ("head_scaled", "prefix_lm")])  # fmt: skip
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences_with_mods_against_float64(monkeypatch, score, mask, d, causal):
    """b the sequence, positions within it; out, lse, dq, dk, dv (GQA 4 / 2) against the packed float64 reference."""
    score_mod, mask_mod = _mods(score, mask, monkeypatch)
    lens_q, lens_k = LENS_Q, LENS_K
    if mask == "prefix_lm":  # (its table is indexed by b: two sequences)
        lens_q, lens_k = [77, 300], [77, 517]
    seed = zlib.crc32(repr((score, mask, d, causal)).encode()) % 1000
    check_packed(score_mod, mask_mod, d, causal, lens_q, lens_k, seed=seed)


@pytest.mark.parametrize("d", [32, 256])
def test_packed_mods_mqa_and_other_head_dims(monkeypatch, d):
    """MQA (one KV head) at the narrowest and widest head dims of the sm80 backward."""
    score_mod, mask_mod = _mods("alibi", "sliding", monkeypatch)
    check_packed(score_mod, mask_mod, d, True, LENS_Q, LENS_K, heads_kv=1, seed=d)


def test_packed_mods_forward_at_a_head_dim_without_a_backward(monkeypatch):
    """d72: the sm80 forward serves it; its backward (head_dim a multiple of 32) does not, refused before the
    forward where gradients are wanted."""
    score_mod, _ = _mods("alibi", None, monkeypatch)
    check_packed(score_mod, examples.causal, 72, False, LENS_Q, LENS_K, seed=72, backward=False)
    q = torch.zeros(sum(LENS_Q), examples.H, 72, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = v = torch.zeros(sum(LENS_K), 2, 72, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.tensor([0, *torch.tensor(LENS_Q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(LENS_K).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    with pytest.raises(NotImplementedError, match="multiple of 32"):
        cute_flash.attention_varlen(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), score_mod=score_mod)


def test_empty_and_keyless_sequences(monkeypatch):
    """Every row of a sequence without keys: out 0, lse -inf, zero gradients; an empty call launches nothing."""
    score_mod, mask_mod = _mods("t5_bias", "causal", monkeypatch)
    check_packed(score_mod, mask_mod, 64, False, [0, 9, 1], [0, 0, 3], seed=3)
    q = torch.zeros(0, examples.H, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = v = torch.zeros(0, 2, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.zeros(3, dtype=torch.int32, device="cuda")
    out, lse = cute_flash.attention_varlen(q, k, v, cu, cu, 0, 0, score_mod=score_mod, mask_mod=mask_mod,
                                           return_lse=True)  # fmt: skip
    assert out.shape == (0, examples.H, 64) and lse.shape == (examples.H, 0)
    out.sum().backward()
    assert q.grad.shape == q.shape

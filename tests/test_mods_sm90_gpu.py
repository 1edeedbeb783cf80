"""The sm90 score_mod / mask_mod kernels (arch/sm90/flash_fwd_mods.py, flash_bwd_mods.py) on a Hopper GPU: outputs
and lse against the float64 reference by FlashAttention's rule, dense and block-sparse (block masks of the mask_mod,
and coarser ones that visit extra tiles), and the gradients against autograd through the float64 reference."""

from __future__ import annotations

import pytest
import torch

import cute_flash
from cute_flash.mods.reference import attention_mods_reference

from . import test_mods as examples
from .test_mods_gpu import check_gradients, check_packed

pytestmark = pytest.mark.sm90

CASES = [
    ("alibi", None, 300, 517),
    (None, "sliding", 517, 517),
    ("t5_bias", "document", 77, 77),
    ("softcap30", "sliding", 300, 300),
    (None, "prefix_lm", 333, 200),
    ("alibi", "random_blocks", 128, 128),
    ("t5_bias", "causal", 1000, 1000),
]


def _mods(score, mask, monkeypatch):
    for name in ("SLOPES", "T5_TABLE", "HEAD_SCALES", "DOC", "PREFIX", "RANDOM_BLOCKS"):
        monkeypatch.setattr(examples, name, getattr(examples, name).cuda())
    return (getattr(examples, score) if score else None), (getattr(examples, mask) if mask else None)


def _qkv(sq, sk, d, seed, requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, h, hk = examples.B, examples.H, 2

    def randn(*shape):
        t = torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16)
        return t.requires_grad_(requires_grad)

    return randn(b, sq, h, d), randn(b, sk, hk, d), randn(b, sk, hk, d)


def _check(out, lse, q, k, v, kw):
    with torch.no_grad():
        ref, ref_lse = attention_mods_reference(q, k, v, return_lse=True, **kw)
        same = attention_mods_reference(q, k, v, compute_dtype=torch.bfloat16, **kw)
    tol = 2 * (same.double() - ref).abs().max().item() + 1e-5
    err = (out.double() - ref).abs().max().item()
    assert err <= tol, (err, tol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("score, mask, sq, sk", CASES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_mods_forward_against_float64(monkeypatch, score, mask, sq, sk, d, causal):
    score_mod, mask_mod = _mods(score, mask, monkeypatch)
    q, k, v = _qkv(sq, sk, d, seed=hash((score, mask, d, causal)) % 1000)
    kw = dict(score_mod=score_mod, mask_mod=mask_mod, causal=causal)
    assert cute_flash.explain(q, k, v, **kw).forward.family == "sm90"
    with torch.no_grad():
        out, lse = cute_flash.attention(q, k, v, return_lse=True, **kw)
    _check(out, lse, q, k, v, kw)
    if mask_mod is None:
        return
    for tiles in ((128, 128), (64, 32), (256, 256)):  # the kernel's, finer, coarser: every tile list is exact
        block = cute_flash.mods.create_block_mask(mask_mod, examples.B, examples.H, sq, sk, tile_m=tiles[0],
                                                  tile_n=tiles[1], device="cuda")  # fmt: skip
        with torch.no_grad():
            out_b, lse_b = cute_flash.attention(q, k, v, return_lse=True, block_mask=block, **kw)
        _check(out_b, lse_b, q, k, v, kw)


GRAD_CASES = [  # every kind of derivative (constant: alibi, t5_bias; of positions: head_scaled; of the score:
    # softcap30), masks with and without tables, seqlen_q != seqlen_k and odd lengths
    ("alibi", None, 300, 517),
    (None, "sliding", 517, 517),
    ("t5_bias", "document", 77, 77),
    ("softcap30", "sliding", 300, 300),
    ("head_scaled", "prefix_lm", 333, 200),
    ("softcap30", "random_blocks", 128, 128),
]


@pytest.mark.parametrize("score, mask, sq, sk", GRAD_CASES)
@pytest.mark.parametrize("d", [64, 128, 256])  # keys on the accumulator rows (64, 128) and queries (256)
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_mods_gradients_against_float64(monkeypatch, score, mask, sq, sk, d, causal):
    """dq, dk, dv (lse's gradient too) of the sm90 forward and backward, GQA 4 / 2, by FlashAttention's rule."""
    score_mod, mask_mod = _mods(score, mask, monkeypatch)
    q, k, v = _qkv(sq, sk, d, seed=hash((score, mask, d, causal, "grad")) % 1000, requires_grad=True)
    kw = dict(score_mod=score_mod, mask_mod=mask_mod, causal=causal)
    e = cute_flash.explain(q, k, v, **kw)
    assert (e.forward.family, e.backward.family) == ("sm90", "sm90"), e
    check_gradients(q, k, v, kw)


@pytest.mark.parametrize("score, mask, sq, sk", [c for c in GRAD_CASES if c[1] is not None])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("tiles", [(128, 128), (64, 32), (256, 256)], ids=["128", "finer", "coarser"])
def test_sm90_block_sparse_gradients_against_float64(monkeypatch, score, mask, sq, sk, d, tiles):
    """The backward walking each key tile's list of query tiles (mods/call.query_tile_lists) from block masks at the
    kernel's, finer and coarser tiles, full tiles without the mask_mod: gradients by FlashAttention's rule."""
    score_mod, mask_mod = _mods(score, mask, monkeypatch)
    q, k, v = _qkv(sq, sk, d, seed=hash((score, mask, d, tiles)) % 1000, requires_grad=True)
    block = cute_flash.mods.create_block_mask(mask_mod, examples.B, examples.H, sq, sk, tile_m=tiles[0],
                                              tile_n=tiles[1], device="cuda")  # fmt: skip
    check_gradients(q, k, v, dict(score_mod=score_mod, mask_mod=mask_mod), block_mask=block)


@pytest.mark.parametrize("score, mask", [("alibi", "causal"), ("t5_bias", "document"), ("softcap30", "sliding")])
def test_natural_routing_gradients_with_a_block_mask(monkeypatch, score, mask):
    """Natural routing (no family forced): forward and backward here through one node, both walking the block
    mask's lists; d72 (no sm90 forward tile: the sm80 forward, the sm90 backward on
    d128 kernels, zero-padded: score_mod builds take no d96 tile)."""
    monkeypatch.delenv("CUTE_FLASH_ARCH", raising=False)
    score_mod, mask_mod = _mods(score, mask, monkeypatch)
    sq = 77 if mask == "document" else 300
    for d, families in ((64, ("sm90", "sm90")), (72, ("sm80", "sm90"))):
        q, k, v = _qkv(sq, sq, d, seed=7, requires_grad=True)
        kw = dict(score_mod=score_mod, mask_mod=mask_mod)
        e = cute_flash.explain(q, k, v, **kw)
        assert (e.forward.family, e.backward.family) == families, e
        block = cute_flash.mods.create_block_mask(mask_mod, examples.B, examples.H, sq, sq, device="cuda")
        check_gradients(q, k, v, kw, block_mask=block)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq, sk", [(300, 300), (77, 517)])
def test_scores_set_to_minus_infinity_by_a_score_mod(d, sq, sk):
    """A mask written as a score_mod (torch.where(..., score, -inf), FlexAttention users' habit): hidden keys and
    rows left without any key (out 0, lse -inf) in the sm90 forward; gradients through the sm90 backward where every
    row keeps a key (the derivative is 0 where the score is -inf)."""
    q, k, v = _qkv(sq, sk, d, seed=d + sq)
    kw = dict(score_mod=examples.empty_rows_by_score)
    with torch.no_grad():
        out, lse = cute_flash.attention(q, k, v, return_lse=True, **kw)
    _check(out, lse, q, k, v, kw)
    assert torch.all(out[:, :8] == 0) and torch.all(torch.isneginf(lse[:, :, :8]))
    q, k, v = _qkv(sq, sk, d, seed=d + sq, requires_grad=True)
    check_gradients(q, k, v, dict(score_mod=examples.hidden_by_score))


def test_a_broadcast_output_gradient(monkeypatch):
    """out.sum().backward() hands the backward an expanded (stride 0) dO: copied into the kernels' layout."""
    score_mod, mask_mod = _mods("alibi", "causal", monkeypatch)
    q, k, v = _qkv(300, 300, 128, seed=11, requires_grad=True)
    cute_flash.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod).sum().backward()
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    attention_mods_reference(qd, kd, vd, score_mod=score_mod, mask_mod=mask_mod).sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), (qd.grad, kd.grad, vd.grad)):
        torch.testing.assert_close(got.double(), want, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("score, mask", [("alibi", None), ("t5_bias", "causal"), ("softcap30", "sliding"),
                                         ("head_scaled", "prefix_lm")])  # fmt: skip
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences_with_mods_against_float64(monkeypatch, score, mask, d, causal):
    """attention_varlen(score_mod=, mask_mod=): b the sequence, positions within it; lengths 0, odd, seqlen_q !=
    seqlen_k, seqused_k; out, lse and gradients by FlashAttention's rule against the packed float64 reference."""
    score_mod, mask_mod = _mods(score, mask, monkeypatch)
    lens_q, lens_k = [77, 0, 300, 1], [77, 5, 517, 40]
    if mask == "prefix_lm":  # (its table is indexed by b: two sequences)
        lens_q, lens_k = [77, 300], [77, 517]
    check_packed(score_mod, mask_mod, d, causal, lens_q, lens_k, seed=hash((score, mask, d, causal)) % 1000)


def test_packed_sequences_at_a_head_dim_without_an_sm90_forward(monkeypatch):
    """d72 on Hopper: the sm80 packed forward (no sm90 forward tile there), then the sm90 packed backward (zero-padded
    to its d128 kernels) on that forward's out and lse (one layout in both families). Natural routing: the sm90
    marker forces CUTE_FLASH_ARCH=sm90, which would leave the forward no family."""
    monkeypatch.delenv("CUTE_FLASH_ARCH", raising=False)
    e_args = [torch.empty(10, h, 72, dtype=torch.bfloat16) for h in (examples.H, 2, 2)]
    cu = torch.tensor([0, 10], dtype=torch.int32)
    e = cute_flash.explain_varlen(*e_args, cu, cu, 10, 10, score_mod=examples.alibi, capability=(9, 0))
    assert (e.forward.family, e.backward.family) == ("sm80", "sm90"), e
    score_mod, mask_mod = _mods("alibi", "sliding", monkeypatch)
    check_packed(score_mod, mask_mod, 72, True, [77, 0, 300, 1], [77, 5, 517, 40], seed=72)

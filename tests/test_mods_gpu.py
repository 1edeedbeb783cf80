"""The generated code of score_mod / mask_mod graphs on a GPU: the probe kernel (cute_flash/mods/probe.py) of every
example of tests/test_mods.py against graph.evaluate on random inputs: masks exactly, scores within float32
rounding of the fast math functions."""

from __future__ import annotations

import pytest
import torch

import cute_flash
from cute_flash.mods import trace_mask_mod, trace_score_mod
from cute_flash.mods.graph import evaluate
from cute_flash.mods.probe import run_probe

from . import test_mods as examples

pytestmark = pytest.mark.sm80  # plain loads and arithmetic: any GPU that runs cute-flash


def _inputs(n=4096, seq=77):
    g = torch.Generator().manual_seed(5)
    return {
        "score": torch.randn(n, generator=g) * 8,
        "b": torch.randint(0, examples.B, (n,), generator=g),
        "h": torch.randint(0, examples.H, (n,), generator=g),
        "q_idx": torch.randint(0, seq, (n,), generator=g),
        "kv_idx": torch.randint(0, seq, (n,), generator=g),
    }


@pytest.mark.parametrize("fn", examples.SCORE_MODS + examples.MASK_MODS, ids=lambda f: f.__name__)
def test_probe_matches_the_graph(fn):
    score_mod = fn in examples.SCORE_MODS
    graph = trace_score_mod(fn) if score_mod else trace_mask_mod(fn)
    x = _inputs()
    want = evaluate(graph, x).expand(x["b"].shape)
    cuda = {k: v.cuda() for k, v in x.items()}
    graph_cuda = type(graph)(graph.kind, graph.nodes, tuple(t.cuda() for t in graph.aux), graph.aux_types)
    got = run_probe(graph_cuda, cuda["score"] if score_mod else None, cuda["b"], cuda["h"], cuda["q_idx"],
                    cuda["kv_idx"]).cpu()  # fmt: skip
    if score_mod:  # tanh by tanh.approx.f32 (relative error about 2^-11: mods/codegen.py), the rest within ulps
        tol = 2e-3 if any(node.op == "tanh" for node in graph.nodes) else 2e-6
        torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)
    else:
        assert torch.equal(got.bool(), want)


def _attention_case(d, causal, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, s, h, hk = examples.B, examples.SQ, examples.H, 2

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16)

    return randn(b, s, h, d), randn(b, s, hk, d), randn(b, s, hk, d)


def _cuda_mod(fn, monkeypatch):
    """The example with its tables on the GPU (the tables are module attributes the callables read)."""
    for name in ("SLOPES", "T5_TABLE", "HEAD_SCALES", "DOC", "PREFIX", "RANDOM_BLOCKS"):
        monkeypatch.setattr(examples, name, getattr(examples, name).cuda())
    return fn


@pytest.mark.parametrize(
    "score, mask",
    [
        ("alibi", None),
        (None, "causal"),
        ("t5_bias", "document"),
        ("softcap30", "sliding"),
        (None, "prefix_lm"),
        ("alibi", "random_blocks"),
    ],  # fmt: skip
)
@pytest.mark.parametrize("d, causal", [(64, False), (128, True)])
def test_attention_with_mods_against_float64(monkeypatch, score, mask, d, causal):
    """FlashAttention's rule against the float64 reference: |out - ref| <= 2 |out_torch_bf16 - ref| + 1e-5, with the
    callables applied by the reference itself (not through their graphs); GQA 4 / 2, odd length 77."""
    from cute_flash.mods.reference import attention_mods_reference

    score_mod = _cuda_mod(getattr(examples, score), monkeypatch) if score else None
    mask_mod = _cuda_mod(getattr(examples, mask), monkeypatch) if mask else None
    q, k, v = _attention_case(d, causal, seed=hash((score, mask, d)) % 1000)
    kw = dict(score_mod=score_mod, mask_mod=mask_mod, causal=causal)
    with torch.no_grad():
        out, lse = cute_flash.attention(q, k, v, return_lse=True, **kw)
        ref, ref_lse = attention_mods_reference(q, k, v, return_lse=True, **kw)
        same = attention_mods_reference(q, k, v, compute_dtype=torch.bfloat16, **kw)
    tol = 2 * (same.double() - ref).abs().max().item() + 1e-5
    assert (out.double() - ref).abs().max().item() <= tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("score, mask", [("alibi", "causal"), ("t5_bias", "document"), ("softcap30", "sliding")])
@pytest.mark.parametrize("d", [64, 128])
def test_gradients_with_mods_against_float64(monkeypatch, score, mask, d):
    """dq, dk, dv (and lse's gradient folded into D) by FlashAttention's rule against autograd through the float64
    reference, GQA 4 / 2, odd length 77."""

    kw = dict(score_mod=_cuda_mod(getattr(examples, score), monkeypatch), mask_mod=getattr(examples, mask))
    q, k, v = (t.requires_grad_() for t in _attention_case(d, False, seed=hash((score, mask, d)) % 1000))
    check_gradients(q, k, v, kw)


def check_gradients(q, k, v, kw, **call):
    """dq, dk, dv of attention(q, k, v, **kw, **call) by FlashAttention's rule against autograd through the float64
    reference with kw (the callables)."""
    from cute_flash.mods.reference import attention_mods_reference

    g = torch.randn(q.shape[:3] + (v.shape[-1],), device="cuda", dtype=q.dtype)
    out, lse = cute_flash.attention(q, k, v, return_lse=True, **kw, **call)
    grads = torch.autograd.grad((out, lse), (q, k, v), (g, torch.ones_like(lse)))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = attention_mods_reference(qd, kd, vd, return_lse=True, **kw)
    ref = torch.autograd.grad((ref_out, ref_lse), (qd, kd, vd), (g.double(), torch.ones_like(ref_lse)))
    qb, kb, vb = (t.detach().requires_grad_() for t in (q, k, v))
    same_out, same_lse = attention_mods_reference(qb, kb, vb, return_lse=True, compute_dtype=torch.bfloat16, **kw)
    same = torch.autograd.grad((same_out, same_lse), (qb, kb, vb), (g, torch.ones_like(same_lse)))
    for name, got, want, base in zip(("dq", "dk", "dv"), grads, ref, same):
        tol = 2 * (base.double() - want).abs().max().item() + 1e-5
        assert (got.double() - want).abs().max().item() <= tol, name


def check_packed(score_mod, mask_mod, d, causal, lens_q, lens_k, heads_kv=2, seed=0, backward=True):
    """attention_varlen(score_mod=, mask_mod=) over sequences of lens_q / lens_k rows (GQA: examples.H query heads,
    heads_kv KV heads), without and with seqused_k: out and lse, and with `backward` dq / dk / dv (lse's gradient
    folded in), by FlashAttention's rule against the packed float64 reference (the callables applied by it)."""
    from cute_flash.mods.reference import attention_varlen_mods_reference

    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    used = torch.tensor([min(n, 64 + 7 * i) for i, n in enumerate(lens_k)], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16).requires_grad_(backward)

    q = randn(sum(lens_q), examples.H, d)
    k, v = randn(sum(lens_k), heads_kv, d), randn(sum(lens_k), heads_kv, d)
    kw = dict(score_mod=score_mod, mask_mod=mask_mod, causal=causal)
    for seqused_k in (None, used):
        args = (cu_q, cu_k, max(lens_q), max(lens_k))
        with torch.set_grad_enabled(backward):
            out, lse = cute_flash.attention_varlen(q, k, v, *args, seqused_k=seqused_k, return_lse=True, **kw)
        ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
        same_in = [t.detach().requires_grad_() for t in (q, k, v)]
        ref, ref_lse = attention_varlen_mods_reference(*ref_in, cu_q, cu_k, seqused_k=seqused_k, return_lse=True, **kw)
        same, same_lse = attention_varlen_mods_reference(*same_in, cu_q, cu_k, seqused_k=seqused_k, return_lse=True,
                                                         compute_dtype=torch.bfloat16, **kw)  # fmt: skip
        tol = 2 * (same.detach().double() - ref.detach()).abs().max().item() + 1e-5
        assert (out.detach().double() - ref.detach()).abs().max().item() <= tol, seqused_k is not None
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        torch.testing.assert_close(lse.detach()[finite], ref_lse.detach()[finite], atol=1e-3, rtol=1e-4)
        if not backward:
            continue
        grad = torch.randn(out.shape, generator=g, device="cuda", dtype=out.dtype)
        got = torch.autograd.grad((out, lse), (q, k, v), (grad, torch.ones_like(lse)))
        want = torch.autograd.grad((ref, ref_lse), ref_in, (grad.double(), torch.ones_like(ref_lse)))
        base = torch.autograd.grad((same, same_lse), same_in, (grad, torch.ones_like(same_lse)))
        for name, a, w, b in zip(("dq", "dk", "dv"), got, want, base):
            tol = 2 * (b.double() - w).abs().max().item() + 1e-5
            assert (a.double() - w).abs().max().item() <= tol, (name, seqused_k is not None)

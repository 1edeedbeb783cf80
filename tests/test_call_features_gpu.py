"""Soft-capping, learnable sinks and negative window bounds through the call core on a GPU (issue 45): every front-end
path that reaches the sm90 kernels with them (eager dense forward and backward, packed sequences, decoding packed
under GQA with split keys, torch.compile with inductor, the C++ call path, ring attention on one rank), against the
float64 reference (`cute_flash.reference`, with softcap / learnable_sink) by FlashAttention's rule, dsink included.
Needs a Hopper GPU and the sm90 feature builds (common/entries.py's feature entries).

Run: python -m pytest -q tests/test_call_features_gpu.py   (about 10 kernel builds; a few minutes on an H200 host)
"""

from __future__ import annotations

import pytest
import torch

import cute_flash
from cute_flash.reference import attention_reference
from cute_flash.testing import check_backward, check_forward, check_varlen, random_qkv

pytestmark = [pytest.mark.sm90, pytest.mark.xdist_group("call-features")]

CASES = {
    "softcap": dict(causal=True, softcap=30.0),
    "sink": dict(causal=True, sink=True),
    "softcap_sink_window": dict(window_size=(96, 16), softcap=15.0, sink=True),
    "negative_window_sink": dict(window_size=(64, -8), sink=True),  # keys at least 8 before the diagonal
}


def _sink(h: int, seed: int = 7, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(h, device="cuda", generator=g) * 2 + 1).to(dtype).requires_grad_(True)


def _kwargs(case: dict, h: int) -> dict:
    kw = {k: v for k, v in case.items() if k != "sink"}
    if case.get("sink"):
        kw["learnable_sink"] = _sink(h)
    return kw


def _dsink_reference(q, k, v, dout, kw, compute_dtype):
    leaves = [t.detach().to(compute_dtype) for t in (q, k, v)]
    sink = kw["learnable_sink"].detach().to(compute_dtype).requires_grad_(True)
    out = attention_reference(*leaves, compute_dtype=compute_dtype, **{**kw, "learnable_sink": sink})
    return torch.autograd.grad(out, sink, dout.to(compute_dtype))[0]


def _check_dsink(got, q, k, v, dout, kw):
    ref = _dsink_reference(q, k, v, dout, kw, torch.float64)
    low = _dsink_reference(q, k, v, dout, kw, q.dtype)
    err, base = (got.double() - ref).abs().max().item(), (low.double() - ref).abs().max().item()
    assert got.dtype == kw["learnable_sink"].dtype and err <= 2 * base + 1e-3, (err, base)


@pytest.mark.parametrize("name", list(CASES))
def test_dense_forward_and_backward(name):
    q, k, v = random_qkv(2, 300, 333, 8, 2, 128, dtype=torch.bfloat16, seed=1)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    kw = _kwargs(CASES[name], 8)
    out, lse = cute_flash.attention(q, k, v, return_lse=True, **kw)
    check_forward(q, k, v, out, lse, **kw)
    dout = torch.randn_like(out)
    inputs = (q, k, v) + ((kw["learnable_sink"],) if "learnable_sink" in kw else ())
    grads = torch.autograd.grad(out, inputs, dout)
    check_backward(q, k, v, dout, grads[:3], **kw)
    if "learnable_sink" in kw:
        _check_dsink(grads[3], q, k, v, dout, kw)
    e = cute_flash.explain(q, k, v, **kw)
    assert (e.softcap, e.sink) == (kw.get("softcap", 0.0), "learnable_sink" in kw) and e.forward_family == "sm90"


def test_rows_without_keys_get_out_zero_and_the_sink():
    """A window whose right edge lies left of every key of the first rows: out 0 and lse = sink there, exactly."""
    q, k, v = random_qkv(1, 64, 64, 4, 4, 128, dtype=torch.bfloat16, seed=2)
    sink = _sink(4)
    out, lse = cute_flash.attention(q, k, v, window_size=(None, -16), learnable_sink=sink, return_lse=True)
    assert torch.count_nonzero(out[:, :16]) == 0
    torch.testing.assert_close(lse[:, :, :16], sink.detach().view(1, 4, 1).expand(1, 4, 16), atol=0, rtol=0)
    check_forward(q, k, v, out, lse, window_size=(None, -16), learnable_sink=sink)


def _packed(lens_q, lens_k, h, hkv, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(lens_q), h, d, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(sum(lens_k), hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(sum(lens_k), hkv, d, device="cuda", generator=g).to(torch.bfloat16)

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    return q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k)


@pytest.mark.parametrize("name", ["softcap", "sink"])
def test_varlen_forward_and_backward(name):
    q, k, v, cq, ck, mq, mk = _packed([130, 0, 257, 64], [200, 5, 257, 1], 8, 2, 128, seed=3)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    kw = _kwargs(CASES[name], 8)
    out, lse = cute_flash.attention_varlen(q, k, v, cq, ck, mq, mk, return_lse=True, **kw)
    dout = torch.randn_like(out)
    inputs = (q, k, v) + ((kw["learnable_sink"],) if "learnable_sink" in kw else ())
    grads = torch.autograd.grad(out, inputs, dout)
    check_varlen(q, k, v, cq, ck, mq, mk, out, lse, dout, grads[:3], **kw)
    if "learnable_sink" in kw:
        assert grads[3].shape == (8,) and torch.isfinite(grads[3]).all()


def test_decoding_packs_query_heads_with_their_sinks():
    """One query row under GQA (packed: a KV head's query heads as rows, split keys at batch 1): each row reads its
    query head's sink (the (group, h_kv) view), softcap per score; the C++ path's warm call equals the first."""
    q, k, v = random_qkv(1, 1, 4000, 32, 8, 128, dtype=torch.bfloat16, seed=4)
    sink = _sink(32).detach()
    kw = dict(causal=True, softcap=20.0, learnable_sink=sink)
    out, lse = cute_flash.attention(q, k, v, return_lse=True, **kw)
    check_forward(q, k, v, out, lse, **kw)
    for window in ((1000, -5), (None, -4000)):  # a window's keys only; no key at all (no launch: out 0, lse = sink)
        out, lse = cute_flash.attention(q, k, v, window_size=window, return_lse=True, learnable_sink=sink)
        check_forward(q, k, v, out, lse, window_size=window, learnable_sink=sink)


def test_the_cpp_path_serves_softcap_calls_bit_for_bit():
    q, k, v = random_qkv(2, 200, 200, 8, 2, 128, dtype=torch.bfloat16, seed=5)
    with torch.no_grad():
        python, _ = cute_flash.attention(q, k, v, causal=True, softcap=25.0, return_lse=True)  # the Python path
        for _ in range(3):  # registered, then the C++ path
            cpp = cute_flash.attention(q, k, v, causal=True, softcap=25.0)
    torch.testing.assert_close(cpp, python, atol=0, rtol=0)


def test_torch_compile_with_softcap_and_sinks():
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_(True) for t in random_qkv(2, 300, 333, 8, 2, 128, dtype=torch.bfloat16, seed=6))
    sink = _sink(8, dtype=torch.bfloat16)
    w = torch.randn(2, 300, 8, 128, device="cuda")

    def step(q, k, v, sink):
        out = cute_flash.attention(q, k, v, causal=True, softcap=30.0, learnable_sink=sink)
        return (out.float() * w).sum()

    grads_c = torch.autograd.grad(torch.compile(step, fullgraph=True)(q, k, v, sink), (q, k, v, sink))
    grads_e = torch.autograd.grad(step(q, k, v, sink), (q, k, v, sink))
    assert grads_c[3].dtype == torch.bfloat16
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)  # dQ's atomic order may differ


def test_ring_attention_on_one_rank_with_softcap_and_sinks():
    from cute_flash.distributed import ring_attention

    q, k, v = (t.requires_grad_(True) for t in random_qkv(2, 256, 256, 8, 2, 128, dtype=torch.bfloat16, seed=8))
    sink = _sink(8)
    kw = dict(causal=True, softcap=30.0, learnable_sink=sink)
    out, lse = ring_attention(q, k, v, return_lse=True, **kw)
    check_forward(q, k, v, out, lse, **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    check_backward(q, k, v, dout, grads[:3], **kw)
    _check_dsink(grads[3], q, k, v, dout, kw)

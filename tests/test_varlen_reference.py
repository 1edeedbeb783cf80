"""The packed (variable-length) reference of issue 16 against the dense reference, and the varlen layout checks."""

from __future__ import annotations

import pytest
import torch

from cute_flash.reference import attention_reference, attention_varlen_reference


def _packed(lens_q, lens_k, h=4, hkv=2, d=32, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(sum(lens_q), h, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lens_k), hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lens_k), hkv, dv, generator=g, dtype=torch.float64)

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    return q, k, v, cu(lens_q), cu(lens_k)


@pytest.mark.parametrize(
    "kw", [{}, {"causal": True}, {"window_size": (5, 2)}, {"causal": True, "window_size": (7, None)}]
)
def test_equal_lengths_match_the_batched_dense_reference(kw):
    q, k, v, cq, ck = _packed([37] * 3, [41] * 3, dv=16)
    out, lse = attention_varlen_reference(q, k, v, cq, ck, 37, 41, return_lse=True, **kw)
    dense, dense_lse = attention_reference(
        q.view(3, 37, 4, 32), k.view(3, 41, 2, 32), v.view(3, 41, 2, 16), return_lse=True, **kw
    )
    # float64 both ways; only the batching of the products differs.
    torch.testing.assert_close(out, dense.reshape(-1, 4, 16), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse, dense_lse.permute(1, 0, 2).reshape(4, -1), rtol=1e-6, atol=1e-6)


def test_mixed_lengths_zero_lengths_and_seqused_k():
    lens_q, lens_k = [0, 1, 13, 5, 200, 3], [4, 0, 17, 5, 190, 9]
    q, k, v, cq, ck = _packed(lens_q, lens_k)
    used = torch.tensor([4, 0, 10, 5, 190, 0], dtype=torch.int32)
    out, lse = attention_varlen_reference(q, k, v, cq, ck, 200, 190, causal=True, seqused_k=used, return_lse=True)
    for i in range(len(lens_q)):
        q0, q1, k0 = cq[i].item(), cq[i + 1].item(), ck[i].item()
        k1 = k0 + used[i].item()
        if q1 == q0:
            continue
        if k1 == k0:  # a sequence whose rows see no key: out 0, lse -inf
            assert torch.all(out[q0:q1] == 0) and torch.all(lse[:, q0:q1] == float("-inf"))
            continue
        o, l_ = attention_reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=True, return_lse=True)
        torch.testing.assert_close(out[q0:q1], o[0], rtol=0, atol=0)
        torch.testing.assert_close(lse[:, q0:q1], l_[0], rtol=0, atol=0)


def test_gradients_flow_per_sequence():
    q, k, v, cq, ck = _packed([3, 8], [5, 6])
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    attention_varlen_reference(*leaves, cq, ck, 8, 6, causal=True).sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)


def test_layout_and_value_errors():
    q, k, v, cq, ck = _packed([3, 4], [3, 4])
    with pytest.raises(ValueError, match="int32"):
        attention_varlen_reference(q, k, v, cq.long(), ck, 4, 4)
    with pytest.raises(ValueError, match="one batch"):
        attention_varlen_reference(q, k, v, cq, ck[:2], 4, 4)
    with pytest.raises(ValueError, match="host int"):
        attention_varlen_reference(q, k, v, cq, ck, torch.tensor(4), 4)
    with pytest.raises(ValueError, match="packed"):
        attention_varlen_reference(q[None], k, v, cq, ck, 4, 4)
    with pytest.raises(ValueError, match="longer than its max_seqlen"):
        attention_varlen_reference(q, k, v, cq, ck, 3, 4)
    with pytest.raises(ValueError, match="never decrease"):
        attention_varlen_reference(q, k, v, torch.tensor([0, 5, 3], dtype=torch.int32), ck, 5, 4)
    with pytest.raises(ValueError, match="end at 7"):  # rows past the last sequence: the kernels never write them
        attention_varlen_reference(q, k, v, torch.tensor([0, 3, 6], dtype=torch.int32), ck, 4, 4)
    with pytest.raises(ValueError, match="seqused_k"):
        attention_varlen_reference(q, k, v, cq, ck, 4, 4, seqused_k=torch.tensor([3, 9], dtype=torch.int32))


@pytest.mark.parametrize(
    "kw", [{"softcap": 4.0}, {"window_size": (-3, None)}, {"window_size": (None, -2), "softcap": 2.0}, {}], ids=str
)
def test_softcap_sinks_and_signed_windows_per_sequence(kw):
    # Each sequence is its own dense problem (softcap, the sink and the window aligned per sequence); a sequence with
    # no keys gives out 0 and, with sinks, lse = the sink (-inf without).
    lens_q, lens_k = [4, 9, 3, 0, 6], [7, 9, 0, 5, 2]
    q, k, v, cq, ck = _packed(lens_q, lens_k, h=4, hkv=1, d=16)
    sink = torch.randn(4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for extra in ({}, {"learnable_sink": sink}):
        out, lse = attention_varlen_reference(q, k, v, cq, ck, 9, 9, return_lse=True, **kw, **extra)
        for i in range(len(lens_q)):
            q0, q1, k0, k1 = cq[i].item(), cq[i + 1].item(), ck[i].item(), ck[i + 1].item()
            if q1 == q0:
                continue
            o, l_ = attention_reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], return_lse=True, **kw, **extra)
            torch.testing.assert_close(out[q0:q1], o[0], rtol=0, atol=0)
            torch.testing.assert_close(lse[:, q0:q1], l_[0], rtol=0, atol=0)
            if k1 == k0:
                assert torch.all(out[q0:q1] == 0)
                want = sink.float()[:, None].expand(4, q1 - q0) if extra else torch.full((4, q1 - q0), float("-inf"))
                assert torch.equal(lse[:, q0:q1], want)


def test_sink_gradient_flows_through_every_sequence():
    q, k, v, cq, ck = _packed([3, 5, 2], [4, 0, 6], h=2, hkv=2, d=8)
    sink = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    out, lse = attention_varlen_reference(q, k, v, cq, ck, 5, 6, learnable_sink=sink, return_lse=True)
    (g,) = torch.autograd.grad(lse.sum(), sink)
    # d(lse)/d(sink) = P_sink per row: exactly 1 for the 5 rows of the sequence without keys, in (0, 1) elsewhere.
    p_sink = torch.exp(sink.detach().float()[:, None] - lse)
    torch.testing.assert_close(g.float(), p_sink.sum(dim=1))
    assert torch.all(p_sink[:, 3:8] == 1)


def test_check_varlen_with_sinks_finds_rows_without_keys():
    # With sinks a row without keys has lse = the sink, not -inf; the check still demands out 0 there.
    from cute_flash.testing import check_varlen

    q, k, v, cq, ck = _packed([3, 4], [0, 5], h=2, hkv=1, d=8)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    sink = torch.tensor([0.5, -1.0])
    out, lse = attention_varlen_reference(
        q, k, v, cq, ck, 4, 5, learnable_sink=sink, compute_dtype=torch.float32, return_lse=True
    )
    out = out.to(torch.bfloat16)
    assert all(r.ok for r in check_varlen(q, k, v, cq, ck, 4, 5, out, lse, learnable_sink=sink))
    bad = out.clone()
    bad[:3] = 1e-3  # the first sequence has no keys
    with pytest.raises(AssertionError, match="out 0"):
        check_varlen(q, k, v, cq, ck, 4, 5, bad, lse, learnable_sink=sink)

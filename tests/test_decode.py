"""Decoding under GQA / MQA (cute_flash/decode.py) without a GPU: a reference backend (tests/test_integrations.py)
computes each launch with the float64 reference, so the packing of query heads into rows, the key slice of a window,
the strided views of q / out / lse and the results against the unpacked reference are checked on the CPU, eager and
through the custom op (torch.compile's path). The GPU side is tests/test_edge_cases_gpu.py's decoding cases."""

from __future__ import annotations

import pytest
import torch

import cute_flash
from cute_flash import decode
from cute_flash.reference import attention_reference
from cute_flash.validation import validate

from .test_integrations import fake_gpu  # noqa: F401  (fixture)


def _qkv(b, sk, h, hkv, d, dv=None, head_major=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    dv = dv or d
    if head_major:  # transformers' layout: (b, h, s, d) storage seen as (b, s, h, d)
        q = torch.randn(b, h, 1, d, generator=g).to(torch.bfloat16).transpose(1, 2)
        k = torch.randn(b, hkv, sk, d, generator=g).to(torch.bfloat16).transpose(1, 2)
        v = torch.randn(b, hkv, sk, dv, generator=g).to(torch.bfloat16).transpose(1, 2)
        return q, k, v
    return (
        torch.randn(b, 1, h, d, generator=g).to(torch.bfloat16),
        torch.randn(b, sk, hkv, d, generator=g).to(torch.bfloat16),
        torch.randn(b, sk, hkv, dv, generator=g).to(torch.bfloat16),
    )


@pytest.mark.parametrize("head_major", [False, True], ids=["seq_major", "head_major"])
@pytest.mark.parametrize(
    "causal,window", [(False, (None, None)), (True, (None, None)), (True, (5, None)), (False, (3, 2)), (False, (40, 0))]
)
@pytest.mark.parametrize("h,hkv", [(8, 2), (6, 1)], ids=["gqa", "mqa"])
def test_decoding_packs_query_heads(fake_gpu, h, hkv, causal, window, head_major):  # noqa: F811
    q, k, v = _qkv(3, 29, h, hkv, 32, head_major=head_major)
    out, lse = cute_flash.attention(q, k, v, causal=causal, window_size=window, softmax_scale=0.3, return_lse=True)
    want, want_lse = attention_reference(q, k, v, causal=causal, window_size=window, softmax_scale=0.3, return_lse=True)
    torch.testing.assert_close(out.double(), want.double(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, want_lse.float(), atol=1e-4, rtol=1e-4)
    (call,) = fake_gpu.calls  # one launch: the packed problem, group rows per KV head, no mask, the keys it sees
    kind, mask, scale, q_shape, k_shape = call
    left = window[0]
    keys = 29 if left is None else min(29, left + 1)
    assert q_shape == (3, h // hkv, hkv, 32) and k_shape == (3, keys, hkv, 32)
    assert mask.kind == "none" and scale == pytest.approx(0.3)


def test_what_is_not_packed(fake_gpu):  # noqa: F811
    # No GQA, or several query rows: the plain path.
    for args, kw in [
        (_qkv(2, 20, 4, 2, 32)[:1] * 3, {}),  # q as keys: seqlen_k 1 with MHA
        ((torch.randn(2, 2, 4, 32).bfloat16(), *_qkv(2, 20, 4, 2, 32)[1:]), {"causal": True}),
    ]:
        p = validate(
            *args,
            causal=kw.get("causal", False),
            softmax_scale=None,
            window_size=kw.get("window_size", (None, None)),
            dtype=None,
        )
        assert decode.keys_seen(p, 0, False) is None
    q, k, v = _qkv(2, 20, 4, 2, 32)
    p = validate(q, k, v, causal=True, softmax_scale=None, window_size=(None, None), dtype=None)
    assert decode.keys_seen(p, 0, False) == (0, 20)
    assert decode.keys_seen(p, 132, False) is None  # 2 x 4 CTAs: all at once anyway, packing gains nothing
    assert decode.keys_seen(p, 132, True) == (0, 20)  # unless the family splits the packed problem's keys


@pytest.mark.parametrize("cap", [30.0, 100.0])
def test_the_packed_decode_problem_keeps_the_caps_spec(fake_gpu, cap):  # noqa: F811
    """A cap above spec.WIDE_SOFTCAP keeps its running max on the KV-cache kernels too (softcap_wide travels)."""
    q, k, v = _qkv(2, 20, 4, 2, 32)
    p = validate(q, k, v, causal=True, softmax_scale=None, window_size=(None, None), dtype=None, softcap=cap)
    spec = decode.kvcache_problem(p, (0, 20)).spec
    assert spec.softcap and spec.softcap_wide == (cap > 60) == p.spec.softcap_wide


def test_decoding_gradients_are_unchanged(fake_gpu):  # noqa: F811
    # The forward may run packed; the backward takes the saved q, k, v, out and lse as they are.
    q, k, v = (t.detach().requires_grad_(True) for t in _qkv(2, 17, 8, 2, 32))
    out = cute_flash.attention(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = attention_reference(*leaves, causal=True)
    grads = torch.autograd.grad(ref.square().sum(), leaves)
    for got, want in zip((dq, dk, dv), grads):
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)


def test_the_custom_op_packs_as_the_eager_path(fake_gpu):  # noqa: F811
    # torch.compile's path (cute_flash::fwd -> the call core's one launcher) packs too: the same launch, same result.
    import cute_flash.ops  # noqa: F401  (registers the ops)

    q, k, v = _qkv(3, 29, 8, 2, 32)
    eager = cute_flash.attention(q, k, v, causal=True, window_size=(5, None), return_lse=True)
    # core/fields.py's CALL then PACKED: causal, scale, window, deterministic, softcap, sink, packed (none)
    op = torch.ops.cute_flash.fwd(q, k, v, True, None, 5, None, False, 0.0, None, None, None, None, 0, 0, False)
    assert [c[3] for c in fake_gpu.calls] == [(3, 4, 2, 32)] * 2
    for a, b in zip(eager, op):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize(
    "window,keys",
    [((None, -3), (0, 26)), ((4, -2), (24, 27)), ((-2, 5), None), ((None, -29), None), ((-1, None), None)],
    ids=["right_negative", "both_edges", "left_negative", "all_keys_hidden", "left_past_the_row"],
)
def test_decoding_with_negative_window_bounds(fake_gpu, window, keys):  # noqa: F811
    """A negative bound moves a window edge past the query row (at key 28 of 29): the keys it leaves are the packed
    problem's, and a window that leaves none launches nothing (out 0, lse -inf; with sinks lse = the sink)."""
    q, k, v = _qkv(3, 29, 8, 2, 32)
    p = validate(q, k, v, causal=False, softmax_scale=None, window_size=window, dtype=None)
    lo, hi = decode.keys_seen(p, 0, True)
    assert (lo, hi) == keys if keys is not None else lo >= hi
    out, lse = cute_flash.attention(q, k, v, window_size=window, return_lse=True)
    if keys is None:
        assert fake_gpu.calls == [] and torch.all(out == 0) and torch.all(torch.isneginf(lse))
        sink = torch.randn(8)
        out, lse = cute_flash.attention(q, k, v, window_size=window, return_lse=True, learnable_sink=sink)
        assert fake_gpu.calls == [] and torch.all(out == 0)
        torch.testing.assert_close(lse, sink.view(1, 8, 1).expand(3, 8, 1))
        return
    ((_, _, _, q_shape, k_shape),) = fake_gpu.calls
    assert q_shape == (3, 4, 2, 32) and k_shape == (3, keys[1] - keys[0], 2, 32)
    want, want_lse = attention_reference(q, k, v, window_size=window, return_lse=True)
    torch.testing.assert_close(out.double(), want.double(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, want_lse.float(), atol=1e-4, rtol=1e-4)


def test_decoding_maps_each_packed_row_to_its_query_heads_sink(fake_gpu):  # noqa: F811
    """Packed decoding views the (h,) sinks as (group, h_kv) with strides (1, group): row j of KV head g reads the
    sink of query head g * group + j (arch/base.FwdTensors.sink), and the result equals the unpacked call's."""
    from .feature_reference import featured_reference

    q, k, v = _qkv(3, 29, 8, 2, 32)
    sink = torch.randn(8, dtype=torch.bfloat16)
    out, lse = cute_flash.attention(q, k, v, causal=True, softcap=5.0, learnable_sink=sink, return_lse=True)
    (call,) = fake_gpu.calls
    assert call[3] == (3, 4, 2, 32)  # packed
    assert fake_gpu.features == [("forward", 5.0, ((4, 2), (1, 4)))]
    mask = validate(q, k, v, causal=True, softmax_scale=None, window_size=(None, None), dtype=None).mask
    want, want_lse = featured_reference(q, k, v, 32**-0.5, mask, 5.0, sink.float().expand(1, 8))
    torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-4)

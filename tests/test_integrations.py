"""The plug-ins (cute_flash/integrations) without a GPU: a fake backend computes every launch with the float64
reference (forward, and the backward by autograd through it), so the registration logic, the layout transposes,
the mask translation and the error paths are checked on the CPU. The GPU side is
tests/test_integrations_gpu.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from cute_flash.arch.base import BackendBase, launcher_through_backward, launcher_through_forward
from cute_flash import validation
from cute_flash.core import device
from cute_flash.reference import attention_reference, attention_varlen_reference, kvcache_reference

from .feature_reference import featured_reference


class _ReferenceBackend(BackendBase):
    name = "fake"
    cute_arch = "sm_90a"

    def __init__(self):
        self.calls = []
        self.features = []  # (direction, softcap, the sink view's shape and strides or None) per featured launch

    def unsupported_reason(self, spec, backward, deterministic=False):
        return None

    def _ref(self, q, k, v, softmax_scale, mask, softcap=0.0, sink_rows=None):
        if softcap or sink_rows is not None:
            return featured_reference(q, k, v, softmax_scale, mask, softcap, sink_rows)
        return attention_reference(
            q, k, v, softmax_scale=softmax_scale, window_size=(mask.left, mask.right), return_lse=True
        )

    def forward_launcher(self, problem, device):
        return launcher_through_forward(self, problem)

    def backward_launcher(self, problem, device, deterministic=False):
        return launcher_through_backward(self, problem, deterministic)

    def forward(self, t, problem, descale=None):
        q, k, v, out, lse, sink = t
        softmax_scale, mask = problem.softmax_scale, problem.mask
        self.calls.append(("forward", mask, softmax_scale, tuple(q.shape), tuple(k.shape)))
        assert (sink is not None) == problem.spec.sink and (problem.softcap > 0) == problem.spec.softcap
        if problem.spec.softcap or problem.spec.sink:
            view = None if sink is None else (tuple(sink.shape), sink.stride())
            self.features.append(("forward", problem.softcap, view))
        o, l = self._ref(q, k, v, softmax_scale, mask, problem.softcap, sink)
        out.copy_(o)
        lse.copy_(l)

    def backward(self, t, grads, problem, deterministic=False):
        dout, q, k, v, out, lse, dlse, sink = t
        dq, dk, dv, dsink = grads
        softmax_scale, mask = problem.softmax_scale, problem.mask
        self.calls.append(("backward", mask, softmax_scale, tuple(q.shape), tuple(k.shape)))
        assert (sink is not None) == problem.spec.sink == (dsink is not None)
        if problem.spec.softcap or problem.spec.sink:
            self.features.append(("backward", problem.softcap, None if sink is None else tuple(sink.shape)))
        leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
        if sink is not None:
            leaves.append(sink.detach().double().requires_grad_(True))
        with torch.enable_grad():  # a backward runs with grad mode off
            rows = None if sink is None else leaves[3].expand(q.shape[1], q.shape[2])
            o, l_ = self._ref(*leaves[:3], softmax_scale, mask, problem.softcap, rows)
        outs, grads_in = ((o,), (dout.double(),)) if dlse is None else ((o, l_), (dout.double(), dlse.to(l_.dtype)))
        got = torch.autograd.grad(outs, leaves, grads_in, allow_unused=True)
        for g, t in zip(got, (dq, dk, dv, dsink)):
            t.copy_(torch.zeros_like(t) if g is None else g)

    # The KV-cache forward (what the transformers plug-in sends masked decoding to: the patched router hands every
    # call here), one split. Not declared (kvcache False), so attention()'s decoding under GQA stays on the packed
    # problem that test_decode checks.
    kvcache = False

    def kvcache_splits(self, problem, sm_count):
        return 1

    def forward_kvcache(self, t, problem, num_splits):
        self.calls.append(("forward_kvcache", problem.mask, problem.softmax_scale, tuple(t.q.shape), t.k_cache.shape))
        m = problem.mask
        ref = kvcache_reference(
            t.q, t.k_cache, t.v_cache, cache_seqlens=t.seqlens_k, page_table=t.page_table, causal=m.kind == "causal",
            softmax_scale=problem.softmax_scale, window_size=(m.left, m.right) if m.kind == "local" else (None, None),
            softcap=problem.softcap, learnable_sink=t.sink, return_lse=True,
        )  # fmt: skip
        t.out.copy_(ref.out)
        t.lse.copy_(ref.lse)

    # Packed sequences (what the transformers plug-in sends padded batches and packed documents to).
    def _ref_varlen(self, q, k, v, seqs, problem, sink_rows=None):
        cu_q, cu_k, seqused_k, max_q, max_k = seqs
        m = problem.mask
        if not (problem.softcap or sink_rows is not None):
            return attention_varlen_reference(
                q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=problem.softmax_scale, seqused_k=seqused_k,
                window_size=(m.left, m.right), return_lse=True,
            )  # fmt: skip
        outs, lses = [], []  # one sequence at a time (a test double may read the offsets on the host)
        for b, (q0, q1, k0, k1) in enumerate(zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:])):
            if seqused_k is not None:
                k1 = k0 + int(seqused_k[b])
            rows = None if sink_rows is None else sink_rows[q0:q1]
            o, l_ = featured_reference(
                q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], problem.softmax_scale, m, problem.softcap, rows
            )
            outs.append(o[0])
            lses.append(l_[0])
        return torch.cat(outs), torch.cat(lses, dim=-1)

    def forward_varlen(self, q, k, v, out, lse, seqs, problem, sink=None):
        self.calls.append(("forward_varlen", problem.mask, problem.softmax_scale, tuple(q.shape), tuple(k.shape)))
        assert (sink is not None) == problem.spec.sink and (problem.softcap > 0) == problem.spec.softcap
        if problem.spec.softcap or problem.spec.sink:
            view = None if sink is None else (tuple(sink.shape), sink.stride())
            self.features.append(("forward_varlen", problem.softcap, view))
        o, l_ = self._ref_varlen(q, k, v, seqs, problem, sink)
        out.copy_(o)
        lse.copy_(l_)

    def backward_varlen(self, t, grads, seqs, problem, deterministic=False):
        dout, q, k, v, out, lse, dlse, sink = t
        self.calls.append(("backward_varlen", problem.mask, problem.softmax_scale, tuple(q.shape), tuple(k.shape)))
        if problem.spec.softcap or problem.spec.sink:
            self.features.append(("backward_varlen", problem.softcap, None if sink is None else tuple(sink.shape)))
        leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
        if sink is not None:
            leaves.append(sink.detach().double().requires_grad_(True))
        with torch.enable_grad():
            rows = None if sink is None else leaves[3].expand(q.shape[0], q.shape[1])
            o, _ = self._ref_varlen(*leaves[:3], seqs, problem, rows)
        for g, x in zip(torch.autograd.grad(o, leaves, dout.double(), allow_unused=True), grads):
            x.copy_(torch.zeros_like(x) if g is None else g)


@pytest.fixture
def fake_gpu(monkeypatch):
    backend = _ReferenceBackend()
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(device, "route", lambda spec, t, backward, deterministic=False: backend)
    monkeypatch.setattr(device, "guard", lambda t: contextlib.nullcontext())
    return backend


# --- torch SDPA --------------------------------------------------------------------------------------------------
from cute_flash.integrations import sdpa  # noqa: E402


def _bhsd(b, h, s, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, s, d, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("sq,sk", [(24, 24), (32, 16), (16, 40)], ids=["square", "more_queries", "more_keys"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_ops_keep_sdpa_semantics(fake_gpu, sq, sk, is_causal):
    # SDPA's is_causal is top-left aligned; cute_flash's causal is bottom-right: the plug-in must translate.
    q, k, v, do = _bhsd(2, 4, sq, 64, 1), _bhsd(2, 2, sk, 64, 2), _bhsd(2, 2, sk, 64, 3), _bhsd(2, 4, sq, 64, 4)
    out, lse, *_rest = sdpa.forward(q, k, v, 0.0, is_causal, scale=0.2)
    assert out.shape == q.shape and lse.shape == (2, 4, sq) and lse.dtype == torch.float32
    leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=is_causal, scale=0.2, enable_gqa=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    grads = sdpa.backward(do, q, k, v, out, lse, None, None, sq, sk, 0.0, is_causal, None, None, scale=0.2)
    ref_grads = torch.autograd.grad(ref, leaves, do.double())
    for got, want, t in zip(grads, ref_grads, (q, k, v)):
        assert got.shape == t.shape
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)


def test_sdpa_refuses_dropout_and_debug_mask(fake_gpu):
    q = _bhsd(1, 2, 8, 64, 0)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        sdpa.forward(q, q, q, 0.1, False)
    with pytest.raises(NotImplementedError, match="debug"):
        sdpa.forward(q, q, q, 0.0, False, True)


@pytest.mark.skipif(not sdpa._available(), reason="torch has no register_flash_attention_impl")
def test_sdpa_registration_and_activation():
    from torch.nn.attention import (
        activate_flash_attention_impl,
        current_flash_attention_impl,
        list_flash_attention_impls,
        restore_flash_attention_impl,
    )

    assert sdpa.register("cute_flash_test") == "cute_flash_test"
    assert "cute_flash_test" in list_flash_attention_impls()
    activate_flash_attention_impl("cute_flash_test")  # registers CUDA kernels for two aten ops; needs no GPU
    try:
        assert current_flash_attention_impl() == "cute_flash_test"
    finally:
        restore_flash_attention_impl()
    assert current_flash_attention_impl() is None


# --- transformers ------------------------------------------------------------------------------------------------
def _tiny(kind: str, name: str, **extra):
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=64, **extra,
    )  # fmt: skip
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}
    cls = cls[kind]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**common), attn_implementation="sdpa")
    model = model.to(torch.bfloat16)
    twin = transformers.AutoModelForCausalLM.from_config(cls(**common), attn_implementation=name).to(torch.bfloat16)
    twin.load_state_dict(model.state_dict())
    return model, twin


def _cache_kw(cache) -> dict:
    """The model's cache keyword: `cache` in transformers >= 5.2x, `past_key_values` before (deprecated since)."""
    import inspect

    import transformers

    params = inspect.signature(transformers.LlamaForCausalLM.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


@pytest.fixture
def registered():
    pytest.importorskip("transformers")
    from cute_flash.integrations import transformers as cft

    return cft.register()


def test_transformers_name_must_not_contain_flash():
    pytest.importorskip("transformers")
    from cute_flash.integrations import transformers as cft

    with pytest.raises(ValueError, match="flash"):
        cft.register("cute_flash")


@pytest.mark.parametrize("kind,extra", [("llama", {}), ("mistral", {"sliding_window": 5})], ids=["llama", "sliding"])
def test_transformers_model_matches_sdpa(fake_gpu, registered, kind, extra):
    model, twin = _tiny(kind, registered, **extra)
    assert twin.config._attn_implementation == registered
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    want, got = model(ids).logits, twin(ids).logits
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    assert fake_gpu.calls and all(c[0] == "forward" for c in fake_gpu.calls)
    mask = fake_gpu.calls[0][1]
    assert (mask.left, mask.right) == ((4, 0) if extra else (1 << 30, 0))
    assert fake_gpu.calls[0][2] == pytest.approx(32**-0.5)  # the module's scaling
    # (b, h, s, d) from transformers became (b, s, h, d), with the kv heads of GQA left unrepeated
    assert fake_gpu.calls[0][3] == (2, 12, 4, 32) and fake_gpu.calls[0][4] == (2, 12, 2, 32)
    want.float().square().mean().backward()
    got.float().square().mean().backward()
    for (n, p), p2 in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p2.grad.float(), p.grad.float(), atol=5e-2, rtol=5e-2, msg=n)


def test_transformers_decoding_with_a_cache(fake_gpu, registered):
    model, twin = _tiny("llama", registered)
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=4, do_sample=False)
        got = twin.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)


def test_transformers_dropout_and_config_switch(fake_gpu, registered):
    model, twin = _tiny("llama", registered)
    ids = torch.randint(0, 64, (2, 8))
    twin(ids, attention_mask=torch.ones(2, 8, dtype=torch.long))  # an all-ones mask is no mask
    assert {c[0] for c in fake_gpu.calls} == {"forward"}
    twin.config.attention_dropout = 0.1
    for layer in twin.model.layers:
        layer.self_attn.attention_dropout = 0.1
    twin.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        twin(ids)
    twin.eval()
    twin(ids)  # evaluation passes dropout 0
    model.set_attn_implementation(registered)  # switching a built model
    assert model.config._attn_implementation == registered


def _padding_mask(lengths, width, side):
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        if side == "left":
            mask[i, width - n :] = 1
        else:
            mask[i, :n] = 1
    return mask


def _compare_training_step(model, twin, keep, **inputs):
    """Logits and every parameter gradient of a loss over the `keep` positions, twin (cute-flash) against model."""
    want, got = model(**inputs).logits, twin(**inputs).logits
    torch.testing.assert_close(got[keep].float(), want[keep].float(), atol=3e-2, rtol=3e-2)
    want[keep].float().square().mean().backward()
    got[keep].float().square().mean().backward()
    for (n, p), p2 in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p2.grad.float(), p.grad.float(), atol=5e-2, rtol=5e-2, msg=n)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("kind,extra", [("llama", {}), ("mistral", {"sliding_window": 5})], ids=["llama", "sliding"])
def test_transformers_padded_batch_matches_sdpa(fake_gpu, registered, kind, extra, side):
    # A padded batch goes through attention_varlen over the call's own rows (each row's valid tokens one packed
    # sequence, its padding others that see no key): no gather, no scatter. Compared on the valid positions (SDPA's
    # padded rows are not meaningful).
    model, twin = _tiny(kind, registered, **extra)
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(5))
    mask = _padding_mask([12, 7, 1], 12, side)
    _compare_training_step(model, twin, mask.bool(), input_ids=ids, attention_mask=mask)
    kinds = [c[0] for c in fake_gpu.calls]
    assert "forward_varlen" in kinds and "backward_varlen" in kinds and "forward" not in kinds
    call = next(c for c in fake_gpu.calls if c[0] == "forward_varlen")
    assert call[3] == (36, 4, 32) and call[4] == (36, 2, 32)  # the 3 x 12 rows as they are, kv heads unrepeated
    assert (call[1].left, call[1].right) == ((4, 0) if extra else (1 << 30, 0))


def _decode_teacher_forced(model, ids, mask, prefill, cache):
    """Next-token logits of a padded batch: prefill, then one token per step into the cache (as generate does, position
    ids counting each row's valid tokens), the same tokens for every model so no greedy near-tie can diverge."""
    transformers = pytest.importorskip("transformers")
    if cache == "static":
        cache = transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1] + 3)
    else:
        cache = transformers.DynamicCache(config=model.config)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    steps = []
    with torch.no_grad():
        for t0, t1 in [(0, prefill)] + [(t, t + 1) for t in range(prefill, ids.shape[1])]:
            out = model(
                ids[:, t0:t1], attention_mask=mask[:, :t1], position_ids=pos[:, t0:t1], **_cache_kw(cache),
                use_cache=True,
            )  # fmt: skip
            steps.append(out.logits[:, -1])
    return torch.stack(steps)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kind,extra", [("llama", {}), ("mistral", {"sliding_window": 5})], ids=["llama", "sliding"])
def test_transformers_padded_decoding_matches_sdpa(fake_gpu, registered, kind, extra, cache):
    # Batched decoding: prompts of different lengths, left padded, then steps past the sliding window.
    model, twin = _tiny(kind, registered, **extra)
    ids = torch.randint(1, 64, (3, 15), generator=torch.Generator().manual_seed(6))
    mask = _padding_mask([15, 10, 12], 15, "left")
    want = _decode_teacher_forced(model, ids, mask, 9, cache)
    got = _decode_teacher_forced(twin, ids, mask, 9, cache)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    assert any(c[0] == "forward_varlen" for c in fake_gpu.calls)
    # A static cache's decoding steps come with a materialised 4D mask (so do a sliding window's past its width): the
    # KV-cache forward over the cache in place.
    assert any(c[0] == "forward_kvcache" for c in fake_gpu.calls) or cache == "dynamic"
    with torch.no_grad():  # and through generate itself
        twin.generate(ids[:, :9], attention_mask=mask[:, :9], max_new_tokens=3, do_sample=False, pad_token_id=0)


def test_transformers_static_cache_prefill_without_mask(fake_gpu, registered):
    # A static cache holds more key slots than tokens seen: without a mask the queries must still end at the last
    # filled slot, not at the end of the cache.
    transformers = pytest.importorskip("transformers")
    model, twin = _tiny("llama", registered)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        outs = []
        for m in (model, twin):
            cache = transformers.StaticCache(config=m.config, max_cache_len=16)
            outs.append(m(ids, **_cache_kw(cache), use_cache=True).logits)
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=3e-2, rtol=3e-2)


def _documents(lengths):
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    return position_ids, cu


@pytest.mark.parametrize("kind,extra", [("llama", {}), ("mistral", {"sliding_window": 5})], ids=["llama", "sliding"])
def test_transformers_packed_documents_match_sdpa(fake_gpu, registered, kind, extra):
    # Documents packed into one row, marked by position_ids restarting (transformers' padding-free training).
    model, twin = _tiny(kind, registered, **extra)
    lengths = [5, 8, 1, 6]
    position_ids, cu = _documents(lengths)
    ids = torch.randint(0, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(8))
    keep = torch.ones(1, sum(lengths), dtype=torch.bool)
    # use_cache=False: transformers looks for packed documents only without a cache (as in training)
    _compare_training_step(model, twin, keep, input_ids=ids, position_ids=position_ids, use_cache=False)
    calls = [c for c in fake_gpu.calls if c[0] == "forward_varlen"]
    assert len(calls) == 2 and calls[0][3] == (20, 4, 32)
    # DataCollatorWithFlattening's keywords say the same (and are checked against the mask).
    fake_gpu.calls.clear()
    flat = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=8, max_length_k=8)
    with torch.no_grad():
        got = twin(input_ids=ids, position_ids=position_ids, use_cache=False, **flat).logits
        want = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    assert [c[0] for c in fake_gpu.calls] == ["forward_varlen"] * 2
    # The keywords alone (positions not restarting, the default cache): a sliding-window layer then gets an
    # all-visible padding mask where a full one gets none; both keep the documents apart.
    fake_gpu.calls.clear()
    with torch.no_grad():
        got = twin(input_ids=ids, **flat).logits
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    assert [c[0] for c in fake_gpu.calls] == ["forward_varlen"] * 2
    bad = dict(flat, cu_seq_lens_q=torch.tensor([0, 5, 20], dtype=torch.int32))
    bad["cu_seq_lens_k"] = bad["cu_seq_lens_q"]
    with pytest.raises(NotImplementedError, match="not the causal pattern"):
        twin(input_ids=ids, position_ids=position_ids, use_cache=False, **bad)


def test_transformers_refuses_what_it_cannot_serve(fake_gpu, registered):
    model, twin = _tiny("mistral", registered, sliding_window=5)
    ids = torch.randint(0, 64, (2, 8))
    holes = torch.ones(2, 8, dtype=torch.long)
    holes[1, 3] = 0  # padding inside a row: a window's distances would change once packed
    with pytest.raises(NotImplementedError, match="contiguous"):
        twin(ids, attention_mask=holes)
    llama, twin = _tiny("llama", registered)
    custom = torch.ones(2, 1, 8, 8, dtype=torch.bool)  # bidirectional: a custom 4D mask
    with pytest.raises(NotImplementedError, match="marks no packed documents|not the causal pattern"):
        twin(ids, attention_mask=custom)
    with pytest.raises(NotImplementedError, match="not the causal pattern"):
        twin(ids, attention_mask=custom, position_ids=torch.arange(8)[None].expand(2, 8))


def test_transformers_window_comes_with_the_mask(fake_gpu, registered):
    # PhiMoE's attention module passes no sliding_window although its mask is a sliding-window one: the window travels
    # with the mask the plug-in's mask function returns, so it is applied (not silently dropped).
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=4, num_local_experts=2,
        num_experts_per_tok=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.PhimoeConfig(**common), attn_implementation="sdpa"
    )
    model = model.to(torch.bfloat16).eval()
    twin = transformers.AutoModelForCausalLM.from_config(
        transformers.PhimoeConfig(**common), attn_implementation=registered
    )
    twin = twin.to(torch.bfloat16).eval()
    twin.load_state_dict(model.state_dict())
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():  # inference tensors keep no version counter: the per-forward cache copes
        for mask in (None, _padding_mask([12, 7], 12, "left")):
            want, got = model(ids, attention_mask=mask).logits, twin(ids, attention_mask=mask).logits
            keep = slice(None) if mask is None else mask.bool()
            torch.testing.assert_close(got[keep].float(), want[keep].float(), atol=3e-2, rtol=3e-2)
    assert {(c[1].left, c[1].right) for c in fake_gpu.calls} == {(3, 0)}


def _tiny_eager_pair(cls_name: str, name: str, **extra):
    """A tiny randomly initialised model (2 layers, hidden 64) in bf16 and its twin under the plug-in, against
    transformers' eager attention."""
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, **extra,
    )  # fmt: skip
    cls = getattr(transformers, cls_name)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**common), attn_implementation="eager")
    model = model.to(torch.bfloat16).eval()
    twin = transformers.AutoModelForCausalLM.from_config(cls(**common), attn_implementation=name)
    twin = twin.to(torch.bfloat16).eval()
    twin.load_state_dict(model.state_dict())
    return model, twin


def _static_generate_logits(model, ids, mask, chunk, turn):
    """generate() on a static cache, its logits: the prompt prefilled in chunks of `chunk` tokens, or (chunk None) in
    one piece and then a second turn `turn` appended to it against the same cache (teacher forced: the first turn
    generates nothing that the second one reads, so no greedy near-tie can make the models' inputs differ)."""
    transformers = pytest.importorskip("transformers")
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    kw = dict(
        do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True, prefill_chunk_size=chunk,
        **_cache_kw(cache),
    )  # fmt: skip
    with torch.no_grad():
        first = model.generate(ids, attention_mask=mask, max_new_tokens=1 if turn is not None else 3, **kw)
        logits = list(first.logits)
        if turn is not None:
            ids, mask = torch.cat([ids, turn], 1), torch.cat([mask, torch.ones_like(turn)], 1)
            logits += model.generate(ids, attention_mask=mask, max_new_tokens=2, **kw).logits
    return torch.stack(logits)


# Qwen2-MoE's modules pass no sliding_window (the window comes with the mask); Mistral's config has no layer_types,
# so the mask generate() builds reaches the model's own mask creation again; Gemma 2's has both layer types.
_STATIC_MODELS = {
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        use_sliding_window=True, sliding_window=4, max_window_layers=1, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
    )),
    "mistral": ("MistralConfig", dict(sliding_window=4, head_dim=16)),
    "gemma2": ("Gemma2Config", dict(sliding_window=4, head_dim=16, query_pre_attn_scalar=16)),
}  # fmt: skip


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("steps", ["chunked_prefill", "second_turn"])
@pytest.mark.parametrize("kind", sorted(_STATIC_MODELS))
def test_transformers_static_cache_chunks_match_eager(fake_gpu, registered, kind, steps, padded):
    """A static cache whose sliding-window layer is already full when more than one token arrives (a prefill in
    chunks, a second turn): the padding mask then covers the layer's last slots (a slice of the 2D mask). It must
    keep its window (Qwen2-MoE's modules do not pass theirs: a copy without the tag ran full causal attention), and
    the plug-in's own mask, handed back to its mask function by a model that builds its masks again (Mistral), is
    that mask, not a user's to read from the left. Logits of generate() against transformers' eager attention."""
    cls_name, extra = _STATIC_MODELS[kind]
    model, twin = _tiny_eager_pair(cls_name, registered, **extra)
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(13))
    mask = torch.ones(2, 12, dtype=torch.long)
    if padded:
        mask[1, :6] = 0  # left padding reaching into the sliding layer's last slots after the first chunk
    chunk, turn = (5, None) if steps == "chunked_prefill" else (None, torch.randint(1, 64, (2, 5)))
    want = _static_generate_logits(model, ids, mask, chunk, turn)
    got = _static_generate_logits(twin, ids, mask, chunk, turn)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    assert (3, 0) in {(c[1].left, c[1].right) for c in fake_gpu.calls if c[1].kind != "none"}  # the window applied


def test_transformers_untagged_2d_mask_takes_the_modules_window(fake_gpu):
    # A 2D mask without the mask function's tag (a copy of the plug-in's, e.g. moved by .to(device)): its values and
    # key slots stand, its window is the module's (the sliding_window it passes, else its layer type), and a module
    # that tells none is refused, not served as plain causal padding.
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from cute_flash.integrations import transformers as cft

    q = torch.randn(2, 4, 6, 32, dtype=torch.bfloat16)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, :2] = False
    built = cft.mask_function(2, 6, 6, attention_mask=mask, local_size=None)
    want = cft.attention_forward(torch.nn.Module(), q, q, q, built)[0]
    with pytest.raises(NotImplementedError, match="without the plug-in's tag"):
        cft.attention_forward(torch.nn.Module(), q, q, q, built.clone())  # (no config: the window is unknown)

    def windows(module, **kw):
        fake_gpu.calls.clear()
        out = cft.attention_forward(module, q, q, q, built.clone(), **kw)[0]
        return out, {(c[1].left, c[1].right) for c in fake_gpu.calls}

    plain = (1 << 30, 0)
    got, seen = windows(torch.nn.Module(), sliding_window=3)
    assert seen == {(2, 0)}
    config = SimpleNamespace(layer_types=["full_attention", "sliding_attention"], sliding_window=3)
    for index, window in ((0, plain), (1, (2, 0))):
        got, seen = windows(SimpleNamespace(config=config, layer_idx=index))
        assert seen == {window}
    got, seen = windows(SimpleNamespace(config=SimpleNamespace(sliding_window=None), layer_idx=0))
    assert seen == {plain}
    assert torch.equal(got, want)
    with pytest.raises(NotImplementedError, match="window the module does not tell"):  # PhiMoE: no layer types
        cft.attention_forward(SimpleNamespace(config=SimpleNamespace(sliding_window=4), layer_idx=0), q, q, q,
                              built.clone())  # fmt: skip


def test_transformers_mask_copied_before_each_layer_matches_sdpa(fake_gpu, registered):
    # accelerate's device_map hooks move every layer's inputs with .to(device), which copies a mask on another device
    # and drops its tags: Qwen2 with a full and a sliding layer, its masks cloned before each decoder layer, trains
    # as SDPA does, each layer under its own window.
    model, twin = _tiny("qwen2", registered, use_sliding_window=True, sliding_window=5, max_window_layers=1)

    copied = []

    def copy_mask(layer, args, kwargs):
        if isinstance(kwargs.get("attention_mask"), torch.Tensor):
            kwargs["attention_mask"] = kwargs["attention_mask"].clone()
            copied.append(kwargs["attention_mask"].dim())
        return args, kwargs

    for layer in twin.model.layers:
        layer.register_forward_pre_hook(copy_mask, with_kwargs=True)
    ids = torch.randint(1, 64, (3, 15), generator=torch.Generator().manual_seed(11))
    mask = _padding_mask([15, 10, 12], 15, "left")
    _compare_training_step(model, twin, mask.bool(), input_ids=ids, attention_mask=mask)
    assert copied == [2, 2]  # (both layers' 2D padding masks were copies)
    assert {(c[1].left, c[1].right) for c in fake_gpu.calls if c[1].kind != "none"} == {(1 << 30, 0), (4, 0)}


def test_transformers_own_mask_back_in_the_mask_function():
    # The plug-in's 2D mask covers the layer's key slots, not positions from 0: handed back to the mask function for
    # the pattern it was built for, it is the answer (the same tensor); materialised (no skip), its slots stay where
    # they are; for another window or cache state it is refused, not read from the left.
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from transformers.masking_utils import sliding_window_causal_mask_function

    from cute_flash.integrations import transformers as cft

    config = SimpleNamespace(sliding_window=4)
    sliding = dict(local_size=4, config=config, mask_function=sliding_window_causal_mask_function(4))
    user = torch.ones(2, 10, dtype=torch.bool)
    user[1, :7] = False
    built = cft.mask_function(2, 3, 6, q_offset=7, kv_offset=4, attention_mask=user, local_size=4, config=config)
    assert built.shape == (2, 6) and built.is_contiguous() and torch.equal(built, user[:, 4:])
    again = cft.mask_function(2, 3, 6, q_offset=7, kv_offset=4, attention_mask=built, local_size=4, config=config)
    assert again is built
    at = dict(q_offset=7, kv_offset=4, allow_is_causal_skip=False)
    full = cft.mask_function(2, 3, 6, attention_mask=built, **at, **sliding)
    want = cft.mask_function(2, 3, 6, attention_mask=user, **at, **sliding)
    assert full.shape == (2, 1, 3, 6) and torch.equal(full, want)
    with pytest.raises(NotImplementedError, match="came back"):
        cft.mask_function(2, 3, 10, q_offset=7, attention_mask=built, config=config)  # a full-attention layer's
    with pytest.raises(NotImplementedError, match="came back"):
        cft.mask_function(2, 1, 6, q_offset=8, kv_offset=5, attention_mask=built, local_size=4, config=config)


def test_transformers_refuses_output_attentions(fake_gpu, registered):
    # No attention weights are computed: asking for them raises, rather than returning empty attentions.
    model, twin = _tiny("llama", registered)
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(NotImplementedError, match='output_attentions.*attn_implementation="eager"'):
        twin(ids, output_attentions=True)
    twin(ids, output_attentions=False)


def test_transformers_derived_results_follow_contents_a_version_does_not_tell(fake_gpu):
    """What the layers of one forward share (page tables, packed sequences) is cached only where the tensors prove
    their contents: a mask the mask function built this forward, or versioned tensors. The same tensor with new
    contents and an unchanged version is derived anew: a CUDA-graph tree's output under torch.compile
    mode="reduce-overhead" (the same tensor from replay to replay; here its contents are written through .data, which
    bumps no version), or a caller's inference tensor (no version) changed in place."""
    import math

    pytest.importorskip("transformers")
    from transformers.masking_utils import causal_mask_function

    from cute_flash.integrations import transformers as cft

    g = torch.Generator().manual_seed(14)
    b, h, hkv, sk, d = 2, 4, 2, 12, 32
    q, k, v = (torch.randn(*s, generator=g).bfloat16() for s in ((b, h, 1, d), (b, hkv, sk, d), (b, hkv, sk, d)))
    module = torch.nn.Module()
    seen = torch.zeros(b, 10, dtype=torch.bool)
    seen[:, 4:] = True
    built = cft.mask_function(
        b, 1, sk, q_offset=9, attention_mask=seen, allow_is_causal_skip=False, mask_function=causal_mask_function
    )
    assert built.shape == (b, 1, 1, sk) and built.is_contiguous()

    def attend(mask):
        scores = (q.double() @ k.double().repeat_interleave(h // hkv, 1).transpose(-1, -2)) * 0.3
        p = torch.softmax(scores.masked_fill(~mask, -math.inf), -1)
        return (p @ v.double().repeat_interleave(h // hkv, 1)).transpose(1, 2)

    def check(mask):
        before = mask._version
        cft.attention_forward(module, q, k, v, mask, scaling=0.3)
        mask.data[..., :4] = True  # the next replay's contents, the version unchanged
        assert mask._version == before
        out = cft.attention_forward(module, q, k, v, mask, scaling=0.3)[0]
        torch.testing.assert_close(out.double(), attend(mask), atol=2e-2, rtol=0)
        mask.data[..., :4] = False

    versioned = built.clone()  # a caller's mask with a version counter: an in-place write bumps it
    cft.attention_forward(module, q, k, v, versioned, scaling=0.3)
    versioned[..., :4] = True
    out = cft.attention_forward(module, q, k, v, versioned, scaling=0.3)[0]
    torch.testing.assert_close(out.double(), attend(versioned), atol=2e-2, rtol=0)
    with torch.inference_mode():  # a caller's mask without one, changed in place
        caller = built.clone()
        cft.attention_forward(module, q, k, v, caller, scaling=0.3)
        caller[..., :4] = True
        out = cft.attention_forward(module, q, k, v, caller, scaling=0.3)[0]
        want = attend(caller)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=0)
    # A built padding mask (2D, packed sequences) too.
    qp, kp = (torch.randn(b, n, 6, d, generator=g).bfloat16() for n in (h, hkv))
    user = torch.ones(b, 6, dtype=torch.bool)
    user[1, :3] = False
    pad = cft.mask_function(b, 6, 6, attention_mask=user)
    torch._C._set_cached_tensors_enabled(True)  # registered as cudagraph_trees registers its outputs
    try:
        torch._C._add_cached_tensor(built)
        check(built)
        torch._C._add_cached_tensor(pad)
        cft.attention_forward(module, qp, kp, kp, pad, scaling=0.3)
        pad.data[1, :3] = True
        out = cft.attention_forward(module, qp, kp, kp, pad, scaling=0.3)[0]
    finally:
        for t in (built, pad):
            torch._C._remove_cached_tensor(t)
        torch._C._set_cached_tensors_enabled(False)
    want = cft.attention_forward(module, qp, kp, kp, None, scaling=0.3)[0]  # (no padding left)
    torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_transformers_packed_keywords_checked_in_one_read():
    # The collator's keywords, derived in every layer that has no mask to key the forward on: their documents (empty
    # ones included) and every refusal, from one host read.
    from cute_flash.integrations.transformers import _packing_from_keywords

    def keywords(cu, cu_k=None):
        cu = torch.tensor(cu, dtype=torch.int32)
        return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu if cu_k is None else torch.tensor(cu_k), max_length_q=1,
                    max_length_k=1)  # fmt: skip

    starts, p = _packing_from_keywords(keywords([0, 3, 3, 8, 10, 16]), 2, 8, "cpu")
    assert starts.int().tolist() == [[1, 0, 0, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0, 0, 0]]
    assert p.cu_seqlens_q.tolist() == [0, 3, 3, 8, 10, 16] and p.max_seqlen_q == p.max_seqlen_k == 6
    for cu, cu_k, match in [
        ([0, 4, 16], None, "crosses a batch row"),
        ([0, 9, 8, 16], None, "without decreasing"),
        ([0, 8, 15], None, "without decreasing"),
        ([0, 8, 16], [0, 4, 16], "cu_seq_lens_q != cu_seq_lens_k"),
        ([0, 8, 16], [0, 16], "same 1D offsets"),
    ]:
        with pytest.raises(NotImplementedError, match=match):
            _packing_from_keywords(keywords(cu, cu_k), 2, 8, "cpu")
    assert _packing_from_keywords({}, 2, 8, "cpu") is None


def test_transformers_refusals_say_what_is_served(fake_gpu, registered):
    # A 4D causal + padding mask is refused with what is served (padding from the 2D mask); padding and the
    # collator's packed documents together are ambiguous (which tokens are there), refused rather than one ignored.
    model, twin = _tiny("llama", registered)
    ids = torch.randint(0, 64, (2, 8))
    pad = _padding_mask([8, 5], 8, "left").bool()
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    four_d = (causal[None] & pad[:, None, :])[:, None]
    for position_ids in (None, torch.arange(8)[None].expand(2, 8)):
        with pytest.raises(NotImplementedError, match="Padding is served from the 2D attention_mask"):
            twin(ids, attention_mask=four_d, position_ids=position_ids)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    flat = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=8, max_length_k=8)
    with pytest.raises(NotImplementedError, match="ambiguous"):
        twin(ids, attention_mask=pad.long(), **flat)
    with torch.no_grad():  # an all-visible mask says nothing the documents do not
        got = twin(ids, attention_mask=torch.ones(2, 8, dtype=torch.long), **flat).logits
        want = model(ids).logits
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


def test_transformers_refuses_sparse_attention_keywords(fake_gpu):
    from cute_flash.integrations import transformers as cft

    q = torch.randn(1, 4, 8, 32, dtype=torch.bfloat16)
    module = torch.nn.Module()
    for name in ("block_indices", "indices"):
        with pytest.raises(NotImplementedError, match="sparse"):
            cft.attention_forward(module, q, q, q, None, **{name: torch.zeros(1, dtype=torch.long)})


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_transformers_mixed_layer_types(fake_gpu, registered, cache):
    # Qwen2 with a full-attention layer and a sliding-window one (layer_types): each layer gets its own mask and
    # window, padded training and padded decoding alike.
    extra = dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)
    model, twin = _tiny("qwen2", registered, **extra)
    assert twin.config.layer_types == ["full_attention", "sliding_attention"]
    ids = torch.randint(1, 64, (3, 15), generator=torch.Generator().manual_seed(10))
    mask = _padding_mask([15, 10, 12], 15, "left")
    _compare_training_step(model, twin, mask.bool(), input_ids=ids, attention_mask=mask)
    want = _decode_teacher_forced(model, ids, mask, 9, cache)
    got = _decode_teacher_forced(twin, ids, mask, 9, cache)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    # (single-row decoding steps without padding run packed, without a mask: cute_flash/decode.py; q (b, group, h_kv,
    # d), the keys the window leaves)
    assert {(c[1].left, c[1].right) for c in fake_gpu.calls if c[1].kind != "none"} == {(1 << 30, 0), (4, 0)}
    packed = [c for c in fake_gpu.calls if c[1].kind == "none" and c[0] == "forward"]
    assert all(c[3] == (3, 2, 2, 32) and c[4][1] <= 5 for c in packed)  # (static caches: none, 4D masks)
    # Padded decoding steps (dynamic cache; a static one hands 4D masks): the cache read in place, one packed sequence
    # per (row, KV head) with its 2 query heads as rows.
    folded = [c for c in fake_gpu.calls if c[1].kind == "none" and c[0] == "forward_varlen"]
    assert all(c[3] == (3 * 4, 1, 32) and c[4][1:] == (1, 32) for c in folded) and (cache == "static") != bool(folded)


# --- soft-capping (Gemma 2) and learnable sinks (gpt-oss) through the plug-in ------------------------------------
def _tiny_featured(kind: str, name: str, query_pre_attn_scalar: int = 32):
    """A tiny Gemma 2 (attn_logit_softcapping, a sliding and a full layer) or gpt-oss (learnable sinks, a sliding
    and a full layer) in bf16, with transformers' own eager attention as the twin to compare with (it implements
    both, where "sdpa" refuses them). Gemma 2 scales by query_pre_attn_scalar ** -0.5, not head_dim's."""
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=64, sliding_window=5,
    )  # fmt: skip
    if kind == "gemma2":
        cfg = dict(
            common, attn_logit_softcapping=20.0, final_logit_softcapping=None,
            query_pre_attn_scalar=query_pre_attn_scalar,
        )  # fmt: skip
        cls = transformers.Gemma2Config
    else:
        cfg = dict(common, num_local_experts=1, num_experts_per_tok=1)  # (no routing for a rounding to flip)
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        cls = transformers.GptOssConfig
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**cfg), attn_implementation="eager")
    if kind == "gpt_oss":
        for layer in model.model.layers:  # sinks large enough to matter
            torch.nn.init.normal_(layer.self_attn.sinks, mean=1.0, std=2.0)
    model = model.to(torch.bfloat16)
    twin = transformers.AutoModelForCausalLM.from_config(cls(**cfg), attn_implementation=name).to(torch.bfloat16)
    twin.load_state_dict(model.state_dict())
    return model, twin


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_transformers_softcap_and_sinks_match_eager(fake_gpu, registered, kind):
    """The plug-in hands transformers' `softcap` (Gemma 2's attn_logit_softcapping) and `s_aux` (gpt-oss's sinks) to
    cute_flash: the backend sees the cap and the sinks' (rows, h) view, and the logits and every parameter gradient
    (the sinks' included) match transformers' eager attention, dense and padded (attention_varlen)."""
    model, twin = _tiny_featured(kind, registered)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(11))
    _compare_training_step(model, twin, slice(None), input_ids=ids)
    softcap, sink = (20.0, False) if kind == "gemma2" else (0.0, True)
    dense = [f for f in fake_gpu.features if f[0] == "forward"]
    assert len(dense) == 2 and all(f[1] == softcap for f in dense)  # one launch per layer
    assert all((f[2] is not None) == sink for f in dense)
    if sink:
        assert dense[0][2] == ((12, 4), (0, 1))  # the (h,) sinks expanded over the rows
    assert {f[0] for f in fake_gpu.features} == {"forward", "backward"}
    if kind == "gpt_oss":
        assert all(layer.self_attn.sinks.grad is not None for layer in twin.model.layers)
    model.zero_grad()
    twin.zero_grad()
    mask = _padding_mask([12, 7], 12, "left")
    fake_gpu.features.clear()
    _compare_training_step(model, twin, mask.bool(), input_ids=ids, attention_mask=mask)
    assert {f[0] for f in fake_gpu.features} == {"forward_varlen", "backward_varlen"}
    assert all(f[1] == softcap for f in fake_gpu.features)


def test_transformers_gemma2_scale_is_query_pre_attn_scalar(fake_gpu, registered):
    # Gemma 2's softmax scale is query_pre_attn_scalar ** -0.5, here not head_dim ** -0.5 (32): the backend gets the
    # module's scaling, with the cap, and the logits match eager attention, dense and padded.
    model, twin = _tiny_featured("gemma2", registered, query_pre_attn_scalar=8)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(15))
    mask = _padding_mask([12, 7], 12, "left")
    with torch.no_grad():
        for m in (None, mask):
            want, got = model(ids, attention_mask=m).logits, twin(ids, attention_mask=m).logits
            keep = slice(None) if m is None else m.bool()
            torch.testing.assert_close(got[keep].float(), want[keep].float(), atol=3e-2, rtol=3e-2)
    launches = [c for c in fake_gpu.calls if c[0] in ("forward", "forward_varlen")]
    assert {c[0] for c in launches} == {"forward", "forward_varlen"}
    assert all(c[2] == pytest.approx(8**-0.5) for c in launches)
    assert {f[1] for f in fake_gpu.features} == {20.0}


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_transformers_padded_decoding_with_softcap_and_sinks_matches_eager(fake_gpu, registered, kind):
    # Padded decoding past the sliding window: Gemma 2's softcap on the in-place cache layout (one packed sequence
    # per row and KV head), gpt-oss's sinks on the general packed path (sinks differ per query head).
    model, twin = _tiny_featured(kind, registered)
    ids = torch.randint(1, 64, (3, 14), generator=torch.Generator().manual_seed(12))
    mask = _padding_mask([14, 9, 11], 14, "left")
    want = _decode_teacher_forced(model, ids, mask, 8, "dynamic")
    got = _decode_teacher_forced(twin, ids, mask, 8, "dynamic")
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    folded = [c for c in fake_gpu.calls if c[0] == "forward_varlen" and c[3][1] == 1]
    assert bool(folded) == (kind == "gemma2")


def test_transformers_sinks_keywords(fake_gpu):
    """transformers passes sinks as `s_aux` (gpt-oss) or `sinks`; both at once must be the same tensor."""
    from cute_flash.integrations import transformers as cft

    q = torch.randn(1, 4, 8, 32, dtype=torch.bfloat16)
    module = torch.nn.Module()
    sink = torch.randn(4)
    a = cft.attention_forward(module, q, q, q, None, s_aux=sink)[0]
    b = cft.attention_forward(module, q, q, q, None, sinks=sink, s_aux=sink, softcap=None)[0]
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert [f[2] for f in fake_gpu.features] == [((8, 4), (0, 1))] * 2 and fake_gpu.features[0][1] == 0.0
    with pytest.raises(NotImplementedError, match="s_aux and sinks"):
        cft.attention_forward(module, q, q, q, None, s_aux=sink, sinks=sink.clone())
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        cft.attention_forward(module, q, q, q, None, softcap=-1.0)


@pytest.mark.parametrize("q_length", [1, 3, 12])
@pytest.mark.parametrize("k_width", [12, 17])
def test_transformers_unpad_sequences_keep_positions(q_length, k_width):
    # The padded path's sequences over the call's own rows: every valid query sees exactly its row's valid keys at or
    # before it (by the kernels' bottom-right alignment), padding queries see none, padding keys are never read.
    from cute_flash.integrations.transformers import _unpad

    width = 12
    rows = [[1] * 12, [0] * 5 + [1] * 7, [1] * 4 + [0] * 8, [0] * 12, [0] * 11 + [1], [1] * 11 + [0]]
    mask = torch.tensor(rows, dtype=torch.bool)
    p = _unpad(mask, q_length, windowed=True, k_width=k_width)
    assert p.q_rows is None and p.k_width == k_width
    cu_q, cu_k, used = p.cu_seqlens_q.tolist(), p.cu_seqlens_k.tolist(), p.seqused_k.tolist()
    assert cu_q[-1] == len(rows) * q_length and cu_k[-1] == len(rows) * k_width
    assert p.max_seqlen_q == max(b - a for a, b in zip(cu_q, cu_q[1:]))
    assert p.max_seqlen_k == max(b - a for a, b in zip(cu_k, cu_k[1:]))
    seen = {}
    for n in range(len(used)):
        nq, nk = cu_q[n + 1] - cu_q[n], used[n]
        for j in range(nq):
            keys = [cu_k[n] + t for t in range(nk) if t <= j + nk - nq]  # causal, bottom-right
            seen[cu_q[n] + j] = keys
    for i, r in enumerate(rows):
        for p_ in range(q_length):
            slot = width - q_length + p_
            want = [i * k_width + t for t in range(width) if r[t] and t <= slot] if r[slot] else []
            assert seen[i * q_length + p_] == want, (i, p_)
    # Told by the mask function that there are no gaps, the same sequences without a device read (bounded lengths).
    told = _unpad(mask, q_length, windowed=True, k_width=k_width, gaps=False)
    assert torch.equal(told.cu_seqlens_q, p.cu_seqlens_q) and torch.equal(told.cu_seqlens_k, p.cu_seqlens_k)
    assert torch.equal(told.seqused_k, p.seqused_k) and (told.max_seqlen_q, told.max_seqlen_k) == (q_length, k_width)


def test_transformers_unpad_gathers_rows_with_gaps():
    from cute_flash.integrations.transformers import _unpad

    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    p = _unpad(mask, 4, windowed=False, k_width=4)
    assert p.q_rows is not None and p.cu_seqlens_q.tolist() == [0, 3, 7] and p.max_seqlen_k == 4
    with pytest.raises(NotImplementedError, match="not contiguous"):
        _unpad(mask, 4, windowed=True, k_width=4)
    assert _unpad(torch.ones(2, 4, dtype=torch.bool), 4, windowed=False, k_width=4) is None


@pytest.mark.parametrize("window", [None, 3])
def test_transformers_fold_sequences_see_each_rows_keys(window):
    # Padded decoding's layout (_fold): sequence 1 + row * h_kv + head holds that row's group of query heads and, in
    # the cache flattened over (row, head, slot), exactly the row's valid slots the window keeps (none where the
    # query's own slot is padding).
    from cute_flash.integrations.transformers import _fold

    h_kv, sk, group, width = 2, 9, 3, 7
    rows = [[1] * 7, [0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0], [0] * 7, [0] * 6 + [1]]
    mask = torch.tensor(rows, dtype=torch.bool)
    cu_q, cu_k, used = (t.tolist() for t in _fold(mask, h_kv, sk, group, window))
    assert len(cu_q) == len(cu_k) == len(used) + 1 == len(rows) * h_kv + 2
    assert cu_q[0] == cu_k[0] == 0 and used[0] == 0 and cu_q[1] == 0 and cu_k[-1] == len(rows) * h_kv * sk
    for r, row in enumerate(rows):
        for hd in range(h_kv):
            n = 1 + r * h_kv + hd
            assert cu_q[n + 1] - cu_q[n] == group and cu_q[n] == (r * h_kv + hd) * group
            keys = list(range(cu_k[n], cu_k[n] + used[n]))
            want = [] if not row[width - 1] else [
                (r * h_kv + hd) * sk + t for t in range(width) if row[t] and (window is None or t > width - 1 - window)
            ]  # fmt: skip
            assert keys == want, (r, hd)
            assert cu_k[n] + used[n] <= cu_k[n + 1]


@pytest.mark.parametrize("s", [1, 8], ids=["decoding", "prefill"])
def test_transformers_attention_forward_traces_in_one_graph_without_a_mask(fake_gpu, s):
    """Under torch.compile a call with no mask (no padding) must not graph-break: the padded-decoding and packing
    checks that decide it are plain code; only the calls that read the mask on the host run eagerly."""
    pytest.importorskip("transformers")
    from cute_flash.integrations import transformers as cft

    torch._dynamo.reset()
    q = torch.randn(2, 4, s, 32, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 8, 32, dtype=torch.bfloat16)
    module = torch.nn.Module()
    want = cft.attention_forward(module, q, k, k, None, scaling=0.2)[0]
    compiled = torch.compile(lambda q, k: cft.attention_forward(module, q, k, k, None, scaling=0.2)[0],
                             fullgraph=True, backend="eager")  # fmt: skip
    torch.testing.assert_close(compiled(q, k), want, atol=0, rtol=0)
    torch._dynamo.reset()


def test_transformers_static_cache_decoding_step_traces_in_one_graph(fake_gpu, monkeypatch):
    """A static cache's decoding step (what generate() compiles and CUDA-graphs) traces into one graph whose
    attention is the KV-cache op, one per layer, and which runs; where no family serves that KV-cache call (as on
    Hopper with CUTE_FLASH_ARCH=sm90, which excludes the sm80 family's page-size-1 gathers) the trace falls back to
    the general path, as the eager call does, rather than failing when the graph runs."""
    tf = pytest.importorskip("transformers")
    from cute_flash.integrations import transformers as cft

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    name = cft.register()
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM._from_config(cfg, attn_implementation=name, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 64, (2, 9))
    for refused in (False, True):
        if refused:

            def route(spec, t, backward, deterministic=False):
                if spec.kvcache:
                    raise NotImplementedError("no KV-cache forward here")
                return fake_gpu

            monkeypatch.setattr(device, "route", route)
        torch._dynamo.reset()
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        with torch.no_grad():
            cache = tf.StaticCache(config=model.config, max_cache_len=32)
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            step = torch.compile(model.forward, backend=backend, fullgraph=not refused)
            logits = step(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True,
                          cache_position=torch.tensor([9])).logits  # fmt: skip
        assert logits.shape == (2, 1, 64)
        ops = [n for g in graphs for n in g.graph.nodes if "kvcache_fwd" in str(n.target)]
        if not refused:
            assert len(graphs) == 1 and len(ops) == cfg.num_hidden_layers
        else:
            assert not ops and len(graphs) > 1  # (the general path reads the mask eagerly: graph breaks)
    torch._dynamo.reset()


def test_transformers_key_width_stays_within_int32_indexing():
    # A padded batch packs over the whole cache where it flattens without a copy, but never past the kernels' Int32
    # indexing: a huge static cache then packs over the slots in use.
    pytest.importorskip("transformers")
    from cute_flash.integrations.transformers import _key_width

    small = torch.empty(2, 4096, 8, 128, device="meta")
    assert _key_width(small, 700, 128) == 4096
    assert _key_width(small.transpose(1, 2).contiguous().transpose(1, 2), 700, 128) == 700  # (b, h, s, d) storage
    huge = torch.empty(1, 2**24, 8, 128, device="meta")
    assert _key_width(huge, 700, 128) == 700


@pytest.mark.parametrize("b, h, hkv, sk, d", [(3, 8, 2, 37, 64), (1, 4, 4, 5, 128), (4, 16, 4, 100, 128)])
def test_transformers_captured_masked_decoding_reads_the_visible_slots(b, h, hkv, sk, d):
    """Decoding with a 4D bool mask during CUDA-graph capture (no host read possible): the KV-cache call's pages of
    one slot and page tables (built on the device) attend to exactly the slots the mask marks, gaps included; a row
    that sees nothing gets 0. Checked through the paged reference against a direct float64 softmax, on the
    cache's own storage (a (b, h_kv, S, d) cache and a (b, S, h_kv, d) one seen transposed)."""
    import math

    from cute_flash.integrations.transformers import _masked_decoding_args
    from cute_flash.reference import kvcache_reference

    g = torch.Generator().manual_seed(b * sk)
    q = torch.randn(b, h, 1, d, dtype=torch.float64, generator=g)
    mask = torch.rand(b, 1, 1, sk, generator=g) < 0.6
    mask[0, 0, 0, :] = False
    mask[-1, 0, 0, -1] = True
    for layout in ("heads_first", "slots_first"):
        k, v = (torch.randn(b, hkv, sk, d, dtype=torch.float64, generator=g) for _ in range(2))
        if layout == "slots_first":
            k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
        qq, k_pages, v_pages, lens, table = _masked_decoding_args(q, k, v, mask)
        assert k_pages.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()  # in place, no copy
        got = kvcache_reference(qq, k_pages, v_pages, cache_seqlens=lens, page_table=table, causal=False,
                                softmax_scale=0.3)  # fmt: skip
        got = got.out if hasattr(got, "out") else got
        scores = (q @ k.repeat_interleave(h // hkv, 1).transpose(-1, -2)) * 0.3
        p = torch.softmax(scores.masked_fill(~mask, -math.inf), -1).nan_to_num(0.0)
        want = (p @ v.repeat_interleave(h // hkv, 1)).transpose(1, 2)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    # What it does not serve: several queries, a float mask, K (slots first, from the loop's last layout) and V
    # (heads first) whose page numbering differs (one KV head aside: then both layouts are one).
    assert _masked_decoding_args(q.expand(b, h, 2, d), k, v, mask) is None
    assert _masked_decoding_args(q, k, v, mask.double()) is None
    assert (_masked_decoding_args(q, k, v.contiguous(), mask) is None) == (hkv > 1)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_transformers_masked_decoding_follows_a_mask_changed_in_place(fake_gpu, mode):
    """A decode loop that keeps one 4D mask and marks new slots in place: the next call attends to them, also under
    inference_mode (whose tensors have no version counter to tell the change); a cache of another batch than the
    queries is refused, not read in part."""
    import math

    pytest.importorskip("transformers")
    from cute_flash.integrations.transformers import attention_forward

    g = torch.Generator().manual_seed(5)
    b, h, hkv, sk, d = 3, 8, 2, 24, 64
    q, k, v = (torch.randn(*s, generator=g).bfloat16() for s in ((b, h, 1, d), (b, hkv, sk, d), (b, hkv, sk, d)))
    module = torch.nn.Module()
    with mode():
        mask = torch.zeros(b, 1, 1, sk, dtype=torch.bool)
        mask[..., :5] = True
        attention_forward(module, q, k, v, mask, scaling=0.3)
        mask[..., 5:9] = True  # the next step's slots, in the same tensor
        out = attention_forward(module, q, k, v, mask, scaling=0.3)[0]
    scores = (q.double() @ k.double().repeat_interleave(h // hkv, 1).transpose(-1, -2)) * 0.3
    p = torch.softmax(scores.masked_fill(~mask, -math.inf), -1)
    want = (p @ v.double().repeat_interleave(h // hkv, 1)).transpose(1, 2)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=0)
    with pytest.raises(ValueError, match="one batch"):
        attention_forward(module, q, torch.cat([k, k[:2]]), torch.cat([v, v[:2]]), mask, scaling=0.3)

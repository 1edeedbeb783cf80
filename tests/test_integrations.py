"""The plug-ins (cute_flash/integrations) without a GPU: a fake backend computes every launch with the float64
reference (forward, and the backward by autograd through it), so the registration logic, the layout transposes,
the mask translation and the error paths are checked on the CPU. The GPU side is
tests/test_integrations_gpu.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from cute_flash.arch.base import launcher_through_backward, launcher_through_forward
from cute_flash import interface, validation
from cute_flash.reference import attention_reference


class _ReferenceBackend:
    name = "fake"
    cute_arch = "sm_90a"

    def __init__(self):
        self.calls = []

    def unsupported_reason(self, spec, backward, deterministic=False):
        return None

    def _ref(self, q, k, v, softmax_scale, mask):
        return attention_reference(
            q, k, v, softmax_scale=softmax_scale, window_size=(mask.left, mask.right), return_lse=True
        )

    def forward_launcher(self, problem, device):
        return launcher_through_forward(self, problem)

    def backward_launcher(self, problem, device, deterministic=False):
        return launcher_through_backward(self, problem, deterministic)

    def forward(self, t, problem, descale=None):
        q, k, v, out, lse = t
        softmax_scale, mask = problem.softmax_scale, problem.mask
        self.calls.append(("forward", mask, softmax_scale, tuple(q.shape), tuple(k.shape)))
        o, l = self._ref(q, k, v, softmax_scale, mask)
        out.copy_(o)
        lse.copy_(l)

    def backward(self, t, grads, problem, deterministic=False):
        dout, q, k, v, out, lse, dlse = t
        dq, dk, dv = grads
        softmax_scale, mask = problem.softmax_scale, problem.mask
        self.calls.append(("backward", mask, softmax_scale, tuple(q.shape), tuple(k.shape)))
        leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
        with torch.enable_grad():  # a backward runs with grad mode off
            o, l_ = self._ref(*leaves, softmax_scale, mask)
        outs, grads_in = ((o,), (dout.double(),)) if dlse is None else ((o, l_), (dout.double(), dlse.to(l_.dtype)))
        for g, t in zip(torch.autograd.grad(outs, leaves, grads_in), (dq, dk, dv)):
            t.copy_(g)


@pytest.fixture
def fake_gpu(monkeypatch):
    backend = _ReferenceBackend()
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(interface, "_route", lambda spec, t, backward, deterministic=False: backend)
    monkeypatch.setattr(interface, "_device_guard", lambda t: contextlib.nullcontext())
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
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}[kind]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**common), attn_implementation="sdpa")
    model = model.to(torch.bfloat16)
    twin = transformers.AutoModelForCausalLM.from_config(cls(**common), attn_implementation=name).to(torch.bfloat16)
    twin.load_state_dict(model.state_dict())
    return model, twin


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


def test_transformers_padding_dropout_and_config_switch(fake_gpu, registered):
    model, twin = _tiny("llama", registered)
    ids = torch.randint(0, 64, (2, 8))
    padded = torch.ones(2, 8, dtype=torch.long)
    padded[0, :3] = 0
    with pytest.raises(NotImplementedError, match="attention mask"):
        twin(ids, attention_mask=padded)
    twin(ids, attention_mask=torch.ones(2, 8, dtype=torch.long))  # an all-ones mask is no mask
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

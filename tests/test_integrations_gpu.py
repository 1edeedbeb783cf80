"""The plug-ins on a GPU (issue 15): a small randomly initialised Llama (GQA 16/4, d128) and a Mistral-style model
with a sliding window run with attn_implementation=<cute-flash's name> against the same weights with "sdpa", forward
logits and backward gradients; SDPA's flash backend routed to cute-flash (top-left causal with sq == sk, sq > sk,
sq < sk; GQA) against the math backend. Acceptance: FlashAttention's rule at model level, the error against a
float32 SDPA twin at most twice that of the bf16 SDPA model plus a small slack.

Run: python -m pytest -q tests/test_integrations_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cute_flash.core import launch

pytestmark = [pytest.mark.sm90, pytest.mark.xdist_group("integrations")]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _models(kind: str, name: str, **extra):
    transformers = pytest.importorskip("transformers")
    cfg = dict(
        vocab_size=256, hidden_size=2048, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=1024, attention_dropout=0.0, **extra,
    )  # fmt: skip
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}[kind]
    torch.manual_seed(0)
    build = transformers.AutoModelForCausalLM.from_config
    ref = build(cls(**cfg), attn_implementation="sdpa").cuda()  # float32
    out = {"fp32": ref}
    for impl in ("sdpa", name):
        m = build(cls(**cfg), attn_implementation=impl).cuda()
        m.load_state_dict(ref.state_dict())
        out[impl] = m.to(torch.bfloat16)
    return out


@pytest.mark.parametrize(
    "kind,extra", [("llama", {}), ("mistral", {"sliding_window": 64})], ids=["llama_gqa", "mistral_sliding"]
)
def test_transformers_plugin_matches_sdpa(kind, extra):
    from cute_flash.integrations import transformers as cft

    name = cft.register()
    models = _models(kind, name, **extra)
    ids = torch.randint(0, 256, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    logits = {k: m(ids).logits for k, m in models.items()}
    base = _err(logits["sdpa"], logits["fp32"])
    assert _err(logits[name], logits["fp32"]) <= 2 * base + 1e-3, (_err(logits[name], logits["fp32"]), base)
    for k, m in models.items():
        logits[k].float().logsumexp(-1).mean().backward()
    for (pname, p32), p_sdpa, p_cute in zip(
        models["fp32"].named_parameters(), models["sdpa"].parameters(), models[name].parameters()
    ):
        base = _err(p_sdpa.grad, p32.grad)
        got = _err(p_cute.grad, p32.grad)
        assert got <= 2 * base + 1e-4, (pname, got, base)


def test_transformers_plugin_generates_like_sdpa():
    from cute_flash.integrations import transformers as cft

    name = cft.register()
    models = _models("llama", name)
    ids = torch.randint(0, 256, (1, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    with torch.no_grad():
        logits_sdpa = models["sdpa"](ids).logits[:, -1]
        logits_cute = models[name](ids).logits[:, -1]
        out = models[name].generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, 72)
    assert _err(logits_cute, logits_sdpa) < 0.1  # same next-token scores up to bf16 rounding


@pytest.mark.parametrize(
    "kind,extra", [("llama", {}), ("mistral", {"sliding_window": 64})], ids=["llama_gqa", "mistral_sliding"]
)
def test_transformers_plugin_decodes_with_a_cache_like_sdpa(kind, extra):
    """Prefill 96 tokens into the model's cache, then decode 12 more one at a time (teacher-forced with the same
    tokens, so no greedy near-tie can make the two runs diverge): every step's logits match SDPA's with the same
    weights, including, with a 64-token sliding window, steps whose keys start past the window."""
    from cute_flash.integrations import transformers as cft

    name = cft.register()
    models = _models(kind, name, **extra)
    ids = torch.randint(0, 256, (1, 108), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    steps = {}
    with torch.no_grad():
        for impl in ("sdpa", name):
            out = models[impl](ids[:, :96], use_cache=True)
            cache, logits = out.past_key_values, [out.logits[:, -1]]
            for t in range(96, 108):
                out = models[impl](ids[:, t : t + 1], past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                logits.append(out.logits[:, -1])
            steps[impl] = torch.stack(logits)
    assert _err(steps[name], steps["sdpa"]) < 0.1, _err(steps[name], steps["sdpa"])


def _training_step_errors(models, name, keep, **inputs):
    """Logits and parameter gradients of a loss over the `keep` positions: (ours, SDPA bf16) errors against the float32
    SDPA twin, logits first, then every parameter."""
    logits = {k: m(**inputs).logits for k, m in models.items()}
    errs = [(_err(logits[name][keep], logits["fp32"][keep]), _err(logits["sdpa"][keep], logits["fp32"][keep]))]
    for m_logits in logits.values():
        m_logits[keep].float().logsumexp(-1).mean().backward()
    for p32, p_sdpa, p_cute in zip(models["fp32"].parameters(), models["sdpa"].parameters(), models[name].parameters()):
        errs.append((_err(p_cute.grad, p32.grad), _err(p_sdpa.grad, p32.grad)))
    return errs


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize(
    "kind,extra", [("llama", {}), ("mistral", {"sliding_window": 64})], ids=["llama_gqa", "mistral_sliding"]
)
def test_transformers_plugin_padded_batch_like_sdpa(kind, extra, side):
    """A padded batch (lengths 256, 131, 1, 77 in 256 slots) goes through attention_varlen: logits and every
    parameter gradient of a loss over the valid positions against the float32 twin, FlashAttention's 2x rule."""
    from cute_flash.integrations import transformers as cft

    name = cft.register()
    models = _models(kind, name, **extra)
    lengths, width = [256, 131, 1, 77], 256
    mask = torch.zeros(len(lengths), width, dtype=torch.long, device="cuda")
    for i, n in enumerate(lengths):
        if side == "left":
            mask[i, width - n :] = 1
        else:
            mask[i, :n] = 1
    ids = torch.randint(0, 256, (len(lengths), width), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    errs = _training_step_errors(models, name, mask.bool(), input_ids=ids, attention_mask=mask)
    assert errs[0][0] <= 2 * errs[0][1] + 1e-3, errs[0]
    for i, (got, base) in enumerate(errs[1:]):
        assert got <= 2 * base + 1e-4, (i, got, base)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize(
    "kind,extra", [("llama", {}), ("mistral", {"sliding_window": 64})], ids=["llama_gqa", "mistral_sliding"]
)
def test_transformers_plugin_padded_decoding_like_sdpa(kind, extra, cache):
    """Left-padded prompts (96, 40, 70 tokens in 96 slots), then 12 single-token steps teacher-forced into a dynamic
    or static cache (the sliding window's keys start past the window): every step's logits against SDPA's."""
    transformers = pytest.importorskip("transformers")
    from cute_flash.integrations import transformers as cft

    name = cft.register()
    models = _models(kind, name, **extra)
    lengths, prefill, total = [96, 40, 70], 96, 108
    mask = torch.ones(len(lengths), total, dtype=torch.long, device="cuda")
    for i, n in enumerate(lengths):
        mask[i, : prefill - n] = 0
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    ids = torch.randint(1, 256, (len(lengths), total), device="cuda", generator=torch.Generator("cuda").manual_seed(6))
    steps = {}
    with torch.no_grad():
        for impl in ("sdpa", name):
            m = models[impl]
            if cache == "static":
                kv = transformers.StaticCache(config=m.config, max_cache_len=total + 4)
            else:
                kv = transformers.DynamicCache(config=m.config)
            logits = []
            for t0, t1 in [(0, prefill)] + [(t, t + 1) for t in range(prefill, total)]:
                out = m(
                    ids[:, t0:t1], attention_mask=mask[:, :t1], position_ids=pos[:, t0:t1], past_key_values=kv,
                    use_cache=True,
                )  # fmt: skip
                logits.append(out.logits[:, -1])
            steps[impl] = torch.stack(logits)
    assert _err(steps[name], steps["sdpa"]) < 0.1, _err(steps[name], steps["sdpa"])


@pytest.mark.parametrize(
    "kind,extra", [("llama", {}), ("mistral", {"sliding_window": 64})], ids=["llama_gqa", "mistral_sliding"]
)
def test_transformers_plugin_packed_documents_like_sdpa(kind, extra):
    """Documents of 100, 37, 1, 200 and 174 tokens packed into one row (position_ids restarting; transformers'
    padding-free training): logits and gradients against the float32 twin with the same packed mask."""
    from cute_flash.integrations import transformers as cft

    name = cft.register()
    models = _models(kind, name, **extra)
    lengths = [100, 37, 1, 200, 174]
    position_ids = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    ids = torch.randint(0, 256, (1, sum(lengths)), device="cuda", generator=torch.Generator("cuda").manual_seed(7))
    keep = torch.ones(1, sum(lengths), dtype=torch.bool, device="cuda")
    errs = _training_step_errors(models, name, keep, input_ids=ids, position_ids=position_ids, use_cache=False)
    assert errs[0][0] <= 2 * errs[0][1] + 1e-3, errs[0]
    for i, (got, base) in enumerate(errs[1:]):
        assert got <= 2 * base + 1e-4, (i, got, base)


def _bhsd(b, h, s, d, seed):
    g = torch.Generator("cuda").manual_seed(seed)
    return torch.randn(b, h, s, d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)


# SDPA itself never gives the flash backend is_causal with sq != sk (torch's own check refuses it before dispatch:
# "No available kernel"), so the unequal lengths run without a mask here.
@pytest.mark.parametrize(
    "sq,sk,causal",
    [(256, 256, True), (300, 128, False), (128, 300, False)],
    ids=["square", "more_queries", "more_keys"],
)
def test_sdpa_flash_backend_routes_to_cute_flash(monkeypatch, sq, sk, causal):
    from torch.nn.attention import SDPBackend, activate_flash_attention_impl, restore_flash_attention_impl, sdpa_kernel

    from cute_flash.integrations import sdpa

    if not sdpa._available():
        pytest.skip("torch has no register_flash_attention_impl")
    launches = []
    real = launch.forward
    monkeypatch.setattr(launch, "forward", lambda *a: launches.append(1) or real(*a))
    q, k, v, do = _bhsd(2, 8, sq, 128, 1), _bhsd(2, 2, sk, 128, 2), _bhsd(2, 2, sk, 128, 3), _bhsd(2, 8, sq, 128, 4)
    args = dict(is_causal=causal, scale=0.1, enable_gqa=True)
    leaves32 = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves32, **args)
    ref_grads = torch.autograd.grad(ref, leaves32, do.float())
    with sdpa_kernel(SDPBackend.MATH):
        low = F.scaled_dot_product_attention(q, k, v, **args)
    low_grads = torch.autograd.grad(low, (q, k, v), do)
    activate_flash_attention_impl(sdpa.register())
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, **args)
        grads = torch.autograd.grad(out, (q, k, v), do)
    finally:
        restore_flash_attention_impl()
    assert launches, "SDPA's flash backend did not reach cute_flash"
    assert _err(out, ref) <= 2 * _err(low, ref) + 1e-5
    for got, want, base in zip(grads, ref_grads, low_grads):
        assert _err(got, want) <= 2 * _err(base, want) + 1e-4


@pytest.mark.parametrize(
    "kind,extra", [("llama", {}), ("mistral", {"sliding_window": 64})], ids=["llama_gqa", "mistral_sliding"]
)
def test_transformers_plugin_under_torch_compile(kind, extra):
    """torch.compile of the whole model with the plug-in. fullgraph=True: a forward with a cache and no padding (the
    dense path reads nothing from the device; the sliding layers' window rides on the mask). Without a cache
    transformers cannot tell packed rows from plain ones while tracing (it reads position_ids) and materialises a
    mask, which the plug-in reads on the host: a training step compiles with graph breaks, padded too. Logits and
    gradients against the float32 twin by the 2x rule."""
    from cute_flash.integrations import transformers as cft

    name = cft.register()
    models = _models(kind, name, **extra)
    eager_twin = models[name]
    ids = torch.randint(0, 256, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(8))
    torch._dynamo.reset()
    compiled = torch.compile(eager_twin, fullgraph=True)
    with torch.no_grad():
        got = compiled(ids, use_cache=True).logits
        want, ref = models["fp32"](ids).logits, models["sdpa"](ids).logits
    assert _err(got, want) <= 2 * _err(ref, want) + 1e-3
    torch._dynamo.reset()
    models[name] = torch.compile(eager_twin)  # graph breaks allowed
    mask = torch.ones(2, 256, dtype=torch.long, device="cuda")
    mask[1, :100] = 0
    for inputs in (dict(input_ids=ids), dict(input_ids=ids, attention_mask=mask)):
        for m in models.values():
            m.zero_grad()
        keep = inputs.get("attention_mask", torch.ones_like(mask)).bool()
        errs = _training_step_errors(models, name, keep, use_cache=False, **inputs)
        assert errs[0][0] <= 2 * errs[0][1] + 1e-3, errs[0]
        for i, (got, base) in enumerate(errs[1:]):
            assert got <= 2 * base + 1e-4, (i, got, base)


def _featured_models(kind: str, name: str):
    """A randomly initialised Gemma 2 (attn_logit_softcapping, sliding and full layers) or gpt-oss (learnable sinks,
    sliding and full layers; one expert, so that no routing decision can flip on a rounding) with transformers' own
    eager attention as the reference (its float32 twin) and the baseline (bf16): "sdpa" implements neither."""
    transformers = pytest.importorskip("transformers")
    cfg = dict(
        vocab_size=256, hidden_size=1024, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=1024, attention_dropout=0.0, sliding_window=64,
    )  # fmt: skip
    if kind == "gemma2":
        cfg.update(attn_logit_softcapping=30.0, final_logit_softcapping=None, query_pre_attn_scalar=128)
        cls = transformers.Gemma2Config
    else:
        cfg.update(num_local_experts=1, num_experts_per_tok=1)
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        cls = transformers.GptOssConfig
    torch.manual_seed(0)
    build = transformers.AutoModelForCausalLM.from_config
    ref = build(cls(**cfg), attn_implementation="eager").cuda()  # float32
    if kind == "gpt_oss":
        for layer in ref.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, mean=1.0, std=2.0)
    out = {"fp32": ref}
    for impl in ("eager", name):
        m = build(cls(**cfg), attn_implementation=impl).cuda()
        m.load_state_dict(ref.state_dict())
        out[impl] = m.to(torch.bfloat16)
    return out


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_transformers_plugin_softcap_and_sinks_match_eager(kind):
    """Gemma 2's soft-capping and gpt-oss's sinks through the plug-in (dense and padded batches): logits and every
    parameter gradient (the sinks' too) by FlashAttention's rule against transformers' eager attention in float32,
    with its bf16 run as the baseline."""
    from cute_flash.integrations import transformers as cft

    name = cft.register()
    models = _featured_models(kind, name)
    ids = torch.randint(0, 256, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    mask = torch.ones(2, 256, dtype=torch.long, device="cuda")
    mask[1, :77] = 0  # left padding: the packed path (attention_varlen)
    for inputs, keep in ((dict(input_ids=ids), slice(None)), (dict(input_ids=ids, attention_mask=mask), mask.bool())):
        for m in models.values():
            m.zero_grad()
        logits = {k: m(**inputs).logits for k, m in models.items()}
        got, base = _err(logits[name][keep], logits["fp32"][keep]), _err(logits["eager"][keep], logits["fp32"][keep])
        assert got <= 2 * base + 1e-3, (got, base)
        for m_logits in logits.values():
            m_logits[keep].float().logsumexp(-1).mean().backward()
        for (pname, p32), p_eager, p_cute in zip(
            models["fp32"].named_parameters(), models["eager"].parameters(), models[name].parameters()
        ):
            got, base = _err(p_cute.grad, p32.grad), _err(p_eager.grad, p32.grad)
            assert got <= 2 * base + 1e-4, (pname, got, base)


def test_transformers_masked_decoding_captures_in_a_cuda_graph(monkeypatch):
    """One query per row with a materialised 4D bool mask (a static cache's decoding step) runs on the KV-cache
    forward with page tables built on the device: it captures in a CUDA graph, and replays follow new mask contents
    (left padding, a gap, a row of one key) and new cache values, against fp32 SDPA with the same mask. (Pages of
    one slot are the sm80 family's gathers: the family is left to the router, not forced to sm90.)"""
    from cute_flash.integrations import transformers as cft
    from cute_flash.testing import capture_graph

    monkeypatch.delenv("CUTE_FLASH_ARCH", raising=False)

    b, h, hkv, sk, d = 3, 8, 2, 300, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    mask = torch.zeros(b, 1, 1, sk, dtype=torch.bool, device="cuda")
    module = torch.nn.Module()

    def set_mask(spans, gap=None):
        mask.zero_()
        for i, (lo, hi) in enumerate(spans):
            mask[i, 0, 0, lo:hi] = True
        if gap is not None:
            mask[gap[0], 0, 0, gap[1] : gap[2]] = False

    def want():
        kk, vv = (x.float().repeat_interleave(h // hkv, 1) for x in (k, v))
        return F.scaled_dot_product_attention(q.float(), kk, vv, attn_mask=mask, scale=0.1).transpose(1, 2)

    def step():
        return cft.attention_forward(module, q, k, v, mask, scaling=0.1)[0]

    set_mask([(0, 300), (50, 200), (10, 150)])
    torch.testing.assert_close(step().float(), want(), atol=1e-2, rtol=0)  # eager: the same path (and its kernels)
    graph, out = capture_graph(step)
    for spans, gap in [([(5, 250), (0, 300), (0, 20)], (1, 40, 60)), ([(0, 1), (299, 300), (100, 299)], None)]:
        set_mask(spans, gap)
        k.normal_(generator=g)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), want(), atol=1e-2, rtol=0)

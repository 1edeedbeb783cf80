"""attention_with_kvcache under torch.compile on the CPU: one custom op (cute_flash::kvcache_fwd) in a full graph,
the caches and out mutated in place as in an eager call, results equal to the eager call's and to the float64
reference; a fake KV-cache backend computes each launch with the reference and appends with torch."""

from __future__ import annotations

import pytest
import torch

import cute_flash
from cute_flash import kvcache, validation
from cute_flash.core import device
from cute_flash.reference import kvcache_reference


class _ReferenceKvCache:
    name = "fake"
    kvcache = True

    def kvcache_splits(self, problem, sm_count):
        return 1

    def kvcache_launcher(self, problem, device, num_splits):
        def launch(t):
            p = problem
            res = kvcache_reference(
                t.q, t.k_cache, t.v_cache, cache_seqlens=t.seqlens_k, page_table=t.page_table,
                cu_seqlens_q=t.cu_seqlens_q, max_seqlen_q=p.seqlen_q if p.packed_q else None,
                softmax_scale=p.softmax_scale, window_size=(p.mask.left, p.mask.right), softcap=p.softcap,
                learnable_sink=t.sink, return_lse=True,
            )  # fmt: skip
            t.out.copy_(res.out)
            t.lse.copy_(res.lse)

        return launch


def _append(k_new, v_new, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, seqlens_k, k_descale, v_descale,
            max_new):  # fmt: skip
    """The append kernel's contract for a dense cache and dense new tokens (b, s_new, h_kv, d)."""
    for b in range(k_new.shape[0]):
        start = int(cache_seqlens[b])
        k_cache[b, start : start + k_new.shape[1]] = k_new[b]
        v_cache[b, start : start + v_new.shape[1]] = v_new[b]
    seqlens_k.copy_(cache_seqlens + k_new.shape[1])


@pytest.fixture
def backend(monkeypatch):
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    fake = _ReferenceKvCache()
    monkeypatch.setattr(device, "route", lambda spec, t, backward=False, deterministic=False: fake)
    monkeypatch.setattr(kvcache, "_append_kernel", lambda args, p, dev: _append if args.k_new is not None else None)
    kvcache._plans.clear()
    torch._dynamo.reset()
    yield fake
    kvcache._plans.clear()
    torch._dynamo.reset()


def _inputs(b=3, sq=2, h=8, hkv=2, d=64, cache=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g).bfloat16()
    k = torch.randn(b, cache, hkv, d, generator=g).bfloat16()
    v = torch.randn(b, cache, hkv, d, generator=g).bfloat16()
    lens = torch.tensor([5, 17, 30][:b], dtype=torch.int32)
    k_new = torch.randn(b, sq, hkv, d, generator=g).bfloat16()
    v_new = torch.randn(b, sq, hkv, d, generator=g).bfloat16()
    return q, k, v, lens, k_new, v_new


@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
def test_a_decoding_step_compiles_into_one_graph(backend, compile_backend):
    def step(q, k, v, lens, k_new, v_new):
        out, lse = cute_flash.attention_with_kvcache(
            q, k, v, cache_seqlens=lens, k_new=k_new, v_new=v_new, softcap=20.0, window_size=(11, None),
            return_lse=True,
        )  # fmt: skip
        return out * 2, lse

    q, k, v, lens, k_new, v_new = _inputs()
    k_eager, v_eager = k.clone(), v.clone()
    want_out, want_lse = step(q, k_eager, v_eager, lens, k_new, v_new)
    compiled = torch.compile(step, fullgraph=True, backend=compile_backend)
    got_out, got_lse = compiled(q, k, v, lens, k_new, v_new)
    torch.testing.assert_close(got_out, want_out)
    torch.testing.assert_close(got_lse, want_lse)
    assert torch.equal(k, k_eager) and torch.equal(v, v_eager)  # the appended rows landed in the caller's caches
    ref = kvcache_reference(q, k_eager, v_eager, cache_seqlens=lens + 2, softcap=20.0, window_size=(11, None))
    torch.testing.assert_close(got_out.double(), 2 * ref.out, atol=2e-2, rtol=2e-2)


def test_a_preallocated_out_is_written_in_place_under_compile(backend):
    q, k, v, lens, _, _ = _inputs(sq=1)
    out = torch.empty(3, 1, 8, 64, dtype=torch.bfloat16)

    def step(q, k, v, lens, out):
        return cute_flash.attention_with_kvcache(q, k, v, cache_seqlens=lens, out=out)

    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, lens, out)
    want = cute_flash.attention_with_kvcache(q, k, v, cache_seqlens=lens)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(got, want)


def test_malformed_calls_raise_while_tracing(backend):
    q, k, v, lens, _, _ = _inputs()

    def step(q, k, v, lens):
        return cute_flash.attention_with_kvcache(q, k, v, cache_seqlens=lens.long())

    with pytest.raises(Exception, match="cache_seqlens must be an int32"):
        torch.compile(step, fullgraph=True, backend="eager")(q, k, v, lens)


def test_the_op_has_a_consistent_schema(backend):
    q, k, v, lens, _, _ = _inputs(sq=1)
    out = torch.empty(3, 1, 8, 64, dtype=torch.bfloat16)
    args = (q, k, v, lens, None, None, None, None, None, True, None, None, 0, 0.0, None, None, None, 0, out)
    torch.library.opcheck(torch.ops.cute_flash.kvcache_fwd, args, test_utils=("test_schema", "test_faketensor"))


def test_a_changing_max_seqlen_q_shares_one_dynamic_graph(backend):
    """Chunked prefill / speculative decoding change max_seqlen_q every step: a SymInt op argument, so after the first
    (static) graph one dynamic graph serves every value (an int argument recompiled per value and, with
    fullgraph=True, failed at torch's recompile limit)."""
    from torch._dynamo.utils import counters

    def step(q, k, v, lens, cu, mq):
        return cute_flash.attention_with_kvcache(q, k, v, cache_seqlens=lens, cu_seqlens_q=cu, max_seqlen_q=mq)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    k, v = (torch.randn(3, 64, 2, 64).to(torch.bfloat16) for _ in range(2))
    lens = torch.tensor([20, 30, 40], dtype=torch.int32)
    for qlens in ([1, 2, 3], [2, 2, 4], [1, 5, 1], [3, 3, 6], [2, 7, 1], [1, 1, 8], [4, 4, 9], [2, 2, 10], [1, 1, 11]):
        cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(sum(qlens), 8, 64).to(torch.bfloat16)
        torch.testing.assert_close(compiled(q, k, v, lens, cu, max(qlens)), step(q, k, v, lens, cu, max(qlens)))
    assert counters["stats"]["unique_graphs"] <= 3

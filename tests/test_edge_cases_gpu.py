"""GPU: inputs at the edges of what `attention` / `attention_varlen` take, on Hopper's default families: tensors on a
GPU other than the current one, decode-like shapes (a few queries against tens of thousands of keys, deterministic
too), empty batches / heads / keys with gradients, and odd layouts (a misaligned base, an expanded batch) through the
backward. Each result against the float64 reference by FlashAttention's rule (cute_flash.testing).

Run: python -m pytest -q tests/test_edge_cases_gpu.py (the other-GPU case needs two GPUs)
"""

from __future__ import annotations

import pytest
import torch

import cute_flash
from cute_flash.core import plan
from cute_flash.testing import check_backward, check_forward, random_qkv


def _plan(q, k, v, kw):
    """The call core's plan of attention(q, k, v, **kw) (cached: the one a warm call runs)."""
    call = dict(causal=kw.get("causal", False), softmax_scale=kw.get("softmax_scale"))
    call.update(window_size=kw.get("window_size", (None, None)), deterministic=False, softcap=0.0, learnable_sink=None)
    return plan.of_call(q, k, v, **call)


pytestmark = [pytest.mark.sm90, pytest.mark.xdist_group("edge-cases")]


def _train(q, k, v, seed=0, **kw):
    out, lse = cute_flash.attention(q, k, v, return_lse=True, **kw)
    g = torch.Generator(device=q.device).manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, device=q.device).to(out.dtype)
    return out, lse, dout, torch.autograd.grad(out, (q, k, v), dout)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_inputs_on_a_gpu_other_than_the_current_one():
    """Kernels compiled and first launched on cuda:0 run on cuda:1 while cuda:0 stays current (the module is loaded
    into each device's context), dense and packed, forward and backward: cuda:0's forward bit for bit (on two GPUs of
    one model) and the rule against float64; the packed gradients finite."""
    assert torch.cuda.current_device() == 0
    kw = dict(causal=True)
    q0, k0, v0 = random_qkv(2, 300, 333, 4, 2, 128, seed=1, requires_grad=True, device="cuda:0")
    out0, lse0, dout0, grads0 = _train(q0, k0, v0, **kw)
    q1, k1, v1 = (t.detach().to("cuda:1").requires_grad_(True) for t in (q0, k0, v0))
    out1, lse1, dout1, grads1 = _train(q1, k1, v1, **kw)
    assert torch.cuda.current_device() == 0 and out1.device == torch.device("cuda:1")
    if torch.cuda.get_device_name(0) == torch.cuda.get_device_name(1):  # the same kernels on the same model
        torch.testing.assert_close(out1.cpu(), out0.cpu(), atol=0, rtol=0)
    check_forward(q1, k1, v1, out1, lse1, **kw)
    check_backward(q1, k1, v1, dout1, grads1, **kw)
    # Packed sequences on cuda:1.
    lens = [37, 0, 250, 13]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda:1")
    pq, pk, pv = (t.detach()[0, :300].to("cuda:1").requires_grad_(True) for t in (q0, k0, v0))
    pout = cute_flash.attention_varlen(pq, pk, pv, cu, cu, 250, 250, causal=True)
    pgrads = torch.autograd.grad(pout, (pq, pk, pv), torch.ones_like(pout))
    assert pout.device == torch.device("cuda:1") and all(torch.isfinite(g).all() for g in pgrads)
    for b in range(len(lens)):
        s, e = int(cu[b]), int(cu[b + 1])
        if e > s:
            check_forward(pq[None, s:e], pk[None, s:e], pv[None, s:e], pout[None, s:e], causal=True)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("seqlen_q", [1, 7])
def test_decode_like_shapes(seqlen_q, deterministic):
    """A few queries against 40k keys (one query tile, hundreds of key tiles: the deterministic dQ sums wait on a
    long chain of semaphores)."""
    q, k, v = random_qkv(1, seqlen_q, 40_000, 8, 2, 128, seed=seqlen_q, requires_grad=True)
    kw = dict(causal=True)
    out, lse, dout, grads = _train(q, k, v, deterministic=deterministic, **kw)
    check_forward(q, k, v, out, lse, **kw)
    check_backward(q, k, v, dout, grads, **kw)


@pytest.mark.parametrize("head_major", [False, True], ids=["seq_major", "head_major"])
@pytest.mark.parametrize(
    "b,sk,h,hkv,d,dv,kw",
    [
        (5, 4099, 32, 8, 128, 128, dict(causal=True)),
        (9, 40_000, 16, 1, 128, 128, dict()),
        (12, 777, 12, 4, 64, 64, dict(causal=True, window_size=(300, None))),
        (17, 2048, 8, 2, 256, 256, dict(causal=True, window_size=(4000, 0))),
        (9, 1000, 16, 2, 96, 96, dict(causal=True)),
        (17, 513, 8, 4, 192, 128, dict(causal=True)),
    ],
    ids=["gqa4_d128", "mqa_40k", "d64_window", "d256_wide_window", "d96", "d192x128"],
)
def test_decoding_with_packed_query_heads(b, sk, h, hkv, d, dv, kw, head_major):
    """One query row per sequence under GQA / MQA runs as one problem per KV head whose rows are its query heads
    (cute_flash/decode.py; batch x heads above an H100's 132 SMs, where it applies): out and lse against float64,
    q / k / v in the layout they come in (transformers' cache is head-major), both 16-bit dtypes in the d128 case."""
    for dtype in (torch.bfloat16, torch.float16) if d == 128 and hkv == 8 else (torch.bfloat16,):
        q, k, v = random_qkv(b, 1, sk, h, hkv, d, dv, dtype=dtype, seed=sk)
        if head_major:
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        assert _plan(q, k, v, kw).decode_keys
        out, lse = cute_flash.attention(q, k, v, return_lse=True, **kw)
        check_forward(q, k, v, out, lse, **kw)
    # torch.compile's custom op packs the same way: bit for bit the eager result.
    torch._dynamo.reset()  # (one lambda per case: its code object would hit dynamo's recompile limit)
    compiled = torch.compile(lambda q, k, v: cute_flash.attention(q, k, v, return_lse=True, **kw), fullgraph=True)
    for got, want in zip(compiled(q, k, v), (out, lse)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def _runs_split(q, k, v, kw) -> bool:
    """Whether a warm eager call of these arguments splits its keys: decoding under GQA on the KV-cache forward (its
    split count), else the launcher it runs (the packed problem's under packed decoding) is the split one."""
    from cute_flash import compile_cache, decode
    from cute_flash.arch import split_kv
    from cute_flash.arch.base import SplitForward
    from cute_flash.core import device

    planned = _plan(q, k, v, kw)
    if planned.decode_kvcache:
        kv = decode.kvcache_problem(planned.problem, planned.decode_keys)
        backend = device.route(kv.spec, q, backward=False)
        return split_kv.auto_kvcache_splits(backend, kv, compile_cache.sm_count(q.device)) > 1
    return isinstance((planned.decode_plan or planned).launch, SplitForward)


@pytest.mark.parametrize("head_major", [False, True], ids=["seq_major", "head_major"])
@pytest.mark.parametrize(
    "b,sq,sk,h,hkv,d,dv,kw",
    [
        (1, 1, 8192, 32, 8, 128, 128, dict()),
        (2, 1, 4099, 8, 8, 128, 128, dict(causal=True)),
        (1, 5, 3001, 4, 1, 64, 64, dict(causal=True)),
        (3, 1, 3000, 16, 2, 256, 256, dict(causal=True, window_size=(600, None))),
        (1, 64, 20_000, 2, 2, 96, 96, dict(window_size=(5000, 100))),
        (2, 1, 2050, 8, 4, 192, 128, dict(causal=True)),
        (1, 128, 2048, 4, 2, 128, 128, dict(causal=True, softmax_scale=0.5)),
        (4, 3, 1777, 4, 4, 128, 128, dict(window_size=(900, 0))),
    ],
    ids=[
        "gqa_8k",
        "mha_causal",
        "mqa_5rows_d64",
        "d256_window",
        "d96_64rows_window",
        "d192x128",
        "full_tile",
        "3rows_window",
    ],
)
@pytest.mark.parametrize("arch", [None, "sm80"], ids=["default", "sm80"])
def test_split_key_decoding(b, sq, sk, h, hkv, d, dv, kw, head_major, arch, monkeypatch):
    """Few query rows against many keys on few CTAs: the keys are split over CTAs and the partial results combined
    (arch/split_kv.py): out and lse against float64 (both 16-bit dtypes at d128), the split launcher really
    taken, rows whose window misses a split's keys (causal with several rows, windows), torch.compile's custom op
    bit for bit the eager result, and gradients through a split forward; on Hopper's default family and on the
    sm80 family (forced: Ampere's kernels, which run on Hopper too)."""
    if arch is not None:
        monkeypatch.setenv("CUTE_FLASH_ARCH", arch)

    for dtype in (torch.bfloat16, torch.float16) if d == 128 else (torch.bfloat16,):
        q, k, v = random_qkv(b, sq, sk, h, hkv, d, dv, dtype=dtype, seed=sk + sq)
        if head_major:
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        out, lse = cute_flash.attention(q, k, v, return_lse=True, **kw)
        assert _runs_split(q, k, v, kw)
        check_forward(q, k, v, out, lse, **kw)
        assert torch.equal(cute_flash.attention(q, k, v, **kw), out)  # the no-grad fast path agrees
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: cute_flash.attention(q, k, v, return_lse=True, **kw), fullgraph=True)
    for got, want in zip(compiled(q, k, v), (out, lse)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    if dv == d:
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
        out, lse, dout, grads = _train(q, k, v, **kw)
        check_forward(q, k, v, out, lse, **kw)
        check_backward(q, k, v, dout, grads, **kw)


def test_split_key_decoding_in_a_cuda_graph():
    """A split decoding call (partials from torch's allocator, two launches) captured and replayed with new
    queries: the eager result of each."""
    q, k, v = random_qkv(1, 1, 6000, 16, 4, 128, seed=11)
    cute_flash.attention(q, k, v, causal=True)  # warm: kernels built and loaded outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cute_flash.attention(q, k, v, causal=True)
    for seed in (1, 2):
        q.copy_(random_qkv(1, 1, 6000, 16, 4, 128, seed=seed)[0])
        graph.replay()
        torch.testing.assert_close(out, cute_flash.attention(q, k, v, causal=True), atol=0, rtol=0)
        check_forward(q, k, v, out, causal=True)


@pytest.mark.parametrize(
    "shape",
    [(0, 64, 64, 4, 2), (2, 64, 0, 4, 2), (2, 0, 64, 4, 2), (2, 64, 64, 0, 1)],
    ids=["batch0", "keys0", "queries0", "heads0"],
)
def test_empty_dense_shapes_with_gradients(shape):
    b, sq, sk, h, hkv = shape
    q, k, v = random_qkv(b, sq, sk, h, hkv, 128, seed=3, requires_grad=True)
    out, lse = cute_flash.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (b, sq, h, 128) and lse.shape == (b, h, sq)
    assert torch.count_nonzero(out) == 0 and bool(torch.isneginf(lse).all())
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out), allow_unused=True)
    for g, t in zip(grads, (q, k, v)):
        assert g is None or (g.shape == t.shape and torch.count_nonzero(g) == 0)


def test_empty_packed_batches_with_gradients():
    k = torch.randn(5, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(5, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q = torch.randn(0, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    none = torch.zeros(1, dtype=torch.int32, device="cuda")  # batch 0
    out = cute_flash.attention_varlen(q, k[:0], v[:0], none, none, 0, 0)
    assert out.shape == (0, 4, 128)
    cu_q = torch.tensor([0, 0, 0], dtype=torch.int32, device="cuda")  # two sequences without queries
    cu_k = torch.tensor([0, 2, 5], dtype=torch.int32, device="cuda")
    out = cute_flash.attention_varlen(q, k, v, cu_q, cu_k, 0, 3, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert [g.shape for g in grads] == [t.shape for t in (q, k, v)]
    assert all(torch.count_nonzero(g) == 0 for g in grads)


def test_misaligned_and_expanded_inputs_through_the_backward():
    """q starting 2 bytes past an aligned address (copied for the kernels), k / v expanded over the batch (stride 0,
    copied): gradients come back in the inputs' own shapes, summed over the expanded batch."""
    base = random_qkv(2, 200, 300, 4, 2, 128, seed=5)[0]
    flat = torch.empty(base.numel() + 1, device="cuda", dtype=base.dtype)
    q = flat[1:].view_as(base).copy_(base).requires_grad_(True)
    assert q.data_ptr() % 16 != 0
    k1, v1 = (t.requires_grad_(True) for t in random_qkv(1, 200, 300, 4, 2, 128, seed=6)[1:])
    k, v = k1.expand(2, -1, -1, -1), v1.expand(2, -1, -1, -1)
    kw = dict(causal=True)
    out, lse = cute_flash.attention(q, k, v, return_lse=True, **kw)
    g = torch.Generator(device="cuda").manual_seed(7)
    dout = torch.randn(out.shape, generator=g, device="cuda").to(out.dtype)
    dq, dk1, dv1 = torch.autograd.grad(out, (q, k1, v1), dout)
    check_forward(q, k, v, out, lse, **kw)
    # The reference's gradients for the expanded k / v, summed over the batch like autograd's.
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k1, v1)]
    from cute_flash.reference import attention_reference

    ref = attention_reference(leaves[0], leaves[1].expand(2, -1, -1, -1), leaves[2].expand(2, -1, -1, -1), **kw)
    want = torch.autograd.grad(ref, leaves, dout.double())
    for got, w in zip((dq, dk1, dv1), want):
        assert got.shape == w.shape
        torch.testing.assert_close(got.double(), w, atol=5e-2, rtol=5e-2)

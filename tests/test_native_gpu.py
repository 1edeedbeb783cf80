"""The eager forward's C++ call path on a GPU (cute_flash/native.py): a warm no-grad call served by it equals the
Python path's bit for bit (sm90 and the sm80 family forced, masks, GQA, head dims, layouts, fp16 / bf16), launches
on torch's current stream, is captured by CUDA graphs, and follows the call to another GPU than the current one.

Run: python -m pytest -q tests/test_native_gpu.py
"""

from __future__ import annotations

import pytest
import torch

import cute_flash
from cute_flash import native
from cute_flash.core import plan
from cute_flash.testing import check_forward, random_qkv

pytestmark = [pytest.mark.sm90, pytest.mark.xdist_group("native")]


@pytest.fixture
def counted(monkeypatch):
    """The C++ path's library, and a list that grows by one for every call the Python path plans."""
    lib = native.library()
    assert lib is not None, "the C++ call path did not build on this machine (see the warning)"
    plans = []
    real = plan.dense
    monkeypatch.setattr(plan, "dense", lambda *a: plans.append(a) or real(*a))
    return lib, plans


CASES = [
    # (batch, seqlen_q, seqlen_k, heads, heads_kv, d, dv, causal, window, dtype, layout, arch)
    (2, 300, 333, 8, 2, 128, 128, True, (None, None), torch.bfloat16, "bshd", None),
    (1, 128, 128, 8, 8, 128, 128, True, (None, None), torch.bfloat16, "bshd", None),
    (2, 257, 1000, 4, 4, 64, 64, False, (64, 0), torch.float16, "bshd", None),
    (1, 190, 190, 6, 2, 256, 256, True, (None, None), torch.bfloat16, "bhsd", None),
    (3, 77, 500, 4, 1, 96, 96, False, (None, None), torch.float16, "bhsd", None),
    (2, 129, 129, 4, 2, 192, 128, True, (None, None), torch.bfloat16, "bshd", None),
    (2, 200, 300, 4, 2, 128, 128, True, (32, 8), torch.bfloat16, "bshd", "sm80"),
    # decoding: packed GQA with split keys (head-major cache, as transformers keeps it), the keys of a window only,
    # split without packing (MHA, 3 rows), packed without a split (80 CTAs)
    (1, 1, 8192, 32, 8, 128, 128, True, (None, None), torch.bfloat16, "bhsd", None),
    (2, 1, 3000, 16, 2, 64, 64, False, (700, None), torch.float16, "bshd", None),
    (2, 3, 2000, 4, 4, 256, 256, True, (None, None), torch.bfloat16, "bshd", None),
    (40, 1, 1000, 8, 2, 128, 128, True, (None, None), torch.bfloat16, "bhsd", None),
    (1, 1, 8192, 32, 8, 128, 128, True, (None, None), torch.bfloat16, "bhsd", "sm80"),  # the sm80 family's split
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"b{c[0]}-sq{c[1]}-d{c[5]}-{c[10]}-{c[11] or 'default'}-c{int(c[7])}-w{c[8]}"
)
def test_the_cpp_path_equals_the_python_path(case, counted, monkeypatch):
    lib, plans = counted
    b, sq, sk, h, hkv, d, dv, causal, window, dtype, layout, arch = case
    if arch is not None:
        monkeypatch.setenv("CUTE_FLASH_ARCH", arch)
    q, k, v = random_qkv(b, sq, sk, h, hkv, d, dv, dtype=dtype, seed=sq)
    if layout == "bhsd":  # head-major memory, seen through a (b, s, h, d) view
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    kw = dict(causal=causal, window_size=window)
    with torch.no_grad():
        first = cute_flash.attention(q, k, v, **kw)  # the Python path; registers the signature
        n = len(plans)
        assert n == 1
        second = cute_flash.attention(q, k, v, **kw)
    # (the sm80 family's KV-cache forward, which decoding under GQA takes there, has no bound form: Python's)
    if d == dv and not (sq == 1 and h != hkv and arch == "sm80"):
        assert len(plans) == n, "the warm call did not take the C++ path"
    else:  # out is not shaped like q: the Python path's (registered so)
        assert len(plans) == n + 1
    assert torch.equal(first, second)
    out, lse = cute_flash.attention(q, k, v, return_lse=True, **kw)
    assert torch.equal(out, second)
    check_forward(q, k, v, second, lse, **kw)


@pytest.mark.parametrize("window", [(None, None), (300, None)])
def test_decoding_into_a_growing_cache_equals_a_fresh_plan(window):
    """Decoding steps against a head-major cache that grows by a token per call (transformers' DynamicCache): the
    calls after the first plan from the first one's family (core/plan.py) and the warm ones take the C++ path; every
    output equals a freshly planned call's bit for bit."""
    b, h, hkv, d = 4, 16, 4, 64
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(2, b, hkv, 900, d, device="cuda", dtype=torch.bfloat16)
    steps = [(cache[0, :, :, :s].transpose(1, 2), cache[1, :, :, :s].transpose(1, 2)) for s in (500, 501, 502, 899)]
    steps = [(k.contiguous(), v) for k, v in steps]  # (k (b, s, h, d) contiguous, v head-major: strides scale with s)
    kw = dict(causal=True, window_size=window)
    with torch.no_grad():
        served = [[cute_flash.attention(q, k, v, **kw) for _ in range(2)] for k, v in steps]
        for (k, v), outs in zip(steps, served):
            plan.clear_call_cache()
            fresh, lse = cute_flash.attention(q, k, v, return_lse=True, **kw)
            assert all(torch.equal(out, fresh) for out in outs)
            check_forward(q, k, v, fresh, lse, **kw)


def test_the_cpp_path_launches_on_the_current_stream(counted):
    lib, plans = counted
    q, k, v = random_qkv(2, 512, 512, 8, 2, 128, seed=1)
    q2 = torch.randn_like(q)
    with torch.no_grad():
        expected = cute_flash.attention(q2, k, v, causal=True)
        torch.cuda.synchronize()
        n = len(plans)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # the copy below lands long after the call returns to the host
            q.copy_(q2)
            out = cute_flash.attention(q, k, v, causal=True)  # on `side`, after the copy
        side.synchronize()
    assert len(plans) == n
    assert torch.equal(out, expected)


def test_the_cpp_path_is_captured_by_cuda_graphs(counted):
    lib, plans = counted
    q, k, v = random_qkv(2, 384, 640, 8, 2, 128, seed=2)
    with torch.no_grad():
        cute_flash.attention(q, k, v, causal=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm on a side stream, as torch's graph docs do
            cute_flash.attention(q, k, v, causal=True)
        torch.cuda.current_stream().wait_stream(side)
        n = len(plans)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = cute_flash.attention(q, k, v, causal=True)
        assert len(plans) == n
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, cute_flash.attention(q, k, v, causal=True))


def test_out_is_an_ordinary_tensor_of_the_caching_allocator(counted):
    """record_stream on the C++ path's out keeps its memory from reuse while another stream still reads it (an out
    made through DLPack would not be the allocator's own: record_stream would silently do nothing)."""
    lib, plans = counted
    q, k, v = random_qkv(1, 256, 256, 8, 8, 128, seed=4)
    with torch.no_grad():
        cute_flash.attention(q, k, v)
        n = len(plans)
        out = cute_flash.attention(q, k, v)
        assert len(plans) == n and out.is_contiguous()
        expected = out.float().sum()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)
            seen = out.float().sum()
        out.record_stream(side)
        ptr = out.data_ptr()
        del out
        junk = torch.zeros(256 * 8 * 128, dtype=torch.bfloat16, device="cuda")
        assert junk.data_ptr() != ptr  # the block stays out's until the side stream's work is done
        side.synchronize()
    assert seen.item() == expected.item()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_call_on_another_gpu_than_the_current_one(counted):
    lib, plans = counted
    q, k, v = random_qkv(1, 256, 256, 4, 4, 128, device="cuda:1", seed=3)
    with torch.no_grad():
        a = cute_flash.attention(q, k, v)
        b = cute_flash.attention(q, k, v)  # current device 0: the Python path's device guard
        with torch.cuda.device(1):
            c = cute_flash.attention(q, k, v)  # the C++ path
    assert a.device == b.device == c.device == q.device
    assert torch.equal(a, b) and torch.equal(a, c)

"""cute_flash inside torch on a GPU (issue 15): torch.compile with inductor (inference and a training step,
fullgraph=True), CUDA-graph capture and replay, autocast of float32 inputs, and torch.library.opcheck of the custom
ops on real tensors. Results are compared with eager cute_flash (bitwise where the same kernels run) and with the
float64 reference by FlashAttention's rule. Needs a Hopper GPU (the sm90 kernels).

Run: python -m pytest -q tests/test_torch_integration_gpu.py
"""

from __future__ import annotations

import pytest
import torch

import cute_flash
from cute_flash.testing import check_backward, check_forward, random_qkv

pytestmark = [pytest.mark.sm90, pytest.mark.xdist_group("torch-integration")]


def _inputs(grad=True, dtype=torch.bfloat16, seed=0):
    q, k, v = random_qkv(2, 300, 333, 8, 2, 128, dtype=dtype, seed=seed)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def test_torch_compile_inference_and_training_fullgraph():
    torch._dynamo.reset()

    def step(q, k, v, w):
        out = cute_flash.attention(q, k, v, causal=True)
        return (out.float() * w).sum(), out

    q, k, v = _inputs()
    w = torch.randn(2, 300, 8, 128, device="cuda")
    compiled = torch.compile(step, fullgraph=True)  # inductor; a graph break would raise
    with torch.no_grad():
        _, out_c = compiled(q, k, v, w)
        _, out_e = step(q, k, v, w)
    torch.testing.assert_close(out_c, out_e, atol=0, rtol=0)
    loss_c, _ = compiled(q, k, v, w)
    grads_c = torch.autograd.grad(loss_c, (q, k, v))
    loss_e, _ = step(q, k, v, w)
    grads_e = torch.autograd.grad(loss_e, (q, k, v))
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)  # dQ's atomic order may differ
    check_backward(q, k, v, (w / 1).to(torch.bfloat16), grads_c, causal=True)


def test_torch_compile_training_through_lse():
    """A loss of out and lse (a z-loss-like term) under inductor: lse's gradient reaches the backward op (dlse)."""
    torch._dynamo.reset()

    def step(q, k, v, w, wl):
        out, lse = cute_flash.attention(q, k, v, causal=True, return_lse=True)
        return (out.float() * w).sum() + (lse * wl).sum()

    q, k, v = _inputs(seed=3)
    torch.manual_seed(3)
    w = torch.randn(2, 300, 8, 128, device="cuda")
    wl = torch.randn(2, 8, 300, device="cuda")
    grads_c = torch.autograd.grad(torch.compile(step, fullgraph=True)(q, k, v, w, wl), (q, k, v))
    grads_e = torch.autograd.grad(step(q, k, v, w, wl), (q, k, v))
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    check_backward(q, k, v, w.to(torch.bfloat16), grads_c, dlse=wl, causal=True)


def test_cuda_graph_capture_and_replay():
    q, k, v = _inputs(grad=False)
    static = [t.clone() for t in (q, k, v)]
    cute_flash.attention(*static, causal=True)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cute_flash.attention(*static, causal=True)
    for seed in (1, 2):
        fresh = _inputs(grad=False, seed=seed)
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, cute_flash.attention(*fresh, causal=True), atol=0, rtol=0)


def test_autocast_casts_float32_inputs():
    q, k, v = (t.float() for t in _inputs(grad=False))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = cute_flash.attention(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    ref = cute_flash.attention(*(t.to(torch.bfloat16) for t in (q, k, v)), causal=True)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    qg = q.clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        o = cute_flash.attention(qg, k, v, causal=True)
    o.float().sum().backward()
    assert qg.grad is not None and qg.grad.dtype == torch.float32


def test_opcheck_on_the_gpu():
    q, k, v = (t.detach() for t in _inputs(grad=False))
    args = (q, k, v, 128**-0.5, "causal", 1 << 30, 0, False)
    torch.library.opcheck(torch.ops.cute_flash.fwd.default, args)
    out, lse = torch.ops.cute_flash.fwd(*args)
    check_forward(q, k, v, out, lse, causal=True)
    dout = torch.randn_like(out)
    torch.library.opcheck(
        torch.ops.cute_flash.bwd.default, (dout, q, k, v, out, lse, 128**-0.5, "causal", 1 << 30, 0, False)
    )

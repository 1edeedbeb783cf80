"""cute_flash's custom ops (cute_flash/ops.py) without a GPU: meta tensors run the fake implementations, so the
shapes, autograd wiring and torch.compile tracing of `cute_flash.attention` (which takes the ops only under
torch.compile) are checked on the CPU. The GPU side
(the kernels inside the ops, inductor, CUDA graphs, autocast, opcheck on real tensors) is in
tests/test_torch_integration_gpu.py."""

from __future__ import annotations

import pytest
import torch

import cute_flash
from cute_flash import validation


@pytest.fixture(autouse=True)
def meta_is_gpu(monkeypatch):
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "meta"))


def _qkv(sq=100, sk=120, h=4, hkv=2, d=64, dv=64, dtype=torch.bfloat16, grad=True):
    shapes = ((2, sq, h, d), (2, sk, hkv, d), (2, sk, hkv, dv))
    return tuple(torch.empty(s, device="meta", dtype=dtype).requires_grad_(grad) for s in shapes)


def test_ops_are_registered_with_their_schemas():
    assert "softmax_scale" in str(torch.ops.cute_flash.fwd.default._schema)
    assert "deterministic" in str(torch.ops.cute_flash.bwd.default._schema)


def test_fake_outputs_and_gradients_have_the_documented_shapes():
    q, k, v = _qkv(dv=128)
    out, lse = torch.ops.cute_flash.fwd(q, k, v, 0.125, "causal", 1 << 30, 0, False)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (
        (2, 100, 4, 128),
        torch.bfloat16,
        (2, 4, 100),
        torch.float32,
    )
    assert out.requires_grad and lse.requires_grad  # lse is differentiable, as in eager mode
    grads = torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)
    assert [g.shape for g in grads] == [t.shape for t in (q, k, v)]
    # A loss of lse alone, and of both (the backward op takes lse's gradient; out's is zeros when unused).
    for value in (lse.sum(), out.float().sum() + lse.square().sum()):
        grads = torch.autograd.grad(value, (q, k, v), retain_graph=True)
        assert [g.shape for g in grads] == [t.shape for t in (q, k, v)]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_traces_attention_without_a_graph_break(backend):
    torch._dynamo.reset()

    def loss(q, k, v):
        out = cute_flash.attention(q, k, v, causal=True, window_size=(32, None), softmax_scale=0.1)
        return out.float().square().mean()

    q, k, v = _qkv()
    compiled = torch.compile(loss, fullgraph=True, backend=backend)  # fullgraph: a graph break would raise
    value = compiled(q, k, v)
    grads = torch.autograd.grad(value, (q, k, v))
    assert value.shape == () and [g.shape for g in grads] == [t.shape for t in (q, k, v)]


def test_validation_still_runs_under_torch_compile():
    torch._dynamo.reset()
    q, k, v = _qkv()
    with pytest.raises(Exception, match="window_size"):
        torch.compile(lambda q, k, v: cute_flash.attention(q, k, v, window_size=(-1, 0)), fullgraph=True)(q, k, v)


def test_opcheck_on_fake_tensors():
    q, k, v = (t.detach() for t in _qkv(hkv=4))
    args = (q, k, v, 0.125, "causal", 1 << 30, 0, False)
    torch.library.opcheck(torch.ops.cute_flash.fwd.default, args, test_utils=("test_schema", "test_faketensor"))
    out, lse = torch.ops.cute_flash.fwd(*args)
    bargs = (torch.empty_like(out), q, k, v, out, lse, 0.125, "causal", 1 << 30, 0, False)
    torch.library.opcheck(torch.ops.cute_flash.bwd.default, bargs, test_utils=("test_schema", "test_faketensor"))
    with_dlse = (*bargs, None, None, None, 0, 0, torch.empty_like(lse))
    torch.library.opcheck(torch.ops.cute_flash.bwd.default, with_dlse, test_utils=("test_schema", "test_faketensor"))

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


# The ops' field arguments of a dense causal call, in core/fields.py's order: causal, softmax_scale, window_left,
# window_right, deterministic, softcap, learnable_sink, then the packed ones (None / 0).
def _fields(causal=True, scale=0.125, window=(None, None), deterministic=False, softcap=0.0, sink=None, packed=None):
    return (causal, scale, *window, deterministic, softcap, sink, *(packed or (None, None, None, 0, 0)))


def test_ops_are_registered_with_the_fields_schema():
    from cute_flash.core import fields

    for op in (torch.ops.cute_flash.fwd.default, torch.ops.cute_flash.bwd.default):
        names = [a.name for a in op._schema.arguments]
        assert [f.name for f in fields.CALL + fields.PACKED] == [
            n for n in names if n in {f.name for f in fields.CALL + fields.PACKED}
        ]
    assert [a.name for a in torch.ops.cute_flash.fwd.default._schema.arguments][-1] == "check_deterministic"
    assert len(torch.ops.cute_flash.bwd.default._schema.returns) == 4  # dq, dk, dv, dsink


def test_fake_outputs_and_gradients_have_the_documented_shapes():
    q, k, v = _qkv(dv=128)
    out, lse = torch.ops.cute_flash.fwd(q, k, v, *_fields(), False)
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


def test_a_float_argument_that_changes_between_calls_compiles_without_a_break():
    """Dynamo makes a float that changed between calls symbolic: validation's checks of the cap and the scale trace
    on it (fullgraph would raise on a break). A custom op's float argument specializes: each new value is one more
    graph (torch's recompile limit applies; pass a fixed cap / scale in loops)."""
    torch._dynamo.reset()
    step = torch.compile(lambda q, k, v, cap, scale: cute_flash.attention(q, k, v, softcap=cap, softmax_scale=scale),
                         fullgraph=True, backend="eager")  # fmt: skip
    q, k, v = _qkv(grad=False)
    for cap, scale in ((30.0, 0.2), (20.0, 0.3), (75.0, 0.1)):  # (75: a wide cap, another kernel at run time)
        assert step(q, k, v, cap, scale).shape == (2, 100, 4, 64)


def test_window_bounds_that_change_between_calls_share_a_graph():
    """Window bounds are SymInt arguments of the op: after the first call's static graph, one dynamic graph serves
    every other bound (an int argument would add an equality guard per value)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(lambda q, k, v, w: cute_flash.attention(q, k, v, window_size=(w, 0)), fullgraph=True,
                         backend="eager")  # fmt: skip
    q, k, v = _qkv(grad=False)
    for w in (5, 9, 17, 33, 40, 51):
        step(q, k, v, w)
    assert counters["stats"]["unique_graphs"] <= 2


@pytest.mark.parametrize(
    "kw,match",
    [(dict(window_size=(1.5, 0)), "window_size"), (dict(softcap=-1.0), "softcap"), (dict(softmax_scale=-1), "scale")],
)
def test_validation_still_runs_under_torch_compile(kw, match):
    torch._dynamo.reset()
    q, k, v = _qkv()
    with pytest.raises(Exception, match=match):
        torch.compile(lambda q, k, v: cute_flash.attention(q, k, v, **kw), fullgraph=True)(q, k, v)


def test_opcheck_on_fake_tensors():
    q, k, v = (t.detach() for t in _qkv(hkv=4))
    utils = ("test_schema", "test_faketensor")
    sink = torch.empty(4, device="meta")
    for fields in (_fields(), _fields(window=(-3, 5), softcap=30.0, sink=sink)):
        args = (q, k, v, *fields, False)
        torch.library.opcheck(torch.ops.cute_flash.fwd.default, args, test_utils=utils)
        out, lse = torch.ops.cute_flash.fwd(*args)
        for dlse in (None, torch.empty_like(lse)):
            bargs = (torch.empty_like(out), q, k, v, out, lse, dlse, *fields)
            torch.library.opcheck(torch.ops.cute_flash.bwd.default, bargs, test_utils=utils)
            dsink = torch.ops.cute_flash.bwd(*bargs)[3]
            assert dsink.shape == ((4,) if fields[6] is not None else (0,)) and dsink.dtype == torch.float32


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_traces_softcap_and_sinks_and_returns_the_sink_gradient(backend):
    torch._dynamo.reset()
    sink = torch.empty(4, device="meta", dtype=torch.bfloat16, requires_grad=True)

    def loss(q, k, v, sink):
        out = cute_flash.attention(q, k, v, window_size=(-2, 8), softcap=20.0, learnable_sink=sink)
        return out.float().square().mean()

    q, k, v = _qkv()
    value = torch.compile(loss, fullgraph=True, backend=backend)(q, k, v, sink)
    grads = torch.autograd.grad(value, (q, k, v, sink))
    assert [g.shape for g in grads] == [t.shape for t in (q, k, v, sink)] and grads[3].dtype == torch.bfloat16

"""cute-flash's forward and backward as torch custom ops (namespace `cute_flash`), so that `torch.compile` traces
`cute_flash.attention` and `cute_flash.attention_varlen` into its graph (no graph break, fullgraph=True works), CUDA
graphs capture them, and autograd reaches the backward through `register_autograd`. The public functions take the
ops only while torch.compile traces them (`torch.compiler.is_compiling()`); eager calls run the same steps without
the custom-op dispatch, whose host cost (hundreds of µs per call in torch 2.11) would dominate small problems.

    torch.ops.cute_flash.fwd(q, k, v, <the call's fields>, check_deterministic) -> (out, lse)
    torch.ops.cute_flash.bwd(dout, q, k, v, out, lse, dlse, <the call's fields>) -> (dq, dk, dv, dsink)

The call's fields are core/fields.py's CALL then PACKED, in that order and with those names: causal, softmax_scale,
window_left, window_right, deterministic, softcap, learnable_sink, then cu_seqlens_q, cu_seqlens_k, seqused_k,
max_seqlen_q, max_seqlen_k (None / 0 for a dense call). Dense: q (b, sq, h, d), k / v (b, sk, h_kv, d / dv), out
(b, sq, h, dv) in q's dtype, lse (b, h, sq) float32. Packed (with cu_seqlens_q): q (total_q, h, d), k / v (total_k,
h_kv, d / dv), out (total_q, h, dv), lse (h, total_q). dsink: (h,) float32 with learnable_sink, else an empty tensor.
One op pair for both keeps one autograd formula and one place where a trace meets the kernels.

The ops are the public functions' arguments as the caller gave them (validated while tracing, on tensor metadata);
inside, at run time, a call is planned (core/plan.py: the same cached validation and routing as an eager call) and
launched by the one forward / backward launcher (core/launch.py), which a trace never enters: under torch.compile the
fake implementations give the output shapes and dtypes. The FP8 path (forward only, with a GPU pre-pass) is not an
op: it runs eagerly (a graph break).
"""

from __future__ import annotations


import torch

from .core import fields, launch, plan
from .kernel_layout import kernel_view
from .problem import PackedSeqs
from .spec import op_window_bound
from .validation import validate, validate_varlen

FWD_SCHEMA = f"(Tensor q, Tensor k, Tensor v, {fields.op_arguments()}, bool check_deterministic) -> (Tensor, Tensor)"
BWD_SCHEMA = (
    f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, {fields.op_arguments()}) "
    "-> (Tensor, Tensor, Tensor, Tensor)"
)
_FIELDS = len(fields.CALL) + len(fields.PACKED)
_SINK = next(i for i, f in enumerate(fields.CALL) if f.name == "learnable_sink")


def _planned(q, k, v, args: tuple):
    """(plan, sink, seqs) of the ops' field arguments, at run time: the plan cache validates and routes on a miss."""
    scalars, window, tensors, packed = fields.from_op(args)
    if packed[0] is None:
        return plan.dense(q, k, v, scalars, window, tensors), tensors[0], None
    seqs = PackedSeqs(*packed)
    p = plan.packed(q, k, v, scalars, window, tensors, seqs)
    return p, tensors[0], launch.kernel_seqs(p, seqs)


def _fwd(q, k, v, *args):
    p, sink, seqs = _planned(q, k, v, args[:_FIELDS])
    if args[_FIELDS]:  # check_deterministic: fail before the forward, not in the middle of autograd
        p.backward_backend(q)
    return launch.forward(p, *launch.kernel_inputs(p, q, k, v), sink, seqs)


def _fwd_fake(q, k, v, *args):
    *rows, h, _ = q.shape  # dense (b, sq) or packed (total_q,)
    out = q.new_empty(*rows, h, v.shape[-1])
    lse = q.new_empty(*rows[:-1], h, rows[-1], dtype=torch.float32)  # (b, h, sq) or (h, total_q)
    return out, lse


def _bwd(dout, q, k, v, out, lse, dlse, *args):
    p, sink, seqs = _planned(q, k, v, args)
    given = q, k, v
    q, k, v = launch.kernel_inputs(p, q, k, v)
    dq, dk, dv, dsink = launch.backward(p, dout, q, k, v, kernel_view(out), lse, dlse, sink, seqs)
    if any(a is not b for a, b in zip((q, k, v), given)):  # copies: return the fake's layout, empty_like(given)
        dq, dk, dv = (_strided_like(g, x) for g, x in zip((dq, dk, dv), given))
    return dq, dk, dv, q.new_empty(0, dtype=torch.float32) if dsink is None else dsink


def _strided_like(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad with the strides `torch.empty_like(x)` has, which the fake promises (inductor asserts on them)."""
    strides = torch.empty_like(x, device="meta").stride()  # (no allocation)
    if strides == grad.stride():
        return grad
    if all(a == b or n == 1 for a, b, n in zip(strides, grad.stride(), grad.shape)):
        return grad.as_strided(grad.shape, strides)  # only size-1 dimensions' strides differ: the same memory
    return torch.empty_like(x).copy_(grad)


def _bwd_fake(dout, q, k, v, out, lse, dlse, *args):
    sink = args[_SINK]
    dsink = q.new_empty(0 if sink is None else sink.shape[0], dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink


fwd = torch.library.custom_op("cute_flash::fwd", _fwd, mutates_args=(), schema=FWD_SCHEMA)
fwd.register_fake(_fwd_fake)
bwd = torch.library.custom_op("cute_flash::bwd", _bwd, mutates_args=(), schema=BWD_SCHEMA)
bwd.register_fake(_bwd_fake)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, *args = inputs
    packed = args[len(fields.CALL) : _FIELDS]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, args[_SINK], *packed[:3])
    ctx.args = tuple(None if isinstance(a, torch.Tensor) else a for a in args[:_FIELDS])  # (tensors: saved above)
    ctx.set_materialize_grads(False)  # lse is differentiable; an unused output's gradient stays None


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, sink, *offsets = ctx.saved_tensors
    args = list(ctx.args)
    args[_SINK] = sink
    args[len(fields.CALL) : len(fields.CALL) + 3] = offsets
    if dout is None:  # only lse reached the loss
        dout = torch.zeros_like(out)
    dq, dk, dv, dsink = torch.ops.cute_flash.bwd(dout, q, k, v, out, lse, dlse, *args)
    grads = [None] * (3 + _FIELDS + 1)
    grads[:3] = dq, dk, dv
    if sink is not None:
        grads[3 + _SINK] = dsink.to(sink.dtype)
    return tuple(grads)


torch.library.register_autograd("cute_flash::fwd", _backward, setup_context=_setup_context)


def _needs_grad(q, k, v, sink) -> bool:
    return torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (sink is not None and sink.requires_grad)
    )


def traced(q, k, v, causal, softmax_scale, window_size, deterministic, softcap, learnable_sink, seqs=None):
    """`attention` (`attention_varlen` with seqs) while torch.compile traces it: validated on metadata (the same
    errors as eager), then one custom op in the graph; routing and layouts are settled inside it at run time."""
    call = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, deterministic=deterministic)
    call.update(softcap=softcap, learnable_sink=learnable_sink)
    if seqs is None:
        validate(q, k, v, dtype=None, **call)
        packed = (None, None, None, 0, 0)
    else:
        validate_varlen(q, k, v, seqs, **call)
        packed = tuple(seqs)
    left, right = call.pop("window_size")
    call.update(window_left=op_window_bound(left), window_right=op_window_bound(right))
    check = deterministic and _needs_grad(q, k, v, learnable_sink)
    return torch.ops.cute_flash.fwd(q, k, v, *(call[f.name] for f in fields.CALL), *packed, check)

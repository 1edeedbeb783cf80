"""What `cute_flash.attention` and `cute_flash.attention_varlen` do with a call, in order:

  1. autocast (torch.autocast("cuda")): floating inputs are cast to the autocast dtype, as SDPA does;
  2. under torch.compile: one custom op (cute_flash/ops.py);
  3. a warm no-grad dense forward without lse or sinks: the C++ call path (core/native_path.py);
  4. the plan cached for the call's signature (core/plan.py), then the autograd node (core/autograd.py) when
     gradients are needed, else the forward launcher (core/launch.py); a no-grad dense forward the C++ path did
     not know is registered with it afterwards;
  5. FP8 (dtype="fp8" or float8_e4m3fn inputs, dense only): planned per call, launched eagerly, forward only.

The scalar fields travel in core/fields.py's CALL order, as the functions below take them.
"""

from __future__ import annotations

import torch

from .. import ops
from ..problem import PackedSeqs
from ..validation import validate, validate_varlen
from . import autograd, launch, native_path, plan

# (not float64: autocast leaves it alone, as for torch's ops; the kernels then refuse it rather than run it in 16 bits)
_CAST = (torch.float32, torch.float16, torch.bfloat16)
_PAIRS = (tuple, list)  # what validation takes for window_size (with two entries)


def autocast_inputs(q, k, v):
    """Under torch.autocast("cuda"), floating inputs in another precision are cast to the autocast dtype, as torch's
    scaled_dot_product_attention does (float8 inputs are left alone: they carry their own scales; learnable sinks
    too: the kernels read them in float32)."""
    target = torch.get_autocast_dtype("cuda")
    return tuple(
        t.to(target) if isinstance(t, torch.Tensor) and t.dtype in _CAST and t.dtype != target else t for t in (q, k, v)
    )


def _needs_grad(q, k, v, sink) -> bool:
    return torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (sink is not None and sink.requires_grad)
    )


def _keywords(causal, softmax_scale, window_size, deterministic, softcap, sink) -> dict:
    """validation's keywords of the fields (off the hot path)."""
    call = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, deterministic=deterministic)
    return dict(call, softcap=softcap, learnable_sink=sink)


def dense(
    q, k, v, causal, softmax_scale, window_size, deterministic, softcap, learnable_sink, return_lse, dtype, fp8_rotate,
    descale,
):  # fmt: skip
    """`cute_flash.attention` (its arguments, positionally)."""
    if type(return_lse) is not bool:
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    sink = learnable_sink
    if dtype is None and descale is None and fp8_rotate is True:
        if torch.is_autocast_enabled("cuda"):
            q, k, v = autocast_inputs(q, k, v)
        if torch.compiler.is_compiling():
            out, lse = ops.traced(q, k, v, causal, softmax_scale, window_size, deterministic, softcap, sink)
            return (out, lse) if return_lse else out
        try:
            left, right = window_size
            grads = torch.is_grad_enabled() and (
                q.requires_grad or k.requires_grad or v.requires_grad or (sink is not None and sink.requires_grad)
            )
        except (TypeError, ValueError, AttributeError):  # not a pair, not tensors: validation says what is wrong
            grads = None
        if grads is None or type(window_size) not in _PAIRS:  # (a subclass of tuple passes validation)
            validate(q, k, v, dtype=None, **_keywords(causal, softmax_scale, window_size, deterministic, softcap, sink))
            left, right = window_size
            grads = _needs_grad(q, k, v, sink)
        fast = not grads and sink is None and not return_lse
        if fast:
            served = native_path.forward(q, k, v, causal, softmax_scale, left, right, deterministic, softcap)
            if served is not None and served is not False:
                return served
            fast = served is None  # not known to the C++ path: registered after this launch
        scalars = (causal, softmax_scale, left, right, deterministic, softcap)  # core/fields.py's CALL order
        planned = plan.dense(q, k, v, scalars, window_size, (sink,))
        if grads:
            if deterministic:  # fail before the forward, not in the middle of autograd
                planned.backward_backend(q)
            # The layouts are normalised inside the autograd node, so that a view or copy made for the kernels
            # records nothing on the autograd graph (the gradients come back in q, k, v's own shapes).
            out, lse = autograd.Attention.apply(planned.run or launch.run_of(planned), q, k, v, sink)
        else:
            if planned.copies:
                out, lse = launch.forward(planned, *launch.kernel_inputs(planned, q, k, v), sink)
            else:
                out, lse = launch.forward(planned, q, k, v, sink)
            if fast:
                native_path.register(planned, q, k, v, scalars)
        return (out, lse) if return_lse else out
    # FP8 (or arguments validation refuses): the inputs are quantised here, so the pre-pass records no graph.
    if dtype is None and torch.is_autocast_enabled("cuda"):
        q, k, v = autocast_inputs(q, k, v)
    call = _keywords(causal, softmax_scale, window_size, deterministic, softcap, sink)
    planned = plan.fp8(q, k, v, dtype=dtype, descale=descale, fp8_rotate=fp8_rotate, **call)
    with torch.no_grad():
        out, lse = launch.forward(planned, *launch.kernel_inputs(planned, q, k, v))
    if _needs_grad(q, k, v, None):
        out, lse = autograd.Fp8NoBackward.apply(out, lse, q, k, v)  # (lse too: a loss of it must not pass silently)
    return (out, lse) if return_lse else out


def packed(
    q, k, v, seqs: PackedSeqs, causal, softmax_scale, window_size, deterministic, softcap, learnable_sink, return_lse
):
    """`cute_flash.attention_varlen` (its arguments, positionally, the packed-sequence ones as `seqs`)."""
    if type(return_lse) is not bool:
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    sink = learnable_sink
    if torch.is_autocast_enabled("cuda"):
        q, k, v = autocast_inputs(q, k, v)
    if torch.compiler.is_compiling():
        out, lse = ops.traced(q, k, v, causal, softmax_scale, window_size, deterministic, softcap, sink, seqs)
        return (out, lse) if return_lse else out
    try:
        left, right = window_size
    except (TypeError, ValueError):  # not a pair: validation says so
        validate_varlen(q, k, v, seqs, causal=causal, softmax_scale=softmax_scale, window_size=window_size)
        raise
    scalars = (causal, softmax_scale, left, right, deterministic, softcap)  # core/fields.py's CALL order
    planned = plan.packed(q, k, v, scalars, window_size, (sink,), seqs)
    seqs = launch.kernel_seqs(planned, seqs)
    if _needs_grad(q, k, v, sink):
        if deterministic:  # fail before the forward, not in the middle of autograd
            planned.backward_backend(q)
        out, lse = autograd.Attention.apply(planned.run or launch.run_of(planned), q, k, v, sink, seqs)
    else:
        out, lse = launch.forward(planned, *launch.kernel_inputs(planned, q, k, v), sink, seqs)
    return (out, lse) if return_lse else out

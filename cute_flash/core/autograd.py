"""The autograd node of every differentiable call: eager dense and packed attention (run: a plan's
`core.launch.PlanRun`) and ring attention (cute_flash/distributed/ring.py: its config). The custom ops under
torch.compile have their own autograd formula (cute_flash/ops.py), which ends in the same backward launcher.

A `run` provides:
  run.forward_saving(q, k, v, sink, seqs) -> (q, k, v, out, lse): the tensors the backward reads (q, k, v as the
      forward ran them, e.g. in the kernels' layout) and the outputs;
  run.backward(dout, q, k, v, out, lse, dlse, sink, seqs) -> (dq, dk, dv, dsink), shaped like the saved q, k, v
      (dsink (h,) float32, or None without sinks); dlse is lse's gradient, None when the loss does not use lse.
"""

from __future__ import annotations

import torch

from ..problem import PackedSeqs


class Attention(torch.autograd.Function):
    """apply(run, q, k, v, sink[, seqs]) -> (out, lse); sink: the (h,) learnable sinks or None (their gradient comes
    back in their dtype); seqs: a packed call's `PackedSeqs` (its tensors are saved like the others, so that autograd
    notices an in-place change before the backward)."""

    @staticmethod
    def forward(ctx, run, q, k, v, sink, seqs=None):
        q, k, v, out, lse = run.forward_saving(q, k, v, sink, seqs)
        ctx.save_for_backward(q, k, v, out, lse, sink, *(() if seqs is None else seqs[:3]))
        ctx.run = run
        ctx.max_seqlens = None if seqs is None else seqs[3:]
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (no zero tensors to fold in)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink, *offsets = ctx.saved_tensors
        seqs = None if ctx.max_seqlens is None else PackedSeqs(*offsets, *ctx.max_seqlens)
        run = ctx.run

        def kernels(d):
            return run.backward(d, q, k, v, out, lse, dlse, sink, seqs)

        dq, dk, dv, dsink = node_backward(kernels, dout, dlse, q, k, v, out, sink)
        return None, dq, dk, dv, None if dsink is None else dsink.to(sink.dtype), None


def node_backward(kernels, dout, dlse, q, k, v, out, sink=None):
    """What an autograd node does around its kernels' backward `kernels(dout)` -> (dq, dk, dv, dsink): a zero out
    gradient when only lse reached the loss, and under create_graph=True (grad mode on in a backward) the kernels run
    without recording and their gradients come back on a node that refuses a second backward (`refuse_second_order`).
    The usual backward (grad mode off) calls `kernels` directly."""
    if dout is None:
        dout = torch.zeros_like(out)
    if not torch.is_grad_enabled():
        return kernels(dout)
    with torch.no_grad():
        grads = kernels(dout)
    return refuse_second_order(grads, dout, dlse, q, k, v, sink)


class _SecondOrderRefused(torch.autograd.Function):
    """The gradients a backward returned while recording a graph, passed through unchanged; a second backward that
    reaches them raises (the backward kernels have no derivative of their own)."""

    @staticmethod
    def forward(ctx, anchor, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(
            "cute_flash: the attention backward is not differentiable; a gradient of its gradients (double "
            "backward through create_graph=True) is not supported"
        )


def refuse_second_order(grads, *inputs):
    """`grads` (None entries stay None) of a backward that ran with create_graph=True, attached to a node that raises
    if a second backward reaches them, instead of handing them back detached (constants to that second backward,
    which would silently drop their second-order terms). A create_graph=True backward whose gradients no second
    backward uses works as before. inputs: the backward's inputs; the node hangs on one of them that requires grad
    (none: nothing to do)."""
    anchor = next((t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad), None)
    if anchor is None:
        return grads
    present = [g for g in grads if g is not None]
    passed = iter(_SecondOrderRefused.apply(anchor, *present))
    return tuple(None if g is None else next(passed) for g in grads)


class Fp8NoBackward(torch.autograd.Function):
    """Passes the FP8 output and lse through; asking for a gradient of either raises (the FP8 path has no backward
    kernel)."""

    @staticmethod
    def forward(ctx, out, lse, q, k, v):
        return out.view_as(out), lse.view_as(lse)

    @staticmethod
    def backward(ctx, dout, dlse):
        raise NotImplementedError(
            "cute_flash: the FP8 path (dtype='fp8' or float8_e4m3fn inputs) is forward-only; gradients need "
            "dtype=None (fp16/bf16 compute)"
        )

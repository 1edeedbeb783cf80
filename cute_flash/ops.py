"""cute-flash's forward and backward as torch custom ops (namespace `cute_flash`), so that `torch.compile` traces
`cute_flash.attention` into its graph (no graph break, fullgraph=True works), CUDA graphs capture it, and autograd
reaches the backward through `register_autograd`. `attention` takes the ops only while torch.compile traces it
(`torch.compiler.is_compiling()`); eager calls run the same steps without the custom-op dispatch, whose host cost
(hundreds of µs per call in torch 2.11) would dominate small problems.

    torch.ops.cute_flash.fwd(q, k, v, softmax_scale, mask_kind, window_left, window_right, check_deterministic)
        -> (out (b, sq, h, dv) in q's dtype, lse (b, h, sq) float32)
    torch.ops.cute_flash.bwd(dout, q, k, v, out, lse, softmax_scale, mask_kind, window_left, window_right,
        deterministic) -> (dq, dk, dv)

The ops take inputs `cute_flash.attention` has validated (`validation.validate`) and a mask already normalised
(`spec.normalize_mask`); call `attention`, not the ops. Everything that needs the device or real memory (routing by
compute capability, `kernel_view`'s alignment test, compiling, launching) happens inside the ops' implementations,
which a trace never enters: under `torch.compile` the fake implementations give the output shapes and dtypes. The
FP8 path (forward only, with a GPU pre-pass) is not an op: it runs eagerly.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .spec import MaskBounds
from .validation import kernel_view, problem_of

_OUT = Tuple[torch.Tensor, torch.Tensor]


@torch.library.custom_op("cute_flash::fwd", mutates_args=())
def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    mask_kind: str,
    window_left: int,
    window_right: int,
    check_deterministic: bool,
) -> _OUT:
    from . import interface  # the op runs after cute_flash is imported; no import happens in a traced region

    problem = problem_of(q, k, v, MaskBounds(mask_kind, window_left, window_right), softmax_scale)
    arch = interface._route(problem.spec, q, backward=False)
    if check_deterministic:  # fail before the forward, not in the middle of autograd
        interface._route(problem.spec, q, backward=True, deterministic=True)
    return interface._run_forward(kernel_view(q), kernel_view(k), kernel_view(v), problem, arch)


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, mask_kind, window_left, window_right, check_deterministic) -> _OUT:
    b, sq, h, _ = q.shape
    out = q.new_empty(b, sq, h, v.shape[3])
    lse = q.new_empty(b, h, sq, dtype=torch.float32)
    return out, lse


@torch.library.custom_op("cute_flash::bwd", mutates_args=())
def bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    mask_kind: str,
    window_left: int,
    window_right: int,
    deterministic: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from . import interface

    problem = problem_of(q, k, v, MaskBounds(mask_kind, window_left, window_right), softmax_scale)
    views = (kernel_view(t) for t in (q, k, v, out))
    return interface._run_backward(dout, *views, lse, problem, deterministic)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, mask_kind, window_left, window_right, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, softmax_scale, mask_kind, window_left, window_right, check_deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.params = (softmax_scale, mask_kind, window_left, window_right, check_deterministic)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    softmax_scale, mask_kind, window_left, window_right, deterministic = ctx.params
    dq, dk, dv = torch.ops.cute_flash.bwd(
        dout, q, k, v, out, lse, softmax_scale, mask_kind, window_left, window_right, deterministic
    )
    return dq, dk, dv, None, None, None, None, None


torch.library.register_autograd("cute_flash::fwd", _backward, setup_context=_setup_context)

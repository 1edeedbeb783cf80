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

`cute_flash.attention_varlen` has the same pair for packed sequences, taken the same way (only under torch.compile):

    torch.ops.cute_flash.fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
        softmax_scale, mask_kind, window_left, window_right, check_deterministic)
        -> (out (total_q, h, dv) in q's dtype, lse (h, total_q) float32)
    torch.ops.cute_flash.bwd_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
        max_seqlen_k, softmax_scale, mask_kind, window_left, window_right, deterministic) -> (dq, dk, dv)
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .spec import AttentionSpec, MaskBounds
from .validation import INPUT_DTYPES, Problem, VarlenProblem, kernel_view

_OUT = Tuple[torch.Tensor, torch.Tensor]


def _problem(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, mask_kind: str, left: int, right: int
) -> Problem:
    batch, seqlen_q, nheads, head_dim = q.shape
    dtype = INPUT_DTYPES[q.dtype]
    spec = AttentionSpec(dtype, head_dim, v.shape[3], mask_kind, dtype)
    return Problem(
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=k.shape[1],
        nheads=nheads,
        nheads_kv=k.shape[2],
        head_dim=head_dim,
        head_dim_v=v.shape[3],
        spec=spec,
        mask=MaskBounds(mask_kind, left, right),
        softmax_scale=softmax_scale,
    )


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

    problem = _problem(q, k, v, softmax_scale, mask_kind, window_left, window_right)
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

    problem = _problem(q, k, v, softmax_scale, mask_kind, window_left, window_right)
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


# --------------------------------------------------------------------------------------------- packed sequences
def _varlen_problem(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    mask_kind: str,
    left: int,
    right: int,
) -> VarlenProblem:
    total_q, nheads, head_dim = q.shape
    dtype = INPUT_DTYPES[q.dtype]
    return VarlenProblem(
        batch=cu_seqlens_q.shape[0] - 1,
        total_q=total_q,
        total_k=k.shape[0],
        nheads=nheads,
        nheads_kv=k.shape[1],
        head_dim=head_dim,
        head_dim_v=v.shape[2],
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        spec=AttentionSpec(dtype, head_dim, v.shape[2], mask_kind, dtype, varlen=True),
        mask=MaskBounds(mask_kind, left, right),
        softmax_scale=softmax_scale,
    )


@torch.library.custom_op("cute_flash::fwd_varlen", mutates_args=())
def fwd_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    seqused_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    mask_kind: str,
    window_left: int,
    window_right: int,
    check_deterministic: bool,
) -> _OUT:
    from . import interface, varlen

    problem = _varlen_problem(
        q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, mask_kind, window_left, window_right
    )
    arch = interface._route(problem.spec, q, backward=False)
    if check_deterministic:  # fail before the forward, not in the middle of autograd
        interface._route(problem.spec, q, backward=True, deterministic=True)
    views = (kernel_view(t) for t in (q, k, v))
    return varlen._run_forward(*views, cu_seqlens_q, cu_seqlens_k, seqused_k, problem, arch)


@fwd_varlen.register_fake
def _fwd_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, *mask) -> _OUT:
    total_q, h, _ = q.shape
    return q.new_empty(total_q, h, v.shape[2]), q.new_empty(h, total_q, dtype=torch.float32)


@torch.library.custom_op("cute_flash::bwd_varlen", mutates_args=())
def bwd_varlen(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    seqused_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    mask_kind: str,
    window_left: int,
    window_right: int,
    deterministic: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from . import varlen

    problem = _varlen_problem(
        q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, mask_kind, window_left, window_right
    )
    views = (kernel_view(t) for t in (q, k, v, out))
    return varlen._run_backward(dout, *views, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, problem, deterministic)


@bwd_varlen.register_fake
def _bwd_varlen_fake(dout, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_varlen_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, *params = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k)
    ctx.params = params  # max_seqlen_q, max_seqlen_k, softmax_scale, mask_kind, window_left/right, deterministic
    ctx.mark_non_differentiable(lse)


def _backward_varlen(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k = ctx.saved_tensors
    grads = torch.ops.cute_flash.bwd_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, *ctx.params)
    return (*grads, *(None,) * 10)


torch.library.register_autograd("cute_flash::fwd_varlen", _backward_varlen, setup_context=_setup_varlen_context)

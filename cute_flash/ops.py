"""cute-flash's forward and backward as torch custom ops (namespace `cute_flash`), so that `torch.compile` traces
`cute_flash.attention` into its graph (no graph break, fullgraph=True works), CUDA graphs capture it, and autograd
reaches the backward through `register_autograd`. `attention` takes the ops only while torch.compile traces it
(`torch.compiler.is_compiling()`); eager calls run the same steps without the custom-op dispatch, whose host cost
(hundreds of µs per call in torch 2.11) would dominate small problems.

    torch.ops.cute_flash.fwd(q, k, v, softmax_scale, mask_kind, window_left, window_right, check_deterministic,
        cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, max_seqlen_q=0, max_seqlen_k=0)
        -> (out (b, sq, h, dv) in q's dtype, lse (b, h, sq) float32)
    torch.ops.cute_flash.bwd(dout, q, k, v, out, lse, softmax_scale, mask_kind, window_left, window_right,
        deterministic, <the same five packed-sequence arguments>, dlse=None) -> (dq, dk, dv)

With cu_seqlens_q (and cu_seqlens_k, max_seqlen_*; seqused_k optional) the ops serve `cute_flash.attention_varlen`:
q (total_q, h, d), k / v (total_k, h_kv, d / dv), out (total_q, h, dv), lse (h, total_q). One op pair for both
keeps one autograd formula and one place where a trace meets the kernels.

The ops take inputs `cute_flash.attention` has validated (`validation.validate`) and a mask already normalised
(`spec.normalize_mask`); call `attention`, not the ops. Everything that needs the device or real memory (routing by
compute capability, `kernel_view`'s alignment test, compiling, launching) happens inside the ops' implementations,
which a trace never enters: under `torch.compile` the fake implementations give the output shapes and dtypes. The
FP8 path (forward only, with a GPU pre-pass) is not an op: it runs eagerly.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .spec import MaskBounds
from .validation import PackedSeqs, kernel_view, problem_of

_OUT = Tuple[torch.Tensor, torch.Tensor]


def _packed(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k) -> Optional[PackedSeqs]:
    """The ops' trailing arguments as `attention_varlen` passed them, or None for a dense call."""
    if cu_seqlens_q is None:
        return None
    return PackedSeqs(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k)


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
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
) -> _OUT:
    from . import interface, varlen  # the op runs after cute_flash is imported; no import happens in a traced region

    seqs = _packed(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k)
    p = problem_of(q, k, v, MaskBounds(mask_kind, window_left, window_right), softmax_scale, seqs)
    arch = interface._route(p.spec, q, backward=False)
    if check_deterministic:  # fail before the forward, not in the middle of autograd
        interface._route(p.spec, q, backward=True, deterministic=True)
    views = (kernel_view(q), kernel_view(k), kernel_view(v))
    if cu_seqlens_q is None:
        return interface._run_forward(*views, p, arch)
    return varlen._run_forward(*views, seqs, p, arch)


@fwd.register_fake
def _fwd_fake(q, k, v, *params_and_seqs) -> _OUT:
    *rows, h, _ = q.shape  # dense (b, sq) or packed (total_q,)
    out = q.new_empty(*rows, h, v.shape[-1])
    lse = q.new_empty(*rows[:-1], h, rows[-1], dtype=torch.float32)  # (b, h, sq) or (h, total_q)
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
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
    dlse: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from . import interface, varlen

    seqs = _packed(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k)
    p = problem_of(q, k, v, MaskBounds(mask_kind, window_left, window_right), softmax_scale, seqs)
    views = (kernel_view(t) for t in (q, k, v, out))
    if cu_seqlens_q is None:
        return interface._run_backward(dout, *views, lse, p, deterministic, dlse)
    return varlen._run_backward(dout, *views, lse, seqs, p, deterministic, dlse)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, softmax_scale, mask_kind, window_left, window_right, check_deterministic, cu_q, cu_k, used, *maxes = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, used)
    ctx.params = (softmax_scale, mask_kind, window_left, window_right, check_deterministic)
    ctx.max_seqlens = maxes
    ctx.set_materialize_grads(False)  # lse is differentiable; an unused output's gradient stays None


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, used = ctx.saved_tensors
    if dout is None:  # only lse reached the loss
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.cute_flash.bwd(
        dout, q, k, v, out, lse, *ctx.params, cu_q, cu_k, used, *ctx.max_seqlens, dlse
    )
    return dq, dk, dv, *(None,) * 10


torch.library.register_autograd("cute_flash::fwd", _backward, setup_context=_setup_context)

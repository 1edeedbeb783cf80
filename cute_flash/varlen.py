"""`attention_varlen`: attention over packed sequences of different lengths (cu_seqlens), forward and backward.

Served by the kernel families that have a packed (varlen) variant: the sm80 family (FlashAttention-2 design) on
Ampere, and on Hopper the sm90 packed forward and backward (deterministic too); sm100 has none, so on a Blackwell GPU
the call raises NotImplementedError. `explain_varlen` shows the skipped families with their reasons.

The kernels read each sequence's offsets from cu_seqlens on the GPU, so a call makes no device-to-host copy and can
be captured in a CUDA graph. The sm90 forward and backward main kernels launch one CTA per tile that exists (plus at
most batch + 1 idle ones per head; common/packed_tiles.py); the sm80 kernels and the pre- / postprocess kernels span
max_seqlen's blocks for every sequence, and the CTAs whose block lies past their own sequence's end exit at once.

Under torch.compile the call is traced as the custom ops `cute_flash::fwd` / `bwd` with their packed-sequence
arguments (cute_flash/ops.py), without a graph break; eager calls run the same steps without the custom-op dispatch,
as `attention` does.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import compile_cache, interface
from .arch.base import ArchBackend, BwdTensors, Grads
from .interface import Explanation, _autocast, _route, node_backward
from .validation import PackedSeqs, VarlenProblem, is_kernel_layout, kernel_view, validate_varlen

Window = Tuple[Optional[int], Optional[int]]


class _Plan:
    """What a warm eager call of one signature needs (`_signature`): the validated problem, the forward family,
    whether the packed-sequence vectors need `contiguous()` (the kernels read them with unit stride) and whether q,
    k, v need `kernel_view`'s fix-ups."""

    __slots__ = ("problem", "arch", "copy_seqs", "copies")

    def __init__(self, problem: VarlenProblem, arch: ArchBackend, copy_seqs: bool, copies: bool):
        self.problem, self.arch, self.copy_seqs, self.copies = problem, arch, copy_seqs, copies


# Plans by call signature, as interface's for dense calls (bounded, emptied with it and with the kernel cache).
_plans = interface.call_cache(compile_cache.memo())


def _signature(q, k, v, seqs: PackedSeqs, causal, softmax_scale, window_size, deterministic) -> tuple:
    """interface._signature of the packed tensors, and the packed-sequence arguments: the vectors' metadata (their
    values are the kernels' to read) and max_seqlen_* with their types. Raises like interface._signature."""
    cu_q, cu_k, used, max_q, max_k = seqs
    meta = (cu_q.shape, cu_q.stride(), cu_q.dtype, cu_q.device, cu_k.shape, cu_k.stride(), cu_k.dtype, cu_k.device)
    used_meta = None if used is None else (used.shape, used.stride(), used.dtype, used.device)
    dense = interface._signature(q, k, v, causal, softmax_scale, window_size, deterministic)
    return dense + meta + (used_meta, max_q, max_k, type(max_q), type(max_k), type(used))


def _make_plan(q, k, v, seqs: PackedSeqs, causal, softmax_scale, window_size, deterministic) -> _Plan:
    problem = validate_varlen(
        q, k, v, seqs, causal=causal, softmax_scale=softmax_scale, window_size=window_size, deterministic=deterministic
    )
    copy_seqs = not all(t is None or t.is_contiguous() for t in seqs[:3])
    copies = not all(is_kernel_layout(t) for t in (q, k, v))
    return _Plan(problem, _route(problem.spec, q, backward=False), copy_seqs, copies)


def _plan(q, k, v, seqs: PackedSeqs, causal, softmax_scale, window_size, deterministic) -> _Plan:
    """The cached plan of an eager call (validating and routing it on a miss)."""
    args = (q, k, v, seqs, causal, softmax_scale, window_size, deterministic)
    return interface.cached_plan(_plans, _signature, _make_plan, *args)


def _is_empty(p: VarlenProblem) -> bool:
    return p.batch == 0 or p.total_q == 0 or p.nheads == 0 or p.max_seqlen_q == 0


def _run_forward(q, k, v, seqs: PackedSeqs, p: VarlenProblem, arch: ArchBackend):
    out = torch.empty(p.total_q, p.nheads, p.head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(p.nheads, p.total_q, dtype=torch.float32, device=q.device)
    if _is_empty(p) or p.total_k == 0 or p.max_seqlen_k == 0:
        # No key anywhere (or no query): every row is fully masked (out 0, lse -inf); nothing to launch.
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    with interface._device_guard(q):
        arch.forward_varlen(q, k, v, out, lse, seqs, p)
    return out, lse


def _run_backward(dout, q, k, v, out, lse, seqs: PackedSeqs, p: VarlenProblem, deterministic: bool, dlse=None):
    arch = _route(p.spec, q, backward=True, deterministic=deterministic)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if _is_empty(p) or p.total_k == 0 or p.max_seqlen_k == 0:
        for g in (dq, dk, dv):
            g.zero_()
        return dq, dk, dv
    with interface._device_guard(q):
        t = BwdTensors(kernel_view(dout), q, k, v, out, lse, dlse)
        arch.backward_varlen(t, Grads(dq, dk, dv), seqs, p, deterministic)
    return dq, dk, dv


class _AttentionVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seqs: PackedSeqs, problem: VarlenProblem, arch: ArchBackend, deterministic: bool):
        q, k, v = kernel_view(q), kernel_view(k), kernel_view(v)
        out, lse = _run_forward(q, k, v, seqs, problem, arch)
        # The offsets are saved like the other tensors (autograd then notices an in-place change before backward).
        ctx.save_for_backward(q, k, v, out, lse, *seqs[:3])
        ctx.problem = problem
        ctx.deterministic = deterministic
        ctx.set_materialize_grads(False)  # as interface._Attention: lse is differentiable, its unused gradient None
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k, seqused_k = ctx.saved_tensors
        p = ctx.problem
        seqs = PackedSeqs(cu_q, cu_k, seqused_k, p.max_seqlen_q, p.max_seqlen_k)
        det = ctx.deterministic

        def run(d):
            return _run_backward(d, q, k, v, out, lse, seqs, p, det, dlse)

        grads = node_backward(run, dout, dlse, q, k, v, out)
        return (*grads, None, None, None, None)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Window = (None, None),
    seqused_k: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention over a batch of packed sequences, on a CUDA GPU.

    q (total_q, nheads, head_dim), k (total_k, nheads_kv, head_dim), v (total_k, nheads_kv, head_dim_v); sequence b
    is rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q against rows cu_seqlens_k[b]:cu_seqlens_k[b+1] of k and v (only
    the first seqused_k[b] of them when seqused_k, int32 (batch,), is given). cu_seqlens_* are int32 (batch + 1,) on
    q's device, start at 0, never decrease and end at total_q / total_k (rows past the end would never be written: give
    padding rows a sequence of their own); max_seqlen_* are host ints at least every
    sequence's length (not checked: that would need a device-to-host copy). Sequences of length 0 are allowed.

    causal / window_size / softmax_scale as in `cute_flash.attention`, aligned per sequence (bottom-right: query i of
    a sequence sees key j iff j <= i + seqlen_k - seqlen_q). A row that sees no key gets out 0 and lse -inf.
    Returns out (total_q, nheads, head_dim_v) in q's dtype and, with return_lse, lse (nheads, total_q) float32
    (differentiable like out).

    Differentiable in q, k, v. deterministic=True asks for a backward that sums in a fixed order (the sm90 family's
    on Hopper); where the sm80 family would train, which has none, it raises NotImplementedError before the forward
    when gradients are needed.
    """
    if torch.is_autocast_enabled("cuda"):
        q, k, v = _autocast(q, k, v)
    seqs = PackedSeqs(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k)
    compiling = torch.compiler.is_compiling()
    if compiling:
        problem = validate_varlen(
            q, k, v, seqs, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
            deterministic=deterministic,
        )  # fmt: skip
        copy_seqs = True
    else:  # eager: validation and routing from the plan cached for this call signature (as `attention`'s)
        plan = _plan(q, k, v, seqs, causal, softmax_scale, window_size, deterministic)
        problem, arch, copy_seqs = plan.problem, plan.arch, plan.copy_seqs
    if copy_seqs:
        # The kernels read these with unit stride (a no-op for the usual contiguous vectors).
        seqs = seqs._replace(
            cu_seqlens_q=cu_seqlens_q.contiguous(),
            cu_seqlens_k=cu_seqlens_k.contiguous(),
            seqused_k=None if seqused_k is None else seqused_k.contiguous(),
        )
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if compiling:
        # One custom op in the graph; routing and layouts are settled inside it at run time (as in `attention`).
        m = problem.mask
        out, lse = torch.ops.cute_flash.fwd(
            q, k, v, problem.softmax_scale, m.kind, m.left, m.right, deterministic and needs_grad, *seqs
        )
        return (out, lse) if return_lse else out
    if needs_grad:
        if deterministic:  # fail before the forward, not in the middle of autograd
            _route(problem.spec, q, backward=True, deterministic=True)
        out, lse = _AttentionVarlen.apply(q, k, v, seqs, problem, arch, deterministic)
    elif plan.copies:
        out, lse = _run_forward(kernel_view(q), kernel_view(k), kernel_view(v), seqs, problem, arch)
    else:
        out, lse = _run_forward(q, k, v, seqs, problem, arch)
    return (out, lse) if return_lse else out


def explain_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Window = (None, None),
    seqused_k: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    capability: Optional[Tuple[int, int]] = None,
) -> Explanation:
    """Which family would serve `attention_varlen(...)` with these arguments, forward and backward, and why the
    others were skipped (e.g. on Blackwell, "sm100" without a varlen kernel).
    Validates like `attention_varlen`. capability: explain for a GPU of that compute capability (then the inputs may
    be CPU or meta tensors), as in `cute_flash.explain`."""
    seqs = PackedSeqs(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k)
    problem = validate_varlen(
        q,
        k,
        v,
        seqs,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        deterministic=deterministic,
        any_device=capability is not None,
    )
    capability = interface._device_capability(q) if capability is None else tuple(capability)
    return Explanation.of(problem.spec, capability, deterministic)

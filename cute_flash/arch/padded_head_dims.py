"""Backwards at a wider head dim than the call's (host side, shared by the sm80 and sm90 backwards).

A family whose backward kernels exist for head dim W serves a call with (head_dim, head_dim_v) both <= W by running
them at W on zero-padded operands: zero columns of Q and K leave S = Q·Kᵀ unchanged and give zero columns of dQ and
dK; zero columns of V, dO and O leave dP = dO·Vᵀ and D = rowsum(dO·O) unchanged and give zero columns of dV. The
softmax scale is the call's own (a runtime argument of the kernels), so the gradients are exact; the padded columns
cost their share of the products and a copy of each padded tensor. Used for head_dim != head_dim_v (e.g. DeepSeek's
(192, 128)) and, on Hopper, for head dims without an sm90 backward tile of their own (d160 runs the d192 kernels).
Soft-capping (the cap is the problem's, carried by widened_problem) and learnable sinks (their logits and dsink,
shaped by the heads alone) pass through as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Tuple, TypeVar

import torch

from ..spec import AttentionSpec
from ..validation import MAX_ELEMENTS_PER_HEAD, VarlenProblem
from .base import BwdTensors, Grads

P = TypeVar("P")  # Problem or VarlenProblem (both carry head_dim, head_dim_v and spec)
Dims = Tuple[int, int]  # (head_dim, head_dim_v) of the kernels


def widened_spec(spec: AttentionSpec, dims: Dims) -> AttentionSpec:
    """`spec` with the kernels' head dims `dims` (what they are built for)."""
    return dataclasses.replace(spec, head_dim=dims[0], head_dim_v=dims[1])


def widened_problem(problem: P, dims: Dims) -> P:
    """`problem` at head dims `dims`; raises NotImplementedError where the wider rows leave the kernels' Int32
    indexing (validation checked the call's own head dims, with the same padding of its rows)."""
    width = max(dims)
    if isinstance(problem, VarlenProblem):
        rows = max(problem.total_q, problem.total_k) + (problem.batch + 1) * 256
    else:
        rows = max(problem.seqlen_q, problem.seqlen_k) + 256
    if rows * width > MAX_ELEMENTS_PER_HEAD:
        raise NotImplementedError(
            f"the backward runs head dims ({problem.head_dim}, {problem.head_dim_v}) on kernels {width} wide, and "
            f"{rows} rows x {width} exceeds their Int32 indexing ({MAX_ELEMENTS_PER_HEAD}); split the call"
        )
    return dataclasses.replace(problem, head_dim=dims[0], head_dim_v=dims[1], spec=widened_spec(problem.spec, dims))


def widened(t: torch.Tensor, width: int) -> torch.Tensor:
    """t with its last dim zero-padded to `width` (a new contiguous tensor), or t itself when it is that wide."""
    if t.shape[-1] == width:
        return t
    wide = t.new_zeros(*t.shape[:-1], width)
    wide[..., : t.shape[-1]] = t
    return wide


def padded_launcher(dims: Dims, run: Callable[[BwdTensors, Grads], None]) -> Callable[[BwdTensors, Grads], None]:
    """`run` (a launcher of kernels built for head dims `dims`) as a launcher of a call's own tensors: the narrower
    operands zero-padded to their kernel width (q, k: head_dim's; v, dout, out: head_dim_v's), the narrower gradients
    computed into wide buffers and their leading columns copied out; lse, dlse, the sink logits and dsink as given."""
    d, dv = dims

    def launch(t: BwdTensors, grads: Grads) -> None:
        dout, q, k, v, out, lse, dlse = t[:7]
        wide = [widened(x, w) for x, w in ((dout, dv), (q, d), (k, d), (v, dv), (out, dv))]
        wide_grads = [g if g.shape[-1] == w else g.new_empty(*g.shape[:-1], w) for g, w in zip(grads, (d, d, dv))]
        run(BwdTensors(*wide, lse, dlse, t.sink), Grads(*wide_grads, grads.dsink))  # the sink has no head dim
        for g, w in zip(grads, wide_grads):
            if w is not g:
                g.copy_(w[..., : g.shape[-1]])

    return launch

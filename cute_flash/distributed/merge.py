"""Exact merging of partial attention results over disjoint key sets, through their log-sum-exps.

If out_a, lse_a is attention of some query rows over key set A and out_b, lse_b over a disjoint set B, then over
A ∪ B:  lse = log(exp(lse_a) + exp(lse_b)),  out = exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b.
A row that sees no key of a set has lse -inf and out 0 there; it must add nothing, and a row that sees no key of
either set must stay (out 0, lse -inf), never NaN (-inf - -inf).
"""

from __future__ import annotations

from typing import Tuple

import torch


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    # -inf rows (no key) are shifted by 0 instead of by themselves, so that exp() of them is exp(-inf) = 0, not NaN.
    return torch.where(torch.isneginf(x), torch.zeros_like(x), x)


def _merged_lse_and_weights(lse_a: torch.Tensor, lse_b: torch.Tensor, dtype: torch.dtype):
    la, lb = lse_a.to(dtype), lse_b.to(dtype)
    shift = _finite_or_zero(torch.maximum(la, lb))
    lse = shift + torch.log(torch.exp(la - shift) + torch.exp(lb - shift))  # log(0) = -inf: no key in either set
    base = _finite_or_zero(lse)
    # (b, h, s) -> (b, s, h, 1) to scale the rows of out.
    wa = torch.exp(la - base).transpose(1, 2).unsqueeze(-1)
    wb = torch.exp(lb - base).transpose(1, 2).unsqueeze(-1)
    return lse, wa, wb


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) over both key sets. out (b, s, h, dv), lse (b, h, s); computed in the widest of the inputs' dtypes
    and float32."""
    dtype = torch.promote_types(torch.promote_types(out_a.dtype, out_b.dtype), torch.float32)
    dtype = torch.promote_types(dtype, torch.promote_types(lse_a.dtype, lse_b.dtype))
    lse, wa, wb = _merged_lse_and_weights(lse_a, lse_b, dtype)
    return wa * out_a.to(dtype) + wb * out_b.to(dtype), lse


def merge_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Merges (out_b, lse_b) into the accumulators in place, in their dtype (they may be views, e.g. some rows of a
    shard). Works on out_acc's memory without a temporary of its size: at long sequences it is the largest buffer."""
    lse, wa, wb = _merged_lse_and_weights(lse_acc, lse_b, lse_acc.dtype)
    out_acc.mul_(wa.to(out_acc.dtype)).addcmul_(out_b, wb.to(out_acc.dtype))
    lse_acc.copy_(lse)


def merge_sink_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, sink: torch.Tensor) -> None:
    """Merges learnable sinks (h,) into the accumulators in place: a key set of its own per head, whose lse is the
    sink and whose out is 0 (it attends to no value), so lse = log(exp(lse) + exp(sink_h)) and out is scaled by
    exp(old lse - lse). A row without keys gets out 0 and lse = sink_h."""
    lse_sink = sink.to(lse_acc.dtype).view(1, -1, 1).expand_as(lse_acc)
    lse, wa, _ = _merged_lse_and_weights(lse_acc, lse_sink, lse_acc.dtype)
    out_acc.mul_(wa.to(out_acc.dtype))
    lse_acc.copy_(lse)

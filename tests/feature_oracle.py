"""A plain-torch oracle for the sm80 feature tests (softcap, sinks, negative windows, the KV-cache forward), with
FlashAttention-4's semantics (`attention_ref` in flash_attn/cute/testing.py), and FlashAttention's acceptance rule.

capped score = softcap * tanh(score * scale / softcap); the sink is one more natural-log logit per query head in every
row's softmax denominator, attending to no value (LSE includes it); query i of a sequence sees key j iff
i + off - left <= j <= i + off + right, off = seqlen_k - seqlen_q (bottom-right aligned), None = unbounded. A row that
sees no key and has no sink gets out 0 and LSE -inf. Everything differentiable (float64 autograd is the gradient
reference).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from cute_flash.testing import ErrorReport


def attention_oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    left: Optional[int] = None,
    right: Optional[int] = None,
    softcap: float = 0.0,
    sink: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float64,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One dense batch: q (b, sq, h, d), k (b, sk, h_kv, d), v (b, sk, h_kv, dv), sink (h,) -> out (b, sq, h, dv) in
    compute_dtype, lse (b, h, sq) (float64 for the float64 oracle, else float32)."""
    b, sq, h, _ = q.shape
    sk, h_kv = k.shape[1], k.shape[2]
    group = h // h_kv
    qc, kc, vc = (t.to(compute_dtype) for t in (q, k, v))
    kc, vc = kc.repeat_interleave(group, dim=2), vc.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qc, kc) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    off = sk - sq
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left is not None:
        visible &= j >= i + off - left
    if right is not None:
        visible &= j <= i + off + right
    s = s.masked_fill(~visible, float("-inf"))
    # As cute_flash.reference does: the row max subtracted before exp, the sum divided out after the product.
    row_max = s.amax(dim=-1, keepdim=True) if sk else s.new_full((b, h, sq, 1), float("-inf"))
    sinks = None
    if sink is not None:
        sinks = sink.to(compute_dtype).view(1, h, 1, 1)
        row_max = torch.maximum(row_max, sinks)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max).detach()
    p = torch.exp(s - row_max)
    row_sum = p.sum(dim=-1, keepdim=True)
    if sinks is not None:
        row_sum = row_sum + torch.exp(sinks - row_max)
    safe_sum = torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
    out = torch.einsum("bhqk,bkhd->bqhd", p / safe_sum, vc)
    lse = (row_max + torch.log(row_sum)).squeeze(-1)  # -inf for a row with no key and no sink
    return out, lse if compute_dtype == torch.float64 else lse.float()


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def lse_report(lse: torch.Tensor, ref: torch.Tensor, low: torch.Tensor) -> ErrorReport:
    """Rows the oracle gives -inf must be -inf exactly; the others follow the rule (fp32 floor on the baseline)."""
    masked = torch.isneginf(ref)
    if not torch.equal(torch.isneginf(lse), masked):
        return ErrorReport("lse(-inf rows)", float("inf"), 0.0)
    keep = ~masked
    return ErrorReport("lse", max_abs(lse[keep], ref[keep]), max(max_abs(low[keep], ref[keep]), 1e-4))


def assert_reports(reports: Sequence[ErrorReport], finite: Sequence[Tuple[str, torch.Tensor]] = ()) -> None:
    for name, t in finite:
        assert torch.isfinite(t).all(), f"{name} has non-finite values"
    bad = [str(r) for r in reports if not r.ok]
    assert not bad, "; ".join(bad)

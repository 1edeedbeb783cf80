"""Checks each benchmarked result against the float64 reference, so that a fast wrong kernel posts no number.

The rule is the project's (`cute_flash.testing.ErrorReport`): error against float64 at most twice the error of plain
torch in the input dtype, plus 1e-5. Plain torch has no fp8 attention, so for fp8 the baseline is the plainest fp8
recipe, one scale per tensor and no rotation (`cute_flash.fp8.emulate`, scheme "fp8_tensor": the accuracy study's
baseline), with the FP8 budget's slack (docs/fp8.md): an fp8 kernel at least as accurate as per-tensor FP8 passes.

To stay cheap at long sequences the check looks at batch 0 and the query heads of kv head 0 only, and for the
forward at the last `max_rows` query rows: with bottom-right aligned masks the last R rows of a (sq, sk) problem are
exactly an (R, sk) problem, so the reference needs no extra arguments. The backward check takes every row (dk and
dv depend on all of them) unless the score matrix would be too large, in which case it checks dq of the last rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ..reference import attention_reference
from ..testing import ABS_SLACK, FP8_ABS_SLACK, ErrorReport
from .grid import Case

# Largest score matrix (sq · sk elements of one head) the backward reference materialises in float64.
MAX_FULL_BACKWARD_PAIRS = 1 << 28


@dataclass
class Verdict:
    ok: bool
    reports: List[ErrorReport]

    @property
    def worst(self) -> Optional[ErrorReport]:
        """The report closest to (or furthest past) its bound."""
        if not self.reports:
            return None
        return max(self.reports, key=lambda r: r.err / r.bound if r.bound > 0 else float("inf"))

    def summary(self) -> str:
        return "; ".join(str(r) for r in self.reports)


def _slices(case: Case) -> Tuple[slice, slice]:
    """(query heads, kv heads) of the checked group: kv head 0 and the query heads that read it."""
    group = case.shape.heads // case.shape.heads_kv
    return slice(0, group), slice(0, 1)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def _fp8_baseline(q, k, v, *, causal: bool, softmax_scale: float) -> torch.Tensor:
    """Per-tensor-scaled FP8 attention without rotation, as `cute_flash.fp8.emulate` models it."""
    from ..fp8.emulate import emulated_attention

    return emulated_attention(q, k, v, scheme="fp8_tensor", causal=causal, softmax_scale=softmax_scale)


def _report(
    name: str, got: torch.Tensor, ref: torch.Tensor, baseline_err: float, abs_slack: float = ABS_SLACK
) -> ErrorReport:
    err = _max_abs(got, ref) if torch.isfinite(got).all() else float("inf")
    return ErrorReport(name, err, baseline_err, abs_slack)


class ForwardReference:
    """The float64 reference and the baseline's error on the checked slice of one case's inputs, computed once and
    then held against every implementation's output."""

    def __init__(self, case: Case, q, k, v, scale: float, max_rows: int = 4096):
        self.heads, kv_heads = _slices(case)
        self.abs_slack = FP8_ABS_SLACK if case.dtype == "fp8" else ABS_SLACK
        self.rows = slice(max(0, case.shape.seqlen_q - max_rows), case.shape.seqlen_q)
        qs, ks, vs = (t.detach() for t in (q[:1, self.rows, self.heads], k[:1, :, kv_heads], v[:1, :, kv_heads]))
        with torch.no_grad():
            self.ref = attention_reference(qs, ks, vs, causal=case.causal, softmax_scale=scale)
            if case.dtype == "fp8":
                baseline = _fp8_baseline(qs, ks, vs, causal=case.causal, softmax_scale=scale)
            else:
                baseline = attention_reference(
                    qs, ks, vs, causal=case.causal, softmax_scale=scale, compute_dtype=q.dtype
                )
            self.baseline_err = _max_abs(baseline, self.ref)

    def verdict(self, out: torch.Tensor) -> Verdict:
        report = _report("out", out[:1, self.rows, self.heads], self.ref, self.baseline_err, self.abs_slack)
        return Verdict(report.ok, [report])


class BackwardReference:
    """Reference gradients for one case's inputs and output gradient, held against every implementation's."""

    def __init__(self, case: Case, q, k, v, dout: torch.Tensor, scale: float, max_rows: int = 4096):
        self.heads, self.kv_heads = _slices(case)
        s = case.shape
        group = s.heads // s.heads_kv
        self.full = s.seqlen_q * s.seqlen_k * group <= MAX_FULL_BACKWARD_PAIRS
        self.rows = slice(0, s.seqlen_q) if self.full else slice(max(0, s.seqlen_q - max_rows), s.seqlen_q)
        sliced = [t.detach() for t in (q[:1, self.rows, self.heads], k[:1, :, self.kv_heads], v[:1, :, self.kv_heads])]
        d_out = dout[:1, self.rows, self.heads]

        def reference_grads(compute_dtype):
            leaves = [t.to(compute_dtype).requires_grad_(True) for t in sliced]
            with torch.enable_grad():
                o = attention_reference(*leaves, causal=case.causal, softmax_scale=scale, compute_dtype=compute_dtype)
                o.backward(d_out.to(compute_dtype))
            return [t.grad for t in leaves]

        self.names = ("dq", "dk", "dv") if self.full else ("dq",)  # dk, dv need every query row
        self.ref = reference_grads(torch.float64)[: len(self.names)]
        low = reference_grads(q.dtype)
        self.baseline_errs = [_max_abs(b, r) for b, r in zip(low, self.ref)]

    def verdict(self, grads: Sequence[torch.Tensor]) -> Verdict:
        dq, dk, dv = grads
        got = [dq[:1, self.rows, self.heads], dk[:1, :, self.kv_heads], dv[:1, :, self.kv_heads]]
        reports = [_report(n, g, r, b) for n, g, r, b in zip(self.names, got, self.ref, self.baseline_errs)]
        return Verdict(all(r.ok for r in reports), reports)


def check_forward(case: Case, q, k, v, out: torch.Tensor, scale: float, max_rows: int = 4096) -> Verdict:
    """One-off forward check (the runner keeps a ForwardReference per case instead)."""
    return ForwardReference(case, q, k, v, scale, max_rows).verdict(out)


def check_backward(
    case: Case, q, k, v, dout: torch.Tensor, grads: Sequence[torch.Tensor], scale: float, max_rows: int = 4096
) -> Verdict:
    """One-off backward check (the runner keeps a BackwardReference per case instead)."""
    return BackwardReference(case, q, k, v, dout, scale, max_rows).verdict(grads)

"""Measures one case for every implementation: first call, correctness, median time, host overhead, memory.

Every case draws fresh random inputs, which all implementations share, and checks them against one reference
computed once per case. An implementation that cannot run a case is recorded as "n/a" (its own
NotImplementedError included), one that runs out of memory as "oom", one whose result breaks the accuracy rule as
"wrong" (with no time), and anything else as "error"; none of these stops the grid. A CUDA error that leaves the
context unusable does stop it, since every later measurement would fail too.
"""

from __future__ import annotations

import math
import time
from dataclasses import astuple, dataclass
from typing import Callable, Optional, Sequence

import torch

from ..compile_cache import cache_info
from ..testing import random_qkv
from . import check
from .flops import tflops
from .grid import Case
from .memory import peak_extra_mib, release
from .peers import CUTE_FLASH, Impl
from .results import Result
from .timing import TimingOptions, first_call, host_overhead_us, median_ms

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}  # fp8 reads bf16 inputs

_FATAL_MARKERS = (
    "illegal memory access",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
    "device-side assert",
    "CUDA error: an illegal",
    "uncorrectable ECC",
)


class FatalCudaError(RuntimeError):
    """The CUDA context is unusable; the run stops and keeps what it measured so far."""


@dataclass(frozen=True)
class RunOptions:
    timing: TimingOptions = TimingOptions()
    quadratic_max_seqlen: Optional[int] = None  # skip O(N²)-memory implementations beyond this seqlen
    check_rows: int = 4096


def _is_fatal(e: BaseException) -> bool:
    text = str(e)
    return any(m in text for m in _FATAL_MARKERS)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:240]


def make_inputs(case: Case, requires_grad: bool = False):
    # Shape's fields are random_qkv's extents, in its order (batch, seqlen_q, seqlen_k, heads, heads_kv, d, dv).
    return random_qkv(
        *astuple(case.shape),
        dtype=TORCH_DTYPES[case.dtype],
        device="cuda",
        requires_grad=requires_grad,
    )


class CaseData:
    """One case's fresh random inputs (and output gradient), shared by every implementation, and the reference
    they are all checked against, computed once on first use."""

    def __init__(self, case: Case, check_rows: int):
        self.case = case
        self.check_rows = check_rows
        self.scale = 1.0 / math.sqrt(case.shape.head_dim)
        self.q, self.k, self.v = make_inputs(case)
        s = case.shape
        self.dout = None
        if case.direction != "fwd":
            self.dout = torch.randn(
                s.batch, s.seqlen_q, s.heads, s.head_dim_v, device="cuda", dtype=TORCH_DTYPES[case.dtype]
            )
        self._reference = None

    def reference(self):
        if self._reference is None:
            if self.dout is None:
                self._reference = check.ForwardReference(self.case, self.q, self.k, self.v, self.scale, self.check_rows)
            else:
                self._reference = check.BackwardReference(
                    self.case, self.q, self.k, self.v, self.dout, self.scale, self.check_rows
                )
        return self._reference


def _compile_seconds_since(before: dict) -> float:
    return sum(sec for key, sec in cache_info().items() if key not in before)


def _host_calls(opts: RunOptions, ms: float) -> int:
    """Enough calls for a stable host mean, but no more than about 200 ms of device work (naive at long seqlens)."""
    return max(3, min(opts.timing.host_calls, int(200.0 / max(ms, 1e-3))))


def _fill_check(result_kw: dict, verdict: check.Verdict) -> None:
    worst = verdict.worst
    if worst is not None:
        result_kw["max_err"] = worst.err if math.isfinite(worst.err) else None
        result_kw["err_bound"] = worst.bound
        if not verdict.ok:
            result_kw["note"] = verdict.summary() if math.isfinite(worst.err) else "non-finite values in the result"


def _timed_result(
    impl: Impl, data: CaseData, opts: RunOptions, call, verdict: check.Verdict, kw: dict, grad_to_none=None
) -> Result:
    """Posts a time only for a result that passed the accuracy check."""
    _fill_check(kw, verdict)
    if not verdict.ok:
        return Result.for_case(impl.name, data.case, "wrong", **kw)
    kw["ms"] = median_ms(call, opts.timing, grad_to_none=grad_to_none)
    kw["tflops"] = tflops(data.case.flops, kw["ms"])
    kw["host_us"] = host_overhead_us(call, _host_calls(opts, kw["ms"]), grad_to_none=grad_to_none)
    return Result.for_case(impl.name, data.case, "ok", **kw)


def _first_call_stats(impl: Impl, call) -> tuple:
    """(what the first call returned, {first_call_s, peak_extra_mib[, compile_s]}): the first call, compilation
    included, timed alone."""
    compiled_before = cache_info()
    kw: dict = {}
    (out, kw["first_call_s"]), kw["peak_extra_mib"] = peak_extra_mib(lambda: first_call(call))
    if impl.name == CUTE_FLASH:
        kw["compile_s"] = _compile_seconds_since(compiled_before)
    return out, kw


def _gradient_result(impl: Impl, data: CaseData, opts: RunOptions, call, leaves) -> Result:
    """Times `call`, which leaves q, k, v's gradients in `leaves`, after checking them."""
    _, kw = _first_call_stats(impl, call)
    verdict = data.reference().verdict([t.grad for t in leaves])
    return _timed_result(impl, data, opts, call, verdict, kw, grad_to_none=leaves)


def measure_forward(impl: Impl, data: CaseData, opts: RunOptions) -> Result:
    q, k, v, case = data.q, data.k, data.v, data.case
    call = lambda: impl(q, k, v, case, data.scale)  # noqa: E731
    out, kw = _first_call_stats(impl, call)
    verdict = data.reference().verdict(out)
    del out
    return _timed_result(impl, data, opts, call, verdict, kw)


def measure_backward(impl: Impl, data: CaseData, opts: RunOptions) -> Result:
    # Leaves of this implementation's own graph, sharing the case's input storage.
    leaves = tuple(t.detach().requires_grad_(True) for t in (data.q, data.k, data.v))
    out = impl(*leaves, data.case, data.scale)  # the forward (and its compilation) is not part of the numbers
    dout = data.dout
    call = lambda: out.backward(dout, retain_graph=True)  # noqa: E731
    return _gradient_result(impl, data, opts, call, leaves)


def measure_forward_backward(impl: Impl, data: CaseData, opts: RunOptions) -> Result:
    """One training step's attention: the forward and its backward in one timed call (gradients as in "bwd")."""
    leaves = tuple(t.detach().requires_grad_(True) for t in (data.q, data.k, data.v))
    dout = data.dout
    call = lambda: impl(*leaves, data.case, data.scale).backward(dout)  # noqa: E731
    return _gradient_result(impl, data, opts, call, leaves)


def measure(impl: Impl, data: CaseData, opts: RunOptions) -> Result:
    """One implementation on one case; never raises except FatalCudaError."""
    case = data.case
    reason = impl.unsupported_reason(case)
    if reason is None and impl.quadratic_memory and opts.quadratic_max_seqlen is not None:
        if max(case.shape.seqlen_q, case.shape.seqlen_k) > opts.quadratic_max_seqlen:
            return Result.for_case(
                impl.name, case, "skipped", note=f"O(N^2) memory; timed up to seqlen {opts.quadratic_max_seqlen}"
            )
    if reason is not None:
        return Result.for_case(impl.name, case, "n/a", note=reason)
    try:
        if case.direction == "fwd":
            return measure_forward(impl, data, opts)
        if case.direction == "fwdbwd":
            return measure_forward_backward(impl, data, opts)
        return measure_backward(impl, data, opts)
    except NotImplementedError as e:
        return Result.for_case(impl.name, case, "n/a", note=_first_line(e))
    except torch.cuda.OutOfMemoryError as e:
        return Result.for_case(impl.name, case, "oom", note=_first_line(e))
    except Exception as e:  # noqa: BLE001 - one implementation failing must not stop the grid
        if _is_fatal(e):
            raise FatalCudaError(f"{impl.name} on {case.label()}: {_first_line(e)}") from e
        if "No available kernel" in str(e):  # torch SDPA: the pinned backend does not take this case
            return Result.for_case(impl.name, case, "n/a", note=_first_line(e))
        return Result.for_case(impl.name, case, "error", note=_first_line(e))
    finally:
        release()


def run_grid(
    cases: Sequence[Case],
    impls: Sequence[Impl],
    opts: RunOptions,
    on_result: Callable[[Result], None],
    log: Callable[[str], None] = print,
    deadline: Optional[float] = None,
) -> int:
    """Measures every case with every implementation, reporting each result as soon as it exists.

    Stops starting new cases once time.monotonic() passes `deadline`; returns how many cases it measured.
    """
    start = time.monotonic()
    for n, case in enumerate(cases, 1):
        if deadline is not None and time.monotonic() > deadline:
            log(f"[bench] time budget spent: {len(cases) - n + 1} of {len(cases)} cases not measured")
            return n - 1
        data = CaseData(case, opts.check_rows)
        for impl in impls:
            r = measure(impl, data, opts)
            on_result(r)
            shown = f"{r.tflops:7.1f} TFLOP/s  {r.ms:.3f} ms" if r.status == "ok" else f"{r.status}: {r.note}"
            log(f"[{n}/{len(cases)} {time.monotonic() - start:6.0f}s] {case.label()}  {impl.name:<15} {shown}")
        del data
        release()
    return len(cases)

"""Device time, first-call time and host overhead of one callable.

Device time is a median over many warm calls, taken with CUDA events by `triton.testing.do_bench` (which also flushes
L2 between calls) or, without triton, by an equivalent loop here. The first call, which includes JIT compilation, is
timed on its own with a host clock around a synchronised call, and the warm host overhead is the host time of a
launch that does not wait for the device.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple, TypeVar

import torch

T = TypeVar("T")

_L2_FLUSH_BYTES = 256 << 20  # larger than any current GPU's L2


@dataclass(frozen=True)
class TimingOptions:
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    host_calls: int = 20


def first_call(fn: Callable[[], T]) -> Tuple[T, float]:
    """(result, wall seconds) of one synchronised call: what a user pays on first use (compile + launch + run)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, time.perf_counter() - start


def median_ms(
    fn: Callable[[], object], opts: TimingOptions, grad_to_none: Optional[Sequence[torch.Tensor]] = None
) -> float:
    """Median device time in milliseconds of a warm call."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return _median_ms_events(fn, opts, grad_to_none)
    return float(do_bench(fn, warmup=opts.warmup_ms, rep=opts.rep_ms, grad_to_none=grad_to_none, return_mode="median"))


def _median_ms_events(fn, opts: TimingOptions, grad_to_none) -> float:
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")

    def one(record: bool) -> Optional[float]:
        if grad_to_none:
            for t in grad_to_none:
                t.grad = None
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if record:
            end.synchronize()
            return start.elapsed_time(end)
        return None

    estimate = statistics.median(one(True) for _ in range(5))
    for _ in range(max(1, int(opts.warmup_ms / max(estimate, 1e-3)))):
        one(False)
    samples = [one(True) for _ in range(max(1, int(opts.rep_ms / max(estimate, 1e-3))))]
    return float(statistics.median(samples))


def host_overhead_us(
    fn: Callable[[], object], calls: int, grad_to_none: Optional[Sequence[torch.Tensor]] = None
) -> float:
    """Mean host time per call in microseconds, calls issued back to back without waiting for the device.

    Meaningful while the device work is queued asynchronously (the launch queue holds far more than `calls`), so it
    measures argument checking, dispatch and kernel launch rather than the kernel.
    """
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        if grad_to_none:
            for t in grad_to_none:
                t.grad = None
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6

"""Peak extra device memory of one call, and the sweep that shows O(N) against O(N²) memory.

"Extra" is what the call allocates beyond what was allocated before it (outputs, saved activations, workspaces,
materialised score matrices), as seen by torch's caching allocator, through which every implementation here allocates.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .grid import Case, Shape

MIB = float(1 << 20)


def peak_extra_mib(fn: Callable[[], object]) -> Tuple[object, float]:
    """Runs fn once; returns its result and the peak of allocated memory above the level before the call, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    return result, (torch.cuda.max_memory_allocated() - base) / MIB


def release() -> None:
    """Returns cached blocks to the driver so that one implementation's leftovers never count against the next."""
    gc.collect()
    torch.cuda.empty_cache()


@dataclass(frozen=True)
class MemoryPoint:
    impl: str
    direction: str
    dtype: str
    batch: int
    heads: int
    head_dim: int
    seqlen: int
    status: str  # "ok" | "oom" | "n/a" | "error"
    peak_extra_mib: Optional[float] = None
    note: str = ""


def memory_seqlens(start: int, stop: int) -> List[int]:
    """Doubling sequence lengths from start to stop inclusive."""
    out, s = [], start
    while s <= stop:
        out.append(s)
        s *= 2
    return out


def memory_sweep(
    impls: Sequence,
    run_call: Callable[[object, Case], Callable[[], object]],
    *,
    dtype: str,
    head_dim: int,
    heads: int,
    seqlens: Sequence[int],
    directions: Sequence[str] = ("fwd",),
    log: Callable[[str], None] = print,
) -> List[MemoryPoint]:
    """Peak extra memory per implementation and seqlen (batch 1), until the naive implementation runs out of memory.

    `run_call(impl, case)` prepares fresh inputs and returns the zero-argument call to measure (for "bwd", the
    backward call after a forward that is not counted). The sweep stops after the first seqlen at which every
    O(N²) implementation has run out of memory, so the last row shows where naive attention stops working.
    """
    points: List[MemoryPoint] = []
    exhausted = set()
    quadratic = {i.name for i in impls if i.quadratic_memory}
    for seqlen in seqlens:
        for direction in directions:
            case = Case(dtype, direction, False, Shape(1, seqlen, seqlen, heads, heads, head_dim, head_dim))
            for impl in impls:
                common = dict(
                    impl=impl.name,
                    direction=direction,
                    dtype=dtype,
                    batch=1,
                    heads=heads,
                    head_dim=head_dim,
                    seqlen=seqlen,
                )
                if (impl.name, direction) in exhausted:
                    points.append(MemoryPoint(status="oom", note="ran out at a shorter seqlen", **common))
                    continue
                reason = impl.unsupported_reason(case)
                if reason is not None:
                    points.append(MemoryPoint(status="n/a", note=reason, **common))
                    continue
                try:
                    call = run_call(impl, case)
                    _, mib = peak_extra_mib(call)
                    points.append(MemoryPoint(status="ok", peak_extra_mib=mib, **common))
                except torch.cuda.OutOfMemoryError:
                    exhausted.add((impl.name, direction))
                    points.append(MemoryPoint(status="oom", **common))
                except NotImplementedError as e:
                    points.append(MemoryPoint(status="n/a", note=str(e).splitlines()[0][:200], **common))
                except RuntimeError as e:
                    points.append(MemoryPoint(status="error", note=str(e).splitlines()[0][:200], **common))
                finally:
                    call = None  # noqa: F841 - drop the inputs and outputs before the next implementation
                    release()
                last = points[-1]
                shown = f"{last.peak_extra_mib:.0f} MiB" if last.status == "ok" else last.status
                log(f"[memory] {direction} s={seqlen} {impl.name}: {shown}")
        if quadratic and all((name, d) in exhausted for name in quadratic for d in directions):
            break
    return points

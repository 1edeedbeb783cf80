"""Markdown tables of a run: TFLOP/s per case and implementation, first-call cost, memory, and rejected results.

The tables are what the run prints last and what docs/performance.md records, so they are plain Markdown.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

from .memory import MemoryPoint
from .peers import CUTE_FLASH
from .results import Result

_STATUS_CELL = {"n/a": "n/a", "wrong": "WRONG", "oom": "OOM", "error": "error", "skipped": "skip"}


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _cell(r: Optional[Result]) -> str:
    if r is None:
        return ""
    if r.status == "ok" and r.tflops is not None:
        return f"{r.tflops:.0f}" if r.tflops >= 100 else f"{r.tflops:.3g}"
    return _STATUS_CELL.get(r.status, r.status)


def impl_order(results: Sequence[Result]) -> List[str]:
    """cute-flash first, then peers in the order they first appear."""
    names = list(OrderedDict.fromkeys(r.impl for r in results))
    return sorted(names, key=lambda n: (n != CUTE_FLASH, names.index(n)))


def best_peer(rows: Sequence[Result]) -> Optional[Result]:
    peers = [r for r in rows if r.impl != CUTE_FLASH and r.status == "ok" and r.tflops is not None]
    return max(peers, key=lambda r: r.tflops) if peers else None


def ratio_to_best_peer(rows: Sequence[Result]) -> Optional[float]:
    ours = next((r for r in rows if r.impl == CUTE_FLASH and r.status == "ok" and r.tflops), None)
    best = best_peer(rows)
    if ours is None or best is None:
        return None
    return ours.tflops / best.tflops


def group_by_case(results: Sequence[Result]) -> "OrderedDict[tuple, List[Result]]":
    groups: "OrderedDict[tuple, List[Result]]" = OrderedDict()
    for r in results:
        groups.setdefault(r.case_key(), []).append(r)
    return groups


def _shape_cells(r: Result) -> List[str]:
    seq = str(r.seqlen_q) if r.seqlen_q == r.seqlen_k else f"{r.seqlen_q}/{r.seqlen_k}"
    heads = str(r.heads) if r.heads == r.heads_kv else f"{r.heads}/{r.heads_kv}"
    dim = str(r.head_dim) if r.head_dim == r.head_dim_v else f"{r.head_dim}/{r.head_dim_v}"
    return [dim, r.mask, seq, str(r.batch), heads]


def tflops_tables(results: Sequence[Result]) -> str:
    """One table per (dtype, direction): TFLOP/s of every implementation and cute-flash's ratio to the best peer."""
    impls = impl_order(results)
    sections: "OrderedDict[tuple, list]" = OrderedDict()
    for key, rows in group_by_case(results).items():
        by_impl = {r.impl: r for r in rows}
        ratio = ratio_to_best_peer(rows)
        best = best_peer(rows)
        line = _shape_cells(rows[0]) + [_cell(by_impl.get(i)) for i in impls]
        line += [f"{ratio:.2f}" if ratio is not None else "", best.impl if best else ""]
        sections.setdefault((rows[0].dtype, rows[0].direction), []).append(line)
    header = ["d", "mask", "seqlen", "batch", "heads"] + impls + ["ours/best", "best peer"]
    out = []
    for (dtype, direction), lines in sections.items():
        out.append(f"**{dtype} {direction}** (TFLOP/s)\n\n" + _table(header, lines))
    return "\n\n".join(out)


def first_call_table(results: Sequence[Result]) -> str:
    """Per implementation and compiled configuration: the first call (compile included) and a warm call's host time."""
    groups: "OrderedDict[tuple, List[Result]]" = OrderedDict()
    for r in results:
        if r.first_call_s is not None:
            groups.setdefault((r.impl, r.dtype, r.direction, r.head_dim, r.head_dim_v, r.mask), []).append(r)
    lines = []
    for (impl, dtype, direction, d, dv, mask), rows in groups.items():
        first = rows[0]
        host = [r.host_us for r in rows if r.host_us is not None]
        dim = str(d) if d == dv else f"{d}/{dv}"
        lines.append(
            [
                impl,
                dtype,
                direction,
                dim,
                mask,
                f"{first.seqlen_q}",
                f"{first.first_call_s:.3f}",
                f"{first.compile_s:.2f}" if first.compile_s is not None else "",
                f"{statistics.median(host):.1f}" if host else "",
            ]
        )
    header = ["impl", "dtype", "dir", "d", "mask", "first seqlen", "first call s", "compile s", "warm host µs (median)"]
    return _table(header, lines)


def memory_table(points: Sequence[MemoryPoint]) -> str:
    """Peak extra memory (MiB) per seqlen and implementation, one table per direction."""
    if not points:
        return ""
    impls = list(OrderedDict.fromkeys(p.impl for p in points))
    out = []
    for direction in OrderedDict.fromkeys(p.direction for p in points):
        rows: "OrderedDict[int, Dict[str, MemoryPoint]]" = OrderedDict()
        for p in points:
            if p.direction == direction:
                rows.setdefault(p.seqlen, {})[p.impl] = p
        lines = []
        for seqlen, by_impl in rows.items():
            cells = []
            for i in impls:
                p = by_impl.get(i)
                if p is None:
                    cells.append("")
                elif p.status == "ok":
                    cells.append(f"{p.peak_extra_mib:.0f}")
                else:
                    cells.append(_STATUS_CELL.get(p.status, p.status))
            lines.append([str(seqlen)] + cells)
        first = points[0]
        title = (
            f"**{direction} peak extra memory, MiB** (batch 1, {first.heads} heads, d {first.head_dim}, {first.dtype})"
        )
        out.append(title + "\n\n" + _table(["seqlen"] + impls, lines))
    return "\n\n".join(out)


def problems_table(results: Sequence[Result]) -> str:
    """Rows that posted no number for a reason other than "not supported": wrong results, errors, OOM."""
    bad = [r for r in results if r.status in ("wrong", "error", "oom")]
    if not bad:
        return "No wrong results, errors or out-of-memory failures."
    lines = []
    for r in bad:
        err = f"{r.max_err:.3e} > {r.err_bound:.3e}" if r.max_err is not None and r.err_bound is not None else ""
        lines.append([r.impl, r.status, " ".join(_shape_cells(r)), r.dtype, r.direction, err, r.note[:160]])
    return _table(["impl", "status", "d mask seqlen batch heads", "dtype", "dir", "err > bound", "note"], lines)


def full_report(results: Sequence[Result], memory: Sequence[MemoryPoint]) -> str:
    parts = [tflops_tables(results)] if results else []
    if results:
        parts.append("**First call and warm host overhead**\n\n" + first_call_table(results))
    if memory:
        parts.append(memory_table(memory))
    if results:
        parts.append("**Rejected or failed**\n\n" + problems_table(results))
    return "\n\n".join(parts)

"""PNG plots of a run: TFLOP/s vs seqlen, cute-flash's ratio to the best peer, and peak extra memory vs seqlen.

matplotlib is optional (the project does not depend on it): without it `write_plots` returns no files and says so.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Callable, List, Sequence

from .memory import MemoryPoint
from .peers import CUTE_FLASH
from .report import group_by_case, impl_order, ratio_to_best_peer
from .results import Result


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _style(impl: str) -> dict:
    return {"linewidth": 2.5, "color": "black", "zorder": 3} if impl == CUTE_FLASH else {"linewidth": 1.2}


def _seqlen_axis(ax) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("seqlen")
    ax.grid(True, which="both", alpha=0.3)


def plot_tflops(plt, results: Sequence[Result], path: str, title: str) -> None:
    """Subplots per (head dim, mask), one line per implementation."""
    panels = list(OrderedDict.fromkeys((r.head_dim, r.head_dim_v, r.mask) for r in results))
    cols = len({p[2] for p in panels}) or 1
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.8 * rows), squeeze=False)
    for ax, (d, dv, mask) in zip(axes.flat, panels):
        for impl in impl_order(results):
            pts = sorted(
                (r.seqlen_q, r.tflops)
                for r in results
                if r.impl == impl
                and (r.head_dim, r.head_dim_v, r.mask) == (d, dv, mask)
                and r.status == "ok"
                and r.tflops
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=impl, **_style(impl))
        ax.set_title(f"d={d}" + (f"/{dv}" if dv != d else "") + f", {mask}")
        ax.set_ylabel("TFLOP/s")
        _seqlen_axis(ax)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ratio(plt, results: Sequence[Result], path: str, title: str) -> bool:
    """cute-flash TFLOP/s over the best peer's, one line per (direction, head dim, mask); False when nothing to draw."""
    lines: "OrderedDict[str, list]" = OrderedDict()
    for rows in group_by_case(results).values():
        ratio = ratio_to_best_peer(rows)
        if ratio is None:
            continue
        r = rows[0]
        lines.setdefault(f"{r.direction} d={r.head_dim} {r.mask}", []).append((r.seqlen_q, ratio))
    if not lines:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, pts in lines.items():
        ax.plot(*zip(*sorted(pts)), marker="o", markersize=3, label=label)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_ylabel("cute-flash / best peer")
    _seqlen_axis(ax)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_memory(plt, points: Sequence[MemoryPoint], path: str) -> None:
    """Peak extra MiB vs seqlen on log-log axes; an x marks where an implementation ran out of memory."""
    directions = list(OrderedDict.fromkeys(p.direction for p in points))
    fig, axes = plt.subplots(1, len(directions), figsize=(6.5 * len(directions), 4.2), squeeze=False)
    for ax, direction in zip(axes.flat, directions):
        for impl in OrderedDict.fromkeys(p.impl for p in points):
            mine = [p for p in points if p.impl == impl and p.direction == direction]
            ok = sorted((p.seqlen, p.peak_extra_mib) for p in mine if p.status == "ok")
            if ok:
                line = ax.plot(*zip(*ok), marker="o", markersize=3, label=impl, **_style(impl))[0]
                first_oom = min((p.seqlen for p in mine if p.status == "oom"), default=None)
                if first_oom is not None:
                    ax.plot([first_oom], [ok[-1][1]], marker="x", markersize=10, color=line.get_color())
        _seqlen_axis(ax)
        ax.set_yscale("log")
        ax.set_ylabel("peak extra memory, MiB")
        p0 = points[0]
        ax.set_title(f"{direction}: batch 1, {p0.heads} heads, d={p0.head_dim}, {p0.dtype} (x = out of memory)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(
    out_dir: str, results: Sequence[Result], memory: Sequence[MemoryPoint], log: Callable[[str], None] = print
) -> List[str]:
    """Writes every plot the data allows into out_dir; returns their paths."""
    plt = _pyplot()
    if plt is None:
        log("[bench] matplotlib is not installed: no plots (tables, CSV and JSON are written)")
        return []
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for dtype, direction in OrderedDict.fromkeys((r.dtype, r.direction) for r in results):
        subset = [r for r in results if r.dtype == dtype and r.direction == direction]
        if any(r.status == "ok" for r in subset):
            path = os.path.join(out_dir, f"tflops_{dtype}_{direction}.png")
            plot_tflops(plt, subset, path, f"{dtype} {direction}: TFLOP/s vs seqlen")
            written.append(path)
    for dtype in OrderedDict.fromkeys(r.dtype for r in results):
        path = os.path.join(out_dir, f"ratio_{dtype}.png")
        if plot_ratio(plt, [r for r in results if r.dtype == dtype], path, f"{dtype}: cute-flash vs best peer"):
            written.append(path)
    if any(p.status == "ok" for p in memory):
        path = os.path.join(out_dir, "memory.png")
        plot_memory(plt, memory, path)
        written.append(path)
    return written

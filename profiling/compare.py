"""Compares two profiling summaries (before/after an optimisation), kernel by kernel.

  python -m profiling.compare out/profile/before out/profile/after      # directories holding summary.csv
  python -m profiling.compare before/summary.csv after/summary.csv

Kernels are paired by position when both runs profiled the same number of kernels (a kernel's name may change with
its template parameters), otherwise by name. Numeric metrics show before, after and the relative change.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from typing import Dict, List, Tuple

from .summary import LABELS, _fmt, _number
from profiling import HelpFormatter


def load(path: str) -> List[Dict[str, str]]:
    if os.path.isdir(path):
        path = os.path.join(path, "summary.csv")
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def pair(before: List[Dict[str, str]], after: List[Dict[str, str]]) -> List[Tuple[Dict, Dict]]:
    if len(before) == len(after):
        return list(zip(before, after))
    by_name = {k["kernel"]: k for k in after}
    return [(b, by_name[b["kernel"]]) for b in before if b["kernel"] in by_name]


def compare_table(before: List[Dict[str, str]], after: List[Dict[str, str]]) -> str:
    pairs = pair(before, after)
    if not pairs:
        return "no kernels in common"
    lines = []
    for b, a in pairs:
        lines.append(f"kernel: {b['kernel']}" + ("" if a["kernel"] == b["kernel"] else f"  ->  {a['kernel']}"))
        lines.append(f"  {'metric':<44}{'before':>14}{'after':>14}{'change':>10}")
        for key, label in LABELS:
            vb, va = b.get(key, ""), a.get(key, "")
            if not vb and not va:
                continue
            nb, na = _number(vb), _number(va)
            if nb is None or na is None:
                if vb != va:
                    lines.append(f"  {label:<44}\n      before: {vb}\n      after:  {va}")
                continue
            change = f"{(na - nb) / nb * 100:+.1f}%" if nb else ""
            lines.append(f"  {label:<44}{_fmt(nb):>14}{_fmt(na):>14}{change:>10}")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("before", help="a summary.csv, or a directory holding one (ncu_profile --out)")
    p.add_argument("after", help="the same, after the change")
    args = p.parse_args(argv)
    print(compare_table(load(args.before), load(args.after)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

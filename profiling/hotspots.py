"""Per-instruction warp-stall hot spots of one kernel, from an Nsight Compute report's source page.

    ncu --import out/p/profile.ncu-rep --page source --csv --print-source sass > src.csv
    python -m profiling.hotspots src.csv [--top 40]

The report must come from a run with source-level sampling (`profiling.ncu_profile`'s default `--set full`). Prints
the kernel's stall mix (share of all samples per reason), the samples per opcode, and the `--top` SASS instructions by
samples with their three largest stall reasons: where a warp waits, not only why on average.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys
from typing import Dict, List
from profiling import HelpFormatter


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_source_csv(path: str) -> List[Dict[str, str]]:
    """Rows of the first kernel in an `ncu --page source --csv` export (the export starts with a kernel-name line)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header = rows[start]
    out = []
    for r in rows[start + 1 :]:
        if not r or r[0] == "Kernel Name":
            break
        out.append(dict(zip(header, r)))
    return out


def _stall_columns(row: Dict[str, str]) -> List[str]:
    return [k for k in row if k.startswith("stall_") and "Not Issued" not in k]


def _opcode(source: str) -> str:
    text = re.sub(r"^@!?U?P\w+\s+", "", source.strip())
    return text.split(" ")[0].split(".")[0] if text else "?"


def report(rows: List[Dict[str, str]], top: int) -> str:
    if not rows:
        return "no instructions in the export"
    stalls = _stall_columns(rows[0])
    totals: collections.Counter = collections.Counter()
    by_opcode: collections.Counter = collections.Counter()
    for r in rows:
        for s in stalls:
            totals[s[len("stall_") :]] += _number(r[s])
        by_opcode[_opcode(r["Source"])] += _number(r["# Samples"])
    stall_samples = sum(totals.values()) or 1.0
    all_samples = sum(by_opcode.values()) or 1.0
    lines = [
        f"samples: {all_samples:.0f}",
        "stall mix: " + ", ".join(f"{k} {v / stall_samples:.1%}" for k, v in totals.most_common(12)),
        "by opcode: " + ", ".join(f"{k} {v / all_samples:.1%}" for k, v in by_opcode.most_common(12)),
        "",
        f"{'address':>10} {'samples':>8} {'share':>6}  instruction / top stalls",
    ]
    for r in sorted(rows, key=lambda r: -_number(r["# Samples"]))[:top]:
        n = _number(r["# Samples"])
        reasons = sorted(((_number(r[s]), s[len("stall_") :]) for s in stalls), reverse=True)[:3]
        why = " ".join(f"{name}:{count:.0f}" for count, name in reasons if count)
        lines.append(f"{r['Address'][-6:]:>10} {n:>8.0f} {n / all_samples:>6.1%}  {r['Source'].strip()[:64]:<64} {why}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("source_csv", help="ncu --import R.ncu-rep --page source --csv --print-source sass output")
    p.add_argument("--top", type=int, default=40, help="instructions to list, most sampled first")
    args = p.parse_args(argv)
    print(report(read_source_csv(args.source_csv), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark records and their files: one row per (case, implementation), written as CSV and JSON.

Rows are plain data so that a saved results.json can be re-read to redraw tables and plots on a machine without a
GPU (`python -m cute_flash.bench --from-json DIR/results.json`).
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Dict, Iterable, List, Optional, Sequence

from .grid import Case, Shape
from .memory import MemoryPoint

STATUSES = ("ok", "n/a", "wrong", "oom", "error", "skipped")


@dataclass(frozen=True)
class _Labels:
    """The leading columns of a result row: which implementation ran which case."""

    impl: str
    dtype: str
    direction: str
    mask: str


@dataclass(frozen=True)
class Result(Shape, _Labels):
    """One row: its labels, the extents of the case's `Shape` (inherited, so that rows stay flat in CSV and JSON) and
    what was measured. Columns: impl, dtype, direction, mask, the shape's extents, then the fields below."""

    status: str  # one of STATUSES; only "ok" rows carry a time
    ms: Optional[float] = None
    tflops: Optional[float] = None
    first_call_s: Optional[float] = None  # first call, compilation included
    compile_s: Optional[float] = None  # cute-flash only: seconds spent in its compile cache during the first call
    host_us: Optional[float] = None  # host time of one warm call
    peak_extra_mib: Optional[float] = None
    max_err: Optional[float] = None  # worst checked error against float64 ...
    err_bound: Optional[float] = None  # ... and the bound it had to meet
    note: str = ""

    @classmethod
    def for_case(cls, impl: str, case: Case, status: str, **kw) -> "Result":
        return cls(impl=impl, status=status, **case.as_dict(), **kw)

    def case_key(self) -> tuple:
        return (self.dtype, self.direction, self.mask, *self.extents())


RESULT_FIELDS = [f.name for f in fields(Result)]
MEMORY_FIELDS = [f.name for f in fields(MemoryPoint)]


class CsvAppender:
    """Appends rows to a CSV file as they are measured, so that a run cut short still leaves its results."""

    def __init__(self, path: str, columns: Sequence[str]):
        self.path = path
        self.columns = list(columns)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", newline="") as f:
            csv.writer(f).writerow(self.columns)

    def append(self, row: Dict) -> None:
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.columns).writerow({c: _csv_value(row.get(c)) for c in self.columns})


def _csv_value(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def write_csv(path: str, rows: Iterable, columns: Sequence[str]) -> None:
    out = CsvAppender(path, columns)
    for r in rows:
        out.append(asdict(r) if not isinstance(r, dict) else r)


def read_csv(path: str) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_json(path: str, meta: Dict, results: Sequence[Result], memory: Sequence[MemoryPoint]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    doc = {
        "meta": meta,
        "results": [_finite(asdict(r)) for r in results],
        "memory": [_finite(asdict(m)) for m in memory],
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False, default=str)


def _finite(row: Dict) -> Dict:
    """JSON has no inf/NaN: such values become null (the row's note says what happened)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def read_json(path: str):
    """-> (meta, results, memory points) as written by `write_json`."""
    with open(path) as f:
        doc = json.load(f)
    results = [Result(**r) for r in doc.get("results", [])]
    memory = [MemoryPoint(**m) for m in doc.get("memory", [])]
    return doc.get("meta", {}), results, memory

"""Condenses an Nsight Compute report into the numbers that explain an attention kernel's speed.

Input: the raw page of a report exported as CSV with base units
(`ncu --import R.ncu-rep --csv --page raw --print-units base > raw.csv`), and optionally the configuration JSON
that profiling.target writes (FLOPs and IO-model bytes). Output, per profiled kernel: duration, achieved TFLOP/s,
speed-of-light, tensor-pipe utilisation, DRAM bytes against the IO model, L2 hit rate, occupancy and its limits,
the top warp-stall reasons, and shared-memory bank conflicts; as a text table and as CSV (one row per kernel, one
column per metric, what profiling.compare reads).

Metric names differ across GPU generations and ncu versions, so every entry lists candidates and takes the first
one present; stall reasons and tensor pipes are found by pattern.

  python -m profiling.summary raw.csv [--meta meta.json] [--csv summary.csv]
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from typing import Dict, List, Optional, Sequence, Tuple
from profiling import HelpFormatter

# (summary column, candidate raw metric names in order of preference, scale applied to the raw value)
METRICS: Sequence[Tuple[str, Sequence[str], float]] = (
    ("duration_us", ("gpu__time_duration.sum",), 1e-3),  # ns -> us
    ("sm_sol_pct", ("sm__throughput.avg.pct_of_peak_sustained_elapsed",), 1.0),
    (
        "mem_sol_pct",
        (
            "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
            "gpu__memory_throughput.avg.pct_of_peak_sustained_elapsed",
        ),
        1.0,
    ),
    (
        "dram_sol_pct",
        (
            "dram__throughput.avg.pct_of_peak_sustained_elapsed",
            "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
        ),
        1.0,
    ),
    ("dram_read_bytes", ("dram__bytes_read.sum",), 1.0),
    ("dram_write_bytes", ("dram__bytes_write.sum",), 1.0),
    ("l2_hit_pct", ("lts__t_sector_hit_rate.pct",), 1.0),
    ("achieved_occupancy_pct", ("sm__warps_active.avg.pct_of_peak_sustained_active",), 1.0),
    ("theoretical_occupancy_pct", ("sm__maximum_warps_per_active_cycle_pct",), 1.0),
    ("registers_per_thread", ("launch__registers_per_thread",), 1.0),
    ("smem_per_block_bytes", ("launch__shared_mem_per_block", "launch__shared_mem_per_block_dynamic"), 1.0),
    ("block_size", ("launch__block_size",), 1.0),
    ("grid_size", ("launch__grid_size",), 1.0),
    ("waves_per_sm", ("launch__waves_per_multiprocessor",), 1.0),
    ("occupancy_limit_registers", ("launch__occupancy_limit_registers",), 1.0),
    ("occupancy_limit_smem", ("launch__occupancy_limit_shared_mem",), 1.0),
    ("occupancy_limit_warps", ("launch__occupancy_limit_warps",), 1.0),
    (
        "issue_active_pct",
        ("sm__inst_issued.avg.pct_of_peak_sustained_active", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
        1.0,
    ),
    ("smem_ld_bank_conflicts", ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",), 1.0),
    ("smem_st_bank_conflicts", ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",), 1.0),
    ("smem_ld_wavefronts", ("l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",), 1.0),
    ("smem_st_wavefronts", ("l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum",), 1.0),
)
TENSOR_PIPE_ALL = "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"  # every tensor-pipe type
TENSOR_PIPE = re.compile(r"^sm__pipe_tensor_?op_?(\w*?)_cycles_active\.avg\.pct_of_peak_sustained_active$")
TENSOR_INST = re.compile(r"^sm__inst_executed_pipe_tensor_?op_?(\w*?)\.avg\.pct_of_peak_sustained_active$")
STALLS = (
    re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$"),
    re.compile(r"^smsp__average_warp_latency_issue_stalled_(\w+?)\.ratio$"),
)
TOP_STALLS = 6


def _number(text: str) -> Optional[float]:
    text = (text or "").strip().replace(",", "")
    if not text or text.lower() in ("n/a", "nan"):
        return None
    try:
        return float(text)
    except ValueError:
        return None


def read_raw_csv(path: str) -> List[Dict[str, str]]:
    """Rows of `ncu --csv --page raw`: a header of metric names, then (in most versions) a row of units."""
    with open(path, newline="") as f:
        lines = [line for line in f if not line.startswith("==")]  # ncu's own log lines
    # Kernel rows have a numeric ID; the units row (and any footer) does not.
    return [r for r in csv.DictReader(lines) if _number(r.get("ID", "")) is not None]


def summarize_kernel(row: Dict[str, str], meta: Optional[dict] = None) -> Dict[str, object]:
    out: Dict[str, object] = {"kernel": _short_name(row.get("Kernel Name", "?")), "id": row.get("ID", "")}
    for column, names, scale in METRICS:
        value = next((_number(row[n]) for n in names if n in row and _number(row[n]) is not None), None)
        out[column] = None if value is None else value * scale
    pipes = {m.group(1) or "all": _number(v) for k, v in row.items() if (m := TENSOR_PIPE.match(k))}
    insts = {m.group(1) or "all": _number(v) for k, v in row.items() if (m := TENSOR_INST.match(k))}
    pipes = {k: v for k, v in pipes.items() if v is not None}
    insts = {k: v for k, v in insts.items() if v is not None}
    busiest = pipes or insts
    aggregate = _number(row.get(TENSOR_PIPE_ALL, ""))
    out["tensor_pipe_pct"] = aggregate if aggregate is not None else (max(busiest.values()) if busiest else None)
    out["tensor_pipes"] = " ".join(f"{k}={v:.1f}" for k, v in sorted(pipes.items()))
    stalls: Dict[str, float] = {}
    for pattern in STALLS:
        for k, v in row.items():
            m = pattern.match(k)
            # "selected" is the cycle a warp issues, not a stall; "*_not_issued" split existing reasons.
            if m and _number(v) is not None and m.group(1) != "selected" and not m.group(1).endswith("_not_issued"):
                stalls.setdefault(m.group(1), _number(v))
        if stalls:
            break
    top = sorted(stalls.items(), key=lambda kv: -kv[1])[:TOP_STALLS]
    out["top_stalls"] = " ".join(f"{k}={v:.2f}" for k, v in top)
    ld_c, ld_w = out["smem_ld_bank_conflicts"], out["smem_ld_wavefronts"]
    out["smem_ld_conflict_pct"] = 100.0 * ld_c / ld_w if ld_c is not None and ld_w else None
    dram = [out["dram_read_bytes"], out["dram_write_bytes"]]
    out["dram_bytes"] = sum(dram) if all(x is not None for x in dram) else None
    if meta:
        _add_model(out, meta)
    return out


def _add_model(out: Dict[str, object], meta: dict) -> None:
    """Achieved TFLOP/s and DRAM bytes over the IO model; the model covers the whole call (all its kernels)."""
    out["config"] = meta.get("label", "")
    out["model_compulsory_bytes"] = meta["io_bytes"]["compulsory"]
    out["model_tiled_bytes"] = meta["io_bytes"]["tiled"]


def _short_name(name: str) -> str:
    name = re.sub(r"\(.*$", "", name)  # drop the argument list
    return name[:80]


def summarize(rows: Sequence[Dict[str, str]], meta: Optional[dict] = None) -> List[Dict[str, object]]:
    kernels = [summarize_kernel(r, meta) for r in rows]
    if meta and kernels:
        total_us = sum(k["duration_us"] or 0.0 for k in kernels)
        total_dram = sum(k["dram_bytes"] or 0.0 for k in kernels)
        for k in kernels:
            k["call_duration_us"] = total_us
            k["call_tflops"] = meta["flops"] / (total_us * 1e-6) / 1e12 if total_us else None
            k["call_dram_bytes"] = total_dram
            k["call_dram_over_compulsory"] = total_dram / meta["io_bytes"]["compulsory"] if total_dram else None
            k["call_dram_over_tiled"] = total_dram / meta["io_bytes"]["tiled"] if total_dram else None
    return kernels


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 1e6:
            return f"{v:.3e}"
        return f"{v:.2f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


LABELS = (
    ("duration_us", "duration, us"),
    ("sm_sol_pct", "SM throughput (SOL), %"),
    ("mem_sol_pct", "memory throughput (SOL), %"),
    ("dram_sol_pct", "DRAM throughput, %"),
    ("tensor_pipe_pct", "tensor pipe active, %"),
    ("tensor_pipes", "tensor pipes, %"),
    ("issue_active_pct", "issue slots busy, %"),
    ("dram_bytes", "DRAM bytes (read+write)"),
    ("dram_read_bytes", "DRAM read bytes"),
    ("dram_write_bytes", "DRAM write bytes"),
    ("l2_hit_pct", "L2 hit rate, %"),
    ("achieved_occupancy_pct", "achieved occupancy, %"),
    ("theoretical_occupancy_pct", "theoretical occupancy, %"),
    ("registers_per_thread", "registers/thread"),
    ("smem_per_block_bytes", "shared memory/block, bytes"),
    ("block_size", "block size"),
    ("grid_size", "grid size"),
    ("waves_per_sm", "waves per SM"),
    ("occupancy_limit_registers", "occupancy limit: registers (blocks)"),
    ("occupancy_limit_smem", "occupancy limit: shared memory (blocks)"),
    ("top_stalls", "top warp stalls (cycles per issue)"),
    ("smem_ld_bank_conflicts", "smem load bank conflicts"),
    ("smem_st_bank_conflicts", "smem store bank conflicts"),
    ("smem_ld_conflict_pct", "smem load conflicts / wavefronts, %"),
    ("call_duration_us", "whole call: duration, us"),
    ("call_tflops", "whole call: TFLOP/s"),
    ("call_dram_bytes", "whole call: DRAM bytes"),
    ("model_compulsory_bytes", "IO model: compulsory bytes"),
    ("model_tiled_bytes", "IO model: FA tiled bytes (no L2 reuse)"),
    ("call_dram_over_compulsory", "whole call: DRAM / compulsory"),
    ("call_dram_over_tiled", "whole call: DRAM / FA tiled"),
)


def text_table(kernels: Sequence[Dict[str, object]]) -> str:
    """Metrics down, kernels across."""
    if not kernels:
        return "no kernels in the report (check the NVTX filter / profiler range)"
    names = [f"[{k['id']}] {k['kernel'][:40]}" for k in kernels]
    width = max(len(label) for _, label in LABELS) + 2
    lines = []
    if kernels[0].get("config"):
        lines.append(f"configuration: {kernels[0]['config']}")
    lines.append("".ljust(width) + " | ".join(names))
    for key, label in LABELS:
        if all(k.get(key) in (None, "") for k in kernels):
            continue
        lines.append(label.ljust(width) + " | ".join(_fmt(k.get(key)).ljust(len(n)) for k, n in zip(kernels, names)))
    return "\n".join(lines)


def write_csv(path: str, kernels: Sequence[Dict[str, object]]) -> None:
    columns = list(dict.fromkeys(c for k in kernels for c in k))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, columns)
        w.writeheader()
        for k in kernels:
            w.writerow({c: "" if k.get(c) is None else k.get(c) for c in columns})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("raw_csv", help="ncu --import R.ncu-rep --csv --page raw --print-units base output")
    p.add_argument("--meta", default=None, help="configuration JSON from profiling.target")
    p.add_argument("--csv", default=None, help="also write the summary here (CSV, what profiling.compare reads)")
    args = p.parse_args(argv)
    meta = None
    if args.meta:
        with open(args.meta) as f:
            meta = json.load(f)
    kernels = summarize(read_raw_csv(args.raw_csv), meta)
    if args.csv:
        write_csv(args.csv, kernels)
    print(text_table(kernels))
    return 0 if kernels else 1


if __name__ == "__main__":
    sys.exit(main())

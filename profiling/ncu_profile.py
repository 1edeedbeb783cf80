"""Profiles one attention configuration under Nsight Compute and writes the report plus a short summary.

  python -m profiling.ncu_profile --impl cute-flash --dtype bf16 --direction fwd --batch 2 --seqlen 8192 \
      --heads 16 --head-dim 128 --causal --out out/profile/fwd-d128-causal
  python -m profiling.ncu_profile --impl fa4 --direction fwd --batch 1 --seqlen 65536 --varlen-seed 1 \
      --out out/profile/fa4-varlen-fwd          # packed: varlen_benchmark's drawn mix (profiling.target)
  python -m profiling.ncu_profile --direction fwd --batch 12 --seqlen 5248 --varlen-equal \
      --out out/profile/packed-equal            # the dense shape through the packed kernel

Writes into --out: NAME.ncu-rep (open it in the Nsight Compute GUI), raw.csv (every metric, base units),
meta.json (configuration, FLOPs, IO-model bytes), summary.csv and summary.txt (profiling.summary), ncu.log.
Clocks are left as the GPU runs them (`--clock-control none`), so durations match the benchmark's; only launches
inside profiling.target's `cf_profile` NVTX range, after warm-up and compilation, are profiled.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from . import summary
from .target import NVTX_RANGE, add_config_arguments, config_argv
from profiling import HelpFormatter

# Sections for --set lean: what the summary reads, without source-level sampling (faster, fewer replays).
LEAN_SECTIONS = (
    "SpeedOfLight",
    "ComputeWorkloadAnalysis",
    "MemoryWorkloadAnalysis",
    "MemoryWorkloadAnalysis_Tables",
    "Occupancy",
    "LaunchStats",
    "WarpStateStats",
    "SchedulerStats",
)


def ncu_command(args, report_base: str, meta_path: str) -> list:
    cmd = [args.ncu, "--clock-control", "none", "--profile-from-start", "off", "-f", "-o", report_base]
    # NVTX ranges are per thread and autograd runs the backward's kernels on its own thread: a backward profile
    # relies on the profiler start / stop around the range alone.
    if not args.no_nvtx_filter and args.direction != "bwd":
        cmd += ["--nvtx", "--nvtx-include", f"{NVTX_RANGE}/"]
    if args.set == "lean":
        for section in LEAN_SECTIONS:
            cmd += ["--section", section]
    else:
        cmd += ["--set", args.set]
    if args.kernel_regex:
        cmd += ["--kernel-name", f"regex:{args.kernel_regex}"]
    cmd += [sys.executable, "-m", "profiling.target"] + config_argv(args)
    cmd += ["--iters", str(args.iters), "--meta", meta_path]
    return cmd


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_config_arguments(p)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--name", default="profile", help="report file name (without .ncu-rep)")
    p.add_argument("--set", default="full", help="ncu section set: full, detailed, basic, or lean")
    p.add_argument("--iters", type=int, default=1, help="profiled calls (each kernel is replayed per section pass)")
    p.add_argument("--kernel-regex", default=None, help="profile only kernels whose name matches")
    p.add_argument(
        "--no-nvtx-filter",
        action="store_true",
        help="rely on the profiler start/stop range alone (if an ncu version rejects the NVTX filter)",
    )
    p.add_argument("--ncu", default=os.environ.get("NCU", "ncu"), help="ncu executable")
    args = p.parse_args(argv)

    if shutil.which(args.ncu) is None:
        print(f"ncu_profile: {args.ncu!r} is not on PATH (set --ncu or NCU)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    report_base = os.path.join(args.out, args.name)
    meta_path = os.path.join(args.out, "meta.json")
    cmd = ncu_command(args, report_base, meta_path)
    print("ncu_profile: " + " ".join(cmd), flush=True)
    with open(os.path.join(args.out, "ncu.log"), "w") as log:
        run = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if run.returncode != 0 or not os.path.exists(report_base + ".ncu-rep"):
        print(f"ncu_profile: ncu failed (exit {run.returncode}); see {args.out}/ncu.log:", file=sys.stderr)
        with open(os.path.join(args.out, "ncu.log")) as f:
            print("".join(f.readlines()[-25:]), file=sys.stderr)
        return 1

    raw_csv = os.path.join(args.out, "raw.csv")
    with open(raw_csv, "w") as f:
        export = subprocess.run(
            [args.ncu, "--import", report_base + ".ncu-rep", "--csv", "--page", "raw", "--print-units", "base"],
            stdout=f,
            stderr=subprocess.PIPE,
            text=True,
        )
    if export.returncode != 0:
        print(f"ncu_profile: exporting the raw page failed: {export.stderr.strip()}", file=sys.stderr)
        return 1
    with open(meta_path) as f:
        meta = json.load(f)
    kernels = summary.summarize(summary.read_raw_csv(raw_csv), meta)
    summary.write_csv(os.path.join(args.out, "summary.csv"), kernels)
    text = summary.text_table(kernels)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0 if kernels else 1


if __name__ == "__main__":
    sys.exit(main())

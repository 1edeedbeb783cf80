"""`python -m cute_flash bench`: the benchmark grid, the memory sweep, and their tables, CSV/JSON and plots.

Examples:
  python -m cute_flash bench                                   # full default grid + memory sweep
  python -m cute_flash bench --dtypes bf16 --head-dims 128 --seqlens 1024,4096 --impls cute-flash,fa4,sdpa-cudnn
  python -m cute_flash bench --shape 2,4096,4096,32,8,128 --directions fwd      # custom (GQA) shape
  python -m cute_flash bench --from-json out/bench-X/results.json             # redraw tables/plots, no GPU needed
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
import time
from dataclasses import asdict
from typing import Callable, List, Optional, Sequence

from . import grid as grid_mod
from .memory import MemoryPoint, memory_seqlens, memory_sweep
from .peers import IMPL_NAMES
from .report import full_report
from .results import MEMORY_FIELDS, RESULT_FIELDS, CsvAppender, Result, read_json, write_csv, write_json


def _csv_list(cast: Callable = str):
    def parse(text: str) -> List:
        try:
            return [cast(p.strip()) for p in text.split(",") if p.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None

    return parse


def _listed(values) -> str:
    return ",".join(str(x) for x in values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options, each with its help and default (lists are comma-separated)."""
    g = parser.add_argument_group("grid")
    g.add_argument(
        "--dtypes", type=_csv_list(), default=list(grid_mod.DTYPES),
        help=f"input dtypes, of bf16,fp16,fp8 (default {_listed(grid_mod.DTYPES)})",
    )  # fmt: skip
    g.add_argument(
        "--head-dims", type=_csv_list(int), default=list(grid_mod.HEAD_DIMS),
        help=f"head dims of the sweep (default {_listed(grid_mod.HEAD_DIMS)})",
    )  # fmt: skip
    g.add_argument(
        "--seqlens", type=_csv_list(int), default=list(grid_mod.SEQLENS),
        help=f"sequence lengths of the sweep, seqlen_q = seqlen_k (default {_listed(grid_mod.SEQLENS)})",
    )  # fmt: skip
    g.add_argument("--masks", type=_csv_list(), default=["none", "causal"], help="of none,causal (default none,causal)")
    g.add_argument(
        "--directions", type=_csv_list(), default=list(grid_mod.DEFAULT_DIRECTIONS),
        help=f"of fwd,bwd,fwdbwd (fwdbwd: a forward and its backward timed together; default "
        f"{_listed(grid_mod.DEFAULT_DIRECTIONS)})",
    )  # fmt: skip
    g.add_argument(
        "--tokens", type=int, default=grid_mod.DEFAULT_TOKENS,
        help="tokens per case: batch = tokens // seqlen (default %(default)s)",
    )  # fmt: skip
    g.add_argument(
        "--hidden", type=int, default=grid_mod.DEFAULT_HIDDEN,
        help="hidden size: heads = hidden // head_dim (default %(default)s)",
    )  # fmt: skip
    g.add_argument(
        "--shape",
        action="append",
        type=grid_mod.parse_shape,
        metavar="B,SQ,SK,H,HKV,D[,DV]",
        help="custom shape (repeatable); replaces the head-dim × seqlen sweep",
    )
    g.add_argument(
        "--impls",
        type=_csv_list(),
        default=None,
        help=f"implementations to run (default: every one that imports): {','.join(IMPL_NAMES)}",
    )
    g.add_argument("--skip-grid", action="store_true", help="run only the memory sweep")

    t = parser.add_argument_group("timing")
    t.add_argument(
        "--warmup-ms", type=float, default=25.0, help="warm-up time before each measurement, ms (default %(default)s)"
    )
    t.add_argument("--rep-ms", type=float, default=100.0, help="measured time per case, ms (default %(default)s)")
    t.add_argument(
        "--host-calls", type=int, default=20, help="calls averaged for the warm host overhead (default %(default)s)"
    )
    quadratic = "time O(N^2)-memory implementations (naive, sdpa-math) only up to this seqlen (default: no limit)"
    t.add_argument("--quadratic-max-seqlen", type=int, default=None, help=quadratic)
    t.add_argument(
        "--check-rows", type=int, default=4096,
        help="query rows compared with the float64 reference (default %(default)s)",
    )  # fmt: skip
    budget = "start no new grid case after this many seconds (the memory sweep and the files follow; default: none)"
    t.add_argument("--time-budget-s", type=float, default=None, help=budget)

    m = parser.add_argument_group("memory sweep (batch 1, doubling seqlen until naive attention runs out of memory)")
    m.add_argument("--no-memory", action="store_true", help="skip the memory sweep")
    m.add_argument(
        "--memory-dtype", default="bf16", choices=("bf16", "fp16"), help="the sweep's dtype (default %(default)s)"
    )
    m.add_argument("--memory-head-dim", type=int, default=128, help="the sweep's head dim (default %(default)s)")
    m.add_argument("--memory-heads", type=int, default=None, help="the sweep's heads (default: hidden // head dim)")
    m.add_argument("--memory-min-seqlen", type=int, default=1024, help="first seqlen (default %(default)s)")
    m.add_argument("--memory-max-seqlen", type=int, default=131072, help="last seqlen at most (default %(default)s)")
    m.add_argument("--memory-directions", type=_csv_list(), default=["fwd"], help="of fwd,bwd (default fwd)")

    o = parser.add_argument_group("output")
    o.add_argument("--out", default=None, help="output directory (default out/bench-<UTC time>)")
    o.add_argument("--no-plots", action="store_true", help="write no plots (tables, CSV and JSON only)")
    o.add_argument(
        "--from-json",
        default=None,
        metavar="results.json",
        help="print the tables and draw the plots of a saved run; measures nothing",
    )


def _log(msg: str) -> None:
    print(msg, flush=True)


def _validate(args) -> Optional[str]:
    for mask in args.masks:
        if mask not in ("none", "causal"):
            return f"--masks: unknown mask {mask!r} (none, causal)"
    for d in args.memory_directions:
        if d not in grid_mod.DIRECTIONS:
            return f"--memory-directions: unknown direction {d!r}"
    if args.impls is not None:
        unknown = sorted(set(args.impls) - set(IMPL_NAMES))
        if unknown:
            return f"--impls: unknown {unknown}; expected some of {list(IMPL_NAMES)}"
    return None


def build_cases(args) -> List[grid_mod.Case]:
    return grid_mod.build_grid(
        dtypes=args.dtypes,
        head_dims=args.head_dims,
        seqlens=args.seqlens,
        causals=[m == "causal" for m in args.masks],
        directions=args.directions,
        tokens=args.tokens,
        hidden=args.hidden,
        shapes=args.shape,
    )


def _command_line() -> str:
    """How this run was started, as `python -m cute_flash bench ...` (or `... -m cute_flash.bench ...`)."""
    argv = sys.argv[1:]
    module = "cute_flash" if argv[:1] == ["bench"] else "cute_flash.bench"
    return " ".join([os.path.basename(sys.executable), "-m", module] + argv)


def _environment(impls) -> dict:
    import torch

    from .peers import versions

    props = torch.cuda.get_device_properties(0)
    meta = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": _command_line(),
        "device": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": str(torch.backends.cudnn.version()),
        "python": platform.python_version(),
        "impls": versions(impls),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = "absent (CUDA-event timing)"
    try:
        from importlib.metadata import version

        meta["nvidia-cutlass-dsl"] = version("nvidia-cutlass-dsl")
    except Exception:  # noqa: BLE001 - informative only
        pass
    return meta


def _memory_call(impl, case):
    """Fresh inputs for `case`; returns the call whose peak memory the sweep records."""
    import torch

    from .runner import make_inputs

    scale = 1.0 / math.sqrt(case.shape.head_dim)
    if case.direction == "fwd":
        q, k, v = make_inputs(case)
        return lambda: impl(q, k, v, case, scale)
    q, k, v = make_inputs(case, requires_grad=True)
    out = impl(q, k, v, case, scale)
    dout = torch.randn_like(out)
    return lambda: out.backward(dout)


def _meta_header(meta: dict) -> str:
    """The run's environment as a Markdown list (the options stay in results.json)."""
    lines = [f"- {k}: {v}" for k, v in meta.items() if k not in ("impls", "options")]
    lines.append("- implementations: " + ", ".join(f"{k} {v}".strip() for k, v in meta.get("impls", {}).items()))
    return "\n".join(lines)


def _write_outputs(
    out_dir: str, meta: dict, results: Sequence[Result], memory: Sequence[MemoryPoint], plots: bool
) -> str:
    from .plots import write_plots

    write_json(os.path.join(out_dir, "results.json"), meta, results, memory)
    write_csv(os.path.join(out_dir, "results.csv"), results, RESULT_FIELDS)
    if memory:
        write_csv(os.path.join(out_dir, "memory.csv"), memory, MEMORY_FIELDS)
    report = full_report(results, memory)
    header = _meta_header(meta)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(header + "\n\n" + report + "\n")
    if plots:
        for path in write_plots(out_dir, results, memory, log=_log):
            _log(f"[bench] wrote {path}")
    return header + "\n\n" + report


def _replay(args) -> int:
    meta, results, memory = read_json(args.from_json)
    out_dir = args.out or os.path.dirname(os.path.abspath(args.from_json))
    if not args.no_plots:
        from .plots import write_plots

        for path in write_plots(out_dir, results, memory, log=_log):
            _log(f"[bench] wrote {path}")
    print(_meta_header(meta))
    print()
    print(full_report(results, memory))
    return 0


def main(args) -> int:
    problem = _validate(args)
    if problem:
        print(f"bench: {problem}", file=sys.stderr)
        return 2
    if args.from_json:
        return _replay(args)

    import torch

    if not torch.cuda.is_available():
        print(
            "bench: no CUDA GPU is visible; the benchmark measures on a GPU "
            "(use --from-json to redraw a saved run here)",
            file=sys.stderr,
        )
        return 2
    from .peers import select_impls
    from .runner import FatalCudaError, RunOptions, run_grid
    from .timing import TimingOptions

    try:
        cases = [] if args.skip_grid else build_cases(args)
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    impls = select_impls(args.impls, log=_log)
    if not impls:
        print("bench: none of the requested implementations is available", file=sys.stderr)
        return 2
    out_dir = args.out or os.path.join(
        "out", "bench-" + datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    )
    os.makedirs(out_dir, exist_ok=True)
    meta = _environment(impls)
    meta["options"] = {k: v for k, v in vars(args).items() if k not in ("func", "shape")}
    meta["options"]["shape"] = [asdict(s) for s in args.shape] if args.shape else None
    _log(
        f"[bench] {meta['device']} (sm_{meta['capability'].replace('.', '')}), torch {meta['torch']}; "
        f"{len(cases)} cases × {len(impls)} implementations; writing {out_dir}"
    )

    opts = RunOptions(
        timing=TimingOptions(args.warmup_ms, args.rep_ms, args.host_calls),
        quadratic_max_seqlen=args.quadratic_max_seqlen,
        check_rows=args.check_rows,
    )
    partial = CsvAppender(os.path.join(out_dir, "results.partial.csv"), RESULT_FIELDS)
    results: List[Result] = []
    memory: List[MemoryPoint] = []
    status = 0
    try:
        # Collected through the callback so that a run stopped by a fatal CUDA error keeps what it measured.
        deadline = None if args.time_budget_s is None else time.monotonic() + args.time_budget_s
        measured = run_grid(
            cases,
            impls,
            opts,
            on_result=lambda r: (results.append(r), partial.append(asdict(r))),
            log=_log,
            deadline=deadline,
        )
        if measured < len(cases):
            meta["cases_not_measured"] = len(cases) - measured
        if not args.no_memory:
            heads = args.memory_heads or max(1, args.hidden // args.memory_head_dim)
            memory = memory_sweep(
                impls,
                _memory_call,
                dtype=args.memory_dtype,
                head_dim=args.memory_head_dim,
                heads=heads,
                seqlens=memory_seqlens(args.memory_min_seqlen, args.memory_max_seqlen),
                directions=args.memory_directions,
                log=_log,
            )
    except FatalCudaError as e:
        _log(f"[bench] stopping: the CUDA context is unusable after {e}")
        meta["stopped_early"] = str(e)
        status = 1
    text = _write_outputs(out_dir, meta, results, memory, plots=not args.no_plots)
    print()
    print(text)
    wrong = sum(r.status == "wrong" for r in results)
    if wrong:
        _log(f"[bench] {wrong} result(s) failed the accuracy check (see 'Rejected or failed')")
    return status

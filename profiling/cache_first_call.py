"""First-call time in a new process: cute-flash compiling (cold disk cache), cute-flash from a warm disk cache,
cute-flash without the disk cache, beside FlashAttention-4 (flash_attn.cute, when importable) and torch SDPA.

Every run is a fresh Python process. It imports torch and creates its CUDA context and inputs first (not timed), then
times, each synchronised: the import of the implementation, the first forward, the first backward. Defaults: d128
causal bf16, b1 s128 h8 (issue 15's shape). The warm run loads what the cold run wrote, in a temporary cache
directory; `--cache-dir` uses another (e.g. one filled by `python -m cute_flash warmup`).

  python3 -m profiling.cache_first_call [--shape 1,128,8,128] [--runs 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from profiling import HelpFormatter

IMPLS = ("cute-flash", "fa4", "sdpa")
TORCH_WARMUP_ENV = "CUTE_FLASH_FIRST_CALL_TORCH_WARMUP"  # set by --torch-warmup for the child processes
PROFILE_ENV = "CUTE_FLASH_FIRST_CALL_PROFILE"  # set by --profile: where a child writes its cProfile summary


def child(impl: str, shape) -> dict:
    import torch

    b, s, h, d = shape
    torch.cuda.init()
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch_warmup_s = None
    if os.environ.get(TORCH_WARMUP_ENV) == "1":
        # torch's own first-use costs, paid here untimed when asked for, so that the rows show what each
        # implementation adds: the autograd engine's device thread, and above all the first backward given an explicit
        # gradient, whose shape check (autograd._make_grads) imports torch.fx.experimental.symbolic_shapes and sympy
        # (~0.5 s on the CPU machine, 2.3-2.8 s in the H100 machine's first backward for SDPA and cute-flash alike;
        # a scalar loss's backward does not import them).
        tw = time.perf_counter()
        x = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        (x * 2).backward(torch.ones_like(x))
        torch.cuda.synchronize()
        torch_warmup_s = time.perf_counter() - tw

    t0 = time.perf_counter()
    if impl == "cute-flash":
        import cute_flash

        fn = lambda: cute_flash.attention(q, k, v, causal=True)
    elif impl == "fa4":
        from flash_attn.cute import flash_attn_func

        def fn():
            r = flash_attn_func(q, k, v, causal=True)
            return r[0] if isinstance(r, tuple) else r
    else:
        import torch.nn.functional as F

        fn = lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        ).transpose(1, 2)
    profile_path = os.environ.get(PROFILE_ENV)
    if profile_path:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t1 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    out.backward(dout)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    if profile_path:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
        with open(profile_path, "w") as f:
            f.write(text.getvalue())
    result = {"import_s": t1 - t0, "forward_s": t2 - t1, "backward_s": t3 - t2, "first_fwd_bwd_s": t3 - t1}
    if torch_warmup_s is not None:
        result["torch_warmup_s"] = torch_warmup_s
    if impl == "cute-flash":
        from cute_flash import compile_cache

        sources = list(compile_cache.cache_sources().values())
        result["kernels"] = {src: sources.count(src) for src in sorted(set(sources))}
        result["cutlass_imported"] = "cutlass" in sys.modules
    return result


def _run(impl: str, shape, env_extra: dict, torch_warmup: bool = False) -> dict:
    env = dict(os.environ, **env_extra)
    if torch_warmup:
        env[TORCH_WARMUP_ENV] = "1"
    cmd = [sys.executable, "-m", "profiling.cache_first_call", "--child", impl, "--shape", ",".join(map(str, shape))]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--shape", default="1,128,8,128", help="batch,seqlen,heads,head_dim")
    p.add_argument("--runs", type=int, default=2, help="warm runs (and FA4 / SDPA runs) to take the median of")
    p.add_argument("--cache-dir", default=None, help="a cache directory to start from (None: a new empty one)")
    p.add_argument(
        "--torch-warmup",
        action="store_true",
        help="run one untimed torch backward in each process first, so that torch's own first-use cost is not counted",
    )
    p.add_argument("--profile", default=None, help="also write a cProfile summary of one warm-cache run to this file")
    p.add_argument("--json", action="store_true", help="print the results as JSON too")
    p.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    args = p.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    if args.child:
        print(json.dumps(child(args.child, shape)))
        return

    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="cute_flash_first_call_")
    on = {"CUTE_FLASH_CACHE_DIR": cache_dir, "CUTE_FLASH_DISK_CACHE": "1"}
    rows = []
    tw = args.torch_warmup
    if args.cache_dir is None:
        rows.append(("cute-flash, cold disk cache (compiles, writes)", [_run("cute-flash", shape, on, tw)]))
    rows.append(("cute-flash, warm disk cache", [_run("cute-flash", shape, on, tw) for _ in range(args.runs)]))
    if args.profile:
        profiled = _run("cute-flash", shape, {**on, PROFILE_ENV: os.path.abspath(args.profile)}, tw)
        if "error" in profiled:
            print(f"--profile run failed: {profiled['error']}")
    off = {"CUTE_FLASH_DISK_CACHE": "0"}
    rows.append(("cute-flash, disk cache off (compiles)", [_run("cute-flash", shape, off, tw)]))
    rows.append(("fa4 (flash_attn.cute)", [_run("fa4", shape, {}, tw) for _ in range(args.runs)]))
    rows.append(("torch sdpa", [_run("sdpa", shape, {}, tw) for _ in range(args.runs)]))

    b, s, h, d = shape
    report = {"shape": {"batch": b, "seqlen": s, "heads": h, "head_dim": d}, "cache_dir": cache_dir, "rows": {}}
    for name, runs in rows:
        ok = [r for r in runs if "error" not in r]
        if not ok:
            report["rows"][name] = {"error": runs[0]["error"]}
            continue
        med = {
            key: statistics.median(r[key] for r in ok)
            for key in ("import_s", "forward_s", "backward_s", "first_fwd_bwd_s")
        }
        if "torch_warmup_s" in ok[-1]:
            med["torch_warmup_s"] = statistics.median(r["torch_warmup_s"] for r in ok)
        report["rows"][name] = {
            **med,
            "runs": len(ok),
            **{k: ok[-1][k] for k in ("kernels", "cutlass_imported") if k in ok[-1]},
        }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    warm = " after an untimed torch backward (--torch-warmup)" if args.torch_warmup else ""
    print(f"first call in a new process{warm}, b{b} s{s} h{h} d{d} bf16 causal (median of runs; seconds)")
    print(f"{'':48} {'import':>8} {'forward':>8} {'backward':>9} {'fwd+bwd':>8}  kernels")
    for name, row in report["rows"].items():
        if "error" in row:
            print(f"{name:48} not run: {row['error']}")
            continue
        extra = ""
        if "kernels" in row:
            extra = ", ".join(f"{n} {src}" for src, n in row["kernels"].items())
            extra += ", cutlass imported" if row["cutlass_imported"] else ", cutlass not imported"
        if "torch_warmup_s" in row:
            extra += f"{', ' if extra else ''}torch's own first backward {row['torch_warmup_s']:.3f} s (untimed)"
        print(
            f"{name:48} {row['import_s']:8.3f} {row['forward_s']:8.3f} {row['backward_s']:9.3f} "
            f"{row['first_fwd_bwd_s']:8.3f}  {extra}"
        )


if __name__ == "__main__":
    main()

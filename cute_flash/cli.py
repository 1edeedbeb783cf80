"""`python -m cute_flash {info,compile,warmup,demo,bench}`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import List, Optional

from .arch import ARCH_ENV_VAR, ARCH_PACKAGES, CUTE_DSL_ARCH
from .spec import AttentionSpec

DTYPE_NAMES = ("bf16", "fp16", "fp8")


def _gpu_capability():
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


# --- info -----------------------------------------------------------------------------------------------------
def cmd_info(args) -> int:
    """versions, GPU and the backend that would serve it"""
    import torch

    from . import __version__

    print(f"cute_flash {__version__}")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}")
    try:
        from importlib.metadata import version

        print(f"nvidia-cutlass-dsl {version('nvidia-cutlass-dsl')}")
    except Exception as e:  # noqa: BLE001 - report, never crash `info`
        print(f"nvidia-cutlass-dsl: not installed ({e.__class__.__name__})")
    cap = _gpu_capability()
    if cap is None:
        print("GPU: none visible (kernels can still be cross-compiled: python -m cute_flash compile --arch ...)")
    else:
        import torch

        print(f"GPU: {torch.cuda.get_device_name()} (compute capability {cap[0]}.{cap[1]})")
    print(f"kernel cache: {_cache_summary()}")
    from . import native

    print(f"C++ call path: {native.describe()}")
    from .interface import backend

    if cap is None and not os.environ.get(ARCH_ENV_VAR):
        print(
            "backend: none (no GPU visible; cross-compile for one with python -m cute_flash compile --arch ... or "
            "warmup --arch ...)"
        )
    else:
        try:
            print(f"backend: {backend()}")
        except (ValueError, NotImplementedError) as e:
            print(f"backend: none ({e})")
    if cap is not None:
        from .routing import candidate_families

        try:
            families = candidate_families(cap, os.environ.get(ARCH_ENV_VAR) or None)
            print(
                f"routing: each call to the first of {' -> '.join(families)} with a kernel for it "
                f"(cute_flash.explain(q, k, v, ...) names the family of a given call)"
            )
        except (ValueError, NotImplementedError) as e:
            print(f"routing: none ({e})")
    return 0


def _cache_summary() -> str:
    from . import disk_cache

    if not disk_cache.enabled():
        return f"off ({disk_cache.ENV_SWITCH}=0 in the environment; docs/cache.md)"
    directory = disk_cache.entries_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return f"{directory} (empty)"
    size = 0
    for n in names:
        try:
            size += os.path.getsize(os.path.join(directory, n)) if not n.startswith(".") else 0
        except OSError:  # removed meanwhile
            pass
    entries = sum(1 for n in names if n.endswith(".json"))
    return f"{directory} ({entries} entries, {size / 2**20:.1f} MiB; fill it with python -m cute_flash warmup)"


# --- compile --------------------------------------------------------------------------------------------------
def _spec_from_args(args) -> AttentionSpec:
    mask = "causal" if args.causal else ("local" if args.local else "none")
    out_dtype = "bf16" if args.dtype == "fp8" else args.dtype
    dv = args.head_dim_v if args.head_dim_v is not None else args.head_dim
    return AttentionSpec(
        dtype=args.dtype, head_dim=args.head_dim, head_dim_v=dv, mask=mask, out_dtype=out_dtype,
        softcap=args.softcap, sink=args.sink,
    )  # fmt: skip


def compile_report(arch: str, spec: AttentionSpec, backward: bool, out_dir: str) -> List[dict]:
    """Cross-compiles every kernel serving `spec` on `arch`, writes .ptx/.cubin into out_dir; one report per kernel."""
    from .census import capture_fd_stderr, cubin_resources, parse_ptxas_reports, ptx_census, ptx_threads
    from .arch import get_backend

    backend = get_backend(arch)
    reason = backend.unsupported_reason(spec, backward)
    if reason is not None:
        raise NotImplementedError(f"{arch}: {reason}")
    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    with capture_fd_stderr() as captured:
        artifacts = backend.compile_artifacts(spec, backward, CUTE_DSL_ARCH[arch])
    seconds = time.perf_counter() - start
    ptxas = parse_ptxas_reports("".join(captured))
    reports = []
    for art in artifacts:
        features = "".join(f"_{name}" for name, on in (("softcap", spec.softcap), ("sink", spec.sink)) if on)
        stem = f"{arch}_{art.kernel}_{spec.dtype}_d{spec.head_dim}x{spec.head_dim_v}_{spec.mask}{features}"
        with open(os.path.join(out_dir, stem + ".ptx"), "w") as f:
            f.write(art.ptx)
        with open(os.path.join(out_dir, stem + ".cubin"), "wb") as f:
            f.write(art.cubin)
        resources = cubin_resources(art.cubin)
        entry, res = next(iter(resources.items()), ("?", {}))
        rep = _take_report(ptxas, entry, res.get("stack_frame_bytes"))
        reports.append(
            {
                "arch": arch,
                "kernel": art.kernel,
                "entry": entry,
                "dtype": spec.dtype,
                "head_dim": spec.head_dim,
                "head_dim_v": spec.head_dim_v,
                "mask": spec.mask,
                "softcap": spec.softcap,
                "sink": spec.sink,
                "registers": res.get("registers", rep.get("registers")),
                "spill_bytes": rep.get("spill_bytes"),
                "stack_frame_bytes": res.get("stack_frame_bytes", rep.get("stack_frame_bytes")),
                "shared_bytes": art.config.get("shared_bytes", res.get("static_shared_bytes", 0)),
                "threads": art.config.get("threads", ptx_threads(art.ptx)),
                "census": ptx_census(art.ptx),
                "config": {k: v for k, v in art.config.items() if k not in ("shared_bytes", "threads")},
                "files": [stem + ".ptx", stem + ".cubin"],
                "compile_seconds": round(seconds / max(len(artifacts), 1), 2),
            }
        )
    return reports


def _take_report(reports: List[tuple], entry: str, stack_frame_bytes: Optional[int]) -> dict:
    """Removes and returns ptxas' report for one artifact.

    Reports come in compile order, but an entry name can repeat: two builds of one kernel class (with and without
    GQA), or candidates a backend compiled and discarded (the sm80 forward tries tiles until one does not spill). The
    report whose stack frame matches the cubin's is this artifact's; failing that, the first with its name.
    """
    named = [i for i, (name, _) in enumerate(reports) if name == entry]
    for i in named:
        if reports[i][1].get("stack_frame_bytes") == stack_frame_bytes:
            return reports.pop(i)[1]
    return reports.pop(named[0])[1] if named else {}


def cmd_compile(args) -> int:
    """cross-compile kernels (no GPU needed), write .ptx/.cubin, report resources

    Cross-compiles every kernel that serves one configuration on a family (no GPU needed), writes each kernel's .ptx
    and .cubin and reports registers, spills, shared memory, threads and an instruction census. Exits 2 when the
    family has no kernel for it."""
    # CuTe DSL reads CUTE_DSL_ARCH once, at import: set it before anything imports cutlass.
    os.environ.setdefault("CUTE_DSL_ARCH", CUTE_DSL_ARCH[args.arch])
    spec = _spec_from_args(args)
    try:
        reports = compile_report(args.arch, spec, args.backward, args.out)
    except NotImplementedError as e:
        print(f"cute_flash compile: no kernel: {e}", file=sys.stderr)
        return 2
    for r in reports:
        if args.json:
            print(json.dumps(r, sort_keys=True))
        else:
            census = ", ".join(f"{k} {v}" for k, v in r["census"].items() if v)
            print(
                f"{r['arch']} {r['kernel']:<16} regs {r['registers']} spill {r['spill_bytes']} B "
                f"smem {r['shared_bytes']} B threads {r['threads']}  [{census}]  -> {args.out}/{r['files'][0]}"
            )
    return 0


# --- warmup ---------------------------------------------------------------------------------------------------
def _int_list(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _choice_list(choices):
    def parse(text: str) -> List[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(choices)}; got {text!r}")
        return items

    return parse


_BOTH = {"off": (False,), "on": (True,), "both": (False, True)}


def _warmup_capability(args):
    if args.capability:
        from .routing import parse_capability

        return parse_capability(args.capability)
    if args.arch:
        from .warmup import FAMILY_CAPABILITY

        return FAMILY_CAPABILITY[args.arch]
    return _gpu_capability()


def _kvcache_option_clash(args) -> str:
    """Options that would be silently ignored: the KV-cache forward has no backward, and the cache options mean
    nothing without --kvcache."""
    if args.kvcache:
        given = [o for o, on in (("--backward", args.backward), ("--gqa", args.gqa != "off"),
                                 ("--deterministic", args.deterministic != "off")) if on]  # fmt: skip
        return f"{', '.join(given)} with --kvcache: the KV-cache forward has no backward" if given else ""
    given = [o for o, v in (("--page-sizes", args.page_sizes), ("--fp8-cache", args.fp8_cache)) if v is not None]
    return f"{', '.join(given)} without --kvcache" if given else ""


def cmd_warmup(args) -> int:
    """fill the disk kernel cache for a list of configurations (no GPU needed: kernels are cross-compiled)

    Compiles (or finds on disk) every kernel that calls of the listed configurations launch on a GPU of the given
    compute capability and writes them to the kernel cache (CUTE_FLASH_CACHE_DIR). Lists are comma-separated; every
    combination is warmed."""
    from . import warmup

    try:
        capability = _warmup_capability(args)
    except ValueError as e:
        print(f"cute_flash warmup: --capability: {e}", file=sys.stderr)
        return 2
    if capability is None:
        print("cute_flash warmup: no GPU visible; name the target with --arch or --capability", file=sys.stderr)
        return 2
    clash = _kvcache_option_clash(args)
    if clash:
        print(f"cute_flash warmup: {clash}", file=sys.stderr)
        return 2
    config_list = warmup.configs(
        args.head_dims,
        args.dtypes,
        args.masks,
        backward=args.backward,
        gqa=_BOTH[args.gqa],
        deterministic=_BOTH[args.deterministic],
        head_dim_v=args.head_dim_v,
        softcap=args.softcap,
        sink=args.sink,
        kvcache=args.kvcache,
        page_sizes=args.page_sizes if args.page_sizes is not None else (0, 16),
        fp8_cache=_BOTH[args.fp8_cache or "off"],
    )
    try:
        summary = warmup.run(config_list, capability, jobs=args.jobs)
    except RuntimeError as e:
        print(f"cute_flash warmup: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print(f"warming {len(config_list)} configurations for {summary['target']} in {summary['cache_dir']}")
        for item in summary["items"]:
            family = item["family"] or "-"
            detail = item.get("reason") or "{built} built, {disk} loaded from disk".format(**item["kernels"])
            seconds = f"{item['seconds']:6.1f} s" if "seconds" in item else " " * 8
            print(f"  {item['status']:<11} {family:<6} {seconds}  {item['config']:<40} {detail}")
        from . import native

        print(f"  the eager forward's C++ call path: {summary['native'] or native.describe()}")
        t = summary["totals"]
        print(
            f"{t['built']} built, {t['cached']} already cached, {t['skipped']} without a kernel, "
            f"{t['unsaved']} not saved, {t['failed']} failed; {summary['seconds']:.1f} s"
        )
    return 1 if summary["totals"]["unsaved"] or summary["totals"]["failed"] else 0


# --- demo -----------------------------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    """the main job: check and time cute_flash on this machine

    On a GPU: cute_flash.attention at the given shape, checked against the float64 reference and timed beside torch
    SDPA. Without one: the tiled online-softmax algorithm against the float64 reference (at the given shape, or a
    small GQA one by default), then the forward kernels of every family cross-compiled for the given head dim and
    mask."""
    from . import demo

    return demo.run(args)


# --- bench ----------------------------------------------------------------------------------------------------
_BENCH_DOC = """benchmark against peers (torch SDPA, FlashAttention-4, naive)

Times cute-flash beside its peers over a grid of shapes (or --shape), checks every result against the float64
reference, sweeps peak memory, and writes tables, CSV / JSON and plots. Needs a GPU, except --from-json."""


def _bench_module():
    try:
        from .bench import cli as bench_cli
    except ImportError:
        return None
    return bench_cli


def _command(sub, func, name: str = "", doc: str = "") -> argparse.ArgumentParser:
    """The parser of the subcommand `func(args)` runs (`cmd_<name>`): its help is the first line of the docstring, its
    description the rest."""
    help_, _, description = (doc or func.__doc__).partition("\n\n")
    parser = sub.add_parser(name or func.__name__[len("cmd_") :], help=help_, description=description or None)
    parser.set_defaults(func=func)
    return parser


def _feature_flags(parser: argparse.ArgumentParser, builds: str) -> None:
    """--softcap / --sink: the builds with soft-capping (Gemma 2) / learnable sinks (gpt-oss); their values (the
    cap, the logits) are runtime arguments."""
    parser.add_argument("--softcap", action="store_true", help=f"the soft-capping {builds} (e.g. Gemma 2)")
    parser.add_argument("--sink", action="store_true", help=f"the learnable-sinks {builds} (e.g. gpt-oss)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cute_flash", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    _command(sub, cmd_info)

    c = _command(sub, cmd_compile)
    c.add_argument("--arch", choices=sorted(ARCH_PACKAGES), required=True, help="the kernel family")
    c.add_argument("--head-dim", type=int, required=True, help="head dim of q and k")
    c.add_argument("--head-dim-v", type=int, default=None, help="head dim of v (default: the head dim)")
    c.add_argument("--dtype", choices=DTYPE_NAMES, default="bf16", help="compute dtype (default %(default)s)")
    mask = c.add_mutually_exclusive_group()
    mask.add_argument("--causal", action="store_true", help="bottom-right causal mask")
    mask.add_argument(
        "--local", action="store_true",
        help="sliding-window mask (its bounds, negative ones included, are runtime values)",
    )  # fmt: skip
    _feature_flags(c, "build")
    c.add_argument("--backward", action="store_true", help="also compile the backward kernels")
    out = os.path.join(tempfile.gettempdir(), "cute_flash_kernels")
    c.add_argument("--out", default=out, help="where the .ptx and .cubin files go (default %(default)s)")
    c.add_argument("--json", action="store_true", help="one JSON object per kernel")

    w = _command(sub, cmd_warmup)
    target = w.add_mutually_exclusive_group()
    target.add_argument("--arch", choices=sorted(ARCH_PACKAGES), help="a family's GPU: sm80 = 8.0, sm90 = 9.0, ...")
    target.add_argument(
        "--capability", help="the GPU's compute capability, e.g. 9.0, 8.6 or sm90 (default: this GPU's)"
    )
    w.add_argument("--head-dims", type=_int_list, default=[64, 128], help="default 64,128")
    w.add_argument("--head-dim-v", type=int, default=None, help="default: equal to the head dim")
    w.add_argument("--dtypes", type=_choice_list(("bf16", "fp16")), default=["bf16"], help="bf16,fp16 (default bf16)")
    masks = _choice_list(("none", "causal", "local"))
    w.add_argument("--masks", type=masks, default=["none", "causal"], help="none,causal,local (default none,causal)")
    w.add_argument("--backward", action="store_true", help="also the backward kernels (training)")
    w.add_argument("--gqa", choices=sorted(_BOTH), default="off", help="backward with grouped heads (default off)")
    w.add_argument("--deterministic", choices=sorted(_BOTH), default="off", help="deterministic backward (default off)")
    _feature_flags(w, "builds")
    w.add_argument("--kvcache", action="store_true", help="the KV-cache forward's kernels (serving) instead")
    w.add_argument("--page-sizes", type=_int_list, default=None, help="with --kvcache; 0: dense (default 0,16)")
    w.add_argument("--fp8-cache", choices=sorted(_BOTH), default=None, help="with --kvcache: an e4m3 cache (off)")
    w.add_argument("--jobs", type=int, default=1, help="processes compiling at once (default 1)")
    w.add_argument("--json", action="store_true", help="one JSON object with every configuration's result")

    d = _command(sub, cmd_demo)
    for option, on_gpu, without in (("batch", 4, 2), ("seqlen", 4096, "100 / 173"), ("nheads", 16, "4 / 2 kv"),
                                    ("head-dim", 128, 64)):  # fmt: skip
        help_ = f"{option.replace('-', ' ')} (default: {on_gpu} on a GPU, {without} without)"
        d.add_argument(f"--{option}", type=_positive, default=None, help=help_)
    d.add_argument("--causal", action="store_true", help="causal mask (without a GPU: the only mask shown)")
    d.add_argument(
        "--no-compile", action="store_true", help="without a GPU: show the algorithm only, no cross-compiles"
    )
    d.add_argument(
        "--out", default=None, help="without a GPU: keep the cross-compiled PTX / cubins here (default: not kept)"
    )

    bench = _bench_module()
    if bench is not None:
        b = _command(sub, bench.main, "bench", _BENCH_DOC)
        bench.add_arguments(b)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)

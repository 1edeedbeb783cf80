"""Is the generated code unchanged? Cross-compiles a representative set of forward builds on the CPU and saves or
compares their normalised PTX (and ptxas' registers / spill bytes), for refactors that must not change kernels.

    python -m profiling.ptx_identity --save /tmp/ptx_before          # before the change
    python -m profiling.ptx_identity --compare /tmp/ptx_before       # after: exit 1 on any difference
    python -m profiling.ptx_identity --compare /tmp/ptx_before --arch sm90 --only fp8
    python -m profiling.ptx_identity --save /tmp/ptx_before --arch sm80 --arch sm80-sm90a --arch sm80-varlen

The sm80 family also runs on Hopper (target sm_90a) with another backward tile config ("fragment" dQ layout, red.v4,
its own dQ postprocess), and has packed (varlen) twins of every kernel, some of them reading seqused_k: the groups
sm80-sm90a, sm80-varlen and sm80-varlen-sm90a build those.

Normalised: comments, `.file` / `.loc` lines and blank lines are dropped, and every entry name (which carries the
class name and a hash of the build) becomes `KERNEL`, so a renamed class or a moved source line does not count as a
difference. Each arch is built in its own process (CuTe DSL fixes its target at import).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

from profiling import HelpFormatter

REPO = Path(__file__).resolve().parents[1]

# (dtype, head_dim, head_dim_v, mask) per arch: the forward kernels of the sm90 bf16 / FP8 and sm100 families.
CASES: Dict[str, List[Tuple[str, int, int, str]]] = {
    "sm90": [
        ("bf16", 64, 64, "none"),
        ("bf16", 64, 64, "causal"),
        ("bf16", 128, 128, "none"),
        ("bf16", 128, 128, "causal"),
        ("bf16", 128, 128, "local"),
        ("bf16", 256, 256, "none"),
        ("bf16", 256, 256, "causal"),
        ("fp8", 128, 128, "causal"),
        ("fp8", 256, 256, "none"),
    ],
    # FP8 configurations that take the paths the defaults do not (`fp8_variants` below): promote_pv, row_sum_mma,
    # the polynomial exp2.
    "sm90-variants": [
        ("fp8", 128, 128, "causal", "tile128_promote"),
        ("fp8", 128, 128, "none", "tile128_promote_row_sum_mma"),
        ("fp8", 128, 128, "local", "poly8_no_promote"),
    ],
    "sm100": [
        ("bf16", 128, 128, "causal"),  # 1-CTA and 2-CTA builds
        ("bf16", 64, 64, "local"),
        ("fp16", 96, 96, "causal"),
        ("fp8", 128, 128, "none"),
    ],
    # Kernels that share common/ code with the forward kernels: with --arch sm80 / sm90-bwd, a change there can be
    # shown not to touch them either (every kernel the backward=True compile builds: forward, pre/postprocess, main).
    "sm80": [
        ("bf16", 128, 128, "causal"),
        ("fp16", 64, 64, "local"),
    ],
    "sm90-bwd": [
        ("bf16", 128, 128, "causal"),
        ("bf16", 64, 64, "local"),
    ],
    # The sm80 family built for sm_90a: the "fragment" dQ layout, vector reductions and DqFragmentConvertSm80.
    "sm80-sm90a": [
        ("bf16", 128, 128, "causal"),
        ("fp16", 64, 64, "local"),
    ],
    # Packed (varlen) sm80 builds, with the seqused_k variants of the forward and of the main backward kernels.
    "sm80-varlen": [
        ("bf16", 128, 128, "causal"),
        ("fp16", 64, 64, "local"),
    ],
    "sm80-varlen-sm90a": [
        ("bf16", 128, 128, "causal"),
    ],
}
TARGET = {
    "sm90": "sm_90a",
    "sm90-variants": "sm_90a",
    "sm100": "sm_100a",
    "sm80": "sm_80",
    "sm90-bwd": "sm_90a",
    "sm80-sm90a": "sm_90a",
    "sm80-varlen": "sm_80",
    "sm80-varlen-sm90a": "sm_90a",
}
BACKWARD = {"sm80", "sm90-bwd"}  # also build the backward kernels (through the compile command's report)
SM80_BUILDS = {"sm80-sm90a", "sm80-varlen", "sm80-varlen-sm90a"}  # sm80 family, built here for TARGET[arch]
VARLEN = {"sm80-varlen", "sm80-varlen-sm90a"}
DEFAULT_ARCHES = ["sm100", "sm90", "sm90-variants"]

_DROP = re.compile(r"^\s*(?://|\.file\b|\.loc\b)")
_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)")


def normalise_ptx(ptx: str) -> str:
    names = set(_ENTRY.findall(ptx))
    out = []
    for line in ptx.splitlines():
        if not line.strip() or _DROP.match(line):
            continue
        line = re.sub(r"\s*//.*$", "", line)
        for name in names:
            line = line.replace(name, "KERNEL")
        out.append(line.rstrip())
    return "\n".join(out) + "\n"


def _case_name(arch: str, case) -> str:
    dtype, d, dv, mask = case[:4]
    return f"{arch}_{dtype}_d{d}x{dv}_{mask}" + "".join(f"_{v}" for v in case[4:])


def _artifact_reports(artifacts, ptxas_output: str, tmp: str) -> List[dict]:
    """Writes each artifact's PTX into tmp; its registers and stack frame from the cubin, spills from ptxas' report
    (the last one for its entry whose stack frame matches the cubin's: a backend may compile and discard candidates)."""
    from cute_flash.census import cubin_resources, parse_ptxas_reports

    ptxas = parse_ptxas_reports(ptxas_output)
    reports = []
    for art in artifacts:
        (Path(tmp) / f"{art.kernel}.ptx").write_text(art.ptx)
        entry, res = next(iter(cubin_resources(art.cubin).items()))
        named = [r for name, r in ptxas if name == entry]
        matching = [r for r in named if r.get("stack_frame_bytes") == res.get("stack_frame_bytes")] or named
        reports.append(
            {
                "kernel": art.kernel,
                "files": [f"{art.kernel}.ptx"],
                "registers": res.get("registers"),
                "spill_bytes": matching[-1].get("spill_bytes") if matching else None,
                "stack_frame_bytes": res.get("stack_frame_bytes"),
                "shared_bytes": None,
            }
        )
    return reports


def fp8_variants() -> dict:
    """The sm90 FP8 forward configurations of the "sm90-variants" group, for the kernel paths no default takes: the
    128-key tile with P·V promoted (the d <= 128 default before the 192-key tile), the same with the row sums taken
    from the P·V wgmma, and without promotion but with 8 of each row's exponentials by the FMA-pipe polynomial."""
    from cute_flash.arch.sm90.fp8.tile_config import Fp8FwdConfig
    from cute_flash.arch.sm90.tile_config import FwdTileConfig

    tile128 = FwdTileConfig(2, 128, 2)
    return {
        "tile128_promote": Fp8FwdConfig(tile128, promote_pv=True),
        "tile128_promote_row_sum_mma": Fp8FwdConfig(tile128, promote_pv=True, row_sum_mma=True),
        "poly8_no_promote": Fp8FwdConfig(tile128, promote_pv=False, exp2_poly_per_row=8),
    }


def _variant_report(spec, variant: str, tmp: str) -> List[dict]:
    """Builds the sm90 FP8 forward with one of `fp8_variants()`' configurations."""
    from cute_flash.arch.base import KernelArtifact
    from cute_flash.arch.sm90.fp8.launch import build_fp8_forward
    from cute_flash.census import capture_fd_stderr
    from cute_flash.compile_cache import keep_artifacts_options

    with capture_fd_stderr() as captured:
        compiled = build_fp8_forward(spec, fp8_variants()[variant], "sm_90a", keep_artifacts_options(tmp))
    art = KernelArtifact("fwd_fp8", compiled.artifacts.PTX, compiled.artifacts.CUBIN)
    return _artifact_reports([art], "".join(captured), tmp)


def _sm80_reports(spec, target: str, tmp: str) -> List[dict]:
    """Every sm80 kernel serving `spec` on `target` (forward and backward); packed specs add the seqused_k variants."""
    from cute_flash.arch.base import KernelArtifact
    from cute_flash.arch.sm80.backend import BACKEND
    from cute_flash.arch.sm80.build import compile_forward
    from cute_flash.arch.sm80.backward import compile_backward_artifacts
    from cute_flash.census import capture_fd_stderr

    with capture_fd_stderr() as captured:
        artifacts = BACKEND.compile_artifacts(spec, True, target)
        if spec.varlen:
            fwd = compile_forward(spec, target, "remarks{ptx}", seqused=True)
            artifacts.append(KernelArtifact("fwd_seqused", fwd.ptx, fwd.cubin))
            artifacts += compile_backward_artifacts(spec, target, ["bwd_seqused", "bwd_gqa_seqused"])
    return _artifact_reports(artifacts, "".join(captured), tmp)


def _worker(arch: str, out_dir: Path, only: str) -> None:
    """Builds every case of `arch` (in this process: CUTE_DSL_ARCH is set by the parent) into out_dir."""
    from cute_flash.cli import compile_report
    from cute_flash.spec import AttentionSpec

    for case in CASES[arch]:
        name = _case_name(arch, case)
        if only and only not in name:
            continue
        dtype, d, dv, mask = case[:4]
        out_dtype = "bf16" if dtype in ("fp8", "bf16") else dtype
        spec = AttentionSpec(dtype, d, dv, mask, out_dtype, varlen=arch in VARLEN)
        with tempfile.TemporaryDirectory(prefix="ptx_identity_") as tmp:
            if len(case) > 4:
                reports = _variant_report(spec, case[4], tmp)
            elif arch in SM80_BUILDS:
                reports = _sm80_reports(spec, TARGET[arch], tmp)
            else:
                family = arch.split("-")[0]
                reports = compile_report(family, spec, backward=arch in BACKWARD, out_dir=tmp)
            for rep in reports:
                stem = f"{name}_{rep['kernel']}"
                ptx = (Path(tmp) / rep["files"][0]).read_text()
                (out_dir / f"{stem}.ptx").write_text(normalise_ptx(ptx))
                res = {k: rep[k] for k in ("registers", "spill_bytes", "stack_frame_bytes", "shared_bytes")}
                (out_dir / f"{stem}.json").write_text(json.dumps(res, sort_keys=True) + "\n")
                print(f"{stem}: {res}", flush=True)


def build(out_dir: Path, arches: List[str], only: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for arch in arches:
        env = dict(os.environ, CUTE_DSL_ARCH=TARGET[arch], PYTHONPATH=str(REPO))
        cmd = [sys.executable, "-m", "profiling.ptx_identity", "--worker", arch, "--out", str(out_dir)]
        procs.append(subprocess.Popen(cmd + (["--only", only] if only else []), cwd=REPO, env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"a build failed: exit codes {codes}")


def compare(reference: Path, current: Path, arches: List[str], only: str) -> int:
    ref = {p.name for p in reference.iterdir() if p.name.split("_")[0] in arches and only in p.name}
    cur = {p.name for p in current.iterdir()}
    bad = 0
    for name in sorted(cur):
        if name not in ref:
            print(f"NEW      {name} (not in {reference})")
            continue
        a, b = (reference / name).read_text(), (current / name).read_text()
        if a == b:
            print(f"same     {name}")
            continue
        bad += 1
        diff = list(difflib.unified_diff(a.splitlines(), b.splitlines(), "before", "after", lineterm="", n=1))
        print(f"DIFFERS  {name} ({len(diff)} diff lines)")
        print("\n".join(diff[:40]))
    missing = sorted(n for n in ref - cur)
    if missing:
        print(f"not built this time: {', '.join(missing)}")
    print(f"{len(cur) - bad} of {len(cur)} files identical")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", type=Path, help="build and write normalised PTX into this folder")
    g.add_argument("--compare", type=Path, help="build and compare with a folder written by --save")
    g.add_argument("--worker", choices=sorted(CASES), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument(
        "--arch",
        choices=sorted(CASES),
        action="append",
        help=f"these case groups (repeatable; None: {' '.join(DEFAULT_ARCHES)})",
    )
    p.add_argument("--only", default="", help="only cases whose name contains this (e.g. fp8, d128x128_causal)")
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.out, args.only)
        return 0
    arches = args.arch or DEFAULT_ARCHES
    if args.save:
        build(args.save, arches, args.only)
        return 0
    with tempfile.TemporaryDirectory(prefix="ptx_identity_now_") as now:
        build(Path(now), arches, args.only)
        return compare(args.compare, Path(now), arches, args.only)


if __name__ == "__main__":
    sys.exit(main())

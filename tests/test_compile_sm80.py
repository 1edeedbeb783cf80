"""CPU checks of the sm80 forward: block arithmetic against brute force, and cross-compiles of the kernel.

The compiles run in subprocesses (CuTe DSL fixes its target at import) and report registers, spills and the PTX
instruction census; the kernel must use mma.sync, ldmatrix and cp.async, and must not spill for head dims <= 128.
A handful of configurations run by default; CUTE_FLASH_SM80_FULL_COMPILE=1 compiles every head dim (multiples of
8 up to 256) for both targets, which takes tens of minutes on a small machine.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cute_flash.common.block_info import BlockInfo
from cute_flash.spec import UNBOUNDED_WINDOW

REPO = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------------------------------------------
# Block arithmetic (pure Python: the same functions kernels call with Int32 values).
# ----------------------------------------------------------------------------------------------------------------
U = UNBOUNDED_WINDOW
WINDOWS = [("none", U, U), ("causal", U, 0), ("local", 4, 0), ("local", U, 3), ("local", 0, 0), ("local", 7, U),
           ("local", 2, 5), ("local", 20, 0), ("local", 0, 9)]  # fmt: skip
SHAPES = [(1, 1), (5, 3), (3, 5), (17, 40), (40, 17), (33, 33), (64, 1), (1, 64), (50, 70)]
TILES = [(4, 4), (8, 4), (4, 8), (16, 16)]


def _sees(i, j, sq, sk, kind, left, right):
    off = sk - sq
    if not 0 <= j < sk:
        return False
    if kind == "none":
        return True
    if kind == "causal":
        return j <= i + off
    return i + off - left <= j <= i + off + right


def _check_block_info(sq, sk, kind, left, right, tile_m, tile_n):
    info = BlockInfo(tile_m, tile_n, kind, sq, sk, left, right)
    seen = lambda rows, keys: any(_sees(i, j, sq, sk, kind, left, right) for i in rows for j in keys)  # noqa: E731
    hidden = lambda rows, keys: any(not _sees(i, j, sq, sk, kind, left, right) for i in rows for j in keys)  # noqa
    num_m, num_n = -(-sq // tile_m), -(-sk // tile_n)
    for m in range(num_m):
        rows = range(m * tile_m, min((m + 1) * tile_m, sq))
        lo, hi = info.kv_block_range(m)
        needed = [n for n in range(num_n) if seen(rows, range(n * tile_n, (n + 1) * tile_n))]
        if needed:  # exact for windows >= 0
            assert (lo, hi) == (needed[0], needed[-1] + 1), (m, lo, hi, needed)
        else:
            assert hi <= lo, (m, lo, hi)
        right_start = info.kv_right_masked_start(m) if info.has_right_bound else num_n
        left_end = info.kv_left_masked_end(m) if info.has_left_bound else 0
        for n in range(lo, hi):
            keys = range(n * tile_n, (n + 1) * tile_n)
            if hidden(rows, keys) and n != hi - 1:  # the last block of the range is always masked
                assert n >= right_start or n < left_end, ("unmasked forward block needs a mask", m, n)
    for n in range(num_n):
        keys = range(n * tile_n, min((n + 1) * tile_n, sk))
        lo, hi = info.q_block_range(n)
        needed = [m for m in range(num_m) if seen(range(m * tile_m, min((m + 1) * tile_m, sq)), keys)]
        if needed:  # a superset is allowed: blocks nobody sees must then be masked
            assert lo <= needed[0] and hi >= needed[-1] + 1, (n, lo, hi, needed)
        right_end = info.q_right_masked_end(n) if info.has_right_bound else 0
        left_start = info.q_left_masked_start(n) if info.has_left_bound else num_m
        for m in range(lo, hi):
            rows = range(m * tile_m, min((m + 1) * tile_m, sq))
            if hidden(rows, keys) or m not in needed:
                assert m < right_end or m >= left_start, ("unmasked backward block needs a mask", n, m)


@pytest.mark.parametrize("kind,left,right", WINDOWS, ids=lambda x: str(x))
def test_block_info_matches_brute_force(kind, left, right):
    for (sq, sk), (tile_m, tile_n) in itertools.product(SHAPES, TILES):
        _check_block_info(sq, sk, kind, left, right, tile_m, tile_n)


# ----------------------------------------------------------------------------------------------------------------
# Cross-compiles.
# ----------------------------------------------------------------------------------------------------------------
# (target, head_dim, mask, dtype): every head-dim class of the tile table, every mask, both targets and dtypes, and
# a head dim that needs padding to the MMA k (72 -> 80). One process per target builds its list: the two lists are
# balanced so that the wide head dims' process is the only long one.
DEFAULT_CONFIGS = [
    ("sm_80", 64, "causal", "bf16"),
    ("sm_80", 128, "local", "fp16"),
    ("sm_80", 72, "none", "bf16"),
    ("sm_80", 96, "none", "fp16"),
    ("sm_90a", 128, "causal", "bf16"),
    ("sm_90a", 192, "local", "bf16"),
    ("sm_90a", 256, "causal", "bf16"),
]
FULL_CONFIGS = [
    (target, d, mask, "bf16")
    for target in ("sm_80", "sm_90a")
    for d in range(8, 257, 8)
    for mask in ("none", "causal", "local")
]
CONFIGS = FULL_CONFIGS if os.environ.get("CUTE_FLASH_SM80_FULL_COMPILE") == "1" else DEFAULT_CONFIGS

# Compiles every configuration of one target in one process and prints a JSON line per kernel.
_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, re, sys
    from cute_flash.arch.sm80 import BACKEND
    from cute_flash.census import capture_fd_stderr, cubin_resources, ptx_census
    from cute_flash.spec import AttentionSpec

    SPILL = re.compile(r"(\\d+) bytes spill stores, (\\d+) bytes spill loads")
    REGS = re.compile(r"Used (\\d+) registers")
    target = sys.argv[1]
    for item in sys.argv[2:]:
        d, mask, dtype = item.split(":")
        spec = AttentionSpec(dtype, int(d), int(d), mask, dtype)
        with capture_fd_stderr() as captured:
            artifacts = BACKEND.compile_artifacts(spec, False, target)
        # One ptxas report per compiled candidate; the kept kernel is the last one compiled.
        spills = [int(a) + int(b) for a, b in SPILL.findall("".join(captured))]
        for art in artifacts:
            res = next(iter(cubin_resources(art.cubin).values()))
            print(json.dumps({
                "key": f"{target}:{item}", "kernel": art.kernel, "registers": res["registers"],
                "stack_frame_bytes": res.get("stack_frame_bytes", 0), "spill_bytes": spills[-1] if spills else None,
                "census": ptx_census(art.ptx), "config": art.config,
            }), flush=True)
    """
)


def _compile(target: str, items):
    env = dict(os.environ, CUTE_DSL_ARCH=target, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT, target, *items], env=env, capture_output=True, text=True, timeout=7200
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def compiled():
    """Every configuration, in two subprocesses at a time (the suite's machine has two cores): per target, its
    configurations split in two halves."""
    import concurrent.futures

    jobs = []
    for target in sorted({c[0] for c in CONFIGS}):
        items = [f"{d}:{mask}:{dtype}" for t, d, mask, dtype in CONFIGS if t == target]
        jobs += [(target, half) for half in (items[0::2], items[1::2]) if half]
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for reports in pool.map(lambda job: _compile(*job), jobs):
            results.update({rep["key"]: rep for rep in reports})
    return results


@pytest.mark.parametrize("target,head_dim,mask,dtype", CONFIGS, ids=lambda x: str(x))
def test_forward_compiles(compiled, target, head_dim, mask, dtype):
    rep = compiled[f"{target}:{head_dim}:{mask}:{dtype}"]
    tried = rep["config"].pop("candidates_tried")
    tried_summary = [(t["tile_n"], t["opt_level"], t["stack_frame_bytes"]) for t in tried]
    print(
        f"sm80 fwd {target} d{head_dim} {mask} {dtype}: {rep['registers']} registers, spills {rep['spill_bytes']} B, "
        f"tile {rep['config']}, candidates (tile_n, opt level, spill frame) {tried_summary}"
    )
    census = rep["census"]
    for instr in ("mma.sync", "ldmatrix", "cp.async"):
        assert census[instr] > 0, f"no {instr} in the PTX"
    assert census["wgmma.mma_async"] == 0 and census["cp.async.bulk.tensor"] == 0
    assert rep["spill_bytes"] is not None, "ptxas printed no spill report"
    assert rep["stack_frame_bytes"] == tried[-1]["stack_frame_bytes"]
    if head_dim <= 128:
        assert rep["spill_bytes"] == 0 and rep["stack_frame_bytes"] == 0, f"spills at d{head_dim}: {rep}"


def test_cli_compile_reports_census(tmp_path):
    """The project's compile command serves the sm80 family (it compiles for the family's default target, sm_80)."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("CUTE_DSL_ARCH", None)
    cmd = [sys.executable, "-m", "cute_flash", "compile", "--arch", "sm80", "--head-dim", "64", "--dtype", "fp16",
           "--out", str(tmp_path), "--json"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["kernel"] for r in reports] == ["fwd"]
    rep = reports[0]
    print(f"cli: {rep['registers']} registers, census {rep['census']}")
    assert rep["registers"] and rep["census"]["mma.sync"] > 0 and rep["census"]["ldmatrix"] > 0
    assert rep["census"]["cp.async"] > 0


_BLACKWELL_SCRIPT = textwrap.dedent(
    """
    import json
    from cute_flash.arch.sm80 import BACKEND
    from cute_flash.census import capture_fd_stderr, cubin_resources, ptx_census
    from cute_flash.spec import AttentionSpec

    for spec in (AttentionSpec("bf16", 128, 128, "causal", "bf16"), AttentionSpec("fp16", 80, 80, "none", "fp16")):
        with capture_fd_stderr():
            artifacts = BACKEND.compile_artifacts(spec, True, "sm_100a")
        for art in artifacts:
            res = next(iter(cubin_resources(art.cubin).values()))
            print(json.dumps({"spec": spec.head_dim, "kernel": art.kernel, "census": ptx_census(art.ptx),
                              "target": ".target sm_100a" in art.ptx, **res}), flush=True)
    """
)


def test_sm80_kernels_cross_compile_for_blackwell():
    """On Blackwell every call without an sm100 kernel (other head dims, packed sequences, KV caches, score_mod /
    mask_mod, a deterministic backward) runs the sm80 family built for sm_100a (routing.py): its forward and backward
    compile for that target with the FlashAttention-2 instructions (d128 causal, and d80, whose backward runs the d96
    kernels on padded operands).
    Never run on a Blackwell GPU. Their stack frames (ptxas' spills at 255 registers, as on sm_90a) stay small."""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_100a", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", _BLACKWELL_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for d in (128, 80):
        kernels = {r["kernel"]: r for r in reports if r["spec"] == d}
        assert set(kernels) == {"fwd", "bwd_preprocess", "bwd", "bwd_gqa", "bwd_postprocess"}, kernels.keys()
        for name in ("fwd", "bwd", "bwd_gqa"):
            r = kernels[name]
            assert r["target"] and r["census"]["mma.sync"] > 0 and r["census"]["cp.async"] > 0, r
            assert r["census"]["wgmma.mma_async"] == 0 and r["census"]["tcgen05.mma"] == 0, r
            assert r["stack_frame_bytes"] <= 64, r

"""CPU: the sm90 backward cross-compiles for sm_90a and is built the way FlashAttention-3's design says (no GPU).

Per head dim with an sm90 backward configuration and causal on/off, through `python -m cute_flash compile --arch sm90
--backward` in a subprocess (CuTe DSL fixes its target at import; ptxas' report goes to that process's stderr): the
main kernel's PTX must hold wgmma in both forms (SS for Sᵀ, dPᵀ and dQ; register-A for dV and dK), TMA bulk-tensor
loads, setmaxnreg and the bulk reduce-add of dQ (d256: dQ added from registers, except in deterministic builds);
ptxas must report zero spill bytes, for the plain, GQA and deterministic builds alike.
"""

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cute_flash.spec import AttentionSpec

REPO = Path(__file__).resolve().parents[1]
# Head dims with kernels of their own: d == dv, or a (head_dim, head_dim_v) pair (tile_config.bwd_head_dim_pairs).
HEAD_DIMS = (64, 96, 128, 192, 256, (192, 128))
QUERIES_ON_ROWS = (192, 256)  # head dims whose configuration puts the queries on the S rows, with dQ from registers
# (head_dim, causal) builds. Every head dim's configuration and both masks' code paths by default (d128 both: its
# masks take different configurations; (192, 128) builds d192's configuration with dO / V of their own width);
# CUTE_FLASH_SM90_FULL_COMPILE=1 builds the other pairs too (spill-free when last run), which the CPU suite leaves out
# for time.
DEFAULT_BUILDS = [(64, True), (96, False), (128, False), (128, True), ((192, 128), True), (256, False)]
FULL_BUILDS = [(d, causal) for d in HEAD_DIMS for causal in (False, True)]
BUILDS = FULL_BUILDS if os.environ.get("CUTE_FLASH_SM90_FULL_COMPILE") == "1" else DEFAULT_BUILDS


def _dims(head_dim) -> tuple:
    return head_dim if isinstance(head_dim, tuple) else (head_dim, head_dim)


def _compile(out_dir, head_dim, causal: bool) -> subprocess.CompletedProcess:
    d, dv = _dims(head_dim)
    cmd = [sys.executable, "-m", "cute_flash", "compile", "--arch", "sm90", "--backward", "--head-dim", str(d)]
    cmd += ["--head-dim-v", str(dv), "--dtype", "bf16", "--out", str(out_dir), "--json"]
    cmd += ["--causal"] if causal else []
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Every (head_dim, causal) build of BUILDS, started at once and compiled two at a time: each is one
    single-threaded subprocess, so the suite's 2-core machine finishes them in about half the time."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1)))
    futures = {
        (d, causal): pool.submit(_compile, tmp_path_factory.mktemp(f"sm90_bwd_{_build_id((d, causal))}"), d, causal)
        for d, causal in BUILDS
    }
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def _compile_reports(builds, head_dim: int, causal: bool) -> dict:
    done = builds[(head_dim, causal)].result()
    assert done.returncode == 0, done.stderr[-2000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {r["kernel"]: r for r in reports}


def _build_id(build) -> str:
    d, dv = _dims(build[0])
    return f"{d if d == dv else f'{d}x{dv}'}-{'causal' if build[1] else 'full'}"


@pytest.mark.parametrize("head_dim,causal", BUILDS, ids=[_build_id(b) for b in BUILDS])
def test_sm90_backward_compiles(builds, head_dim, causal):
    reports = _compile_reports(builds, head_dim, causal)
    roles = {"bwd", "bwd_gqa", "bwd_det", "bwd_gqa_det"}
    assert roles | {"fwd", "bwd_dq_postprocess", "bwd_preprocess"} <= set(reports), sorted(reports)
    long_roles = set()
    if (head_dim, causal) == (128, False):
        # Long query sequences without a mask take the 80-row tile (tile_config.long_queries; dQᵀ = Kᵀ·dSᵀ, dV's
        # first k-block before the dP wait): its main kernels pass the same checks, and its dQ conversion writes dQᵀ
        # with the transposing stmatrix.
        long_roles = {"bwd_long", "bwd_gqa_long"}
        assert long_roles | {"bwd_dq_postprocess_long"} <= set(reports), sorted(reports)
        assert reports["bwd_dq_postprocess_long"]["census"]["stmatrix.trans"] > 0
        assert reports["bwd_dq_postprocess"]["census"]["stmatrix.trans"] == 0
    for role in sorted(roles | long_roles):
        report = reports[role]
        census = report["census"]
        if _dims(head_dim)[0] in QUERIES_ON_ROWS:  # P and dS through shared memory, every product SS
            assert census["wgmma.mma_async"] > 0 and census["wgmma.mma_async.rs"] == 0, census
        else:
            assert census["wgmma.mma_async"] > census["wgmma.mma_async.rs"] > 0, census  # SS and RS forms
        assert census["cp.async.bulk.tensor"] > 0
        assert census["setmaxnreg"] >= 2  # producer decreases, consumers increase
        if _dims(head_dim)[0] in QUERIES_ON_ROWS and not role.endswith("_det"):  # dq_red: dQ from registers
            assert census["red.global.add.v4.f32"] > 0 and census["cp.reduce.async.bulk"] == 0, census
        else:
            assert census["cp.reduce.async.bulk"] > 0, "dQ must be added by the bulk reduce-add"
            assert census["red.global.add.v4.f32"] == 0, "dQ from registers (dq_red) is on at d192 / d256 only"
        # K and V ride on the first Q / dO stage's barrier, each adding its bytes there
        assert census["mbarrier.expect_tx"] == 2, census
        assert census["mma.sync"] == 0, "the sm90 backward must not fall back to mma.sync"
        assert report["threads"] == 384
        assert report["spill_bytes"] == 0, f"{role} d={head_dim} spills {report['spill_bytes']} bytes"
        # Built at the call's own head dims (no padding): (192, 128) reads dO and V 128 wide.
        assert (report["head_dim"], report["head_dim_v"]) == _dims(head_dim)
        # d128: the 80-row tile loads LSE / D where they are used (no shuffles), and the causal build loads D after
        # dV's early product is issued (tile_config._BWD_LONG_QUERIES, _BWD_BY_HEAD_DIM_AND_MASK)
        assert report["config"]["stats_at_use"] == (role in long_roles), role
        # the 80-row tile loads 7 column pairs' LSE while S runs (tile_config.BwdTileConfig.lse_ahead)
        assert report["config"]["lse_ahead"] == (7 if role in long_roles else 0), role
        if (
            role in long_roles
        ):  # no statistics shuffles: no more shuffles than the 64-row build (16 columns in registers)
            assert census["shfl.sync"] == reports[role.removesuffix("_long")]["census"]["shfl.sync"], role
        assert report["config"]["d_after_dv_issue"] == ((head_dim, causal) == (128, True)), role
        # d64 causal stages dQ in two shared buffers (tile_config._BWD_BY_HEAD_DIM_AND_MASK), all 227 KiB; not its
        # deterministic builds, whose dQ warp waits for every reduce (tile_config._NOT_DETERMINISTIC)
        if (head_dim, causal) == (64, True) and not role.endswith("_det"):
            assert report["config"]["dq_buffers"] == 2 and report["shared_bytes"] == 232448, report["config"]
        else:
            assert report["config"]["dq_buffers"] == 1
    # Programmatic dependent launch from the preprocess to the main kernel to the dQ postprocess: the sm90
    # preprocess build signals its dependent, the main kernel waits (producer, dQ warp, epilogue) and signals, the dQ
    # postprocess waits.
    expected = {"bwd_preprocess": (0, 1), "bwd_dq_postprocess": (1, 0), **{role: (3, 1) for role in roles | long_roles}}
    if long_roles:
        expected["bwd_dq_postprocess_long"] = (1, 0)
    for role, (waits, launches) in sorted(expected.items()):
        census = reports[role]["census"]
        assert (census["griddepcontrol.wait"], census["griddepcontrol.launch_dependents"]) == (waits, launches), (
            role,
            census,
        )
    assert "sm80_bwd_preprocess" not in reports
    if _dims(head_dim)[0] != _dims(head_dim)[1]:  # GQA's dV sums convert at head_dim_v
        assert reports["sm80_bwd_postprocess_v"]["config"]["head_dim"] == _dims(head_dim)[1]


@pytest.mark.parametrize("head_dim,causal", BUILDS, ids=[_build_id(b) for b in BUILDS])
def test_sm90_forward_compiles(builds, head_dim, causal):
    """The forward that `compile --backward` builds first (the d == dv forward builds of the suite)."""
    from tests.test_compile_sm90 import check_census

    report = _compile_reports(builds, head_dim, causal)["fwd"]
    check_census(report)
    if max(_dims(head_dim)) <= 128:
        assert report["spill_bytes"] == 0, f"d={head_dim} spills {report['spill_bytes']} bytes"


def test_sm90_backward_support():
    from cute_flash.arch.sm90 import BACKEND
    from cute_flash.arch.sm90.backward import backward_unsupported_reason

    for d in HEAD_DIMS:
        spec = AttentionSpec("bf16", *_dims(d), "causal", "bf16")
        assert backward_unsupported_reason(spec) is None
        assert BACKEND.unsupported_reason(spec, backward=True, deterministic=True) is None
    # (192, 128) has kernels of its own; other head dims run a wider tile on zero-padded operands (deterministic too):
    # d160 and (160, 128) the d192 kernels, (192, 256) and d224 the d256 ones, d32 the d64 ones.
    from cute_flash import routing
    from cute_flash.arch.sm90.backward import kernel_spec

    for d, dv, dims in ((192, 192, (192, 192)), (192, 128, (192, 128)), (160, 128, (192, 192)), (160, 160, (192, 192)),
                        (192, 256, (256, 256)), (224, 224, (256, 256)), (32, 32, (64, 64))):  # fmt: skip
        other = AttentionSpec("bf16", d, dv, "none", "bf16")
        assert BACKEND.unsupported_reason(other, backward=True, deterministic=True) is None
        assert routing.route(other, (9, 0), backward=True, deterministic=True).family == "sm90"
        assert kernel_spec(other) == AttentionSpec("bf16", *dims, "none", "bf16")

"""CPU: the packed (varlen) sm90 forward and backward cross-compile for sm_90a with the dense kernels' instructions
(TMA loads, wgmma, setmaxnreg), without spills, and write O / dK, dV / dQ with 16-byte predicated stores instead of
TMA stores (a TMA store would clip only at the end of the packed tensor); the deterministic packed build waits on
its semaphores. Dense builds are unchanged by them
(normalised PTX identical, `python -m profiling.ptx_identity --compare` on the sm90 and sm90-bwd groups;
docs/varlen.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import json, sys, tempfile
from cute_flash import census, compile_cache
from cute_flash.arch.sm90 import build
from cute_flash.arch.sm90.tile_config import fwd_tile_config
from cute_flash.spec import AttentionSpec

d, dv, mask, seqused, role = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1", sys.argv[5]
spec = AttentionSpec("bf16", d, dv, mask, "bf16", varlen=True)
dump = tempfile.mkdtemp()
with census.capture_fd_stderr() as captured:
    if role == "fwd":
        compiled = build.compile_forward_packed(
            spec, fwd_tile_config(spec), "sm_90a", compile_cache.keep_artifacts_options(dump), seqused
        )
    else:
        from cute_flash.arch.sm90 import backward
        det, long = role.endswith("_det"), role.endswith("_long")
        role = role.removesuffix("_det").removesuffix("_long")
        role += ("_seqused" if seqused else "") + ("_det" if det else "")
        cfg = backward.bwd_tile_config(spec, det, long)
        # (built from the role's cache key, as calls build it: backward.kernel_key)
        compiled = backward._build(
            role, *backward.kernel_key(role, spec, cfg), "sm_90a", compile_cache.keep_artifacts_options(dump)
        )
ptx = compiled.artifacts.PTX
print(json.dumps({
    "census": census.ptx_census(ptx),
    "spills": [r.get("spill_bytes") for _, r in census.parse_ptxas_reports("".join(captured))],
    "vector_stores": sum("st.global.v4" in line for line in ptx.splitlines()),
    "tma_stores": sum("cp.async.bulk.tensor" in line and "global.shared" in line for line in ptx.splitlines()),
    "acquire_loads": sum("ld.acquire.gpu" in line for line in ptx.splitlines()),
    "launch_dependents": ptx.count("griddepcontrol.launch_dependents"),
    "shuffles": sum("shfl.sync" in line for line in ptx.splitlines()),
    "multicast_loads": sum("multicast::cluster" in line for line in ptx.splitlines()),
    "remote_arrives": ptx.count("mbarrier.arrive.shared::cluster"),
    "cluster_barriers": ptx.count("barrier.cluster.arrive") + ptx.count("barrier.cluster.wait"),
}))
"""

# (d, dv, mask, seqused, role). Forward: d256 local, (192, 128) causal and d96 local built too when the kernel was
# written (spill-free); backward: d 64 / 96 / 128 / 256, every mask, with and without GQA and seqused_k (all
# spill-free when they were built); kept out of CI for time.
BUILDS = [
    (128, 128, "causal", False, "fwd"),
    (128, 128, "none", True, "fwd"),  # 2-CTA clusters sharing K / V (tile_config.multicast_kv)
    (256, 256, "none", False, "fwd"),  # d256's 128 x 80 tile in clusters too
    (64, 64, "none", True, "fwd"),
    (128, 128, "causal", True, "bwd"),
    (128, 128, "causal", False, "bwd_gqa_det"),
    (128, 128, "none", False, "bwd_preprocess"),
    (128, 128, "none", True, "bwd_gqa_long"),  # the 80-row tile (long queries), LSE / D loaded where used
]
FORWARD_BUILDS = [b for b in BUILDS if b[4] == "fwd"]


@pytest.fixture(scope="module")
def builds():
    """Every build in BUILDS, two subprocesses at a time (CuTe DSL fixes its target at import)."""
    import concurrent.futures

    def run(args):
        cmd = [sys.executable, "-c", _SCRIPT, *[str(int(a)) if isinstance(a, bool) else str(a) for a in args]]
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        yield {args: pool.submit(run, args) for args in BUILDS}


def _report(builds, args) -> dict:
    done = builds[args].result()
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("d, dv, mask, seqused, role", FORWARD_BUILDS, ids=lambda a: str(a))
def test_sm90_varlen_forward_compiles(builds, d, dv, mask, seqused, role):
    rep = _report(builds, (d, dv, mask, seqused, role))
    census = rep["census"]
    assert census["wgmma.mma_async"] > 0 and census["cp.async.bulk.tensor"] > 0 and census["setmaxnreg"] >= 2
    assert census["mma.sync"] == 0
    assert rep["spills"] and set(rep["spills"]) == {0}, rep["spills"]
    # O: 64 rows x dv per consumer warpgroup in 16-byte stores over its 128 threads, no TMA store
    assert rep["vector_stores"] == 64 * dv // (8 * 128) and rep["tma_stores"] == 0, rep


def test_sm90_varlen_forward_multicasts_kv_without_a_mask(builds):
    """The packed d128 / d256 forward without a mask runs in 2-CTA clusters: K and V arrive by multicast TMA loads,
    the consumers release stages in both CTAs (remote mbarrier arrives), and the only cluster barrier is the one
    after the barriers' init (no barrier before exit: pipelines.ClusterRing). With a causal mask, one CTA per
    cluster."""
    for build in ((128, 128, "none", True, "fwd"), (256, 256, "none", False, "fwd")):
        rep = _report(builds, build)
        assert rep["multicast_loads"] > 0 and rep["remote_arrives"] > 0 and rep["cluster_barriers"] == 2, rep
    causal = _report(builds, (128, 128, "causal", False, "fwd"))
    assert causal["multicast_loads"] == 0 and causal["remote_arrives"] == 0 and causal["cluster_barriers"] == 0


def test_forward_tile_configs_multicast_only_packed_d128_d256_without_a_mask():
    from dataclasses import replace

    from cute_flash.arch.sm90.tile_config import budget_problem, fwd_tile_config
    from cute_flash.spec import AttentionSpec

    def cluster(d, mask, varlen, dtype="bf16"):
        return fwd_tile_config(AttentionSpec(dtype, d, d, mask, "bf16", varlen=varlen)).cluster_m

    assert cluster(128, "none", True) == 2 and cluster(128, "none", True, "fp16") == 2
    assert {cluster(128, "none", False), cluster(128, "causal", True), cluster(128, "local", True)} == {1}
    assert cluster(256, "none", True) == 2 and {cluster(256, "none", False), cluster(256, "causal", True)} == {1}
    assert {cluster(64, "none", True), cluster(96, "none", True)} == {1}
    packed = AttentionSpec("bf16", 128, 128, "none", "bf16", varlen=True)
    assert "cluster_m" in budget_problem(replace(fwd_tile_config(packed), cluster_m=4), 128, 128)


def test_sm90_varlen_backward_compiles(builds):
    rep = _report(builds, (128, 128, "causal", True, "bwd"))
    census = rep["census"]
    assert census["wgmma.mma_async"] > census["wgmma.mma_async.rs"] > 0 and census["cp.async.bulk.tensor"] > 0
    assert census["setmaxnreg"] >= 2 and census["cp.reduce.async.bulk"] > 0 and census["mma.sync"] == 0
    assert rep["spills"] and set(rep["spills"]) == {0}, rep["spills"]
    # dK and dV: 128 keys x 128 columns each in 16-byte stores over the 256 consumer threads, no TMA store
    assert rep["vector_stores"] == 2 * 128 * 128 // (8 * 256) and rep["tma_stores"] == 0, rep


def test_sm90_varlen_long_query_backward_compiles(builds):
    """The packed 80-row tile (max_seqlen_q from 4096, no mask; GQA, seqused_k): spill-free, and its LSE / D come
    from shared memory where they are used (stats_at_use), not by shuffles: the 40 per step of the shuffling build
    (20 query columns per thread, twice) are gone, a few other shuffles stay."""
    rep = _report(builds, (128, 128, "none", True, "bwd_gqa_long"))
    assert rep["spills"] and set(rep["spills"]) == {0}, rep["spills"]
    assert rep["census"]["wgmma.mma_async.rs"] > 0 and rep["census"]["mma.sync"] == 0
    assert rep["shuffles"] < 20, rep["shuffles"]


def test_sm90_varlen_deterministic_backward_compiles(builds):
    """The deterministic GQA build: the dQ warp and the GQA epilogue each wait on a semaphore (one acquire load
    each), dQ by the bulk reduce-add, spill-free."""
    rep = _report(builds, (128, 128, "causal", False, "bwd_gqa_det"))
    assert rep["acquire_loads"] == 2 and rep["census"]["cp.reduce.async.bulk"] > 0, rep
    assert rep["spills"] and set(rep["spills"]) == {0}, rep["spills"]


def test_sm90_varlen_preprocess_zeroes_dq_and_signals_pdl(builds):
    """The packed preprocess as the sm90 backward builds it: besides D and lse_log2 it zeroes its 64 rows of the dQ
    sums (64 x 128 floats in 16-byte stores over 128 threads) and lets the main kernel launch early."""
    rep = _report(builds, (128, 128, "none", False, "bwd_preprocess"))
    assert rep["vector_stores"] == 64 * 128 * 4 // (16 * 128) and rep["launch_dependents"] == 1, rep
    assert rep["spills"] and set(rep["spills"]) == {0}, rep["spills"]

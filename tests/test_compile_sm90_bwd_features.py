"""CPU: the sm90 backward's soft-capping builds cross-compile spill-free for sm_90a (d128 causal; the packed
deterministic GQA build), with the tanh of the recomputed scores and the lg2 that recovers it from P in the main
loop; learnable sinks change no kernel (the cache key drops spec.sink) and pass through the padded-head-dim launcher;
the packed sink gradient gathers each sequence's rows of the padded D buffer. Numerics: tests/test_sm90_bwd_features.py.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cute_flash.spec import AttentionSpec

REPO = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import json, sys, tempfile
from cute_flash import census, compile_cache
from cute_flash.arch.sm90 import backward
from cute_flash.spec import AttentionSpec

mask, varlen, role = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
spec = AttentionSpec("bf16", 128, 128, mask, "bf16", varlen=varlen, softcap=True, sink=True)
cfg = backward.bwd_tile_config(spec, role.endswith("_det"))
with census.capture_fd_stderr() as captured:
    compiled = backward._build(
        role, *backward.kernel_key(role, spec, cfg), "sm_90a", compile_cache.keep_artifacts_options(tempfile.mkdtemp())
    )
ptx = compiled.artifacts.PTX
print(json.dumps({
    "census": census.ptx_census(ptx),
    "spills": [r.get("spill_bytes") for _, r in census.parse_ptxas_reports("".join(captured))],
    "tanh": ptx.count("tanh.approx.f32"),
    "lg2": ptx.count("lg2.approx"),
    "ex2": ptx.count("ex2.approx"),
    "acquire_loads": ptx.count("ld.acquire.gpu"),
}))
"""

BUILDS = [("causal", False, "bwd"), ("causal", True, "bwd_gqa_det")]


@pytest.fixture(scope="module")
def builds():
    """Both builds at once, one subprocess each (CuTe DSL fixes its target at import)."""
    import concurrent.futures

    def run(args):
        mask, varlen, role = args
        cmd = [sys.executable, "-c", _SCRIPT, mask, str(int(varlen)), role]
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        yield {args: pool.submit(run, args) for args in BUILDS}


@pytest.mark.parametrize("mask, varlen, role", BUILDS, ids=["d128-causal", "d128-causal-packed-gqa-det"])
def test_sm90_softcap_backward_compiles(builds, mask, varlen, role):
    done = builds[(mask, varlen, role)].result()
    assert done.returncode == 0, done.stderr[-3000:]
    rep = json.loads(done.stdout.strip().splitlines()[-1])
    census = rep["census"]
    assert census["wgmma.mma_async"] > census["wgmma.mma_async.rs"] > 0 and census["mma.sync"] == 0, census
    assert census["cp.reduce.async.bulk"] > 0 and census["setmaxnreg"] >= 2
    assert rep["spills"] and set(rep["spills"]) == {0}, rep["spills"]
    # One tanh per score (before the mask) and one lg2 (T recovered from P for dS) per exponential, in the masked
    # and the unmasked steps alike.
    assert rep["tanh"] == rep["lg2"] == rep["ex2"] > 0, rep
    if role.endswith("_det"):  # the dQ warp's and the GQA epilogue's semaphores
        assert rep["acquire_loads"] == 2, rep


def test_sm90_backward_serves_softcap_and_sinks():
    from cute_flash.arch.sm90 import BACKEND
    from cute_flash.arch.sm90.backward import MAIN_ROLES, kernel_key
    from cute_flash.arch.sm90.tile_config import bwd_tile_config

    plain = AttentionSpec("bf16", 128, 128, "causal", "bf16")
    both = dataclasses.replace(plain, softcap=True, sink=True)
    assert BACKEND.unsupported_reason(both, backward=True, deterministic=True) is None
    assert BACKEND.unsupported_reason(dataclasses.replace(both, varlen=True), backward=True) is None
    # A sink is in the LSE the kernels read: a sink build's kernels are the plain ones; softcap changes the main
    # kernels only.
    cfg = bwd_tile_config(plain)
    for role in ("bwd", "bwd_gqa_det", "bwd_preprocess", "bwd_dq_postprocess"):
        assert kernel_key(role, dataclasses.replace(plain, sink=True), cfg) == kernel_key(role, plain, cfg)
        key_spec = kernel_key(role, both, cfg)[0]
        assert not key_spec.sink and key_spec.softcap == (role in MAIN_ROLES), (role, key_spec)


def test_softcap_builds_take_their_own_tiles():
    """tile_config._BWD_SOFTCAP / _SOFTCAP_PADDED: d64 softcap builds on 64-row tiles, d96 (and d72) on the d128
    kernels, no 80-row tile for long queries; every softcap configuration passes the budget checks."""
    from cute_flash.arch.sm90.backward import kernel_dims, kernel_spec
    from cute_flash.arch.sm90.tile_config import bwd_config_problem, bwd_tile_config

    def capped(d, mask="causal", varlen=False):
        return AttentionSpec("bf16", d, d, mask, "bf16", varlen=varlen, softcap=True)

    assert kernel_dims(capped(96)) == kernel_dims(capped(72)) == (128, 128)
    assert kernel_dims(dataclasses.replace(capped(96), softcap=False)) == (96, 96)
    cfg = bwd_tile_config(capped(64))
    assert (cfg.tile_m, cfg.dq_split, cfg.dq_buffers) == (64, "single", 1)
    assert bwd_tile_config(capped(128, "none"), long=True) == bwd_tile_config(capped(128, "none"))
    for d in (64, 96, 128, 192, 256):
        for mask in ("none", "causal", "local"):
            for varlen in (False, True):
                spec = kernel_spec(capped(d, mask, varlen))
                for det in (False, True):
                    assert bwd_config_problem(bwd_tile_config(spec, det, True), spec.head_dim) is None


def test_padded_head_dims_carry_sink_and_dsink():
    """arch/padded_head_dims.padded_launcher hands the sink logits and dsink to the wide launcher as they are."""
    from cute_flash.arch.base import BwdTensors, Grads
    from cute_flash.arch.padded_head_dims import padded_launcher

    seen = {}

    def run(t, grads):
        seen["sink"], seen["dsink"] = t.sink, grads.dsink
        seen["widths"] = [x.shape[-1] for x in t[:5]] + [g.shape[-1] for g in grads[:3]]
        grads.dsink.fill_(7.0)
        for g in grads[:3]:
            g.zero_()

    q, k, v = torch.randn(1, 5, 2, 72), torch.randn(1, 6, 2, 72), torch.randn(1, 6, 2, 72)
    out, dout, lse = torch.randn(1, 5, 2, 72), torch.randn(1, 5, 2, 72), torch.randn(1, 2, 5)
    sink, dsink = torch.randn(2), torch.empty(2)
    grads = Grads(torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink)
    padded_launcher((96, 96), run)(BwdTensors(dout, q, k, v, out, lse, None, sink), grads)
    assert seen["sink"] is sink and seen["dsink"] is dsink and torch.all(dsink == 7.0)
    assert seen["widths"] == [96] * 8 and grads.dq.shape[-1] == 72


def test_packed_rows_gather_each_sequence_from_its_padded_offset():
    """backward.packed_rows: row r of sequence b sits at padded offset floor((cu[b] + b * pad) / pad) * pad plus
    r - cu[b] (common/packed.py), empty sequences included."""
    from cute_flash.arch.sm90.backward import packed_rows
    from cute_flash.common.packed import padded_rows

    lens, pad = [3, 0, 130, 1, 64], 64
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    rows = padded_rows(cu[-1], len(lens), pad) + pad
    buf = torch.arange(2 * rows, dtype=torch.float32).view(2, rows)
    want = []
    for b, n in enumerate(lens):
        start = (cu[b] + b * pad) // pad * pad
        want += list(range(start, start + n))
    got = packed_rows(buf, torch.tensor(cu, dtype=torch.int32), pad, cu[-1])
    assert torch.equal(got, buf[:, want])

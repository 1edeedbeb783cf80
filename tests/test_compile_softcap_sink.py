"""CPU: the forward builds with soft-capping and learnable sinks (spec.softcap / spec.sink) cross-compile spill-free
and hold what the design says: one tanh.approx per score of every key-tile step (the FMUL before it, no other pass),
the sink read once per row (plain global loads where the plain build has none), the split build's partials without
the sink and a combine that takes it. One representative build each: sm90 dense (d128, causal), packed (d64,
local), split-key (d128) and its combine with sinks, in one subprocess; the sm100 1-CTA build (d64, local) in
another (CuTe DSL fixes its target at import). The numbers are checked on the GPU
(tests/test_softcap_sink_sm90_gpu.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cute_flash.spec import AttentionSpec

REPO = Path(__file__).resolve().parents[1]

_BUILDS = textwrap.dedent(
    """
    import json, os, re, sys, tempfile
    arch = sys.argv[1]
    target = os.environ["CUTE_DSL_ARCH"] = {"sm90": "sm_90a", "sm100": "sm_100a"}[arch]
    from cute_flash import census, compile_cache
    from cute_flash.spec import AttentionSpec

    def report(name, fn):
        with tempfile.TemporaryDirectory() as dump:
            with census.capture_fd_stderr() as err:
                compiled = fn(compile_cache.keep_artifacts_options(dump))
            ptx, _ = census.read_artifacts(compiled)
        (_, res), = census.parse_ptxas_reports("".join(err))[-1:]
        counts = {op: len(re.findall(pat, ptx)) for op, pat in (
            ("tanh", r"tanh\\.approx\\.f32"), ("ld_global", r"\\bld\\.global\\."),
            ("fmax", r"\\bmax(?:\\.ftz)?(?:\\.NaN)?\\.f32"), ("fmul", r"\\bmul(?:\\.ftz)?\\.f32"), ("mul_before_tanh",
             r"mul(?:\\.ftz)?\\.f32\\s+(%r\\d+),[^\\n]*\\n(?:\\s*//[^\\n]*\\n)*\\s*tanh\\.approx\\.f32\\s+%r\\d+,\\s*\\1;"))}
        print(json.dumps(dict(name=name, census=census.ptx_census(ptx), **counts, **res)), flush=True)

    if arch == "sm90":
        from cute_flash.arch.sm90 import build
        from cute_flash.arch.sm90.tile_config import fwd_tile_config
        from cute_flash.common.split_combine import compile_split_combine

        dense = AttentionSpec("bf16", 128, 128, "causal", softcap=True, sink=True)
        wide = AttentionSpec("bf16", 128, 128, "causal", softcap=True, softcap_wide=True, sink=True)
        packed = AttentionSpec("bf16", 64, 64, "local", varlen=True, softcap=True, sink=True)
        report("dense", lambda x: build.compile_forward(dense, fwd_tile_config(dense), target, x))
        report("wide", lambda x: build.compile_forward(wide, fwd_tile_config(wide), target, x))
        report("packed", lambda x: build.compile_forward_packed(packed, fwd_tile_config(packed), target, x))
        report("split", lambda x: build.compile_forward_split(dense, fwd_tile_config(dense), target, x))
        report("combine", lambda x: compile_split_combine("bf16", 128, target, x, sink=True))
    else:
        from cute_flash.arch.sm100.backend import _build
        from cute_flash.arch.sm100.tile_config import make_config

        spec = AttentionSpec("bf16", 64, 64, "local", softcap=True, sink=True)
        report("sm100", lambda x: _build(spec, make_config(spec, use_2cta=False), target, x))
    """
)


def _reports(arch: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _BUILDS, arch], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["name"]: r for r in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))}


def test_sm90_softcap_sink_builds():
    reports = _reports("sm90")
    assert set(reports) == {"dense", "wide", "packed", "split", "combine"}
    for r in reports.values():
        assert r["spill_bytes"] == 0, r
    # 64 scores per consumer thread and key tile (64 x 128 / 128 threads at d128; 64 x 128 / 128 at d64): the first
    # tile and one step per phase of the walk (causal: right-masked, interior; local: and left-masked), each capped
    # once, every tanh right after its one FMUL.
    dense, packed, split = reports["dense"], reports["packed"], reports["split"]
    assert dense["tanh"] == 64 * 3 and packed["tanh"] == 64 * 4 and split["tanh"] == 64 * 3, reports
    for r in (dense, packed, split):
        assert r["mul_before_tanh"] == r["tanh"], r
        c = r["census"]
        assert c["wgmma.mma_async.rs"] > 0 and c["cp.async.bulk.tensor"] > 0 and c["setmaxnreg"] >= 2, r
    # The dense plain build reads nothing with plain loads (TMA only): the sink build reads one sink per row of the
    # thread (2); the split build's partials leave the sink to the combine.
    assert dense["ld_global"] == 2, dense
    assert split["ld_global"] == 0, split
    # bf16 caps up to spec.WIDE_SOFTCAP take no running max (common/softcap.CappedSoftmax): no FMNMX per score and
    # no rescale of O per tile (64 FMULs per thread and step); wider caps keep both.
    wide = reports["wide"]
    assert wide["tanh"] == dense["tanh"] and wide["spill_bytes"] == 0, wide
    for r in (dense, packed, split):
        assert r["fmax"] <= 4, r
    assert wide["fmax"] >= dense["tanh"], wide
    assert wide["fmul"] - dense["fmul"] >= 64 * 2, (wide, dense)
    assert reports["combine"]["tanh"] == 0


def test_sm100_softcap_sink_build():
    (r,) = _reports("sm100").values()
    assert r["spill_bytes"] == 0, r
    # One query row of 128 scores per softmax thread, capped in the masked and the unmasked step.
    assert r["tanh"] == 128 * 2 and r["mul_before_tanh"] == r["tanh"], r
    assert r["census"]["tcgen05.mma"] > 0
    assert r["ld_global"] == 2, r  # the sink of this correction thread's row in each q stage


def test_backends_accept_the_features_for_16_bit_and_refuse_them_for_fp8():
    from cute_flash.arch.sm90 import BACKEND as SM90
    from cute_flash.arch.sm100 import BACKEND as SM100

    for flags in (dict(softcap=True), dict(sink=True), dict(softcap=True, sink=True)):
        for backend in (SM90, SM100):
            assert backend.unsupported_reason(AttentionSpec("bf16", 128, 128, "causal", **flags), False) is None
            reason = backend.unsupported_reason(AttentionSpec("fp8", 128, 128, "none", "bf16", **flags), False)
            assert reason is not None and re.search("soft-capping|learnable sinks", reason), reason
        packed = AttentionSpec("fp16", 64, 64, "local", "fp16", varlen=True, **flags)
        assert SM90.unsupported_reason(packed, False) is None


@pytest.mark.parametrize("sink", [False, True])
def test_combine_kernel_keys_tell_sink_builds_apart(monkeypatch, sink):
    from cute_flash import compile_cache
    from cute_flash.arch import split_kv

    keys = []
    monkeypatch.setattr(compile_cache, "get_or_compile", lambda key, build: keys.append(key))
    split_kv.combine_kernel(AttentionSpec("bf16", 128, 128, "none", sink=sink), "sm_90a")
    split_kv.combine_kernel(AttentionSpec("bf16", 128, 128, "none"), "sm_90a")
    assert (keys[0] == keys[1]) is (not sink)

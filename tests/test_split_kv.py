"""CPU: split-key decoding (cute_flash/arch/split_kv.py) without a GPU: when a call splits and into how many parts,
which key tiles each split walks, what the launchers hand their two kernels, and the sm_90a / sm_80 builds of the
split forwards and the combine (spill-free; sm90: wgmma with P from registers and TMA loads; O stored from
registers). The results are checked on the GPU (tests/test_edge_cases_gpu.py::test_split_key_decoding)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cute_flash import compile_cache
from cute_flash.arch.base import SplitForward
from cute_flash.arch import split_kv
from cute_flash.arch.sm90 import BACKEND
from cute_flash.arch.sm90.tile_config import fwd_tile_config
from cute_flash.common.block_info import BlockInfo, split_kv_range
from cute_flash.spec import AttentionSpec, normalize_mask
from cute_flash.validation import Problem

REPO = Path(__file__).resolve().parents[1]


def _problem(b, sq, sk, h, hkv, d, causal=False, window=(None, None), dtype="bf16", dv=None):
    mask = normalize_mask(causal, window)
    spec = AttentionSpec(dtype, d, dv or d, mask.kind, dtype)
    return Problem(b, sq, sk, h, hkv, d, dv or d, mask, d**-0.5, spec)


@pytest.mark.parametrize(
    "args,kw,splits",
    [
        ((1, 4, 8192, 8, 8, 128), {}, 16),  # packed GQA decoding at batch 1: 8 CTAs -> 16 splits of 4 key tiles
        ((2, 1, 4099, 8, 8, 128), dict(causal=True), 8),  # 16 CTAs: 8 fill 132 SMs (33 key tiles)
        ((1, 5, 3001, 4, 1, 64), dict(causal=True), 12),  # capped by the key tiles (24, two per split)
        ((1, 64, 20_000, 2, 2, 96), dict(window=(5000, 100)), 20),  # the window's 41 key tiles
        ((1, 1, 10**6, 1, 1, 128), {}, 64),  # MAX_SPLITS
        ((1, 1, 767, 8, 8, 128), {}, 3),  # 6 key tiles, 2 each
        ((1, 1, 1024, 8, 8, 128), {}, 4),  # 8 key tiles, 2 each
        ((1, 1, 640, 8, 8, 128), {}, 1),  # 5 key tiles: 2 splits, fewer than MIN_SPLITS
        ((6, 1, 8192, 8, 8, 128), {}, 1),  # 48 CTAs: 2 splits would fill the SMs, fewer than MIN_SPLITS
        ((1, 129, 8192, 4, 4, 128), {}, 1),  # two query tiles: not decoding
        ((8, 1, 8192, 16, 16, 128), {}, 1),  # 128 CTAs already
        ((1, 1, 8192, 8, 8, 128), dict(dtype="fp8"), 1),
    ],
)
def test_num_splits(args, kw, splits):
    p = _problem(*args, **kw)
    cfg = fwd_tile_config(_problem(*args).spec)  # (the sm90 forward's tile: fp8 has its own)
    assert split_kv.num_splits(p, cfg.tile_m, cfg.tile_n, 132) == splits
    assert split_kv.num_splits(p, cfg.tile_m, cfg.tile_n, 0) == 1  # not a GPU


def test_families_choose_their_fewest_splits():
    # The sm80 family splits from 2 on (its unsplit CTAs read the cache slowly): batch 8 x 8 heads, 64 CTAs.
    p = _problem(8, 1, 8192, 8, 8, 128)
    assert split_kv.num_splits(p, 128, 128, 132) == 1
    assert split_kv.num_splits(p, 128, 64, 132, 2) == 2
    assert split_kv.num_splits(_problem(17, 1, 8192, 8, 8, 128), 128, 64, 132, 2) == 1  # 136 CTAs


def test_the_splits_cover_each_rows_keys_once():
    """Every split's run of key tiles, over query tiles, masks and split counts: the runs tile [n_min, n_max)
    exactly (an empty range stays empty), so each key a row sees is walked by exactly one split."""
    import random

    r = random.Random(0)
    for _ in range(20000):
        tile_m, tile_n = r.choice([(64, 128), (128, 128), (192, 128), (128, 80)])
        sq, sk = r.randint(1, tile_m), r.randint(1, 5000)
        mask = r.choice(["none", "causal", "local"])
        left, right = r.choice([0, 3, 200, 1 << 30]), r.choice([0, 7, 1 << 30])
        info = BlockInfo(tile_m, tile_n, mask, sq, sk, left, right)
        n_min, n_max = info.kv_block_range(0)
        splits = r.randint(1, 64)
        walked = []
        for s in range(splits):
            lo, hi = split_kv_range(n_min, n_max, s, splits)
            walked += range(lo, hi)
        assert walked == list(range(n_min, max(n_min, n_max))), (tile_m, tile_n, sq, sk, mask, left, right, splits)


def test_split_launcher_hands_its_kernels_the_partials(monkeypatch):
    calls = []
    kernels = {}

    def fake_kernel(spec, target, variant=""):
        return kernels.setdefault(variant, lambda *a: calls.append((variant, a)))

    monkeypatch.setattr(BACKEND, "_forward_kernel", fake_kernel)
    monkeypatch.setattr(compile_cache, "runtime_target", lambda device: "sm_90a")
    monkeypatch.setattr(compile_cache, "sm_count", lambda device: 132)
    p = _problem(3, 2, 5000, 4, 2, 128, causal=True, window=(700, None))
    launch = BACKEND.forward_launcher(p, torch.device("cpu"))
    assert isinstance(launch, SplitForward)
    splits = split_kv.num_splits(p, 128, 128, 132)
    assert splits == 3  # 12 CTAs; the window's 7 key tiles, 2 per split
    q, k, v = torch.empty(3, 2, 4, 128), torch.empty(3, 5000, 2, 128), torch.empty(3, 5000, 2, 128)
    out, lse = torch.empty(3, 2, 4, 128), torch.empty(3, 4, 2)
    launch(q, k, v, out, lse)
    (kind, fwd), (kind2, combine) = calls
    assert (kind, kind2) == ("split", "combine")
    o_part, lse_part = fwd[3], fwd[4]
    assert o_part.shape == (9, 2, 4, 128) and lse_part.shape == (9, 4, 2) and o_part.dtype == torch.float32
    assert fwd[5:] == (128**-0.5, 700, 0)
    assert combine[0] is o_part and combine[1] is lse_part and combine[2] is out and combine[3] is lse
    # forward() (the custom op's path) takes the same launcher.
    calls.clear()
    BACKEND.forward((q, k, v, out, lse), p)
    assert [c[0] for c in calls] == ["split", "combine"]
    # Not split: the bound dense kernel.
    calls.clear()
    BACKEND.forward((q, k, v, out, lse), _problem(3, 200, 5000, 4, 2, 128))
    assert [c[0] for c in calls] == [""]


_CENSUS = textwrap.dedent(
    """
    import json, os, re, sys, tempfile
    arch = sys.argv[1]
    os.environ["CUTE_DSL_ARCH"] = {"sm90": "sm_90a", "sm80": "sm_80"}[arch]
    target = os.environ["CUTE_DSL_ARCH"]
    from cute_flash import census, compile_cache
    from cute_flash.common.split_combine import compile_split_combine
    from cute_flash.spec import AttentionSpec

    def stores(ptx):
        return len(re.findall(r"^\\s*(?:@!?%\\w+\\s+)?st\\.global\\.b32", ptx, re.M))

    def report(name, fn):
        with tempfile.TemporaryDirectory() as dump:
            with census.capture_fd_stderr() as err:
                compiled = fn(compile_cache.keep_artifacts_options(dump))
            ptx, _ = census.read_artifacts(compiled)
        (_, res), = census.parse_ptxas_reports("".join(err))
        print(json.dumps(dict(name=name, census=census.ptx_census(ptx), stores=stores(ptx), pdl="griddepcontrol" in ptx,
                              **res)), flush=True)

    cases = [("bf16", 128, 128, "causal"), ("fp16", 64, 64, "local")]
    for dtype, d, dv, mask in cases if arch == "sm90" else cases[:1]:  # (CI time: the sm80 build tries tiles)
        spec = AttentionSpec(dtype, d, dv, mask, dtype)
        if arch == "sm90":
            from cute_flash.arch.sm90 import build
            from cute_flash.arch.sm90.tile_config import fwd_tile_config

            report(f"split d{d} {mask}", lambda x: build.compile_forward_split(spec, fwd_tile_config(spec), target, x))
        else:
            from cute_flash.arch.sm80.build import compile_forward
            from cute_flash.census import cubin_resources

            fwd = compile_forward(spec, target, split=True)
            frame = max(r.get("stack_frame_bytes", 0) for r in cubin_resources(fwd.cubin).values())
            print(json.dumps(dict(name=f"split d{d} {mask}", census=census.ptx_census(fwd.ptx), stores=stores(fwd.ptx),
                                  pdl=False, spill_bytes=frame)), flush=True)
        report(f"combine d{dv}", lambda x: compile_split_combine(dtype, dv, target, x))
    """
)


@pytest.mark.parametrize("arch", ["sm90", "sm80"])
def test_split_builds_compile(arch):
    done = subprocess.run([sys.executable, "-c", _CENSUS, arch], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == (4 if arch == "sm90" else 2)
    for r in reports:
        assert r["spill_bytes"] == 0, r
        c = r["census"]
        if r["name"].startswith("split"):
            if arch == "sm90":
                assert c["wgmma.mma_async.rs"] > 0 and c["wgmma.mma_async"] > c["wgmma.mma_async.rs"], r
                assert c["cp.async.bulk.tensor"] > 0 and c["setmaxnreg"] >= 2, r
            else:
                assert c["mma.sync"] > 0 and c["cp.async"] > 0 and c["wgmma.mma_async"] == 0, r
            assert r["stores"] > 0, r  # O and LSE partials from registers
        else:
            assert c["wgmma.mma_async"] == 0 and c["cp.async.bulk.tensor"] == 0, r
            assert r["pdl"] is (arch == "sm90"), r  # programmatic dependent launch on sm_90 only

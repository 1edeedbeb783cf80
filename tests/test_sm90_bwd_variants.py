"""The sm90 backward's study variants (profiling/sm90_bwd_variants.py VARIANTS; docs/sm90_bwd_sass_study.md).

CPU: they are valid configurations where they are meant to run, and dq_stage_single_base addresses the same shared
memory as the default dQ staging. The launch-overhead variants (zeroing in the preprocess, PDL) build for sm_90a
without spills and with the instructions they are about, and the preprocess grid covers the whole dQ accumulator.
GPU (Hopper; tests/gpu_suite.sh steps "variants" / "otests", not in the "sm90" step): their gradients against the
reference, and bitwise equal to the default's where the arithmetic is the same.
"""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cute_flash.arch.sm90.tile_config import BwdTileConfig, bwd_config_problem, bwd_tile_config
from cute_flash.spec import AttentionSpec
from profiling.sm90_bwd_variants import VARIANTS

STUDY_VARIANTS = ("dv_early", "dv_early_b", "dv_kb3", "dq_base", "m80_regstats", "d_dv", "m80_kb1_at_use")
OVERHEAD_VARIANTS = ("plain", "memset", "no_pdl", "kv_barrier")
OVERHEAD_FIELDS = ("zero_dq_in_preprocess", "pdl", "pdl_dq_post", "kv_with_first_tile")
REPO = Path(__file__).resolve().parents[1]


def _d128(mask: str) -> BwdTileConfig:
    return bwd_tile_config(AttentionSpec("bf16", 128, 128, mask, "bf16"))


@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("name", STUDY_VARIANTS)
def test_study_variants_are_valid_at_d128(name, mask):
    cfg = dataclasses.replace(_d128(mask), **VARIANTS[name])
    assert bwd_config_problem(cfg, 128) is None


def test_study_switches_default_off():
    cfg = _d128("local")
    assert not cfg.dv_before_dp_wait and not cfg.dq_stage_single_base and cfg.max_unshuffled_stat_cols == 16
    assert cfg.dv_early_kblocks is None
    for field in ("dv_before_dp_wait", "dv_early_kblocks", "dq_stage_single_base", "max_unshuffled_stat_cols"):
        assert field in cfg.as_dict()
    # A is the default at d128 without a mask, half of it (2 of dV's 4 k-blocks) with a causal mask
    # (tile_config._BWD_BY_HEAD_DIM_AND_MASK); the rest is unchanged there.
    assert _d128("none") == dataclasses.replace(cfg, dv_before_dp_wait=True)
    # With a causal mask D's loads also move after dV's early product is issued (d_after_dv_issue, session 22).
    assert _d128("causal") == dataclasses.replace(
        cfg, dv_before_dp_wait=True, dv_early_kblocks=2, d_after_dv_issue=True
    )


def test_dv_early_kblocks_needs_dv_before_dp_wait():
    cfg, a = _d128("local"), _d128("none")
    bad = [dataclasses.replace(cfg, dv_early_kblocks=2)]  # without A
    bad += [dataclasses.replace(a, dv_early_kblocks=kb) for kb in (0, 4, True, 2.0)]  # 64-row tile: 4 k-blocks
    for cfg_bad in bad:
        problem = bwd_config_problem(cfg_bad, 128)
        assert problem is not None and "dv_early_kblocks" in problem, cfg_bad
    assert bwd_config_problem(dataclasses.replace(a, dv_early_kblocks=3), 128) is None


def test_session22_switches_need_their_forms():
    # D after dV's early product needs that product (A); LSE / D loaded where used need keys on rows.
    cfg = _d128("local")
    problem = bwd_config_problem(dataclasses.replace(cfg, d_after_dv_issue=True), 128)
    assert problem is not None and "d_after_dv_issue" in problem
    assert bwd_config_problem(dataclasses.replace(_d128("none"), d_after_dv_issue=True), 128) is None
    d256 = bwd_tile_config(AttentionSpec("bf16", 256, 256, "none", "bf16"))
    problem = bwd_config_problem(dataclasses.replace(d256, stats_at_use=True), 256)
    assert problem is not None and "stats_at_use" in problem
    long = bwd_tile_config(AttentionSpec("bf16", 128, 128, "none", "bf16"), long=True)
    assert long.stats_at_use and long.tile_m == 80 and bwd_config_problem(long, 128) is None
    # where a thread's columns stay in registers anyway (64-row tile: 16 columns) the switch is refused, not ignored
    for cfg_bad in (
        dataclasses.replace(_d128("none"), stats_at_use=True),
        dataclasses.replace(long, max_unshuffled_stat_cols=20),
    ):
        problem = bwd_config_problem(cfg_bad, 128)
        assert problem is not None and "stats_at_use" in problem, cfg_bad


def test_lse_ahead_needs_stats_at_use_and_counts_pairs():
    # session 24: the 80-row tile's default loads 7 of its 10 LSE column pairs while S runs
    long = bwd_tile_config(AttentionSpec("bf16", 128, 128, "none", "bf16"), long=True)
    assert long.lse_ahead == 7 and bwd_config_problem(long, 128) is None
    assert bwd_config_problem(dataclasses.replace(long, lse_ahead=10), 128) is None
    for cfg_bad in (
        dataclasses.replace(long, lse_ahead=11),
        dataclasses.replace(long, lse_ahead=-1),
        dataclasses.replace(long, stats_at_use=False),
        dataclasses.replace(_d128("none"), lse_ahead=2),
    ):
        problem = bwd_config_problem(cfg_bad, 128)
        assert problem is not None and "lse_ahead" in problem, cfg_bad
    # deterministic builds keep the plain 64-row tile (no long-query changes)
    det = bwd_tile_config(AttentionSpec("bf16", 128, 128, "none", "bf16"), deterministic=True, long=True)
    assert det.lse_ahead == 0


def test_dv_before_dp_wait_needs_keys_on_rows():
    d256 = bwd_tile_config(AttentionSpec("bf16", 256, 256, "causal", "bf16"))
    assert not d256.keys_on_rows and bwd_config_problem(d256, 256) is None
    problem = bwd_config_problem(dataclasses.replace(d256, dv_before_dp_wait=True), 256)
    assert problem is not None and "dv_before_dp_wait" in problem and "keys on rows" in problem
    # dq_stage_single_base serves both forms.
    assert bwd_config_problem(dataclasses.replace(d256, dq_stage_single_base=True), 256) is None
    # register-held column stats exist only with keys on rows: elsewhere the switch would be ignored, so it is refused
    problem = bwd_config_problem(dataclasses.replace(d256, max_unshuffled_stat_cols=20), 256)
    assert problem is not None and "keys on rows" in problem


@pytest.mark.parametrize("tile_m", [16, 48, 64, 80, 96, 112, 128, 144, 192])
def test_stat_stages_start_on_tma_boundaries(tile_m):
    # Each stage of the LSE / D buffers is a TMA destination: it must start 128 bytes apart (tile_m 80's unpadded
    # 320-byte stage was a misaligned address on the GPU), and hold the whole tile.
    from cute_flash.arch.sm90.tile_config import stat_stage_stride

    stride = stat_stage_stride(tile_m)
    assert stride * 4 % 128 == 0 and tile_m <= stride < tile_m + 32


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("tile_m", [None, 80])
def test_dq_single_base_offsets_match_fragment_layout(head_dim, tile_m):
    # stage_dq with dq_stage_single_base stores element DQ_VEC * i + j of a thread at
    # align16(dq_fragment_offset(0, tidx)) + i * 128 * DQ_VEC + j; the default at
    # align16(dq_fragment_offset(DQ_VEC * i, tidx)) + j. Same offsets for every element of every consumer thread, and
    # the base is 16-byte aligned (so the align is a no-op in both).
    from cute_flash.arch.sm90.flash_bwd import DQ_VEC, dq_fragment_offset, dq_tile

    cfg = bwd_tile_config(AttentionSpec("bf16", head_dim, head_dim, "none", "bf16"))
    if tile_m is not None:
        if head_dim != 128:
            pytest.skip("tile_m 80 is a d128 shape")
        cfg = dataclasses.replace(cfg, tile_m=tile_m, dq_swap_ab=True)
    chunk = cfg.tile_m * head_dim // cfg.num_dq_wgs
    m, n = dq_tile(head_dim, cfg)
    per_thread = m * n // (cfg.num_dq_wgs * 128)  # acc_dQ elements of one thread
    assert per_thread % DQ_VEC == 0
    seen = set()
    for tidx in range(cfg.num_dq_wgs * 128):
        base = dq_fragment_offset(0, tidx, chunk)
        assert base % DQ_VEC == 0 and chunk % DQ_VEC == 0
        for i in range(per_thread // DQ_VEC):
            default = dq_fragment_offset(i * DQ_VEC, tidx, chunk)
            assert default % DQ_VEC == 0
            for j in range(DQ_VEC):
                assert base + i * 128 * DQ_VEC + j == default + j == dq_fragment_offset(i * DQ_VEC + j, tidx, chunk)
                seen.add(default + j)
    assert seen == set(range(cfg.tile_m * head_dim))  # and they tile the dQ buffer exactly once


def _spec(head_dim: int, mask: str) -> AttentionSpec:
    return AttentionSpec("bf16", head_dim, head_dim, mask, "bf16")


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_overhead_switches_default_on(head_dim):
    for mask in ("none", "causal", "local"):
        cfg = bwd_tile_config(_spec(head_dim, mask))
        assert all(getattr(cfg, f) for f in OVERHEAD_FIELDS), cfg
        for name in OVERHEAD_VARIANTS:
            variant = dataclasses.replace(cfg, **VARIANTS[name])
            assert bwd_config_problem(variant, head_dim) is None
            assert set(VARIANTS[name]) <= set(OVERHEAD_FIELDS)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("tile_m", [None, 80])
def test_preprocess_grid_covers_dq_accum(head_dim, tile_m):
    # zero_dq_in_preprocess: preprocess CTA m zeroes floats [64 m d, 64 (m + 1) d) of each (b, h)'s accumulator,
    # for m < sq_pad / 64 (its grid, from the stats' padded length). Every float the main kernel may add to (whole
    # query tiles m_block < ceil(sq / tile_m)) and the postprocess reads (the same tiles) must be among them.
    from cute_flash.arch.sm90.backward import STATS_ROW_MULTIPLE
    from cute_flash.validation import _round_up

    cfg = bwd_tile_config(_spec(head_dim, "none"))
    if tile_m is not None:
        if head_dim != 128:
            pytest.skip("tile_m 80 is a d128 shape")
        cfg = dataclasses.replace(cfg, tile_m=tile_m, dq_swap_ab=True)
    for sq in list(range(1, 700)) + [1023, 1024, 1025, 4096, 16383]:
        sq_pad = _round_up(sq, math.lcm(cfg.tile_m, STATS_ROW_MULTIPLE))  # as run_backward sizes it
        accum = sq_pad * head_dim
        pre_blocks = -(-sq_pad // STATS_ROW_MULTIPLE)  # BackwardPreprocessSm80._launch's grid
        zeroed = pre_blocks * STATS_ROW_MULTIPLE * head_dim
        assert zeroed == accum  # exactly the buffer: no CTA writes past it
        tiles = -(-sq // cfg.tile_m)  # the main kernel's and the postprocess's query tiles
        assert tiles * cfg.tile_m * head_dim <= zeroed
        # 16-byte stores over 128 threads, and 16-byte aligned blocks
        assert (STATS_ROW_MULTIPLE * head_dim) % (4 * 128) == 0


_OVERHEAD_SCRIPT = """
import os, sys, json, dataclasses
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from cute_flash import census
from cute_flash.arch.sm90.backward import compile_backward_artifacts
from cute_flash.arch.sm90.tile_config import bwd_tile_config
from cute_flash.spec import AttentionSpec
from profiling.sm90_bwd_variants import VARIANTS

ZEROS = "{0f00000000, 0f00000000, 0f00000000, 0f00000000}"
head_dim, mask, variant, roles = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4].split(",")
spec = AttentionSpec("bf16", head_dim, head_dim, mask, "bf16")
cfg = dataclasses.replace(bwd_tile_config(spec), **VARIANTS[variant])
with census.capture_fd_stderr() as captured:
    artifacts = compile_backward_artifacts(spec, "sm_90a", cfg, roles)
ptxas = census.parse_ptxas_reports("".join(captured))
out = {}
for art in artifacts:
    entry, res = next(iter(census.cubin_resources(art.cubin).items()))
    out[art.kernel] = {
        "census": census.ptx_census(art.ptx),
        "zero_stores": sum("st.global.v4.b32" in line and ZEROS in line for line in art.ptx.splitlines()),
        "stack": res.get("stack_frame_bytes", 0),
        "spills": [r.get("spill_bytes") for name, r in ptxas if name == entry],
    }
print(json.dumps(out))
"""

# The default builds of every head dim and mask (GQA and deterministic roles with their waits; dQ from registers at
# d256) are checked by tests/test_compile_sm90_bwd.py; here the options turned off. (CI time: the d128 dq_red
# builds "red" / "red3", measured slower than the default, were built spill-free in session 10 and are GPU-tested
# only; the two main-kernel builds below run with CUTE_FLASH_SM90_FULL_COMPILE=1, as the other study builds.)
OVERHEAD_BUILDS = [
    (64, "causal", "memset", "bwd_preprocess"),  # launch_dependents alone
    (128, "none", "no_pdl", "bwd_preprocess"),  # zeroing alone
]
if os.environ.get("CUTE_FLASH_SM90_FULL_COMPILE") == "1":
    OVERHEAD_BUILDS += [
        (128, "none", "plain", "bwd,bwd_dq_postprocess"),  # no griddepcontrol at all
        (128, "causal", "kv_barrier", "bwd"),  # K + V on their own barrier: no extra expect_tx
    ]


@pytest.fixture(scope="module")
def overhead_builds():
    """Every build in OVERHEAD_BUILDS, two subprocesses at a time (CuTe DSL fixes its target at import)."""
    import concurrent.futures

    def run(args):
        cmd = [sys.executable, "-c", _OVERHEAD_SCRIPT, *map(str, args)]
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {args: pool.submit(run, args) for args in OVERHEAD_BUILDS}
        yield futures


@pytest.mark.parametrize("head_dim, mask, variant, roles", OVERHEAD_BUILDS, ids=lambda a: str(a))
def test_overhead_variants_build(overhead_builds, head_dim, mask, variant, roles):
    done = overhead_builds[(head_dim, mask, variant, roles)].result()
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    options = dataclasses.replace(bwd_tile_config(_spec(head_dim, mask)), **VARIANTS[variant]).as_dict()
    for role, rep in out.items():
        assert rep["stack"] == 0 and rep["spills"] and set(rep["spills"]) == {0}, (role, rep)
        census = rep["census"]
        waits, launches = census["griddepcontrol.wait"], census["griddepcontrol.launch_dependents"]
        if role == "bwd_preprocess":
            # never waits (launched normally); signals its dependent at the start under pdl
            assert waits == 0 and launches == (1 if options.get("pdl") else 0), census
            zero_stores = head_dim * 64 // (4 * 128)  # 64 rows x d floats in 16-byte stores over 128 threads
            assert rep["zero_stores"] == (zero_stores if options.get("zero_dq_in_preprocess") else 0), rep
        elif role == "bwd_dq_postprocess":
            assert waits == (1 if options.get("pdl_dq_post") else 0) and launches == 0, census
        else:
            # the producer (before the first LSE / D load), the dQ warp (before its first reduce-add or semaphore;
            # with dq_red the consumers before their first add instead), the consumers (before the epilogue's
            # global writes)
            assert waits == (3 if options.get("pdl") else 0), census
            assert launches == (1 if options.get("pdl_dq_post") else 0), census
            assert census["setmaxnreg"] >= 2
            if options["dq_red"]:
                assert census["red.global.add.v4.f32"] > 0 and census["cp.reduce.async.bulk"] == 0, census
            else:
                assert census["cp.reduce.async.bulk"] > 0 and census["red.global.add.v4.f32"] == 0, census
            assert census["mbarrier.expect_tx"] == (2 if options["kv_with_first_tile"] else 0), census


MASKS = {"full": (False, (None, None)), "causal": (True, (None, None)), "window100_30": (False, (100, 30))}
GPU_CASES = [
    pytest.param(
        name,
        sq,
        sk,
        m,
        h,
        hk,
        id=f"{name}-{sq}x{sk}-{m}-h{h}_{hk}",
        marks=(pytest.mark.sm90, pytest.mark.xdist_group(name)),
    )
    for name in STUDY_VARIANTS
    for sq, sk in ((1, 1), (113, 203), (239, 1), (1023, 1024))
    for m in ("full", "causal", "window100_30")
    for h, hk in ((8, 8), (8, 2))
]


@pytest.mark.parametrize("name, sq, sk, mask, h, h_kv", GPU_CASES)
def test_sm90_backward_study_variants(name, sq, sk, mask, h, h_kv):
    """The d128 variants of docs/sm90_bwd_sass_study.md (profiling/sm90_bwd_variants.py), each built on the no-mask
    default for every mask (dv_kb3: a split other than the causal default's): the kernels alone against the
    reference; the 64-row ones (dV before the dP wait, dQ staging from one base) change no arithmetic, so their
    deterministic gradients equal the default's bit for bit."""
    from cute_flash.arch.sm90.backward import run_backward
    from cute_flash.testing import backward_inputs, backward_kernel_grads, check_backward, stable_seed

    causal, window = MASKS[mask]
    q, k, v, dout = backward_inputs(
        torch.bfloat16, 128, sq, sk, h, h_kv, stable_seed("bf16", sq, sk, mask, h, h_kv, name)
    )
    default = _d128("none")
    cfg = dataclasses.replace(default, **VARIANTS[name])
    grads = backward_kernel_grads(run_backward, q, k, v, dout, causal, window, cfg=cfg)
    check_backward(q, k, v, dout, grads, causal=causal, window_size=window)
    det = backward_kernel_grads(run_backward, q, k, v, dout, causal, window, cfg=cfg, deterministic=True)
    check_backward(q, k, v, dout, det, causal=causal, window_size=window)
    if cfg.tile_m == default.tile_m:
        ref = backward_kernel_grads(run_backward, q, k, v, dout, causal, window, cfg=default, deterministic=True)
        for a, b in zip(det, ref):
            assert torch.equal(a, b)


def _variant_gpu_cases(prefix: str, variants, masks) -> list:
    """GPU cases (variant, head_dim, sq, sk, mask, h, h_kv) of (variant, head dim) pairs: odd and equal lengths,
    MHA and GQA; one xdist group per build."""
    return [
        pytest.param(
            name,
            d,
            sq,
            sk,
            m,
            h,
            hk,
            id=f"{prefix}-{name}-d{d}-{sq}x{sk}-{m}-h{h}_{hk}",
            marks=(pytest.mark.sm90, pytest.mark.xdist_group(f"{prefix}-{name}-d{d}")),
        )
        for name, d in variants
        for sq, sk in ((1, 1), (113, 203), (1023, 1024))
        for m in masks
        for h, hk in ((8, 8), (8, 2))
    ]


OVERHEAD_GPU_CASES = _variant_gpu_cases(
    "overhead",
    [
        (name, d)
        for name, dims in (
            ("plain", (64, 128, 256)),
            ("memset", (64, 128, 256)),
            ("no_pdl", (128,)),
            ("kv_barrier", (96, 256)),
        )
        for d in dims
    ],  # fmt: skip
    ("full", "causal"),
)


@pytest.mark.parametrize("name, head_dim, sq, sk, mask, h, h_kv", OVERHEAD_GPU_CASES)
def test_sm90_backward_overhead_variants(name, head_dim, sq, sk, mask, h, h_kv):
    """The launch-overhead variants (the preprocess zeroes dQaccum; PDL preprocess -> main -> dQ postprocess) change
    no arithmetic: gradients against the reference, and deterministic ones bitwise equal to the default's. Called
    twice in a row (the second call's accumulator may be the first one's block, no longer zero)."""
    from cute_flash.arch.sm90.backward import run_backward
    from cute_flash.testing import backward_inputs, backward_kernel_grads, check_backward, stable_seed

    causal, window = MASKS[mask]
    q, k, v, dout = backward_inputs(
        torch.bfloat16, head_dim, sq, sk, h, h_kv, stable_seed("bf16", head_dim, sq, sk, mask, h, h_kv, name)
    )
    default = bwd_tile_config(_spec(head_dim, "causal" if causal else "none"))
    cfg = dataclasses.replace(default, **VARIANTS[name])
    for _ in range(2):
        grads = backward_kernel_grads(run_backward, q, k, v, dout, causal, window, cfg=cfg)
        check_backward(q, k, v, dout, grads, causal=causal, window_size=window)
    det = backward_kernel_grads(run_backward, q, k, v, dout, causal, window, cfg=cfg, deterministic=True)
    ref = backward_kernel_grads(run_backward, q, k, v, dout, causal, window, cfg=default, deterministic=True)
    for a, b in zip(det, ref):
        assert torch.equal(a, b)


# dq_red (BwdTileConfig): dQ added from registers with red.global.add.v4.f32; with the shared buffer it frees, a
# second Q / dO stage at d256 ("red2") and a third at d128 ("red3"). Atomics in no fixed order: no deterministic build.
RED_VARIANTS = (("red", 128), ("red3", 128), ("red2", 256), ("red", 64))


@pytest.mark.parametrize("name, head_dim", RED_VARIANTS)
def test_dq_red_builds_fit(name, head_dim):
    for mask in ("none", "causal", "local"):
        cfg = dataclasses.replace(bwd_tile_config(_spec(head_dim, mask)), **VARIANTS[name])
        assert bwd_config_problem(cfg, head_dim) is None, (name, head_dim, mask)


def test_dq_red_refuses_deterministic():
    from cute_flash.arch.sm90.backward import _kernels

    cfg = dataclasses.replace(bwd_tile_config(_spec(256, "causal")), **VARIANTS["red2"])
    with pytest.raises(ValueError, match="deterministic"):
        _kernels(_spec(256, "causal"), cfg, "sm_90a", False, True)


RED_GPU_CASES = _variant_gpu_cases("red", RED_VARIANTS, ("full", "causal", "window100_30"))


@pytest.mark.parametrize("name, head_dim, sq, sk, mask, h, h_kv", RED_GPU_CASES)
def test_sm90_backward_dq_red(name, head_dim, sq, sk, mask, h, h_kv):
    """dQ from registers: gradients against the reference, twice in a row (a reused accumulator block must be zeroed
    again by the preprocess)."""
    from cute_flash.arch.sm90.backward import run_backward
    from cute_flash.testing import backward_inputs, backward_kernel_grads, check_backward, stable_seed

    causal, window = MASKS[mask]
    q, k, v, dout = backward_inputs(
        torch.bfloat16, head_dim, sq, sk, h, h_kv, stable_seed("bf16", head_dim, sq, sk, mask, h, h_kv, name)
    )
    base = bwd_tile_config(_spec(head_dim, "causal" if causal else ("local" if window[0] is not None else "none")))
    cfg = dataclasses.replace(base, **VARIANTS[name])
    for _ in range(2):
        grads = backward_kernel_grads(run_backward, q, k, v, dout, causal, window, cfg=cfg)
        check_backward(q, k, v, dout, grads, causal=causal, window_size=window)


# dq_buffers (BwdTileConfig): two shared dQ buffers, query tile m_block's dQ in buffer m_block % 2 (the d64 causal
# default; session 21). GPU: the gradients of the variants below with the other head dims' tiles.
DQ_BUFFER_VARIANTS = (("dqbuf2", 128), ("dqbuf2", 96), ("dqbuf1", 64))


def test_dq_buffers_config():
    from cute_flash.arch.sm90.tile_config import SMEM_CAPACITY_BYTES, bwd_smem_bytes

    d64 = bwd_tile_config(_spec(64, "causal"))
    assert d64.dq_buffers == 2 and bwd_smem_bytes(d64, 64) <= SMEM_CAPACITY_BYTES
    one = dataclasses.replace(d64, dq_buffers=1)
    assert bwd_smem_bytes(d64, 64) - bwd_smem_bytes(one, 64) == 128 * 64 * 4  # one more tile_m x d fp32 buffer
    for mask in ("none", "local"):
        assert bwd_tile_config(_spec(64, mask)).dq_buffers == 1
    # Not deterministic builds either: their dQ warp waits for each reduce before handing the next buffer over.
    assert bwd_tile_config(_spec(64, "causal"), deterministic=True).dq_buffers == 1
    # Dense only: packed GQA builds spill with two buffers (tile_config._DENSE_ONLY).
    packed = AttentionSpec("bf16", 64, 64, "causal", "bf16", varlen=True)
    assert bwd_tile_config(packed).dq_buffers == 1 and bwd_tile_config(packed, True).dq_buffers == 1
    for name, head_dim in DQ_BUFFER_VARIANTS:
        for mask in ("none", "causal", "local"):
            cfg = dataclasses.replace(bwd_tile_config(_spec(head_dim, mask)), **VARIANTS[name])
            assert bwd_config_problem(cfg, head_dim) is None, (name, head_dim, mask)
    assert "dq_buffers" in bwd_config_problem(dataclasses.replace(d64, dq_buffers=3), 64)
    red = dataclasses.replace(bwd_tile_config(_spec(256, "none")), dq_buffers=2)
    assert "dq_red" in bwd_config_problem(red, 256)
    # d128's 80-row tile (long query sequences) has no room for a second buffer: its entry keeps one.
    long = bwd_tile_config(_spec(128, "none"), long=True)
    assert long.tile_m == 80 and long.dq_buffers == 1
    assert "shared memory" in bwd_config_problem(dataclasses.replace(long, dq_buffers=2), 128)


DQ_BUFFER_GPU_CASES = _variant_gpu_cases("dqbuf", DQ_BUFFER_VARIANTS, ("full", "causal", "window100_30"))


@pytest.mark.parametrize("name, head_dim, sq, sk, mask, h, h_kv", DQ_BUFFER_GPU_CASES)
def test_sm90_backward_dq_buffers(name, head_dim, sq, sk, mask, h, h_kv):
    """Two dQ buffers at d128 / d96 and one at d64 (the default's other choice at d64 causal, the same build at its
    other masks): gradients against the reference."""
    from cute_flash.arch.sm90.backward import run_backward
    from cute_flash.testing import backward_inputs, backward_kernel_grads, check_backward, stable_seed

    causal, window = MASKS[mask]
    q, k, v, dout = backward_inputs(
        torch.bfloat16, head_dim, sq, sk, h, h_kv, stable_seed("bf16", head_dim, sq, sk, mask, h, h_kv, name)
    )
    base = bwd_tile_config(_spec(head_dim, "causal" if causal else ("local" if window[0] is not None else "none")))
    grads = backward_kernel_grads(
        run_backward, q, k, v, dout, causal, window, cfg=dataclasses.replace(base, **VARIANTS[name])
    )
    check_backward(q, k, v, dout, grads, causal=causal, window_size=window)


def test_preprocess_build_gets_a_config_keyed_on_its_options(monkeypatch):
    # The option preprocess is cached on (dtype, head dim, zero_dq_in_preprocess, pdl) only, and its builder must get
    # a BwdTileConfig (a bare tuple once reached it and failed on the GPU only).
    from cute_flash import compile_cache
    from cute_flash.arch.sm90 import backward as sm90_bwd

    keys, built = [], []
    monkeypatch.setattr(compile_cache, "ensure_cute_dsl_arch", lambda target: None)
    monkeypatch.setattr(compile_cache, "get_or_compile", lambda key, build: keys.append(key) or build())
    monkeypatch.setattr(sm90_bwd, "_build", lambda role, spec, cfg, target, extra="": built.append((role, spec, cfg)))
    for head_dim, mask in ((128, "causal"), (128, "none"), (64, "causal")):
        sm90_bwd._kernel("bwd_preprocess", _spec(head_dim, mask), bwd_tile_config(_spec(head_dim, mask)), "sm_90a")
    for role, spec, cfg in built:
        assert role == "bwd_preprocess" and isinstance(cfg, BwdTileConfig) and spec.mask == "none"
        assert cfg.zero_dq_in_preprocess and cfg.pdl
    assert keys[0] == keys[1] and keys[0] != keys[2]  # the mask and main-kernel options do not split the cache


@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("dims", [(64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128)], ids=str)
def test_dq_postprocess_key_keeps_what_its_code_reads(dims, mask):
    # The dQ conversion is cached on a reduced configuration (backward.kernel_key). It once dropped keys_on_rows, so
    # d192's conversion took 128-byte swizzle atoms its 96-column halves cannot start on, and every d192 backward
    # failed to build on the GPU while the compile command (which built from the full configuration) passed. Both
    # build from kernel_key now; every field the conversion's code reads must survive the reduction.
    from cute_flash.arch.sm90.backward import kernel_key
    from cute_flash.arch.sm90.flash_bwd import dq_tile
    from cute_flash.arch.sm90.tile_config import operand_atom_cols

    spec = AttentionSpec("bf16", *dims, mask, "bf16")
    for long in (False, True):
        cfg = bwd_tile_config(spec, long=long)
        key_spec, key = kernel_key("bwd_dq_postprocess", spec, cfg)
        assert key_spec.head_dim == spec.head_dim and key_spec.dtype == spec.dtype
        assert operand_atom_cols(spec.head_dim, key) == operand_atom_cols(spec.head_dim, cfg)
        assert dq_tile(spec.head_dim, key) == dq_tile(spec.head_dim, cfg)
        fields = ("tile_m", "dq_split", "keys_on_rows", "num_consumer_wgs", "num_dq_wgs", "dq_swap_ab", "pdl_dq_post")
        for field in fields:
            assert getattr(key, field) == getattr(cfg, field), field

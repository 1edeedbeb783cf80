"""The sm90 backward's study variants (profiling/sm90_bwd_variants.py VARIANTS; docs/sm90_bwd_sass_study.md).

CPU: they are valid configurations where they are meant to run, and dq_stage_single_base addresses the same shared
memory as the default dQ staging. GPU (Hopper; tests/gpu_suite.sh step "variants", not in the "sm90" step): their
gradients against the reference, and bitwise equal to the default's where the arithmetic is the same.
"""

import dataclasses

import pytest
import torch

from cute_flash.arch.sm90.tile_config import BwdTileConfig, bwd_config_problem, bwd_tile_config
from cute_flash.spec import AttentionSpec
from profiling.sm90_bwd_variants import VARIANTS

STUDY_VARIANTS = ("dv_early", "dv_early_b", "dq_base", "m80_regstats")


def _d128(mask: str) -> BwdTileConfig:
    return bwd_tile_config(AttentionSpec("bf16", 128, 128, mask, "bf16"))


@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("name", STUDY_VARIANTS)
def test_study_variants_are_valid_at_d128(name, mask):
    cfg = dataclasses.replace(_d128(mask), **VARIANTS[name])
    assert bwd_config_problem(cfg, 128) is None


def test_study_switches_default_off():
    cfg = _d128("causal")
    assert not cfg.dv_before_dp_wait and not cfg.dq_stage_single_base and cfg.max_unshuffled_stat_cols == 16
    for field in ("dv_before_dp_wait", "dq_stage_single_base", "max_unshuffled_stat_cols"):
        assert field in cfg.as_dict()
    # A is the default at d128 without a mask only (tile_config._BWD_BY_HEAD_DIM_AND_MASK), the rest unchanged there.
    assert dataclasses.replace(_d128("none"), dv_before_dp_wait=False) == cfg
    assert not _d128("local").dv_before_dp_wait


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
    """The d128 variants of docs/sm90_bwd_sass_study.md (profiling/sm90_bwd_variants.py; not defaults): the kernels
    alone against the reference; the 64-row ones (dV before the dP wait, dQ staging from one base) change no
    arithmetic, so their deterministic gradients equal the default's bit for bit."""
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

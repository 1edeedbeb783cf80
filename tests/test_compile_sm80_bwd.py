"""CPU: the sm80 backward kernels cross-compile for sm_80 with the instructions FlashAttention-2's design implies.

A few specs only (each main kernel takes several seconds to build); the CLI's `compile --arch sm80 --backward` covers
any other head dim.
"""

from __future__ import annotations

import pytest

from cute_flash.spec import AttentionSpec

SPECS = [
    AttentionSpec("bf16", 64, 64, "none", "bf16"),
    AttentionSpec("fp16", 128, 128, "causal", "fp16"),
    AttentionSpec("bf16", 256, 256, "local", "bf16"),
]


@pytest.fixture(scope="module")
def artifacts():
    from cute_flash.arch.sm80.backward import compile_backward_artifacts

    return {spec: {a.kernel: a for a in compile_backward_artifacts(spec, "sm_80")} for spec in SPECS}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.dtype}-d{s.head_dim}-{s.mask}")
def test_backward_kernels_census(spec, artifacts):
    from cute_flash.census import cubin_resources, ptx_census

    kernels = artifacts[spec]
    assert set(kernels) == {"bwd_preprocess", "bwd", "bwd_gqa", "bwd_postprocess"}
    for name in ("bwd", "bwd_gqa"):
        census = ptx_census(kernels[name].ptx)
        # Five products per step (S, dP, dV, dK, dQ), all mma.sync; operands through ldmatrix (plain and .trans);
        # Q, dO, K, V arrive by cp.async; dQ (and dK/dV under GQA) leave through fp32 atomics.
        assert census["mma.sync"] > 0 and census["ldmatrix"] > 0 and census["cp.async"] > 0, (name, census)
        assert census["wgmma.mma_async"] == 0 and census["tcgen05.mma"] == 0
        assert "ldmatrix.sync.aligned.m8n8.x4.trans" in kernels[name].ptx
        assert "atom.global" in kernels[name].ptx or "red.global" in kernels[name].ptx
        cfg = kernels[name].config
        assert cfg["shared_bytes"] <= 163 * 1024
        (res,) = cubin_resources(kernels[name].cubin).values()
        assert res["registers"] <= 255
    # D = rowsum(dO * O) is the diagonal of dO O^T by the same mma chain as dP (two n8 atoms per 16-wide k-block).
    assert ptx_census(kernels["bwd_preprocess"].ptx)["mma.sync"] == 2 * spec.head_dim_v // 16
    assert ptx_census(kernels["bwd_postprocess"].ptx)["mma.sync"] == 0


def test_default_sm90_variant_uses_vector_dq_reductions():
    """On sm_90a at d128 the default variant adds dQ with red.global.add.v4.f32 in the "fragment" layout, converted
    by its own postprocess (only the two kernels that change are compiled, to keep this file fast)."""
    from cute_flash.arch.sm80 import backward
    from cute_flash.arch.sm80.tile_config import bwd_tile_config
    from cute_flash.census import cubin_resources
    from cute_flash.compile_cache import compile_options, keep_artifacts_options
    import tempfile

    spec = AttentionSpec("bf16", 128, 128, "causal", "bf16")
    cfg = bwd_tile_config(128, "sm_90a")
    assert (cfg.dq_layout, cfg.dq_vec, cfg.dq_before_dk) == ("fragment", 4, True)
    assert bwd_tile_config(128, "sm_80").dq_layout == "rows"
    assert "bwd_dq_postprocess" in backward._roles(spec, "sm_90a")
    for role in ("bwd", "bwd_dq_postprocess"):
        with tempfile.TemporaryDirectory() as dump:
            compiled = backward._ROLES[role](
                spec, compile_options("sm_90a", extra=keep_artifacts_options(dump)), "sm_90a"
            )
            ptx = compiled.artifacts.PTX
            (res,) = cubin_resources(compiled.artifacts.CUBIN).values()
        assert res["registers"] <= 255
        if role == "bwd":
            # 64 x 128 dQ per step, 256 threads: 32 floats each, as 8 four-wide reductions and no scalar ones.
            assert ptx.count("red.global.add.v4.f32") == 8 and "atom.global.add.f32" not in ptx


def test_unsupported_specs_say_why():
    from cute_flash.arch.sm80.backward import backward_unsupported_reason

    assert backward_unsupported_reason(AttentionSpec("bf16", 128, 128, "causal", "bf16")) is None
    assert backward_unsupported_reason(AttentionSpec("bf16", 192, 128, "causal", "bf16")) is None  # padded to 192
    for spec, words in (
        (AttentionSpec("fp8", 128, 128, "none", "bf16"), "fp8"),
        (AttentionSpec("bf16", 264, 64, "none", "bf16"), "(264, 64)"),  # dv != d: the wider one sets the kernels
        (AttentionSpec("bf16", 272, 272, "none", "bf16"), "up to 256"),
    ):
        reason = backward_unsupported_reason(spec)
        assert reason is not None and words in reason, reason


# (128, "local") builds spill-free too; out of the CPU suite for time. (The pre- and postprocess of a
# d128 build: test_backward_kernels_census; `python -m cute_flash compile --arch sm80 --backward --head-dim 128`
# reports every kernel's spills.)
@pytest.mark.parametrize("head_dim,mask", [(128, "none"), (128, "causal"), (96, "causal"), (64, "none")])
def test_sm80_backward_main_kernels_do_not_spill(head_dim, mask):
    """The main kernels (with and without GQA) for the sm_80 target, where the default opt level 3 spilled at
    d96 causal and d128 (tile_config.default_opt_level)."""
    import tempfile

    from cute_flash.arch.sm80 import backward
    from cute_flash.census import capture_fd_stderr, cubin_resources, parse_ptxas_report
    from cute_flash.compile_cache import ensure_cute_dsl_arch, keep_artifacts_options

    ensure_cute_dsl_arch("sm_80")
    spec = AttentionSpec("bf16", head_dim, head_dim, mask, "bf16")
    for role in ("bwd", "bwd_gqa"):
        with tempfile.TemporaryDirectory() as dump, capture_fd_stderr() as err:
            compiled = backward._ROLES[role](
                spec, backward._options(role, spec, "sm_80", keep_artifacts_options(dump)), "sm_80"
            )
        ((entry, _),) = cubin_resources(compiled.artifacts.CUBIN).items()
        report = parse_ptxas_report("".join(err))
        assert report.get(entry, {}).get("spill_bytes") == 0, (role, report)


@pytest.mark.parametrize("role", ["bwd_postprocess", "bwd_dq_postprocess"])
def test_backward_postprocess_issues_every_load_before_any_branch(role):
    """With a branch per row around its load, each load waited for the one before (the FP8 pre-pass's 1.4 TB/s
    problem, docs/fp8.md); the accumulators are padded to whole blocks, so every load goes first."""
    import re
    import tempfile

    from cute_flash.arch.sm80 import backward
    from cute_flash.compile_cache import compile_options, keep_artifacts_options

    spec = AttentionSpec("bf16", 128, 128, "none", "bf16")
    options = compile_options("sm_90a", extra=keep_artifacts_options(tempfile.mkdtemp(), ptxas_report=False))
    compiled = backward._ROLES[role](spec, options, "sm_90a")
    lines = [line.strip() for line in compiled.artifacts.PTX.splitlines()]
    loads = [i for i, line in enumerate(lines) if re.match(r"ld\.global\.", line)]
    branches = [i for i, line in enumerate(lines) if re.search(r"\bbra\b", line)]
    assert loads, "no global loads found"
    assert not branches or max(loads) < min(branches), (len(loads), loads[-1], branches[:3])


def test_every_tile_config_field_reaches_the_tiled_roles_cache_keys():
    """The sm80 twin of the sm90 check (it guards against a reduced cache key that drops a field its kernel reads:
    one such key once built the sm90 d192 dQ conversion with swizzle atoms its 96-column halves cannot start on).
    The main kernels build from their full tile configuration, so every field must change their keys; the preprocess
    and the rows-layout conversion take none of it, so their keys must not move with it, nor with the mask. (The
    fragment dQ conversion is keyed on the whole configuration too, more than it reads.)"""
    import dataclasses

    from cute_flash.arch.sm80 import backward
    from cute_flash.arch.sm80.tile_config import bwd_tile_config

    spec = AttentionSpec("bf16", 128, 128, "causal", "bf16")
    cfg = bwd_tile_config(128, "sm_90a")
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, bool):
            other = not value
        elif isinstance(value, str):
            other = "fragment" if value != "fragment" else "rows"
        else:
            other = value + 1
        changed = dataclasses.replace(cfg, **{f.name: other})
        for role in backward._MAIN_ROLES:
            assert backward._cache_key(role, spec, "sm_90a", changed) != backward._cache_key(
                role, spec, "sm_90a", cfg
            ), (role, f.name)
        for role in ("bwd_preprocess", "bwd_postprocess"):
            assert backward._cache_key(role, spec, "sm_90a", changed) == backward._cache_key(
                role, dataclasses.replace(spec, mask="none"), "sm_90a", cfg
            ), (role, f.name)

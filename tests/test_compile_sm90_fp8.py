"""CPU: the sm90 FP8 forward and its pre-pass cross-compile for sm_90a, built the way docs/fp8.md says.

The census must show e4m3 wgmma for both GEMMs (Q·Kᵀ from shared memory, P·V with P from registers), TMA loads and
stores, setmaxnreg, and ptxas must report zero spill bytes at d <= 128; the pre-pass must use 16-byte loads and the
saturating e4m3 conversion.
"""

import contextlib
from dataclasses import replace
import io
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402

from cute_flash.census import capture_fd_stderr, cubin_resources, parse_ptxas_report, ptx_census  # noqa: E402
from cute_flash.spec import AttentionSpec  # noqa: E402


def _compile(spec):
    from cute_flash.arch.sm90.fp8.launch import compile_fp8_artifacts

    # The DSL prints ptxas' report through sys.stderr, which pytest swaps for its own object: capture both it and fd 2.
    py_stderr = io.StringIO()
    with capture_fd_stderr() as captured, contextlib.redirect_stderr(py_stderr):
        artifacts = compile_fp8_artifacts(spec, "sm_90a")
    ptxas = parse_ptxas_report("".join(captured) + py_stderr.getvalue())
    out = {}
    for art in artifacts:
        entry = next(iter(cubin_resources(art.cubin)))
        out[art.kernel] = (art, ptx_census(art.ptx), ptxas.get(entry, {}).get("spill_bytes"))
    return out


# (d128 without a mask: built and checked for spills by test_fp8_d128_default_takes_192_key_tiles_that_divide_the_...)
@pytest.mark.parametrize("head_dim,mask", [(128, "causal"), (64, "local"), (256, "causal")], ids=lambda x: str(x))
def test_fp8_forward_compiles(head_dim, mask):
    kernels = _compile(AttentionSpec("fp8", head_dim, head_dim, mask, "bf16"))
    art, census, spill = kernels["fwd_fp8"]
    assert census["wgmma.mma_async.e4m3"] == census["wgmma.mma_async"] > 0, "both GEMMs must be e4m3 wgmma"
    assert 0 < census["wgmma.mma_async.rs"] < census["wgmma.mma_async"], "Q·Kᵀ from smem (SS), P·V from registers (RS)"
    assert census["cp.async.bulk.tensor"] >= 4  # Q, K, Vᵀ loads and the O store
    assert census["setmaxnreg"] >= 2
    assert "cvt.rn.satfinite.e4m3x2.f32" in art.ptx
    # No lane exchange for P (the few indexed shuffles are warp-uniform broadcasts at kernel start).
    n_idx_shuffles = art.ptx.count("shfl.sync.idx")
    assert n_idx_shuffles <= 4 and "prmt.b32" not in art.ptx, f"P needs no shuffle or byte permute ({n_idx_shuffles})"
    assert spill == 0, f"d={head_dim} spills {spill} bytes"
    for role in ("fp8_prepass_q", "fp8_prepass_k", "fp8_prepass_v"):
        pre, pre_census, pre_spill = kernels[role]
        assert pre_spill == 0
        assert "cvt.rn.satfinite.e4m3x2.f32" in pre.ptx
        assert "ld.global.v4" in pre.ptx, "the pre-pass reads with vector loads"


def test_fp8_rejects_what_it_lacks():
    from cute_flash.arch.sm90.fp8.launch import fp8_unsupported_reason

    assert fp8_unsupported_reason(AttentionSpec("fp8", 128, 128, "causal", "bf16")) is None
    assert "multiple of 32" in fp8_unsupported_reason(AttentionSpec("fp8", 80, 80, "none", "bf16"))
    assert "computes in fp8" in fp8_unsupported_reason(AttentionSpec("bf16", 128, 128, "none", "bf16"))


def _tile128(**fields):
    """The 128-key FP8 tile with P·V promoted (the d <= 128 default before the 192-key tile), with `fields` changed:
    the kernel paths no default takes (the polynomial exponential, row sums from the P·V wgmma)."""
    from cute_flash.arch.sm90.fp8.tile_config import Fp8FwdConfig
    from cute_flash.arch.sm90.tile_config import FwdTileConfig

    return replace(Fp8FwdConfig(FwdTileConfig(2, 128, 2), promote_pv=True), **fields)


def test_fp8_polynomial_exp2_variant_compiles_without_spills():
    """The FMA-pipe exponential (`fp8.softmax.exp2_poly`) replaces MUFU.EX2 for part of each row and keeps 0 spills."""
    import tempfile

    from cute_flash.arch.sm90.fp8.launch import build_fp8_forward
    from cute_flash.compile_cache import keep_artifacts_options

    py_stderr = io.StringIO()
    with tempfile.TemporaryDirectory() as dump, capture_fd_stderr() as captured, contextlib.redirect_stderr(py_stderr):
        compiled = build_fp8_forward(
            AttentionSpec("fp8", 128, 128, "causal", "bf16"),
            _tile128(exp2_poly_per_row=8),
            "sm_90a",
            keep_artifacts_options(dump),
        )
    ptx = compiled.artifacts.PTX
    assert "add.rm.f32" in ptx and "ex2.approx.ftz.f32" in ptx, "both exponentials must be present"
    entry = next(iter(cubin_resources(compiled.artifacts.CUBIN)))
    spill = parse_ptxas_report("".join(captured) + py_stderr.getvalue()).get(entry, {}).get("spill_bytes")
    assert spill == 0, f"spills {spill} bytes"


def test_fp8_row_sum_mma_variant_takes_the_sums_from_the_pv_wgmma():
    """row_sum_mma: P·V is one wgmma with N = dv + 8 (the ones rows under Vᵀ give Σ P), no spills, and the softmax
    no longer sums P itself (fewer fp32 adds than scores)."""
    import tempfile

    from cute_flash.arch.sm90.fp8.launch import build_fp8_forward
    from cute_flash.arch.sm90.fp8.tile_config import budget_problem, fp8_fwd_config
    from cute_flash.compile_cache import keep_artifacts_options

    cfg = _tile128(row_sum_mma=True)
    assert budget_problem(replace(cfg, promote_pv=False), 128, 128) is not None  # the sums need the fresh accumulator
    assert budget_problem(replace(fp8_fwd_config(256, 256), row_sum_mma=True), 256, 256) is not None
    assert budget_problem(replace(fp8_fwd_config(128, 128), promote_pv=True, row_sum_mma=True), 128, 128)
    builds = {}
    for name, c in (("default", _tile128()), ("row_sum_mma", cfg)):
        py_stderr = io.StringIO()
        with (
            tempfile.TemporaryDirectory() as dump,
            capture_fd_stderr() as captured,
            contextlib.redirect_stderr(py_stderr),
        ):
            compiled = build_fp8_forward(
                AttentionSpec("fp8", 128, 128, "none", "bf16"), c, "sm_90a", keep_artifacts_options(dump)
            )
        entry = next(iter(cubin_resources(compiled.artifacts.CUBIN)))
        spill = parse_ptxas_report("".join(captured) + py_stderr.getvalue()).get(entry, {}).get("spill_bytes")
        assert spill == 0, f"{name}: spills {spill} bytes"
        builds[name] = compiled.artifacts.PTX
    assert "m64n136k32.f32.e4m3.e4m3" in builds["row_sum_mma"]
    assert "m64n136k32" not in builds["default"]
    adds = {name: ptx.count("add.f32") for name, ptx in builds.items()}
    assert adds["default"] - adds["row_sum_mma"] >= 64, adds


@pytest.mark.parametrize("block,rotate,transpose,row_loads", [(64, True, False, 8), (128, False, True, 16)])
def test_prepass_issues_every_row_load_before_any_branch(block, rotate, transpose, row_loads):
    """A branch per row around its load serialised the loads (each waited for the one before: 1.4 TB/s on the H200);
    with every row load ahead of the first branch the pre-pass ran at 2.4 TB/s (docs/fp8.md)."""
    import re
    import tempfile

    from cute_flash.compile_cache import compile_options, keep_artifacts_options
    from cute_flash.fp8.prepass_kernel import build_prepass

    compiled = build_prepass(
        "bf16",
        128,
        block,
        rotate,
        transpose,
        compile_options("sm_90a", extra=keep_artifacts_options(tempfile.mkdtemp(), ptxas_report=False)),
    )
    lines = [line.strip() for line in compiled.artifacts.PTX.splitlines()]
    loads = [i for i, line in enumerate(lines) if re.match(r"ld\.global\.v[24]\.", line)]
    branches = [i for i, line in enumerate(lines) if re.search(r"\bbra\b", line)]
    assert len(loads) == row_loads
    assert not branches or max(loads) < min(branches), (loads, branches[:3])


def test_fp8_d128_default_takes_192_key_tiles_that_divide_the_scale_block():
    """d128: Q·Kᵀ is m64n192k32 (192-key tiles, two per 384-key K/V scale block), P·V stays m64n128k32, no spills."""
    from cute_flash.arch.sm90.fp8.tile_config import fp8_fwd_config, kv_scale_block

    cfg = fp8_fwd_config(128, 128, "causal")
    assert cfg.tile.tile_n == 192 and kv_scale_block(128, 128) == 384
    for d in (64, 96, 128, 256):
        assert kv_scale_block(d, d) % fp8_fwd_config(d, d).tile.tile_n == 0, d
    art, census, spill = _compile(AttentionSpec("fp8", 128, 128, "none", "bf16"))["fwd_fp8"]
    assert spill == 0
    assert "m64n192k32.f32.e4m3.e4m3" in art.ptx and "m64n128k32.f32.e4m3.e4m3" in art.ptx


def test_fp8_kernel_refuses_descales_of_another_block_size():
    """A k/v descale with 128-key blocks (sm100's) must not reach the sm90 kernel, which reads one per 384 keys."""
    import torch

    from cute_flash.arch.sm90.fp8.launch import run_forward_fp8
    from cute_flash.fp8.quantize import num_blocks
    from cute_flash.spec import normalize_mask

    b, s, h, d = 1, 1000, 2, 128
    k8 = torch.zeros(b, s, h, d, dtype=torch.float8_e4m3fn)
    descale = {
        "q": torch.ones(b, h, num_blocks(s, 64)),
        "k": torch.ones(b, h, num_blocks(s, 128)),
        "v": torch.ones(b, h, num_blocks(s, 128)),
    }
    with pytest.raises(ValueError, match="block_n=384"):
        run_forward_fp8(
            k8,
            k8,
            k8,
            k8,
            k8,
            descale=descale,
            spec=AttentionSpec("fp8", d, d, "none", "bf16"),
            softmax_scale=1.0,
            mask=normalize_mask(False, (None, None)),
        )

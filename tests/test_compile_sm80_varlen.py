"""CPU: the packed (varlen) sm80 kernels cross-compile for sm_80 and sm_90a with FlashAttention-2's instructions.

A few configurations only (each main kernel takes several seconds to build); dense builds are untouched by the
varlen variants (docs/varlen.md says how that was checked: identical normalised PTX before and after).
"""

from __future__ import annotations

import pytest

from cute_flash.spec import AttentionSpec


def _assert_fa2_instructions(ptx: str, cubin: bytes, spills_allowed: bool = False):
    from cute_flash.census import cubin_resources, ptx_census

    census = ptx_census(ptx)
    assert census["mma.sync"] > 0 and census["ldmatrix"] > 0 and census["cp.async"] > 0, census
    assert census["wgmma.mma_async"] == 0 and census["tcgen05.mma"] == 0
    (res,) = cubin_resources(cubin).values()
    assert res["registers"] <= 255
    if not spills_allowed:
        assert res["stack_frame_bytes"] == 0, res


@pytest.mark.parametrize(
    "target, spec, seqused",
    [
        ("sm_90a", AttentionSpec("bf16", 128, 128, "causal", "bf16", varlen=True), False),
        ("sm_80", AttentionSpec("fp16", 128, 128, "none", "fp16", varlen=True), True),
    ],
    ids=["sm_90a-bf16-d128-causal", "sm_80-fp16-d128-none-seqused"],
)
def test_varlen_forward_compiles(target, spec, seqused):
    from cute_flash.arch.sm80.build import compile_forward

    fwd = compile_forward(spec, target, seqused=seqused)
    _assert_fa2_instructions(fwd.ptx, fwd.cubin)
    # Per-sequence offsets come from cu_seqlens in global memory (32-bit loads), not from the launch.
    assert "ld.global" in fwd.ptx


@pytest.mark.parametrize(
    "target, spec, roles",
    [
        (
            "sm_90a",
            AttentionSpec("bf16", 128, 128, "causal", "bf16", varlen=True),
            ["bwd_preprocess", "bwd_gqa_seqused", "bwd_dq_postprocess"],
        ),
        ("sm_80", AttentionSpec("fp16", 64, 64, "local", "fp16", varlen=True), ["bwd"]),
    ],
    ids=["sm_90a-bf16-d128-causal", "sm_80-fp16-d64-local"],
)
def test_varlen_backward_compiles(target, spec, roles):
    from cute_flash.arch.sm80.backward import compile_backward_artifacts
    from cute_flash.census import ptx_census

    kernels = {a.kernel: a for a in compile_backward_artifacts(spec, target, roles)}
    for role in roles:
        if role.startswith("bwd_gqa") or role == "bwd":
            # The dense d128 backward on sm_90a has a small stack frame too (ptxas at 255 registers).
            _assert_fa2_instructions(kernels[role].ptx, kernels[role].cubin, spills_allowed=target == "sm_90a")
    if "bwd_preprocess" in kernels:
        assert ptx_census(kernels["bwd_preprocess"].ptx)["mma.sync"] == 2 * spec.head_dim_v // 16

"""CPU: the sm100 forward cross-compiles for sm_100a and is built the way the design says (no GPU needed).

Through the same path as `python -m cute_flash compile --arch sm100`: the PTX must hold tcgen05.mma (cta_group::2 and
tcgen05.alloc.cta_group::2 in the 2-CTA build, kind::f8f6f4 in the fp8 build), TMA bulk-tensor copies and
setmaxnreg; ptxas must report zero spill bytes. Four compile calls (five kernels) keep this near a minute.
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")

import pytest  # noqa: E402

from cute_flash.arch.sm100 import BACKEND  # noqa: E402
from cute_flash.arch.sm100 import tile_config as config  # noqa: E402
from cute_flash.cli import compile_report  # noqa: E402
from cute_flash.spec import AttentionSpec  # noqa: E402


def _reports(capsys, tmp_path, spec):
    # ptxas' register/spill report reaches Python's sys.stderr, which pytest replaces; compile_report captures file
    # descriptor 2, so pytest's own capture is suspended while compiling.
    with capsys.disabled():
        return compile_report("sm100", spec, backward=False, out_dir=str(tmp_path))


def _check_common(report):
    census = report["census"]
    assert census["tcgen05.mma"] > 0
    assert census["cp.async.bulk.tensor"] > 0
    assert census["setmaxnreg"] >= 2  # the 16 warps re-split the register file by role
    assert report["threads"] == 512
    assert report["spill_bytes"] == 0, f"{report['kernel']} spills {report['spill_bytes']} bytes"


def test_sm100_bf16_d128_causal_builds_1cta_and_2cta(capsys, tmp_path):
    spec = AttentionSpec("bf16", 128, 128, "causal")
    reports = {r["kernel"]: r for r in _reports(capsys, tmp_path, spec)}
    assert set(reports) == {"fwd", "fwd_2cta"}
    for r in reports.values():
        _check_common(r)
    one, two = reports["fwd"]["census"], reports["fwd_2cta"]["census"]
    assert one["tcgen05.mma.cta_group::2"] == 0 and one["tcgen05.alloc.cta_group::2"] == 0
    assert two["tcgen05.mma.cta_group::2"] == two["tcgen05.mma"] > 0
    assert two["tcgen05.alloc.cta_group::2"] == 1
    assert reports["fwd_2cta"]["config"]["cluster"] == [2, 1, 1]


def test_sm100_fp8_d128_builds_f8f6f4(capsys, tmp_path):
    spec = AttentionSpec("fp8", 128, 128, "none", out_dtype="bf16")
    reports = {r["kernel"]: r for r in _reports(capsys, tmp_path, spec)}
    # The front end's e4m3 pre-pass runs before the forward on a B200 too: it must build for sm_100a.
    assert set(reports) == {"fwd", "fp8_prepass_q", "fp8_prepass_k", "fp8_prepass_v"}
    report = reports["fwd"]
    _check_common(report)
    census = report["census"]
    assert census["tcgen05.mma.kind::f8f6f4"] == census["tcgen05.mma"] > 0
    assert census["tcgen05.mma.cta_group::2"] == 0


def test_sm100_bf16_d64_local_builds(capsys, tmp_path):
    spec = AttentionSpec("bf16", 64, 64, "local")
    (report,) = _reports(capsys, tmp_path, spec)
    _check_common(report)
    assert report["kernel"] == "fwd"


def test_sm100_fp16_d96_causal_builds(capsys, tmp_path):
    # 96 is not a multiple of the 64-element swizzle atom: Q/K/V/O tiles take the narrower smem layouts.
    spec = AttentionSpec("fp16", 96, 96, "causal", out_dtype="fp16")
    (report,) = _reports(capsys, tmp_path, spec)
    _check_common(report)


def test_sm100_two_cta_choice():
    causal = AttentionSpec("bf16", 128, 128, "causal")
    assert config.choose_config(causal, seqlen_q=4096).use_2cta
    assert not config.choose_config(causal, seqlen_q=256).use_2cta
    assert not config.choose_config(AttentionSpec("bf16", 64, 64, "none"), seqlen_q=4096).use_2cta
    assert not config.choose_config(AttentionSpec("bf16", 128, 128, "local"), seqlen_q=4096).use_2cta
    assert not config.choose_config(AttentionSpec("fp8", 128, 128, "none"), seqlen_q=4096).use_2cta
    # Shared memory: Q (2 tiles) + O staging (2 tiles) + the K/V ring must fit 227 KiB.
    for spec in (causal, AttentionSpec("fp8", 128, 128, "none"), AttentionSpec("fp16", 64, 64, "none")):
        for cfg in config.configs_for(spec):
            assert cfg.kv_stages >= 2


def test_sm100_rejects_what_it_lacks():
    assert BACKEND.unsupported_reason(AttentionSpec("bf16", 128, 128, "none"), backward=False) is None
    assert BACKEND.unsupported_reason(AttentionSpec("fp8", 64, 64, "causal"), backward=False) is None
    assert BACKEND.unsupported_reason(AttentionSpec("bf16", 128, 128, "none"), backward=True) is None
    assert "up to 128" in BACKEND.unsupported_reason(AttentionSpec("bf16", 192, 192, "none"), backward=True)
    assert "fp16 or bf16" in BACKEND.unsupported_reason(AttentionSpec("fp8", 128, 128, "none", "bf16"), backward=True)
    assert BACKEND.unsupported_reason(AttentionSpec("bf16", 96, 96, "local"), backward=False) is None
    assert "head_dim 256" in BACKEND.unsupported_reason(AttentionSpec("bf16", 256, 256, "none"), backward=False)
    assert "head_dim_v" in BACKEND.unsupported_reason(AttentionSpec("bf16", 128, 64, "none"), backward=False)
    with pytest.raises(NotImplementedError):
        BACKEND.compile_artifacts(AttentionSpec("bf16", 256, 256, "none"), backward=False, target="sm_100a")


def test_sm100_packed_forward_builds_one_cta_with_row_stores(capsys, tmp_path):
    """Packed sequences (spec.varlen): one 1-CTA build whose epilogue stores O row by row inside each sequence (16-byte
    st.global, no TMA store: a box would also write the next sequence's rows); spill-free."""
    spec = AttentionSpec("bf16", 128, 128, "causal", varlen=True, softcap=True, sink=True)
    reports = {r["kernel"]: r for r in _reports(capsys, tmp_path, spec)}
    assert set(reports) == {"fwd"}
    report = reports["fwd"]
    _check_common(report)
    assert report["config"]["cta_group"] == 1
    ptx = (tmp_path / report["files"][0]).read_text()
    assert "st.global.v4" in ptx and "cp.async.bulk.tensor.4d.global.shared" not in ptx


def _flat_rows_errors(tile, coords, width: int, rows) -> list:
    """smem_tails' premise for one operand tile (plain Python at trace time): flat index x + width * k is element
    (x, k), and each 16-byte chunk of flat indices is 8 consecutive, 8-aligned shared-memory elements (checked on
    `rows` element by element, on every chunk's start otherwise)."""
    import cutlass.cute as cute

    from cute_flash.arch.sm100.smem_tails import flat_rows

    bad = [] if flat_rows(tile) == width else [("width", flat_rows(tile), width)]
    for k in rows:
        for x in range(width):
            i = x + width * k
            if coords[i] != (x, k) or tile(i) != tile(i - x % 8) + x % 8:
                bad.append((width, x, k))
    return bad + [(width, i) for i in range(0, cute.size(tile), 8) if tile(i) % 8]


def _tail_tile_errors() -> list:
    """_flat_rows_errors of every tile the packed kernels zero rows of, laid out as the kernels lay them out, for
    both 16-bit dtypes: the forward's V (B of P·V, keys along K) at d 64 / 96 / 128, and the backward's K^T (B of
    dQ = dS K), Q^T (B of dK += dS^T Q) and dO^T (B of dV += P^T dO), rows along K, at d 64 / 128."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    K, MN, TMEM = OperandMajorMode.K, OperandMajorMode.MN, tcgen05.OperandSource.TMEM
    m, n = config.M_BLOCK, config.N_BLOCK
    bad = []
    for dtype in (cutlass.BFloat16, cutlass.Float16):

        def tile(a, b, tiler, src=tcgen05.OperandSource.SMEM):
            """(one stage of the B layout, its coordinates) of an MMA (A major, B major) over tiler (M, N, K)."""
            mma = sm100_utils.make_trivial_tiled_mma(dtype, dtype, a, b, cutlass.Float32, tcgen05.CtaGroup.ONE,
                                                     tiler[:2], src)  # fmt: skip
            layout = sm100_utils.make_smem_layout_b(mma, tiler, dtype, 2)
            coords = mma.get_slice(0).partition_B(cute.make_identity_tensor(tiler[1:]))
            return cute.select(layout, mode=[0, 1, 2]), coords

        tiles = [(tile(K, MN, (m, dv, n), TMEM), dv) for dv in (64, 96, 128)]  # forward V
        for d in (64, 128):
            tiles += [(tile(MN, MN, (m, d, n)), d), (tile(K, MN, (n, d, m)), d), (tile(K, MN, (n, d, m), TMEM), d)]
        rows = (0, 1, 7, 8, 15, 16, 17, 63, 64, 127)
        for (layout, coords), width in tiles:
            bad += _flat_rows_errors(layout, coords, width, rows)
    return bad


def test_sm100_tail_tiles_flatten_to_rows():
    """The packed kernels zero the rows past a sequence's end by flat index (smem_tails.zero_k_rows_from): the tiles
    they zero must flatten as that assumes (the layouts are built and read at trace time, in a jit function)."""
    import cutlass.cute as cute

    found = []

    @cute.jit
    def trace():
        found.extend(_tail_tile_errors())

    trace()
    assert not found, found[:5]

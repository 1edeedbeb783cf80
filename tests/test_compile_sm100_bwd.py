"""CPU: the sm100 backward cross-compiles for sm_100a and is built the way flash_bwd.py says (no GPU needed).

No Blackwell GPU has run this kernel; what can be checked without one is checked here:
  - ptxas reports zero spill bytes for every head dim, mask and soft-capping build;
  - the deterministic twin holds the same MMAs and adds behind acquire / release semaphore accesses;
  - the instruction census: five MMAs per query tile (S^T, dP^T, dV, dK, dQ), issued as prologue (S, dP, dV), one
    loop body (all five) and epilogue (dQ, dK); d / 32 TMA reduce-adds of dQ per tile; one TMEM allocation; three
    setmaxnreg (compute up, dQ and the single warps down);
  - the shared-memory buffers that two MMAs read under different layouts (Q and Q^T, K and K^T, dO and dO^T, dS and
    dS^T) agree element by element, so each MMA reads the operand the other's layout wrote.
"""

import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")

import pytest  # noqa: E402

from cute_flash.cli import compile_report  # noqa: E402
from cute_flash.spec import AttentionSpec  # noqa: E402


def _mma_count(d: int) -> int:
    """tcgen05.mma instructions of the kernel: K-blocks of 16 per MMA (S^T, dP^T over d; dV, dK over 128 queries; dQ
    over 128 keys), prologue + loop body + epilogue."""
    s = dp = d // 16
    dv = dk = dq = 128 // 16
    return (s + dp + dv) + (s + dq + dk + dp + dv) + (dq + dk)


@pytest.mark.parametrize(
    "d, mask, softcap, varlen",
    [
        (64, "none", False, False),
        (128, "causal", False, False),
        (128, "local", False, False),
        (128, "causal", True, False),
        (32, "local", True, False),
        (128, "causal", False, True),  # packed sequences (the `packed` entry; no sm100 forward: the sm80 one's)
    ],
)
def test_sm100_backward_builds(capsys, tmp_path, d, mask, softcap, varlen):
    spec = AttentionSpec("bf16", d, d, mask, softcap=softcap, varlen=varlen)
    with capsys.disabled():  # (ptxas' report goes to file descriptor 2, which compile_report captures)
        reports = {r["kernel"]: r for r in compile_report("sm100", spec, backward=True, out_dir=str(tmp_path))}
    assert {"bwd", "bwd_det", "sm80_bwd_preprocess", "sm80_bwd_postprocess"} <= set(reports)
    bwd = reports["bwd"]
    width = max(d, 64)  # d32 runs the d64 kernel on zero-padded operands
    census = bwd["census"]
    assert bwd["spill_bytes"] == 0, f"the sm100 backward spills {bwd['spill_bytes']} bytes"
    assert bwd["threads"] == 512
    assert bwd["shared_bytes"] <= 227 * 1024
    assert census["tcgen05.mma"] == _mma_count(width)
    assert census["cp.reduce.async.bulk"] == width // 32
    assert census["setmaxnreg"] == 3
    for r in reports.values():
        assert r["spill_bytes"] == 0, r["kernel"]
    # The deterministic twin: the same MMAs and adds, behind acquire / release semaphore accesses.
    det = reports["bwd_det"]
    assert det["census"]["tcgen05.mma"] == census["tcgen05.mma"]
    assert det["census"]["cp.reduce.async.bulk"] == census["cp.reduce.async.bulk"]
    ptx = {name: (tmp_path / reports[name]["files"][0]).read_text() for name in ("bwd", "bwd_det")}
    assert "ld.acquire.gpu" in ptx["bwd_det"] and "red.release.gpu.global.add" in ptx["bwd_det"]
    assert "ld.acquire.gpu" not in ptx["bwd"] and "red.release.gpu" not in ptx["bwd"]
    # Packed builds zero the rows past a sequence's end in K, Q and dO (flash_bwd.tail_warps; 16-byte stores).
    zero_stores = len(re.findall(r"st\.shared\.v4\.b32\s+\[[^]]+\], \{0, 0, 0, 0\}", ptx["bwd"]))
    assert (zero_stores > 0) == varlen, zero_stores


# ------------------------------------------------------------------------------------------------ shared-memory views
def _flat(t):
    return [y for x in t for y in _flat(x)] if isinstance(t, tuple) else [t]


def _parse(layout: str):
    """'(shape):(stride)' of a static layout (or the last, plain part of a composed one) as flat lists."""
    layout = layout.split(" o ")[-1].rstrip(">")
    layout = layout[layout.index("(") :] if "(" in layout else layout
    as_tuple = lambda s: eval(re.sub(r"\)", ",)", s))  # noqa: E731  ("(64,16)" -> (64, 16,); ints stay ints)
    shape, stride = layout.split(":")
    return _flat(as_tuple(shape)), _flat(as_tuple(stride))


def _index(layout, index: int) -> int:
    shape, stride = layout
    off = 0
    for n, s in zip(shape, stride):
        off += (index % n) * s
        index //= n
    return off


def _offset(layout, swizzle: str, index: int) -> int:
    """The element offset of natural index `index` under a swizzled (`S<b,m,s>`) static layout."""
    shape, stride = layout
    off = 0
    for n, s in zip(shape, stride):
        off += (index % n) * s
        index //= n
    b, m, s = map(int, re.findall(r"-?\d+", swizzle)[:3])
    return off ^ (((off >> (m + s)) & ((1 << b) - 1)) << m)


@pytest.mark.parametrize("d", [64, 128])
def test_sm100_backward_shared_views_agree(d):
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    from cute_flash.arch.sm100.tile_config import bwd_config

    found = {}
    dt = cutlass.BFloat16
    do_stages = bwd_config(AttentionSpec("bf16", d, d, "none")).do_stages  # (2 at d64)

    @cute.jit
    def layouts():
        K, MN = OperandMajorMode.K, OperandMajorMode.MN

        def mma(a, b, tiler, src=tcgen05.OperandSource.SMEM):
            return sm100_utils.make_trivial_tiled_mma(
                dt, dt, a, b, cutlass.Float32, tcgen05.CtaGroup.ONE, tiler[:2], src
            )

        t_s, t_dkv, t_dq = (128, 128, d), (128, d, 128), (128, d, 128)
        m_s, m_dk, m_dq = mma(K, K, t_s), mma(K, MN, t_dkv), mma(MN, MN, t_dq)
        m_dv = mma(K, MN, t_dkv, tcgen05.OperandSource.TMEM)
        a, b = sm100_utils.make_smem_layout_a, sm100_utils.make_smem_layout_b
        # (operand, its layout for one MMA, its transpose's for another, rows, columns, stages) as in flash_bwd.py
        for name, one, other, rows, cols, stages in (
            ("Q", b(m_s, t_s, dt, 2), b(m_dk, t_dkv, dt, 2), 128, d, 2),
            ("K", a(m_s, t_s, dt, 1), b(m_dq, t_dq, dt, 1), 128, d, 1),
            ("dO", b(m_s, t_s, dt, do_stages), b(m_dv, t_dkv, dt, do_stages), 128, d, do_stages),
            ("dS", a(m_dq, t_dq, dt, 1), a(m_dk, t_dkv, dt, 1), 128, 128, 1),
        ):
            found[name] = (str(one.outer), str(one.inner), str(other.outer), str(other.inner), rows, cols, stages)

    cute.compile(layouts)
    assert set(found) == {"Q", "K", "dO", "dS"}
    for name, (outer1, swz1, outer2, swz2, rows, cols, stages) in found.items():
        l1, l2 = _parse(outer1), _parse(outer2)
        bad = [
            (s, r, c)
            for s in range(stages)
            for r in range(rows)
            for c in range(cols)
            if _offset(l1, swz1, r + rows * c + rows * cols * s) != _offset(l2, swz2, c + cols * r + rows * cols * s)
        ]
        assert not bad, f"{name}: {len(bad)} elements differ between the two views, e.g. {bad[:3]}"


@pytest.mark.parametrize("d", [64, 128])
def test_sm100_backward_p_words_are_where_the_dv_mma_reads_them(d):
    """P^T goes to TMEM as 32-bit words of two 16-bit probabilities (warpgroup wg's 64 query columns as words
    32 wg .. 32 wg + 31, St32x32b) over the S^T columns; the dV MMA reads its A operand through make_fragment_A of the
    dV MMA's A layout on the TMEM pointer. Element (key, query q) must be the same column and half in both."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    got = {}
    dt = cutlass.BFloat16

    @cute.jit
    def layouts():
        mdv = sm100_utils.make_trivial_tiled_mma(
            dt, dt, OperandMajorMode.K, OperandMajorMode.MN, cutlass.Float32, tcgen05.CtaGroup.ONE, (128, d),
            tcgen05.OperandSource.TMEM,
        )  # fmt: skip
        tmem = cute.make_ptr(cutlass.Float32, 0, mem_space=cute.AddressSpace.tmem, assumed_align=16)
        frag = mdv.make_fragment_A(
            cute.make_tensor(tmem, sm100_utils.make_smem_layout_a(mdv, (128, d, 128), dt, 1).outer)
        )
        got["frag"] = str(frag[None, None, None, 0].layout)
        load = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), cutlass.Float32)
        store = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(32)), cutlass.Float32)
        lanes = 65536  # (a TMEM address's lane stride)
        for wg in cutlass.range_constexpr(2):
            t_s = cute.make_tensor(tmem + wg * 64, cute.make_layout((128, 64), stride=(lanes, 1)))
            t_p = cute.make_tensor(tmem + wg * 32, cute.make_layout((128, 32), stride=(lanes, 1)))
            thr_load = tcgen05.make_tmem_copy(load, t_s).get_slice(0)
            thr_store = tcgen05.make_tmem_copy(store, t_p).get_slice(0)
            got[f"cols{wg}"] = str(thr_load.partition_D(cute.make_identity_tensor((128, 64))).layout)
            got[f"words{wg}"] = str(thr_store.partition_D(t_p).layout)

    cute.compile(layouts)
    frag = _parse(got["frag"])  # ((M, 16), 1, K blocks) in 16-bit units
    for wg in range(2):
        # register j of a thread's S^T load is query column 64 wg + j
        assert "1@1" in got[f"cols{wg}"] and "32@1" in got[f"cols{wg}"], got[f"cols{wg}"]
        words = _parse(got[f"words{wg}"])
        for j in range(64):
            q = 64 * wg + j
            column = wg * 32 + _index(words, j // 2) % 65536
            offset = _index(frag, 128 * (q % 16 + 16 * (q // 16)))  # the MMA's element (key 0, query q)
            assert (offset // 2, offset % 2) == (column, j % 2), (wg, j, offset, column)

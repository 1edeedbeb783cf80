"""CPU checks of the sm80 family's soft-capping / sink builds and its KV-cache forward: the packed GQA rows' block
arithmetic against brute force (negative windows included), the split heuristic, and one representative
cross-compile per new kernel variant (instruction census, no spills). Numerical checks are GPU tests
(tests/test_sm80_softcap_sink.py, tests/test_sm80_kvcache.py).
"""

from __future__ import annotations

import itertools

import pytest

from cute_flash.arch.sm80.kvcache_blocks import PackedGqaBlocks
from cute_flash.spec import UNBOUNDED_WINDOW, AttentionSpec
from cute_flash.validation import KvCacheProblem
from cute_flash.spec import normalize_mask

U = UNBOUNDED_WINDOW
WINDOWS = [("none", U, U), ("causal", U, 0), ("local", 4, 0), ("local", 0, 0), ("local", 2, 5), ("local", 7, U),
           ("local", -3, 9), ("local", 9, -3), ("local", -5, 2), ("local", U, -6), ("local", -8, U)]  # fmt: skip
SHAPES = [(1, 1), (1, 40), (3, 17), (5, 3), (17, 40), (40, 17), (9, 9)]


def _sees(s, j, sq, sk, kind, left, right):
    if not 0 <= j < sk:
        return False
    off = sk - sq
    if kind == "none":
        return True
    if kind == "causal":
        return j <= s + off
    return s + off - left <= j <= s + off + right


@pytest.mark.parametrize("kind,left,right", WINDOWS, ids=lambda x: str(x))
def test_packed_gqa_blocks_match_brute_force(kind, left, right):
    """Every key tile a row tile needs is visited; a visited tile that hides some (row, key) of the tile is masked
    (the last one always is, then those from kv_right_masked_start on and below kv_left_masked_end)."""
    for (sq, sk), group, (tile_m, tile_n) in itertools.product(SHAPES, (1, 3, 4), ((4, 4), (8, 4), (4, 8), (16, 8))):
        info = PackedGqaBlocks(tile_m, tile_n, kind, sq, sk, left, right, group)
        rows = sq * group
        for m in range(-(-rows // tile_m)):
            positions = sorted({r // group for r in range(m * tile_m, min((m + 1) * tile_m, rows))})
            lo, hi = info.kv_block_range(m)
            for n in range(-(-sk // tile_n)):
                keys = range(n * tile_n, (n + 1) * tile_n)
                seen = any(_sees(s, j, sq, sk, kind, left, right) for s in positions for j in keys)
                if seen:
                    assert lo <= n < hi, (sq, sk, group, tile_m, tile_n, m, n, lo, hi)
            right_start = info.kv_right_masked_start(m) if info.has_right_bound else hi
            left_end = info.kv_left_masked_end(m) if info.has_left_bound else lo
            for n in range(lo, hi - 1):
                keys = range(n * tile_n, (n + 1) * tile_n)
                hidden = any(not _sees(s, j, sq, sk, kind, left, right) for s in positions for j in keys)
                if hidden:
                    assert n >= right_start or n < left_end, ("unmasked tile hides keys", sq, sk, group, m, n)


def _problem(batch, seqlen_q, nheads, nheads_kv, max_seqlen_k, d=128):
    spec = AttentionSpec("bf16", d, d, "causal", "bf16", kvcache=True, page_size=16)
    return KvCacheProblem(
        batch, seqlen_q, batch * seqlen_q, nheads, nheads_kv, d, d, max_seqlen_k, batch * max_seqlen_k // 16, spec,
        normalize_mask(True, (None, None)), d**-0.5,
    )  # fmt: skip


def test_kvcache_splits():
    from cute_flash.arch.sm80.kvcache import MAX_SPLITS, num_splits

    # Decoding at batch 1, 8 KV heads of 4 query heads each: 8 CTAs, split to fill 132 SMs twice.
    assert num_splits(_problem(1, 1, 32, 8, 32768), 132) == 2 * 132 // 8
    # Plenty of CTAs already: unsplit; short caches: as many splits as their key tiles allow (two tiles each).
    assert num_splits(_problem(64, 1, 32, 8, 32768), 132) == 1
    assert num_splits(_problem(1, 1, 32, 8, 512), 132) == 512 // 128 // 2
    assert num_splits(_problem(1, 1, 8, 1, 1 << 20), 132) == MAX_SPLITS
    assert num_splits(_problem(1, 1, 8, 1, 100), 132) == 1
    assert num_splits(_problem(0, 1, 8, 1, 100), 132) == 1


def test_packed_rows_gathers_each_sequence():
    """backward.packed_rows: the packed backward's padded per-sequence rows back to (h, total_q) (dsink reads D
    there), empty sequences included."""
    import torch

    from cute_flash.arch.sm80.backward import packed_rows
    from cute_flash.common.packed import padded_rows

    lengths, pad, h = [0, 5, 64, 0, 1, 130], 64, 3
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    total = int(cu[-1])
    stats = torch.randn(h, padded_rows(total, len(lengths), pad))
    expected = torch.empty(h, total)
    for b, n in enumerate(lengths):
        start = (int(cu[b]) + b * pad) // pad * pad  # common/packed.py's padded offset
        expected[:, int(cu[b]) : int(cu[b]) + n] = stats[:, start : start + n]
    assert torch.equal(packed_rows(stats, cu, pad, total), expected)


def _assert_fa2_kernel(ptx: str, cubin: bytes):
    from cute_flash.census import cubin_resources, ptx_census

    census = ptx_census(ptx)
    assert census["mma.sync"] > 0 and census["ldmatrix"] > 0 and census["cp.async"] > 0, census
    assert census["wgmma.mma_async"] == 0 and census["tcgen05.mma"] == 0
    (res,) = cubin_resources(cubin).values()
    print(f"registers {res['registers']}, stack frame {res['stack_frame_bytes']} B, census {census}")
    assert res["stack_frame_bytes"] == 0, res


def test_softcap_sink_forward_compiles():
    """The feature entry of the dense forward (softcap's tanh, the sink read per row)."""
    from cute_flash.arch.sm80.build import compile_forward

    spec = AttentionSpec("bf16", 64, 64, "causal", "bf16", softcap=True, sink=True)
    fwd = compile_forward(spec, "sm_80")
    _assert_fa2_kernel(fwd.ptx, fwd.cubin)
    assert "tanh.approx.f32" in fwd.ptx


def test_softcap_backward_compiles():
    from cute_flash.arch.sm80.backward import compile_backward_artifacts

    spec = AttentionSpec("fp16", 64, 64, "local", "fp16", softcap=True)
    (main,) = compile_backward_artifacts(spec, "sm_80", ["bwd"])
    _assert_fa2_kernel(main.ptx, main.cubin)
    assert "tanh.approx.f32" in main.ptx


def test_kvcache_forward_compiles():
    """A paged-cache build with most of its paths: packed q, local window, softcap and sinks, split keys."""
    from cute_flash.arch.sm80.kvcache import compile_kvcache

    spec = AttentionSpec("bf16", 128, 128, "local", "bf16", softcap=True, sink=True, kvcache=True, page_size=16)
    fwd = compile_kvcache(spec, "sm_90a", packed_q=True, split=True)
    _assert_fa2_kernel(fwd.ptx, fwd.cubin)
    # Page-table entries and lengths are read in the kernel (no host-side lengths).
    assert "ld.global" in fwd.ptx and "tanh.approx.f32" in fwd.ptx

"""CPU: the sm90 KV-cache forward (arch/sm90/kvcache/) without a GPU: the key-tile ranges of tiles whose rows are
(query token, query head) pairs, what the backend refuses (the router then takes the sm80 gather path), the split
counts, and four decoding builds (paged page 16 and dense, paged with an fp8 cache, and that one with soft-capping
and sinks) cross-compiled for sm_90a: spill-free, the K / V tiles as TMA boxes (one per page and 128 bytes of a
row), the query rows by cp.async, wgmma with P from registers, one tanh per score where capped. The numbers are
checked on the GPU (tests/test_sm90_kvcache.py)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cute_flash.arch.sm90 import BACKEND
from cute_flash.arch.sm90.kvcache.tile_config import chunk_rows, kvcache_splits, kvcache_tile_config
from cute_flash.common.block_info import BlockInfo
from cute_flash.reference import visible_keys
from cute_flash.spec import UNBOUNDED_WINDOW, AttentionSpec, MaskBounds, normalize_mask
from cute_flash.validation import KvCacheProblem

REPO = Path(__file__).resolve().parents[1]


def _spec(d=128, mask="none", page_size=16, **kw):
    return AttentionSpec("bf16", d, d, mask, "bf16", kvcache=True, page_size=page_size, **kw)


def test_rows_per_query_block_ranges_match_brute_force():
    """BlockInfo with rows_per_query (row r is query r // group): kv_block_range holds exactly the key tiles some
    row of the tile sees, and the blocks the walk leaves unmasked (between kv_left_masked_end and
    kv_right_masked_start, before the right-most) are seen whole by every row of the tile."""
    rng = random.Random(0)
    for _ in range(800):
        tile_m, tile_n = rng.choice([(64, 64), (64, 128), (128, 128), (192, 128)])
        group = rng.choice([1, 2, 3, 4, 5, 8, 16])
        sq, sk = rng.randint(1, 40), rng.randint(0, 600)
        kind = rng.choice(["none", "causal", "local"])
        left, right = UNBOUNDED_WINDOW, 0 if kind == "causal" else UNBOUNDED_WINDOW
        if kind == "local":
            left = rng.choice([UNBOUNDED_WINDOW, 0, 5, 64, 300, -3])
            right = rng.choice([UNBOUNDED_WINDOW, 0, 7, 200, -2])
        info = BlockInfo(tile_m, tile_n, kind, sq, sk, left, right, rows_per_query=group)
        seen = visible_keys(sq, sk, MaskBounds(kind, left, right)).repeat_interleave(group, dim=0)  # (rows, sk)
        m_tiles, n_tiles = -(-sq * group // tile_m), -(-sk // tile_n)
        # Per (query tile, key tile): does some row see a key; do all the tile's rows see all its keys.
        pad = (0, n_tiles * tile_n - sk, 0, m_tiles * tile_m - sq * group)
        tiles = torch.nn.functional.pad(seen, pad).view(m_tiles, tile_m, n_tiles, tile_n)
        some = tiles.any(dim=3).any(dim=1).tolist()
        whole = torch.nn.functional.pad(seen, pad, value=True).view(m_tiles, tile_m, n_tiles, tile_n)
        every = whole.all(dim=3).all(dim=1).tolist()
        for m in range(m_tiles):
            seen_tiles = [n for n in range(n_tiles) if some[m][n]]
            lo, hi = info.kv_block_range(m)
            case = (tile_m, tile_n, group, sq, sk, kind, left, right, m)
            if left >= 0 and left + right >= 0:  # one run of tiles, and the range is empty when nothing is seen
                assert list(range(lo, hi)) == seen_tiles, case
            else:  # windows off the diagonal may add tiles that no row sees (masked whole: 0 / -inf rows)
                assert set(seen_tiles) <= set(range(lo, hi)), case
            right_lo = min(max(info.kv_right_masked_start(m), lo), hi - 1) if kind != "none" else hi - 1
            left_hi = max(min(info.kv_left_masked_end(m), right_lo), lo) if kind == "local" else lo
            assert all(every[m][n] for n in range(left_hi, right_lo)), case


@pytest.mark.parametrize(
    "page_size, d, reason",
    [
        (16, 128, None),
        (8, 128, None),
        (24, 128, None),
        (0, 64, None),
        (256, 256, None),
        (4, 128, "multiple of 8"),
        (12, 128, "multiple of 8"),
        (16, 96, "head_dim == head_dim_v"),
    ],
)
def test_kvcache_specs_the_backend_refuses(page_size, d, reason):
    got = BACKEND.unsupported_reason(_spec(d, page_size=page_size), backward=False)
    assert (got is None) if reason is None else (reason in got), got
    assert "no backward" in BACKEND.unsupported_reason(_spec(), backward=True)
    assert BACKEND.unsupported_reason(_spec(d, page_size=page_size, kv_fp8=True), backward=False) == got
    for fp8 in (False, True):  # soft-capping and sinks change nothing the backend refuses
        features = _spec(d, page_size=page_size, kv_fp8=fp8, softcap=True, sink=True)
        assert BACKEND.unsupported_reason(features, backward=False) == got


def test_boxes_lie_in_one_page():
    assert [chunk_rows(p, 64) for p in (0, 8, 16, 24, 48, 64, 128, 256)] == [64, 8, 16, 8, 16, 64, 64, 64]
    assert kvcache_tile_config(_spec(), 32).tile_n == 64  # decoding: 64 rows
    assert kvcache_tile_config(_spec(), 65).tile_m == 128  # more rows: the forward's own tile


def _problem(batch, context, h=32, h_kv=8, sq=1, page_size=16, mask=(False, (None, None))):
    spec = _spec(mask=normalize_mask(*mask).kind, page_size=page_size)
    pages = batch * -(-context // page_size) if page_size else batch
    return KvCacheProblem(
        batch, sq, batch * sq, h, h_kv, 128, 128, context, pages, spec, normalize_mask(*mask), 128**-0.5
    )


@pytest.mark.parametrize(
    "batch, context, splits",
    [
        (1, 32768, 16),  # 8 CTAs, a small grid: one slot per SM, 16 splits fill 128 of 132
        (1, 4096, 16),
        (2, 32768, 8),
        (1, 1024, 8),  # 16 key tiles of 64, two per split at least
        (8, 8192, 4),  # 64 CTAs: 4 splits, 256 of 264 slots
        (8, 131072, 4),
        (64, 8192, 1),  # 512 CTAs: two full waves
        (256, 1024, 1),
        (1, 64, 1),  # one key tile
    ],
)
def test_kvcache_splits_fill_the_waves(batch, context, splits):
    assert kvcache_splits(_problem(batch, context), 132) == splits
    assert kvcache_splits(_problem(batch, context, page_size=0), 132) == splits  # the cache's layout does not matter
    assert kvcache_splits(_problem(batch, context), 0) == 1  # not a GPU


def test_fp8_cache_small_grids():
    """The swapped decoder (an fp8 cache at d128) runs one CTA per SM: a small grid is split to fill the SMs as the
    bf16 cache's is. The wgmma kernel's fp8 tiles with two CTAs per SM (d64) fill both slots of the SMs (8 x 32
    of 264): its CTAs stream more slowly (tile_config.SMALL_GRID_DIVISOR)."""
    from dataclasses import replace

    p = _problem(1, 32768)
    assert kvcache_splits(replace(p, spec=replace(p.spec, kv_fp8=True)), 132) == 16
    assert kvcache_splits(p, 132) == 16
    spec64 = _spec(64, page_size=16, kv_fp8=True)
    p64 = KvCacheProblem(1, 1, 1, 32, 8, 64, 64, 32768, 2048, spec64, normalize_mask(False, (None, None)), 0.125)
    assert kvcache_splits(p64, 132) == 32


def test_fp8_cache_grids_of_short_walks_take_two_ctas_per_sm():
    from dataclasses import replace

    from cute_flash.arch.sm90.kvcache.tile_config import SWAPPED_SHORT_WALKS, SwappedTileConfig, problem_tile_config

    def fp8(batch, context, sq=1):
        p = _problem(batch, context, sq=sq)
        return replace(p, spec=replace(p.spec, kv_fp8=True))

    assert problem_tile_config(fp8(64, 1024), 132) == SWAPPED_SHORT_WALKS  # 512 CTAs of 8 key tiles
    assert problem_tile_config(fp8(256, 4096), 132) == SWAPPED_SHORT_WALKS
    assert problem_tile_config(fp8(17, 4096, sq=3), 132) == replace(SWAPPED_SHORT_WALKS, row_tiles=2)
    assert problem_tile_config(fp8(8, 1024), 132) == SwappedTileConfig()  # 64 CTAs: fewer than the SMs
    assert problem_tile_config(fp8(64, 8192), 132) == SwappedTileConfig()  # 64 key tiles per CTA
    assert problem_tile_config(fp8(64, 1024), 0) == SwappedTileConfig()  # not a GPU
    assert not isinstance(problem_tile_config(_problem(64, 1024), 132), SwappedTileConfig)  # a bf16 cache


def test_kvcache_splits_see_the_window():
    # A 256-key window at 32k: the key tiles a query tile walks are the window's 5, not the cache's 512.
    assert kvcache_splits(_problem(1, 32768, mask=(True, (256, None))), 132) == 2


_CENSUS = textwrap.dedent(
    """
    import json, os, sys, tempfile
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    from cute_flash import census, compile_cache
    from cute_flash.arch.sm90.kvcache.launch import kvcache_kernel
    from cute_flash.arch.sm90.kvcache.tile_config import kvcache_tile_config
    from cute_flash.spec import AttentionSpec

    for page_size, fp8, features in ((16, False, False), (0, False, False), (16, True, False), (16, True, True)):
        spec = AttentionSpec("bf16", 128, 128, "causal", "bf16", kvcache=True, page_size=page_size, kv_fp8=fp8,
                             softcap=features, sink=features)
        cfg = kvcache_tile_config(spec, 32)  # (an fp8 cache's <= 16 rows: the swapped decoder, below)
        with tempfile.TemporaryDirectory() as dump:
            with census.capture_fd_stderr() as err:
                fn = kvcache_kernel(spec, cfg, "sm_90a", False, False, compile_cache.keep_artifacts_options(dump))
            ptx, _ = census.read_artifacts(fn)
        (_, res), = census.parse_ptxas_reports("".join(err))
        conversions = ptx.count("cvt.rn.f16x2.e4m3x2")
        print(json.dumps(dict(page_size=page_size, fp8=fp8, features=features, census=census.ptx_census(ptx),
                              conversions=conversions, tanh=ptx.count("tanh.approx.f32"),
                              f16_mma=ptx.count(".f32.f16.f16"), f16_to_f32=ptx.count("cvt.f32.f16"), **res)),
              flush=True)
    """
)


def test_kvcache_decoding_builds_compile():
    """Paged (page 16) and dense with a 16-bit cache, paged with an fp8 one at 32 rows (its e4m3 K tiles converted
    by the producer warpgroup's converter warps, its V tiles by the consumers: wgmma in fp16, the bf16 queries rounded
    to fp16 by the row loader), and that one with soft-capping and sinks (the `kvcache_features` entry), spill-free."""
    done = subprocess.run([sys.executable, "-c", _CENSUS], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    want = [(16, False, False), (0, False, False), (16, True, False), (16, True, True)]
    assert [(r["page_size"], r["fp8"], r["features"]) for r in reports] == want
    # 32 scores per consumer thread and 64 x 64 tile, capped at the first tile and at both kinds of walk step.
    assert [r["tanh"] for r in reports] == [0, 0, 0, 3 * 32]
    for r in reports:
        c = r["census"]
        assert r["spill_bytes"] == 0, r
        assert c["wgmma.mma_async.rs"] > 0 and c["wgmma.mma_async"] > c["wgmma.mma_async.rs"], r
        assert c["wgmma.mma_async.e4m3"] == 0 and c["setmaxnreg"] == 2 and c["mma.sync"] == 0, r
        # bf16 queries: a lane's two query rows by cp.async, 16 bytes at a time; an fp8 cache converts them to fp16
        # through registers, and every GEMM is fp16 (one cvt per two cache values, none through fp32).
        assert c["cp.async"] == (0 if r["fp8"] else 2 * 128 // 8), r
        assert (r["f16_mma"] == c["wgmma.mma_async"]) == r["fp8"] and r["f16_to_f32"] == 0, r
        # The K / V tiles (64 keys): 4 load sites (K first, K and V in the loop, V last) x boxes x the 128-byte
        # halves of a row (d128: two in 16 bits, one in e4m3).
        boxes = 64 // chunk_rows(r["page_size"], 64)
        assert c["cp.async.bulk.tensor"] == 4 * boxes * (1 if r["fp8"] else 2), r
        # One e4m3x2 conversion per two elements. K: a converter thread's 16-element steps over a 64 x 128 tile (64
        # threads: 8 steps) at its 2 conversion sites; V (fp8_v_by_consumers): a consumer thread's 64 elements of the
        # tile (128 threads) at the consumers' 3 V sites (the masked and the unmasked walk steps, the last tile).
        assert r["conversions"] == (2 * 8 * 16 // 2 + 3 * 64 // 2 if r["fp8"] else 0), r


_SWAPPED_CENSUS = textwrap.dedent(
    """
    import json, os, tempfile
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    from cute_flash import census, compile_cache
    from cute_flash.arch.sm90.kvcache.launch import kvcache_kernel
    from dataclasses import replace
    from cute_flash.arch.sm90.kvcache.tile_config import SWAPPED_SHORT_WALKS, SwappedTileConfig, kvcache_tile_config
    from cute_flash.spec import AttentionSpec

    cases = ((16, "causal", 4, False, False, False, False), (0, "local", 12, True, True, False, False),
             (16, "none", 8, False, False, True, False), (16, "causal", 16, False, False, False, True))
    for page_size, mask, rows, split, packed, features, short in cases:
        spec = AttentionSpec("bf16", 128, 128, mask, "bf16", kvcache=True, page_size=page_size, kv_fp8=True,
                             softcap=features, sink=features)
        cfg = kvcache_tile_config(spec, rows)
        assert isinstance(cfg, SwappedTileConfig), cfg
        if short:  # the short-walk form (two CTAs per SM) at two row tiles: the tightest register bound
            cfg = replace(SWAPPED_SHORT_WALKS, row_tiles=cfg.row_tiles)
        with tempfile.TemporaryDirectory() as dump:
            with census.capture_fd_stderr() as err:
                fn = kvcache_kernel(spec, cfg, "sm_90a", packed, split, compile_cache.keep_artifacts_options(dump))
            ptx, _ = census.read_artifacts(fn)
        (_, res), = census.parse_ptxas_reports("".join(err))
        ops = ("cvt.rn.f16x2.e4m3x2", "movmatrix", "prmt.b32", "ld.shared.v4.b32", "tanh.approx.f32")
        counts = {op: ptx.count(op) for op in ops}
        print(json.dumps(dict(page_size=page_size, row_tiles=cfg.row_tiles, features=features, threads=cfg.num_threads,
                              ctas=cfg.ctas_per_sm, census=census.ptx_census(ptx), **counts, **res)), flush=True)
    """
)


def test_swapped_fp8_decoder_builds_compile():
    """The swapped fp8-cache decoder (kvcache/swapped.py; an fp8 cache, d128, <= 16 rows): paged causal at 4 rows
    and dense, windowed, split, packed at 12 rows (two row tiles), and with soft-capping and sinks (the
    `kvcache_features` entry: one tanh per score of a thread's 2 m-tiles x 4 values), and the short-walk form at 16
    rows. Spill-free, within the register file at its CTAs per SM (two for the short-walk form); per 128-key stage
    and consumer warp (32 keys, 2 m-tiles): 8 k-blocks of K·Qᵀ and 8 d-tiles of Vᵀ·Pᵀ per m-tile and row tile, no
    wgmma; one exact cvt per two e4m3 values (32 keys x 128 d x K and V / 32 lanes / 2),
    one byte permute per two V cvts, one movmatrix per 8 x 8 block of P, and the stage read in 16-byte loads (8 of
    K, 8 of V per stage)."""
    done = subprocess.run([sys.executable, "-c", _SWAPPED_CENSUS], cwd=REPO, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(r["page_size"], r["row_tiles"], r["features"], r["ctas"]) for r in reports] == [
        (16, 1, False, 1), (0, 2, False, 1), (16, 1, True, 1), (16, 2, False, 2)
    ]  # fmt: skip
    for r in reports:
        c, rt = r["census"], r["row_tiles"]
        assert r["spill_bytes"] == 0 and r["registers"] * r["threads"] * r["ctas"] <= 65536, r
        assert c["mma.sync"] == 2 * (8 + 8) * rt and c["wgmma.mma_async"] == 0 and c["setmaxnreg"] == 0, r
        assert r["cvt.rn.f16x2.e4m3x2"] == 32 * 128 * 2 // 32 // 2 and r["prmt.b32"] == 2 * 8 * 2, r
        assert r["movmatrix"] == 2 * 2 * rt and r["ld.shared.v4.b32"] >= 8 + 8, r  # (the epilogue reads v4 too)
        assert r["tanh.approx.f32"] == (2 * 4 * rt if r["features"] else 0), r
        # The K / V tiles (128 keys, one 128-byte e4m3 row each): 4 load sites x boxes.
        assert c["cp.async.bulk.tensor"] == 4 * (128 // chunk_rows(r["page_size"], 128)), r


def test_every_config_a_call_runs_is_warmed():
    """problem_tile_config's choices for fp8 d128 at 1-64 rows (swapped, its short-walk form, the wgmma tile) are all
    in kvcache_configs (what warmup builds and the backend checks)."""
    from dataclasses import replace

    from cute_flash.arch.sm90.kvcache.tile_config import kvcache_configs, problem_tile_config

    for batch, context in ((1, 32768), (64, 1024)):
        for sq in (1, 3, 5, 16, 17):
            p = _problem(batch, context, sq=sq)
            p = replace(p, spec=replace(p.spec, kv_fp8=True))
            assert problem_tile_config(p, 132) in kvcache_configs(p.spec), (batch, context, sq)

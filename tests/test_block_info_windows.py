"""BlockInfo against an element-wise mask, over random shapes, tiles and windows whose bounds may be negative.

Pure Python (BlockInfo works on Python ints exactly as kernels run it on Int32): for every query tile and key tile
of random (seqlen_q, seqlen_k, left, right, tile_m, tile_n), with left / right negative, zero, positive or
unbounded (None), the brute-force set of visible (row, key) pairs decides

  - kv_block_range(m): exactly the key tiles holding a key some row of m sees (empty: no row of m sees a key);
  - the forward walk's masked phases (kv_right_masked_start / kv_left_masked_end, as common/block_walk.py uses
    them): every key tile of the range but the last with a hidden (row, key) pair is in a masked phase, and a tile
    in a masked phase has a hidden pair (no mask work on interior tiles);
  - q_block_range(n): exactly the query tiles with a row that sees a key of n (so the two ranges are one relation,
    which the sm90 backward's deterministic turns rely on);
  - tile_needs_mask(m, n) for the visited tiles: True where a real row hides a key of the tile or the tile runs past
    seqlen_k; False where every pair is visible (local windows: and the tile's rows past seqlen_q would hide none);
  - split_kv.num_splits: no split of an empty range.
"""

from __future__ import annotations

import random

import pytest

from cute_flash.common.block_info import BlockInfo, split_kv_range
from cute_flash.spec import UNBOUNDED_WINDOW, normalize_mask

TILES = [(1, 1), (2, 3), (4, 4), (8, 4), (4, 8), (16, 16), (64, 128), (128, 128)]


def _mask_of(kind_window):
    """(kind, left, right) as the kernels get them (spec.normalize_mask clamps the bounds)."""
    causal, window = kind_window
    m = normalize_mask(causal, window)
    return m.kind, m.left, m.right


def _visible(sq, sk, kind, left, right):
    """Each row's visible keys as an interval [lo, hi] (empty: lo > hi)."""
    off = sk - sq
    if kind == "none":
        left = right = UNBOUNDED_WINDOW
    if kind == "causal":
        left, right = UNBOUNDED_WINDOW, 0
    return [(max(0, i + off - left), min(sk - 1, i + off + right)) for i in range(sq)]


def _random_case(rng: random.Random):
    sq, sk = rng.randint(1, 70), rng.randint(1, 70)
    if rng.random() < 0.05:
        sq, sk = rng.choice([(1, 70), (70, 1), (1, 1), (200, 300), (300, 200)])
    tile_m, tile_n = rng.choice(TILES if sq * sk <= 4900 else TILES[4:])
    bound = lambda: rng.choice([None, 0, rng.randint(-80, 80), rng.randint(-8, 8), -UNBOUNDED_WINDOW - 5])  # noqa
    causal = rng.random() < 0.15
    window = (bound(), bound()) if rng.random() < 0.8 else (None, None)
    if causal and window[1] is not None and window[1] > 0:
        window = (window[0], None)
    return (sq, sk, tile_m, tile_n, *_mask_of((causal, window)))


def _check(sq, sk, tile_m, tile_n, kind, left, right):
    info = BlockInfo(tile_m, tile_n, kind, sq, sk, left, right)
    vis = _visible(sq, sk, kind, left, right)
    num_m, num_n = -(-sq // tile_m), -(-sk // tile_n)
    ctx = (sq, sk, tile_m, tile_n, kind, left, right)

    def rows_of(m):
        return range(m * tile_m, min((m + 1) * tile_m, sq))

    def keys_of(n):
        return range(n * tile_n, min((n + 1) * tile_n, sk))

    def seen(m, n):
        k0, k1 = keys_of(n)[0], keys_of(n)[-1]
        return any(max(vis[i][0], k0) <= min(vis[i][1], k1) for i in rows_of(m))

    def hidden(m, n):
        k0, k1 = keys_of(n)[0], keys_of(n)[-1]
        return any(not (vis[i][0] <= k0 and k1 <= vis[i][1]) for i in rows_of(m))

    def hidden_past_seqlen_q(m, n):
        """A hidden pair of the tile's rows past seqlen_q (by the window's formula; not stored by any kernel)."""
        k0, k1 = keys_of(n)[0], keys_of(n)[-1]
        off = sk - sq
        return any(not (i + off - left <= k0 and k1 <= i + off + right) for i in range(sq, (m + 1) * tile_m))

    for m in range(num_m):
        lo, hi = info.kv_block_range(m)
        needed = [n for n in range(num_n) if seen(m, n)]
        if needed:
            assert (lo, hi) == (needed[0], needed[-1] + 1), ("kv_block_range", ctx, m, lo, hi, needed)
        else:
            assert hi <= lo, ("kv_block_range not empty", ctx, m, lo, hi)
        right_lo = hi - 1
        if info.has_right_bound:
            right_lo = min(max(info.kv_right_masked_start(m), lo), hi - 1)
        left_hi = lo
        if info.has_left_bound:
            left_hi = min(max(info.kv_left_masked_end(m), lo), right_lo)
        for n in range(lo, hi - 1):  # the walk after the first (right-most, always masked) tile
            masked = n >= right_lo or n < left_hi
            if hidden(m, n) or (n + 1) * tile_n > sk:
                assert masked, ("unmasked forward tile hides keys", ctx, m, n)
            else:
                assert not masked, ("forward tile masked without need", ctx, m, n)

    for n in range(num_n):
        lo, hi = info.q_block_range(n)
        needed = [m for m in range(num_m) if seen(m, n)]
        if needed:
            assert (lo, hi) == (needed[0], needed[-1] + 1), ("q_block_range", ctx, n, lo, hi, needed)
        else:
            assert hi <= lo, ("q_block_range not empty", ctx, n, lo, hi)
        for m in range(lo, hi):
            needs = bool(info.tile_needs_mask(m, n))
            if hidden(m, n) or (n + 1) * tile_n > sk:
                assert needs, ("tile_needs_mask False for a tile that hides keys", ctx, m, n)
            elif not (kind == "local" and hidden_past_seqlen_q(m, n)):  # (may mask those rows: harmless)
                assert not needs, ("tile_needs_mask True for a fully visible tile", ctx, m, n)

    # Split-key decoding: every split's run stays inside the range, the runs cover it, an empty range stays empty.
    lo, hi = info.kv_block_range(0)
    for splits in (1, 3):
        runs = [split_kv_range(lo, hi, s, splits) for s in range(splits)]
        covered = [n for a, b in runs for n in range(a, b)]
        assert covered == list(range(lo, hi)), ("split_kv_range", ctx, runs)


@pytest.mark.parametrize("seed", range(4))
def test_block_info_matches_elementwise_mask(seed):
    rng = random.Random(seed)
    for _ in range(300):
        _check(*_random_case(rng))


@pytest.mark.parametrize(
    "sq, sk, window",
    [
        (10, 10, (0, -1)),  # left + right < 0: no row sees a key
        (10, 10, (-3, 2)),
        (37, 50, (-5, 5)),  # every row sees exactly one key
        (50, 37, (None, -40)),  # only the last rows see keys
        (50, 37, (-30, None)),  # only the first rows see keys
        (5, 200, (-190, None)),  # keys past seqlen_k only for some rows
        (200, 5, (None, -190)),
        (33, 33, (-1, 1)),
    ],
)
@pytest.mark.parametrize("tiles", [(4, 4), (16, 8), (64, 128), (128, 128)])
def test_negative_windows(sq, sk, window, tiles):
    _check(sq, sk, *tiles, *_mask_of((False, window)))


def test_num_splits_of_a_window_without_keys():
    from cute_flash.arch import split_kv
    from cute_flash.spec import AttentionSpec
    from cute_flash.validation import Problem

    spec = AttentionSpec("bf16", 128, 128, "local")
    for window, expect_split in (((0, -1), False), ((None, None), True), ((-5000, None), False)):
        mask = normalize_mask(False, window)
        problem = Problem(batch=1, seqlen_q=1, seqlen_k=8192, nheads=2, nheads_kv=2, head_dim=128, head_dim_v=128,
                          mask=mask, softmax_scale=0.1, spec=spec)  # fmt: skip
        splits = split_kv.num_splits(problem, 128, 128, 132)
        assert (splits > 1) == expect_split, (window, splits)

"""Packed (varlen) batches without idle CTAs: a kernel's grid spans every sequence's tiles in order (per head), and
each CTA finds its sequence and tile from cu_seqlens (FlashAttention-3's varlen scheduler does the same with a warp
scan). Kernel code only (imports CuTe DSL); the row offsets themselves are in common/packed.py."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


def packed_tiles_bound(total, batch, tile: int):
    """An upper bound of sum over sequences of ceil(len_b / tile), from what the host knows without reading
    cu_seqlens: each sequence wastes less than one tile, so total / tile rounded up plus batch (host or kernel
    arithmetic). A grid of that many tiles per head leaves at most batch + 1 CTAs without work, where one over
    max_seqlen's tiles per sequence leaves every CTA past a short sequence's end idle."""
    return (total + tile - 1) // tile + batch


@cute.jit
def packed_tile(idx: Int32, tile: cutlass.Constexpr[int], mCuSeqlens: cute.Tensor, mSeqUsed=None):
    """(batch, tile) of linear tile `idx` when the sequences' tiles are numbered in order (sequence b has
    ceil(len_b / tile), len_b = cu_seqlens[b + 1] - cu_seqlens[b] or seqused[b]); batch = the number of sequences
    when idx is past the last tile. Inside a kernel, by every lane of a warp (`_nth`)."""
    found_b, found_t, _ = _nth(idx, tile, mCuSeqlens, mSeqUsed, "tiles")
    return found_b, found_t


@cute.jit
def packed_tile_pairs(idx: Int32, rank: Int32, tile: cutlass.Constexpr[int], mCuSeqlens: cute.Tensor, mSeqUsed=None):
    """(batch, tile, single) of the CTA of rank `rank` (0 or 1) in 2-CTA cluster `idx`, when clusters take adjacent
    tiles of one sequence: first every sequence's floor(n_b / 2) pairs of tiles in order (the CTA takes tile 2 p +
    rank of pair p; single 0), then the odd last tiles of the sequences with an odd n_b, two per cluster, one per CTA
    (single 1: the two CTAs work on different sequences). So no cluster holds a CTA without work but the last (and
    those past the end: batch = the number of sequences). n_b = ceil(len_b / tile) as in `packed_tile`."""
    batch = mCuSeqlens.shape[0] - 1
    found_b, pair, pairs = _nth(idx, tile, mCuSeqlens, mSeqUsed, "pairs")
    n_block = pair * 2 + rank
    single = Int32(0)
    if found_b >= batch:  # past the pairs (`pairs` is then their number): the odd last tiles
        found_b, _, _ = _nth((idx - pairs) * 2 + rank, tile, mCuSeqlens, mSeqUsed, "odd")
        single = Int32(1)
        n_block = Int32(0)
        if found_b < batch:
            n_block = _tiles(found_b, tile, mCuSeqlens, mSeqUsed) - 1
    return found_b, n_block, single


@cute.jit
def _tiles(b: Int32, tile: cutlass.Constexpr[int], mCuSeqlens: cute.Tensor, mSeqUsed=None) -> Int32:
    """ceil(len_b / tile) of sequence b (< the number of sequences)."""
    n = Int32(0)
    if cutlass.const_expr(mSeqUsed is None):
        n = (mCuSeqlens[b + 1] - mCuSeqlens[b] + tile - 1) // tile
    else:
        n = (mSeqUsed[b] + tile - 1) // tile
    return n


@cute.jit
def _nth(idx: Int32, tile: cutlass.Constexpr[int], mCuSeqlens: cute.Tensor, mSeqUsed, count: cutlass.Constexpr[str]):
    """(b, i, before): the sequence b whose items hold item `idx` when every sequence's items are numbered in order,
    i = idx's index among b's, and `before` the items of the sequences before the warp step that found it (all of
    them when none did: then b = the number of sequences). A sequence's items: its tiles (count "tiles"), pairs of
    tiles ("pairs", floor(n_b / 2)) or its odd last tile ("odd", n_b % 2). By every lane of a warp: 32 sequences per
    step, each lane reading one length, a warp prefix sum of their counts, and a ballot for the lane whose items hold
    idx."""
    batch = mCuSeqlens.shape[0] - 1
    lane = cute.arch.lane_idx()
    found_b, found_t = Int32(batch), Int32(0)
    first, base = Int32(0), Int32(0)  # first sequence of this step, items before it
    while first < batch:
        b = first + lane
        n = Int32(0)
        if b < batch:
            n = _tiles(b, tile, mCuSeqlens, mSeqUsed)
            if cutlass.const_expr(count == "pairs"):
                n = n // 2
            elif cutlass.const_expr(count == "odd"):
                n = n % 2
        incl = warp_inclusive_sum(n, lane)  # items of sequences first .. b
        hits = cute.arch.vote_ballot_sync(base + incl > idx)
        if hits != 0:
            hit = Int32(cute.arch.clz(cute.arch.brev(hits)))  # the first lane whose items end past idx
            found_b = first + hit
            found_t = idx - base - cute.arch.shuffle_sync(incl - n, hit)
            first = Int32(batch)
        else:
            base = base + cute.arch.shuffle_sync(incl, 31)
            first = first + 32
    return found_b, found_t, base


@cute.jit
def warp_inclusive_sum(n: Int32, lane: Int32) -> Int32:
    """The sum of `n` over lanes 0 .. lane of the warp (every lane of the warp calls it): five shuffle-up steps."""
    incl = n
    for k in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(incl, 1 << k)
        if lane >= (1 << k):
            incl = incl + up
    return incl

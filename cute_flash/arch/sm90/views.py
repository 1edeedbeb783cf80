"""The global-memory views the sm90 kernels tile: a TMA box never spans two (batch, head) pairs in them, and rows past
a sequence's end are out of bounds of their own dimension (zero-filled on load, clipped on store)."""

from __future__ import annotations

import cutlass.cute as cute

from ...common.packed import head_stats


def seq_major_view(t: cute.Tensor) -> cute.Tensor:
    """(batch, seqlen, heads, dim) -> (seqlen, dim, heads, batch)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))


def stats_view(t: cute.Tensor) -> cute.Tensor:
    """Per-row statistics (batch, heads, seqlen) -> (seqlen, heads, batch)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0]))


def packed_seq_major_view(t: cute.Tensor) -> cute.Tensor:
    """Packed sequences (total, heads, dim) -> (total, dim, heads): a TMA box never spans two heads; rows past a
    sequence's end belong to the next sequence (loads read them, stores must be predicated)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[0, 2, 1]))


def packed_stats_view(t: cute.Tensor) -> cute.Tensor:
    """Packed per-row statistics (heads, total) -> (total, heads)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0]))


def head_tiles(mX: cute.Tensor, head, batch, offset=None) -> cute.Tensor:
    """The (rows, dim) view of one (sequence, head) of a seq-major view: mX[:, :, head, batch] (dense), or the rows
    from `offset` of a packed (total, dim, heads) one."""
    if offset is None:
        return mX[None, None, head, batch]
    return cute.domain_offset((offset, 0), mX[None, None, head])


def head_stat_rows(mS: cute.Tensor, head, batch, offset=None) -> cute.Tensor:
    """The (rows,) view of one (sequence, head) of a statistics view: mS[:, head, batch], or from `offset` of a
    packed (total, heads) one."""
    if offset is None:
        return mS[None, head, batch]
    return cute.domain_offset((offset,), mS[None, head])


def accum_rows(mA: cute.Tensor, head, batch, row_offset=None, row_elems: int = 1) -> cute.Tensor:
    """One (sequence, head)'s flat fp32 accumulator: mA[batch, head, :] of a dense (b, h, rows * row_elems) buffer,
    or the part from row `row_offset` of a packed (h, rows * row_elems) one (common/packed.head_stats' views)."""
    return head_stats(mA, batch, head, None if row_offset is None else row_offset * row_elems)


def tile_semaphores(mSem: cute.Tensor, head, batch, row_offset=None, tile: int = 1) -> cute.Tensor:
    """One (sequence, head)'s int32 semaphores, one per tile of `tile` rows: mSem[batch, head, :] of a dense (b, h,
    tiles) buffer, or from row `row_offset` (a whole number of tiles) of a packed (1, h, rows / tile) one."""
    if row_offset is None:
        return mSem[batch, head, None]
    return cute.domain_offset((row_offset // tile,), mSem[0, head, None])


def padded_stat_rows(mS: cute.Tensor, head, batch, row_offset=None) -> cute.Tensor:
    """The (rows,) view of one (sequence, head) of the backward's padded statistics, viewed (rows, heads, batch) by
    `stats_view`: mS[:, head, batch], or from `row_offset` of a packed buffer with one batch entry."""
    if row_offset is None:
        return mS[None, head, batch]
    return cute.domain_offset((row_offset,), mS[None, head, 0])

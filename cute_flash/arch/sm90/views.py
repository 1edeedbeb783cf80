"""The global-memory views the sm90 kernels tile: a TMA box never spans two (batch, head) pairs in them, and rows past
a sequence's end are out of bounds of their own dimension (zero-filled on load, clipped on store)."""

from __future__ import annotations

import cutlass.cute as cute


def seq_major_view(t: cute.Tensor) -> cute.Tensor:
    """(batch, seqlen, heads, dim) -> (seqlen, dim, heads, batch)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))


def stats_view(t: cute.Tensor) -> cute.Tensor:
    """Per-row statistics (batch, heads, seqlen) -> (seqlen, heads, batch)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0]))

"""Tile arithmetic of the KV-cache forward's packed GQA rows (plain integer arithmetic: Python ints on the host and in
CPU tests, cutlass Int32 inside kernels, like common/block_info.py).

A CTA of the KV-cache forward serves one KV head g of one sequence; its rows are the (query token s, query head j of
the group) pairs, row r = s * group + j, so that every K / V byte is read once per group. The mask and the key
tiles a row tile visits follow from the query positions s = r // group of its rows: row tile m holds positions
m * tile_m // group .. (its last row) // group, and since every bound of the window grows with the position, the key
tiles of the whole row tile are those of its first position's start to its last position's end (the same union the
dense block arithmetic takes over its rows). `PackedGqaBlocks` answers the questions `common/block_walk.walk_kv_blocks`
and the forward skeleton ask of a `BlockInfo`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple

from ...common.block_info import BlockInfo

Int = Any  # a Python int or a cutlass.Int32


@dataclass(frozen=True)
class PackedGqaBlocks:
    """BlockInfo's forward questions for rows r = s * group + j of seqlen_q query tokens (seqlen_q * group rows).

    row_pos: inside a kernel, this thread's accumulator rows' query positions (a register tensor the mask reads),
    else None."""

    tile_m: int
    tile_n: int
    mask: str
    seqlen_q: Int
    seqlen_k: Int
    window_left: Int
    window_right: Int
    group: Int
    row_pos: Any = None

    @property
    def has_right_bound(self) -> bool:
        return self.rows.has_right_bound

    @property
    def has_left_bound(self) -> bool:
        return self.rows.has_left_bound

    @property
    def offset(self) -> Int:
        return self.seqlen_k - self.seqlen_q

    @property
    def left(self) -> Int:
        return self.rows.left

    @property
    def right(self) -> Int:
        return self.rows.right

    @property
    def rows(self) -> BlockInfo:
        """The same tile arithmetic over the packed rows (BlockInfo's rows_per_query): the key tiles of a row tile
        are the union of its positions' windows, one interval because every window edge grows with the position."""
        return BlockInfo(
            self.tile_m, self.tile_n, self.mask, self.seqlen_q, self.seqlen_k, self.window_left, self.window_right,
            rows_per_query=self.group,
        )  # fmt: skip

    def kv_block_range(self, m_block: Int) -> Tuple[Int, Int]:
        return self.rows.kv_block_range(m_block)

    def kv_right_masked_start(self, m_block: Int) -> Int:
        return self.rows.kv_right_masked_start(m_block)

    def kv_left_masked_end(self, m_block: Int) -> Int:
        return self.rows.kv_left_masked_end(m_block)

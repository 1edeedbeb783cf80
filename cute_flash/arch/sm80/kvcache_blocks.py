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

from ...common.block_info import BlockInfo, int_min

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
    def positions(self) -> BlockInfo:
        """Block arithmetic over single query positions (tile_m 1): position s is its own "row tile" s."""
        return BlockInfo(1, self.tile_n, self.mask, self.seqlen_q, self.seqlen_k, self.window_left, self.window_right)

    @property
    def has_right_bound(self) -> bool:
        return self.positions.has_right_bound

    @property
    def has_left_bound(self) -> bool:
        return self.positions.has_left_bound

    @property
    def offset(self) -> Int:
        return self.seqlen_k - self.seqlen_q

    @property
    def left(self) -> Int:
        return self.positions.left

    @property
    def right(self) -> Int:
        return self.positions.right

    def first_position(self, m_block: Int) -> Int:
        return m_block * self.tile_m // self.group

    def last_position(self, m_block: Int) -> Int:
        """The query position of row tile m_block's last row inside the sequence (m_block must hold a row)."""
        return (int_min((m_block + 1) * self.tile_m, self.seqlen_q * self.group) - 1) // self.group

    def kv_block_range(self, m_block: Int) -> Tuple[Int, Int]:
        lo = self.positions.kv_block_range(self.first_position(m_block))[0]
        hi = self.positions.kv_block_range(self.last_position(m_block))[1]
        return lo, hi

    def kv_right_masked_start(self, m_block: Int) -> Int:
        return self.positions.kv_right_masked_start(self.first_position(m_block))

    def kv_left_masked_end(self, m_block: Int) -> Int:
        return self.positions.kv_left_masked_end(self.last_position(m_block))

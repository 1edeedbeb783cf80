"""Which query tiles see a key tile, for the backward pass (the transpose of the forward's key-tile range).

Mask semantics (cute_flash.spec): with off = seqlen_k - seqlen_q, query i sees key j iff
i + off - left <= j <= i + off + right. "none" sees everything; "causal" is left = unbounded, right = 0; "local" takes
both bounds at run time (UNBOUNDED_WINDOW for a missing side). These helpers are traced inline into kernels; every
argument other than the tile sizes and the mask kind is a run-time Int32.
"""

from __future__ import annotations

import cutlass
from cutlass import Int32


def query_block_range(
    n_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    window_left: Int32,
    window_right: Int32,
    *,
    block_m: int,
    block_n: int,
    mask_kind: str,
):
    """[m_block_min, m_block_max) of the query tiles holding a query that sees some key of key tile `n_block`.

    The range is empty (min >= max) when no query sees the tile; its dK/dV are then zero.
    """
    num_m_blocks = (seqlen_q + block_m - 1) // block_m
    if cutlass.const_expr(mask_kind == "none"):
        return Int32(0), num_m_blocks
    offset = seqlen_k - seqlen_q
    first_key = n_block * block_n
    last_key = cutlass.min(first_key + block_n, seqlen_k) - 1
    # The lowest query that sees the first key: i >= j - off - right.
    right = Int32(0) if cutlass.const_expr(mask_kind == "causal") else window_right
    first_query = cutlass.max(first_key - offset - right, 0)
    m_block_min = first_query // block_m
    m_block_max = num_m_blocks
    if cutlass.const_expr(mask_kind == "local"):
        # The highest query that sees the last key: i <= j - off + left. Negative means no query sees the tile.
        last_query = last_key - offset + window_left
        m_block_max = cutlass.min(num_m_blocks, cutlass.max(last_query + block_m, 0) // block_m)
    return m_block_min, m_block_max


def tile_needs_mask(
    m_block: Int32,
    n_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    window_left: Int32,
    window_right: Int32,
    *,
    block_m: int,
    block_n: int,
    mask_kind: str,
):
    """True unless the key tile lies inside seqlen_k and every query of the tile sees every key of it.

    Query rows past seqlen_q never need a mask: the kernel gives them P = 0 through their padded LSE.
    """
    first_key = n_block * block_n
    needs = first_key + block_n > seqlen_k
    if cutlass.const_expr(mask_kind == "none"):
        return needs
    offset = seqlen_k - seqlen_q
    first_query = m_block * block_m
    right = Int32(0) if cutlass.const_expr(mask_kind == "causal") else window_right
    # The tile's last key must be visible to its first query.
    needs = needs | (first_key + block_n - 1 > first_query + offset + right)
    if cutlass.const_expr(mask_kind == "local"):
        # The tile's first key must be visible to its last query.
        needs = needs | (first_key < first_query + block_m - 1 + offset - window_left)
    return needs

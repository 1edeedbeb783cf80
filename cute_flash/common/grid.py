"""The launch grid of kernels whose CTA reads `block_idx()` as (sequence block, head, batch entry).

The sm80 forward tiles the queries and the sm80 backward the keys, but both size that grid alike, dense and packed;
one function keeps the two from drifting apart (a packed grid sized from the wrong length silently drops blocks).
"""

from __future__ import annotations

from typing import Any, Optional

import cutlass.cute as cute

Int = Any  # a Python int or a cutlass.Int32 (host side of a @cute.jit launch)


def block_grid(mQ, mTiled, tile: int, mCuSeqlensQ=None, max_seqlen: Optional[Int] = None) -> tuple:
    """(blocks of `tile` rows, heads, batch), traced inside a @cute.jit launch. Dense (mCuSeqlensQ None): q is
    (b, s, h, d) and the blocks cover mode 1 of `mTiled` (q itself, or k when keys are tiled). Packed: q is
    (total, h, d) and sequences differ in length, so the blocks cover the longest (max_seqlen, of the tiled side);
    the kernel's CTAs past their own sequence's end exit at once."""
    if mCuSeqlensQ is None:
        return cute.ceil_div(mTiled.shape[1], tile), mQ.shape[2], mQ.shape[0]
    return (max_seqlen + (tile - 1)) // tile, mQ.shape[1], mCuSeqlensQ.shape[0] - 1

"""The forward kernels' walk over the key blocks of one query tile, right to left, in three phases.

After the right-most block (the seqlen_k tail and the diagonal both live there, so callers always mask it and handle
it themselves: it is the one that starts the online softmax), the remaining blocks [n_min, n_first) fall into

  1. blocks crossing the right window edge (causal / local): masked,
  2. interior blocks: no mask arithmetic at all,
  3. blocks crossing the left window edge (local only): masked.

The boundaries come from `BlockInfo`; phases a mask kind cannot have are not emitted (compile-time `const_expr`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from .block_info import BlockInfo


@cute.jit
def walk_kv_blocks(
    info: BlockInfo,
    m_block: Int32,
    n_min: Int32,
    n_first: Int32,
    step: cutlass.Constexpr,
    state,
):
    """Runs `state = step(state, n_block, mask_window)` for n_block = n_first - 1 down to n_min; returns the state.

    `state` is what the loops carry (a pipeline state, or a tuple of DSL values); `mask_window` is a compile-time
    bool, so each phase compiles its own copy of the step.
    """
    right_lo = n_first
    if const_expr(info.has_right_bound):
        right_lo = cutlass.min(cutlass.max(info.kv_right_masked_start(m_block), n_min), n_first)
        for i in cutlass.range(n_first - right_lo, unroll=1):
            state = step(state, n_first - 1 - i, True)
    left_hi = n_min
    if const_expr(info.has_left_bound):
        left_hi = cutlass.min(cutlass.max(info.kv_left_masked_end(m_block), n_min), right_lo)
    for i in cutlass.range(right_lo - left_hi, unroll=1):
        state = step(state, right_lo - 1 - i, False)
    if const_expr(info.has_left_bound):
        for i in cutlass.range(left_hi - n_min, unroll=1):
            state = step(state, left_hi - 1 - i, True)
    return state


@cute.jit
def walk_key_list(key_tiles: cute.Tensor, n_min: Int32, n_first: Int32, step: cutlass.Constexpr, state):
    """Block-sparse builds: `state = step(state, key_tiles[j], True)` for j = n_first - 1 down to n_min (a block
    mask's ascending list; every tile masked, since where it sits against the window is not known statically)."""
    for i in cutlass.range(n_first - n_min, unroll=1):
        state = step(state, key_tiles[n_first - 1 - i], True)
    return state

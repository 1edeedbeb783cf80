"""Element-wise attention masking of a score accumulator, for any MMA whose fragment has a (rows, cols) view.

Callers hand over three views made by `acc_views.rows_cols_view` from partitions by the same tiled MMA:
  - `acc_rc`     the scores S (float32), modified in place: masked entries become -inf;
  - `coords_rc`  this thread's identity-tensor partition of the (tile_rows, tile_cols) tile: (row, col) in the tile;
  - `coords0_rc` the same partition for thread 0, whose entries are compile-time constants.
The column test compares thread 0's constant columns against limits shifted by this thread's column offset, so the
per-element work is one compare + select against a per-row limit. This needs each thread's columns to be thread 0's
shifted by one constant, which holds for mma.sync (m16n8k16) and WGMMA accumulators alike.

`keys_on_rows=False` (the default) is the forward orientation: rows are queries, columns keys. Backward kernels that
compute Sᵀ (keys on rows, the sm90 backward) pass `keys_on_rows=True`; the same trick applies with the roles swapped.

Which blocks to mask at all comes from `block_info`; this module only decides element by element.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .block_info import BlockInfo


@cute.jit
def apply_mask(
    acc_rc: cute.Tensor,
    coords_rc: cute.Tensor,
    coords0_rc: cute.Tensor,
    info: BlockInfo,
    m_block: Int32,
    n_block: Int32,
    mask_seqlen: cutlass.Constexpr[bool],
    mask_window: cutlass.Constexpr[bool],
    keys_on_rows: cutlass.Constexpr[bool] = False,
):
    """Sets S[i, j] = -inf where query i must not see key j.

    mask_seqlen: mask keys >= seqlen_k (the block may run past the end of K).
    mask_window: mask keys outside [i + off - left, i + off + right] for causal / local specs (a no-op for "none").
    Rows past seqlen_q are left alone: kernels never store them.
    """
    num_rows = cute.size(acc_rc, mode=[0])
    num_cols = cute.size(acc_rc, mode=[1])
    # Limits below are in thread 0's column frame: column thread_col + c0 of the tile  <->  c0.
    thread_col = coords_rc[0, 0][1] - coords0_rc[0, 0][1]
    apply_window = cutlass.const_expr(mask_window and info.has_right_bound)
    if cutlass.const_expr(not keys_on_rows):
        key_base = n_block * info.tile_n + thread_col  # key of column c0 is key_base + c0
        seqlen_limit = info.seqlen_k - key_base  # columns c0 >= this are past seqlen_k
        if cutlass.const_expr(not apply_window):
            if cutlass.const_expr(mask_seqlen):
                for c in cutlass.range_constexpr(num_cols):
                    past_end = coords0_rc[0, c][1] >= seqlen_limit
                    for r in cutlass.range_constexpr(num_rows):
                        acc_rc[r, c] = -Float32.inf if past_end else acc_rc[r, c]
        else:
            # Query row i sees keys in [i + off - left, i + off + right]; shift both ends into the column frame.
            if cutlass.const_expr(info.rows_per_query is None):
                diag_base = m_block * info.tile_m + info.offset - key_base
            else:  # rows are (query, head) pairs: row r holds query r // rows_per_query (block_info.BlockInfo)
                row_base = m_block * info.tile_m
                query_to_col = info.offset - key_base
            for r in cutlass.range_constexpr(num_rows):
                if cutlass.const_expr(info.rows_per_query is None):
                    diag = coords_rc[r, 0][0] + diag_base
                else:
                    diag = (row_base + coords_rc[r, 0][0]) // info.rows_per_query + query_to_col
                col_end = diag + info.right + 1  # exclusive
                if cutlass.const_expr(mask_seqlen):
                    col_end = cutlass.min(col_end, seqlen_limit)
                if cutlass.const_expr(info.has_left_bound):
                    col_begin = diag - info.left
                    for c in cutlass.range_constexpr(num_cols):
                        c0 = coords0_rc[0, c][1]
                        outside = c0 >= col_end or c0 < col_begin
                        acc_rc[r, c] = -Float32.inf if outside else acc_rc[r, c]
                else:
                    for c in cutlass.range_constexpr(num_cols):
                        outside = coords0_rc[0, c][1] >= col_end
                        acc_rc[r, c] = -Float32.inf if outside else acc_rc[r, c]
    else:
        # The transposed tile of a backward kernel: rows are keys of n_block, columns queries of m_block; each row
        # gets a visible column range [col_lo, col_hi] in thread 0's frame.
        query_base = m_block * info.tile_m + thread_col  # query of column c0 is query_base + c0
        for r in cutlass.range_constexpr(num_rows):
            key = n_block * info.tile_n + coords_rc[r, 0][0]
            # Query i sees key j iff j - off - right <= i <= j - off + left.
            col_lo = Int32(0) - (1 << 30)
            col_hi = Int32(1 << 30)
            if cutlass.const_expr(apply_window):
                col_lo = key - info.offset - info.right - query_base
                if cutlass.const_expr(info.has_left_bound):
                    col_hi = key - info.offset + info.left - query_base
            if cutlass.const_expr(mask_seqlen):
                col_lo = (1 << 30) if key >= info.seqlen_k else col_lo
            for c in cutlass.range_constexpr(num_cols):
                c0 = coords0_rc[0, c][1]
                outside = c0 < col_lo or c0 > col_hi
                acc_rc[r, c] = -Float32.inf if outside else acc_rc[r, c]

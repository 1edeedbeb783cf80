"""Views of MMA accumulator fragments that softmax and masking code can index by (row, column).

A thread's accumulator fragment from `thr_mma.partition_C` is shaped (V, MMA_M, MMA_N, ...) where V is the value
layout of one MMA atom:
  - sm80 mma.sync m16n8k16: V = (2, 2): two adjacent columns, then the row half (row r and r + 8);
  - sm90 WGMMA m64nNk16:    V = (2, 2, N/8): two adjacent columns, the row half, then the 8-column group.
In both, mode 0 of V walks columns, mode 1 walks rows and any further V modes walk columns. `rows_cols_view` regroups
the fragment into ((V_row, MMA_M), (V_col..., MMA_N)) so that `view[r, None]` is one full row of this thread's
share of the tile. Every row is spread over the 4 threads of a quad in both cases (see `online_softmax`).

`rows_cols_view` is pure layout algebra on the fragment's layout, so it applies equally to the score accumulator, to
the output accumulator, and to an identity (coordinate) tensor partitioned by the same MMA — which is how masking
gets the (row, col) of every element it touches.
"""

from __future__ import annotations

import cutlass.cute as cute


def rows_cols_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((V_row, MMA_M), (V_col..., MMA_N)) view of an accumulator layout (V, MMA_M, MMA_N[, rest...])."""
    # Express the regrouping on the fragment's own coordinates (a compact col-major layout of its shape), then
    # compose with the real layout: the result indexes the same registers in (row, col) order.
    compact = cute.make_layout(acc_layout.shape)
    v_shape, v_stride = compact.shape[0], compact.stride[0]
    row_shape = (v_shape[1], compact.shape[1])
    row_stride = (v_stride[1], compact.stride[1])
    col_shape = (v_shape[0], *v_shape[2:], compact.shape[2])
    col_stride = (v_stride[0], *v_stride[2:], compact.stride[2])
    rest_shape = tuple(compact.shape[3:])
    rest_stride = tuple(compact.stride[3:])
    regrouped = cute.make_layout((row_shape, col_shape, *rest_shape), stride=(row_stride, col_stride, *rest_stride))
    return cute.composition(acc_layout, regrouped)


def rows_cols_view(acc: cute.Tensor) -> cute.Tensor:
    """The same registers (or coordinates) as `acc`, indexed [row, col]."""
    return cute.make_tensor(acc.iterator, rows_cols_layout(acc.layout))


def sm80_acc_as_a_operand(acc: cute.Tensor) -> cute.Tensor:
    """Views an m16n8k16 accumulator (already converted to the operand dtype) as the A operand of the next mma.sync.

    The C fragment of two neighbouring n8 atoms holds exactly the registers the A fragment of one k16 atom needs, in
    the same order: (V=(2,2), MMA_M, MMA_N) becomes ((2, 2, 2), MMA_M, MMA_N / 2). This is what lets P stay in
    registers between the two GEMMs of attention (FlashAttention-2's trick).
    """
    layout = acc.layout
    if cute.size(layout.shape[2]) % 2 != 0:
        raise ValueError("the score tile must hold an even number of n8 MMA columns to feed a k16 MMA")
    split = cute.logical_divide(layout, (None, None, 2))  # (V, MMA_M, (2, MMA_N / 2))
    operand = cute.make_layout(
        ((split.shape[0][0], split.shape[0][1], split.shape[2][0]), split.shape[1], split.shape[2][1]),
        stride=((split.stride[0][0], split.stride[0][1], split.stride[2][0]), split.stride[1], split.stride[2][1]),
    )
    return cute.make_tensor(acc.iterator, operand)

"""The online-softmax recurrence of FlashAttention, on a (rows, cols) view of a float32 score accumulator.

For each KV block with scores S (already masked, -inf where a key is hidden), per query row:
    m_new   = max(m_old, max_j S_j)
    P_j     = exp2(S_j * scale_log2 - m_new * scale_log2)        (written back into the accumulator)
    scale   = exp2((m_old - m_new) * scale_log2)                 (the caller multiplies its O rows by it)
    l_new   = l_old * scale + sum_j P_j
and at the end O /= l, LSE = (m * scale_log2 + log2 l) * ln 2 (natural log, -inf for a row that saw no key).

Layout contract: `acc_rc[r, None]` is this thread's part of row r (see `acc_views.rows_cols_view`) and the other
parts of that row live in the `threads_per_row` neighbouring lanes of the same warp (lane ids differing in the low
bits) — 4 for both the mma.sync (m16n8k16) and the WGMMA accumulators. Row maxima are reduced across those lanes
every block; row sums stay per-thread partial sums until `finalize` (the rescale factors are identical across the
lanes, so the partial sums stay consistent).

The max is taken over raw scores, which equals the max of the scaled ones only for scale_log2 >= 0: callers must
reject negative softmax scales (the sm80 backend does).

Rows that have seen only -inf keep m = -inf; the exponent then uses 0 in its place so that P = 0 and the rescale
factor is 0 instead of NaN. `finalize` gives such rows scale 0 and LSE -inf, hence the 0 / -inf contract.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

LN2 = math.log(2.0)
LOG2_E = math.log2(math.e)


def _tree_reduce(row: cute.Tensor, op, init):
    """op-reduction of a register row through 4 independent chains (shorter dependency chains than a linear scan).

    Plain Python on purpose: it only unrolls at trace time, so it needs no DSL control flow.
    """
    n = cute.size(row)
    chains = [row[i] for i in range(min(4, n))]
    for i in range(4, n):
        chains[i % 4] = op(chains[i % 4], row[i])
    while len(chains) > 1:
        merged = [op(chains[i], chains[i + 1]) for i in range(0, len(chains) - 1, 2)]
        if len(chains) % 2 == 1:
            merged.append(chains[-1])
        chains = merged
    return chains[0] if init is None else op(chains[0], init)


def _add(a, b):
    return a + b


def _lane_group_reduce(value: Float32, op, threads_per_row: int) -> Float32:
    offset = threads_per_row // 2
    while offset > 0:
        value = op(value, cute.arch.shuffle_sync_bfly(value, offset=offset))
        offset //= 2
    return value


@dataclass(frozen=True)
class OnlineSoftmax:
    """Running row statistics of one thread's rows. Build with `OnlineSoftmax.create` inside the kernel.

    Frozen so that kernels may call its methods inside runtime loops and branches (the DSL carries mutable Python
    objects through those as state); the statistics themselves live in the register tensors row_max / row_sum.
    """

    scale_log2: Float32  # softmax_scale * log2(e), a runtime value
    num_rows: int  # rows this thread holds: size of mode 0 of the rows_cols view
    threads_per_row: int  # lanes sharing a row: 4 for mma.sync and WGMMA accumulators
    row_max: cute.Tensor
    row_sum: cute.Tensor

    @staticmethod
    def create(scale_log2: Float32, num_rows: int, threads_per_row: int = 4) -> "OnlineSoftmax":
        row_max = cute.make_rmem_tensor(num_rows, Float32)
        row_sum = cute.make_rmem_tensor(num_rows, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        return OnlineSoftmax(scale_log2, num_rows, threads_per_row, row_max, row_sum)

    @cute.jit
    def update(self, acc_rc: cute.Tensor, is_first: cutlass.Constexpr[bool]) -> cute.Tensor:
        """Turns the scores of one block into P in place; returns the per-row factor to rescale O by.

        is_first: the first block of the row (statistics still empty) — skips the rescale arithmetic.
        """
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            row = acc_rc[r, None]
            prev_max = self.row_max[r]
            new_max = _tree_reduce(row, cute.arch.fmax, None if cutlass.const_expr(is_first) else prev_max)
            new_max = _lane_group_reduce(new_max, cute.arch.fmax, self.threads_per_row)
            self.row_max[r] = new_max
            # A row with no visible key so far keeps max -inf; subtract 0 instead so P = exp2(-inf) = 0.
            safe_max = 0.0 if new_max == -Float32.inf else new_max
            max_scaled = safe_max * self.scale_log2
            p = cute.math.exp2(row.load() * self.scale_log2 - max_scaled, fastmath=True)
            row.store(p)
            if cutlass.const_expr(is_first):
                row_scale[r] = 1.0
                self.row_sum[r] = _tree_reduce(row, _add, None)
            else:
                scale = cute.math.exp2(prev_max * self.scale_log2 - max_scaled, fastmath=True)
                row_scale[r] = scale
                self.row_sum[r] = _tree_reduce(row, _add, self.row_sum[r] * scale)
        return row_scale

    @cute.jit
    def rescale(self, acc_rc: cute.Tensor, row_scale: cute.Tensor):
        """Multiplies each row of an accumulator (O) by its factor."""
        for r in cutlass.range_constexpr(self.num_rows):
            acc_rc[r, None].store(acc_rc[r, None].load() * row_scale[r])

    @cute.jit
    def finalize(self) -> tuple:
        """Returns (row_scale, lse): 1/l to normalise O by (0 for rows that saw no key) and the natural-log LSE."""
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        lse = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            total = _lane_group_reduce(self.row_sum[r], _add, self.threads_per_row)
            empty = total == 0.0
            row_scale[r] = 0.0 if empty else cute.arch.rcp_approx(total)
            log2_sum = cute.math.log2(1.0 if empty else total, fastmath=True)
            lse[r] = -Float32.inf if empty else (self.row_max[r] * self.scale_log2 + log2_sum) * LN2
        return row_scale, lse

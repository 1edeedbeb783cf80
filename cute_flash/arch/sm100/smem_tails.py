"""Zeroing the rows of a shared-memory MMA operand that lie past a packed sequence's end.

A packed (varlen) kernel loads its tiles by TMA from the whole packed tensor, so the rows of a sequence's last tile
past its end hold the next sequence's rows (or a KV cache's unused slots). Their scores are masked, so their
probabilities are exactly 0, but 0 · Inf and 0 · NaN are NaN: a non-finite value in a neighbouring sequence would
reach this one's output through the MMA. Dense tensors need nothing: TMA fills rows past the tensor with zeros.

The operands here are tcgen05 shared-memory tiles as `blackwell_helpers.make_smem_layout_a / _b` build them, one
stage: ((MMA_X, MMA_K), Rest_X, Rest_K). Flattened colexicographically, element (x, k) of a tile with extent X
along its first mode is the flat index x + X · k when Rest_X is 1 (`flat_rows`): zeroing the rows k >= first along
the K mode is zeroing the flat indices from X · first on (tests/test_compile_sm100.py checks the layouts).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


def flat_rows(slot: cute.Tensor) -> int:
    """X, the elements per K-mode row of a one-stage operand tile ((MMA_X, MMA_K), 1, Rest_K) (trace time)."""
    shape = slot.shape
    if cute.size(shape[1]) != 1:
        raise ValueError(f"an operand tile with Rest_X > 1 ({shape}) does not flatten to rows along K")
    return cute.size(shape[0][0])


@cute.jit
def zero_k_rows_from(slot: cute.Tensor, first: Int32, tidx: Int32, threads: cutlass.Constexpr[int]):
    """Zeroes the K-mode rows first .. K - 1 of a one-stage operand tile in shared memory (`flat_rows`'s layout), each
    of `threads` threads (tidx 0 .. threads - 1) storing every threads-th element. The caller has waited for the
    tile's TMA load, and fences the stores for the async proxy (fence_view_async_shared) before the MMA's barrier."""
    row = flat_rows(slot)
    # 16-byte chunks of consecutive X: the swizzles of these layouts permute whole 16-byte chunks, so each chunk
    # stays contiguous (one vector store).
    vec = 128 // slot.element_type.width
    assert row % vec == 0, f"rows of {row} elements do not split into 16-byte chunks"
    chunks = cute.logical_divide(slot, cute.make_layout(vec))
    zeros = cute.make_rmem_tensor(cute.make_layout(vec), slot.element_type)
    zeros.fill(0)
    per_row = row // vec
    for c in cutlass.range(first * per_row + tidx, cute.size(slot) // vec, threads, unroll=2):
        cute.autovec_copy(zeros, chunks[None, c])

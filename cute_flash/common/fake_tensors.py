"""Fake tensors for compiling kernels without a GPU or real memory (CuTe DSL `make_fake_tensor`), and the stride rule
they encode: every kernel is compiled for symbolic sizes, a unit-stride last dimension, and outer strides that are
multiples of `divisibility` elements, which is what `validation.kernel_view` guarantees at run time (16 bytes for
the operands: 8 fp16/bf16 elements, 16 fp8 ones). One builder for every family, so the rule has one spelling.

Imports cutlass on first use only."""

from __future__ import annotations

from typing import Sequence

OPERAND_ALIGN_BYTES = 16  # kernel_view's ALIGN_BYTES: cp.async and TMA move 16 bytes at a time


def fake_tensor(dtype, shape: Sequence, divisibility: int = 1, align: int = 16):
    """A fake tensor of `shape` (ints or symbolic ints), last dimension contiguous, every other stride a symbolic
    multiple of `divisibility` elements, base aligned to `align` bytes."""
    import cutlass.cute as cute

    strides = tuple(cute.sym_int64(divisibility=divisibility) for _ in shape[:-1]) + (1,)
    return cute.runtime.make_fake_tensor(dtype, tuple(shape), strides, assumed_align=align)


def fake_operand(dtype, shape: Sequence):
    """q, k, v, out, dq, ... : outer strides of whole 16-byte units, 16-byte aligned base."""
    return fake_tensor(dtype, shape, OPERAND_ALIGN_BYTES * 8 // dtype.width, OPERAND_ALIGN_BYTES)


def fake_f32(shape: Sequence, divisibility: int = 1, align: int = 4):
    """fp32 statistics and accumulators (lse, D, dQ sums)."""
    import cutlass

    return fake_tensor(cutlass.Float32, shape, divisibility, align)

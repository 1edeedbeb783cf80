"""The one layout normalisation between torch tensors and the kernels' compiled signatures (`kernel_view`).

Every kernel is compiled for 16-byte-aligned rows: a 16-byte-aligned base address, a unit stride in the last dimension
and outer strides that are multiples of 16 bytes. Plain torch: the kernel contract (arch/base.py) and the checks
(validation.py) both use it.
"""

from __future__ import annotations

from typing import Tuple

import torch

# Kernels load rows 16 bytes at a time; strides that break that alignment are copied once (see `kernel_view`).
ALIGN_BYTES = 16


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# (shape, strides, dtype, base address mod 16) of layouts `kernel_view` hands over unchanged: the backends check every
# tensor they launch with, several per call, and the answer depends on nothing else.
_KERNEL_LAYOUTS: set = set()


def _layout_problems(t: torch.Tensor, address: bool = True) -> Tuple[bool, bool]:
    """(needs a copy, needs a restrided view of a size-1 dimension) for `kernel_view`; see there. address=False:
    the strides alone (a fake tensor while torch.compile traces has no address)."""
    shape, strides = t.shape, t.stride()
    align = max(1, ALIGN_BYTES // t.element_size())
    last = len(shape) - 1
    needs_copy = (address and t.data_ptr() % ALIGN_BYTES != 0) or (shape[last] > 1 and strides[last] != 1)
    fix_unit = False
    for i in range(last):
        n, st = shape[i], strides[i]
        if n == 1:
            fix_unit = fix_unit or st % align != 0
        elif st == 0 or st % align != 0:
            needs_copy = True
    return needs_copy, fix_unit


def is_kernel_layout(t: torch.Tensor, address: bool = True) -> bool:
    """Whether `kernel_view(t)` is `t` itself. Depends only on the shape, strides, element size and the base
    address modulo 16, so a caller may cache the answer per (shape, strides, dtype, alignment). address=False: the
    answer from the strides alone."""
    return t.numel() == 0 or _layout_problems(t, address) == (False, False)


def kernel_view(t: torch.Tensor, *, copy: bool = True, name: str = "tensor") -> torch.Tensor:
    """The one layout normalisation between torch tensors and the kernels' compiled signatures.

    Every kernel is compiled for: a 16-byte-aligned base address, a unit stride in the last dimension, and outer
    strides that are multiples of 16 bytes (8 elements of fp16/bf16, what cp.async and TMA move at a time). This
    returns, in order of preference:
      * `t` itself when it already meets that contract (non-contiguous views included: no copy);
      * a view of the same memory (no copy) when the only problem is the stride of a size-1 dimension, which
        never addresses memory but which torch may leave at any value after slicing or unsqueezing; it becomes
        the stride a contiguous tensor would have, rounded up to 16 bytes;
      * a contiguous copy otherwise: a misaligned base (an offset view), a last dimension that is not unit-stride
        (a transposed view), an outer stride that breaks 16-byte alignment, or a broadcast dimension (stride 0 with
        size > 1, e.g. the expanded gradient autograd hands to backward after `out.sum().backward()`): a kernel
        that reads through TMA needs every stride of a dimension it tiles to step to new memory.
    With copy=False (for tensors a kernel writes, and for backends, whose inputs the front end has normalised) a
    layout that would need a copy raises instead of copying.
    """
    key = (t.shape, t.stride(), t.dtype, t.data_ptr() & (ALIGN_BYTES - 1))
    if key in _KERNEL_LAYOUTS:  # seen before and usable as is: the common case, a dict lookup
        return t
    if t.numel() == 0:
        return t
    needs_copy, fix_unit = _layout_problems(t)
    if not (needs_copy or fix_unit):
        if len(_KERNEL_LAYOUTS) >= 4096:
            _KERNEL_LAYOUTS.clear()
        _KERNEL_LAYOUTS.add(key)
        return t
    shape, strides = t.shape, t.stride()
    elem = t.element_size()
    align = max(1, ALIGN_BYTES // elem)
    last = len(shape) - 1
    if needs_copy:
        if not copy:
            raise ValueError(
                f"cute_flash internal error: {name} (shape {tuple(shape)}, strides {tuple(strides)}, "
                f"{elem}-byte elements) cannot be handed to a kernel without a copy"
            )
        # clone(), not contiguous(): a contiguous tensor can still start at a misaligned offset.
        t = t.clone(memory_format=torch.contiguous_format)
        shape, strides = t.shape, t.stride()
        fix_unit = any(shape[i] == 1 and strides[i] % align != 0 for i in range(last))
    if not fix_unit:
        return t
    new_strides = list(strides)
    trailing = 1
    for i in range(last, -1, -1):
        if shape[i] == 1 and i < last and strides[i] % align != 0:
            new_strides[i] = round_up(max(trailing, 1), align)
        elif shape[i] == 1 and i == last:
            new_strides[i] = 1
        trailing *= shape[i]
    return t.as_strided(shape, new_strides)

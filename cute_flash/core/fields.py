"""The fields of a call: the one list from which the plan cache's key (`key`, `packed_key`), the C++ call path's key
(csrc/eager_forward.cc, built with `NUM_SCALARS`) and the custom ops' schema (`op_arguments`) are made.

Adding an argument to `attention` / `attention_varlen` means adding its `Field` here (scalars before tensors), then
checking it in `cute_flash.validation` and using it where it takes effect; the keys, the C++ key layout, the ops'
schema and what travels between them follow from this list (tests/test_call_core.py checks the entry points against
it). Values travel as two tuples in this order: `scalars` (keyed by value and type, and by the C++ path) and `tensors`
(keyed by metadata; the C++ path serves calls where they are None).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional, Tuple

from .. import validation
from ..arch import ARCH_ENV_VAR
from ..kernel_layout import ALIGN_BYTES

SCALAR, TENSOR = "scalar", "tensor"


class Field(NamedTuple):
    name: str  # the keyword (window_size is two fields, its bounds)
    op_type: str  # the type in the custom ops' schema
    kind: str  # SCALAR or TENSOR


def _table(text: str) -> tuple:
    """Fields from lines of `name op_type kind`."""
    return tuple(Field(*line.split()) for line in text.strip().splitlines())


CALL = _table("""
    causal          bool     scalar
    softmax_scale   float?   scalar
    window_left     SymInt?  scalar
    window_right    SymInt?  scalar
    deterministic   bool     scalar
    softcap         float    scalar
    learnable_sink  Tensor?  tensor
""")
# What a packed call (`attention_varlen`) adds; None / 0 in a dense call's op arguments.
PACKED = _table("""
    cu_seqlens_q    Tensor?  tensor
    cu_seqlens_k    Tensor?  tensor
    seqused_k       Tensor?  tensor
    max_seqlen_q    SymInt   scalar
    max_seqlen_k    SymInt   scalar
""")
NUM_SCALARS = sum(f.kind == SCALAR for f in CALL)
_WINDOW = tuple(i for i, f in enumerate(CALL) if f.name in ("window_left", "window_right"))


def op_arguments() -> str:
    """The call's fields as custom-op schema arguments, CALL then PACKED."""
    return ", ".join(f"{f.op_type} {f.name}" for f in CALL + PACKED)


def _meta(t) -> Optional[tuple]:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def key(q, k, v, scalars: tuple, window_size, tensors: tuple) -> tuple:
    """What a call's validation and routing depend on, read from tensor metadata only (no device sync): shapes,
    strides, dtypes, devices, the inputs' 16-byte alignment, the scalar fields with their types (so that a cached
    `True` never answers for a rejected `1`), the window's container type, the tensor fields' metadata, the device
    check in force and CUTE_FLASH_ARCH. Raises TypeError, ValueError or AttributeError for arguments that cannot be
    part of a key (the caller then validates them the slow way)."""
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride()) + _common_key(
        q, k, v, scalars, window_size, tensors
    )


def _common_key(q, k, v, scalars: tuple, window_size, tensors: tuple) -> tuple:
    """`key` past the inputs' shapes and strides."""
    return (
        q.dtype,
        k.dtype,
        v.dtype,
        q.device,
        k.device,
        v.device,
        (q.data_ptr() | k.data_ptr() | v.data_ptr()) & (ALIGN_BYTES - 1),
        scalars,
        tuple(map(type, scalars)),
        type(window_size),
        tuple(map(_meta, tensors)),
        validation.KERNEL_DEVICE_TYPES,
        os.environ.get(ARCH_ENV_VAR),
    )


def _keys_layout(t) -> tuple:
    """What validation and `kernel_layout` read of a key tensor whose length is left out (`decode_key`): the other
    extents, the last stride, and of each outer stride whether it is 0 and its remainder modulo 16 bytes."""
    align = max(1, ALIGN_BYTES // t.element_size())
    st = t.stride()
    return (t.shape[0], t.shape[2], t.shape[3], st[3]) + tuple((st[i] == 0, st[i] % align) for i in range(3))


def decode_key(q, k, v, call_key: tuple) -> Optional[tuple]:
    """The `key` of a decoding call (one query row), `call_key`, without the key count: k and v by `_keys_layout`,
    so that the calls of a cache that grows by a token per step share it (core/plan.py's decoding families). None
    for other calls and for fewer than two keys (a length-1 dimension is read differently)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[1] != 1 or k.shape[1] < 2 or v.shape[1] != k.shape[1]:
        return None
    return (call_key[0], call_key[1], _keys_layout(k), _keys_layout(v)) + call_key[6:]


def packed_key(q, k, v, scalars: tuple, window_size, tensors: tuple, seqs) -> tuple:
    """`key` of the packed tensors and the PACKED fields: the vectors' metadata (their values are the kernels' to
    read), max_seqlen_* with their types."""
    cu_q, cu_k, used, max_q, max_k = seqs
    return key(q, k, v, scalars, window_size, tensors) + (
        _meta(cu_q), _meta(cu_k), _meta(used), max_q, max_k, type(max_q), type(max_k)
    )  # fmt: skip


def keywords(scalars: tuple, window_size, tensors: tuple) -> dict:
    """The fields as validation's keywords: window_size is the caller's own object (validation refuses containers
    that merely unpack into two values)."""
    kw = {f.name: x for f, x in zip(CALL, scalars + tensors) if f.name not in ("window_left", "window_right")}
    kw["window_size"] = window_size
    return kw


def from_keywords(*, window_size, **call) -> Tuple[tuple, tuple]:
    """(scalars, tensors) of a call given by keyword: every CALL field by name, window_size as the (left, right) pair
    (for callers off the hot path, which build the tuples positionally)."""
    left, right = window_size
    values = dict(call, window_left=left, window_right=right)
    if set(values) != {f.name for f in CALL}:
        raise TypeError(f"a call's fields are {[f.name for f in CALL]}, got {sorted(values)}")
    scalars = tuple(values[f.name] for f in CALL if f.kind == SCALAR)
    return scalars, tuple(values[f.name] for f in CALL if f.kind == TENSOR)


def from_op(args: tuple) -> Tuple[tuple, tuple, tuple, tuple]:
    """(scalars, window_size, tensors, packed) of the custom ops' CALL + PACKED arguments."""
    call, packed = args[: len(CALL)], args[len(CALL) : len(CALL) + len(PACKED)]
    scalars = call[:NUM_SCALARS]
    return scalars, tuple(scalars[i] for i in _WINDOW), call[NUM_SCALARS:], packed

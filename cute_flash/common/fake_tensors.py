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


def fake_cu_seqlens(n):
    """An int32 (n,) vector (cu_seqlens, seqused_k) for compiling the packed kernels."""
    import cutlass

    return fake_tensor(cutlass.Int32, (n,), 1, 4)


def fake_packed_forward_args(dtype, head_dim: int, head_dim_v: int, seqused: bool) -> tuple:
    """The arguments of a packed forward entry (common/entries.FwdEntries.packed) before the stream: q (total_q, h,
    d), k / v (total_k, h_kv, d / dv), out (total_q, h, dv), lse (h, total_q), scale, window edges, cu_seqlens_q /
    _k, seqused_k (None unless `seqused`), max_seqlen_q; batch = cu_seqlens_q's length - 1."""
    import cutlass
    import cutlass.cute as cute

    batch, total_q, total_k, heads, heads_kv = (cute.sym_int() for _ in range(5))
    used = fake_cu_seqlens(batch) if seqused else None
    return (
        fake_operand(dtype, (total_q, heads, head_dim)),
        fake_operand(dtype, (total_k, heads_kv, head_dim)),
        fake_operand(dtype, (total_k, heads_kv, head_dim_v)),
        fake_operand(dtype, (total_q, heads, head_dim_v)),
        fake_f32((heads, total_q)),
        cutlass.Float32(1.0),
        cutlass.Int32(0),
        cutlass.Int32(0),
        fake_cu_seqlens(cute.sym_int()),
        fake_cu_seqlens(cute.sym_int()),
        used,
        cutlass.Int32(0),
    )


def fake_sink():
    """The (rows, h) fp32 sink view a forward with spec.sink reads (arch/base.py): both strides symbolic, row stride
    0 for the (h,) logits expanded along the rows, (1, group) for decoding's packed query heads."""
    import cutlass
    import cutlass.cute as cute

    shape = (cute.sym_int(), cute.sym_int())
    return cute.runtime.make_fake_tensor(cutlass.Float32, shape, (cute.sym_int64(), cute.sym_int64()), assumed_align=4)


def fake_feature_args(sink: bool) -> tuple:
    """The two arguments of a forward feature entry (common/entries.py) after the window bounds: softcap and the sink
    view (None where the build reads no sink)."""
    import cutlass

    return cutlass.Float32(1.0), (fake_sink() if sink else None)


def fake_packed_preprocess_args(dtype, head_dim_v: int, dq_zeroing_block: int = 0, dq_head_dim: int = 0) -> tuple:
    """The arguments of the backward preprocess's packed entry (sm80/flash_bwd_preprocess, which both families run)
    before the stream: out / dout (total_q, h, dv), lse (h, total_q), D / lse_log2 (h, padded rows), cu_seqlens_q,
    two runtime ints (the per-sequence pad and the grid's blocks per sequence), and with `dq_zeroing_block` (its
    block_m; the `packed_with_dq_zeroing` entry) the (h, padded rows * d) fp32 dQ accumulator it zeroes (d:
    dq_head_dim, by default head_dim_v)."""
    import cutlass
    import cutlass.cute as cute

    total, heads, rows = cute.sym_int(), cute.sym_int(), cute.sym_int()
    args = (
        fake_operand(dtype, (total, heads, head_dim_v)),
        fake_operand(dtype, (total, heads, head_dim_v)),
        fake_f32((heads, total)),
        fake_f32((heads, rows)),
        fake_f32((heads, rows)),
        fake_cu_seqlens(cute.sym_int()),
        cutlass.Int32(0),
        cutlass.Int32(0),
    )
    if dq_zeroing_block:
        d = dq_head_dim or head_dim_v
        args += (fake_f32((heads, cute.sym_int()), divisibility=dq_zeroing_block * d, align=16),)
    return args


def fake_mods_tables(spec) -> list:
    """The `mods` entries' a0 .. a3 of a ModsSpec: fake tensors of its graphs' tables (score_mod's, then mask_mod's)
    in the storage types mods/call.py gives them (float32, int32, uint8 for booleans), None past them."""
    import cutlass
    import cutlass.cute as cute

    from .mods_scores import MAX_TABLES, graph_of

    storage = {"f32": cutlass.Float32, "i32": cutlass.Int32, "bool": cutlass.Uint8}
    tables = []
    for key in (spec.score_mod, spec.mask_mod):
        graph = graph_of(key)
        for read, ndim in graph.aux_types if graph is not None else ():
            shape = tuple(cute.sym_int() for _ in range(max(ndim, 1)))
            tables.append(fake_tensor(storage[read], shape, 1, max(1, storage[read].width // 8)))
    return tables + [None] * (MAX_TABLES - len(tables))

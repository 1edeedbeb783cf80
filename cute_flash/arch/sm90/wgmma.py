"""Warpgroup MMA helpers: issuing a (possibly asynchronous) wgmma sequence and turning an S accumulator into the
register A operand of P·V (the RS form, so P never touches shared memory).
"""

from __future__ import annotations

from typing import Optional, Type

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.cute.nvgpu import warpgroup
import cutlass.utils.hopper_helpers as sm90_utils

from ...common.inline_ptx import ptx_asm


def tiled_mma_f32(
    dtype: Type[cutlass.Numeric],
    a_major: cute.nvgpu.OperandMajorMode,
    b_major: cute.nvgpu.OperandMajorMode,
    atoms: tuple,
    tiler: tuple,
    a_source: warpgroup.OperandSource = warpgroup.OperandSource.SMEM,
) -> cute.TiledMma:
    """A wgmma on two `dtype` operands with an fp32 accumulator: `atoms` warpgroups along (M, N, K) share the (M, N)
    `tiler`; A from shared memory, or from registers (the RS form)."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, a_major, b_major, Float32, atom_layout_mnk=atoms, tiler_mn=tiler, a_source=a_source
    )


def k_major_smem_layout(
    dtype: Type[cutlass.Numeric],
    rows: int,
    cols: int,
    stages: int,
    stage_elems: Optional[int] = None,
    atom_cols: Optional[int] = None,
) -> cute.ComposedLayout:
    """(rows, cols, stages) shared-memory tile with `cols` contiguous, in the widest swizzle the row length allows:
    what wgmma reads as a K-major operand (and what TMA writes).

    `atom_cols` caps the swizzle at the atom of that many columns (e.g. 32 bf16 columns: 64-byte swizzle), for tiles
    whose column blocks must start on an atom (tile_config.operand_atom_cols).

    `stage_elems` spaces the stages further apart than rows * cols (two tiles of different widths sharing one slot
    per stage); it must keep every stage on a 1 KiB boundary, where the swizzle pattern repeats."""
    row_bits = (atom_cols or cols) * dtype.width
    kinds = warpgroup.SmemLayoutAtomKind
    if row_bits % 1024 == 0:
        kind = kinds.K_SW128
    elif row_bits % 512 == 0:
        kind = kinds.K_SW64
    elif row_bits % 256 == 0:
        kind = kinds.K_SW32
    else:
        kind = kinds.K_INTER
    packed = cute.tile_to_shape(warpgroup.make_smem_layout_atom(kind, dtype), (rows, cols, stages), order=(0, 1, 2))
    if stage_elems is None or stage_elems == rows * cols:
        return packed
    assert stage_elems > rows * cols and (stage_elems * dtype.width) % (1024 * 8) == 0, stage_elems
    outer = packed.outer
    spaced = cute.make_layout(
        (outer.shape[0], outer.shape[1], stages), stride=(outer.stride[0], outer.stride[1], stage_elems)
    )
    return cute.make_composed_layout(packed.inner, 0, spaced)


@cute.jit
def gemm(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    frag_a: cute.Tensor,
    frag_b: cute.Tensor,
    zero_init: cutlass.Constexpr[bool],
    wait: cutlass.Constexpr[int],
    k_blocks: cutlass.Constexpr = None,
) -> None:
    """acc (=|+=) A·B over every k-block of the fragments (or k-blocks [begin, end) of `k_blocks`), as one wgmma
    group.

    `wait` >= 0 waits until at most that many groups are pending; -1 returns with the group in flight, so the caller
    can issue more work (or do math on other registers) before `warpgroup.wait_group`.
    """
    warpgroup.fence()
    # A fresh atom per call: mutating the ACCUMULATE field of a shared tiled MMA across dynamic regions
    # trips MLIR dominance checks.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    begin, end = (0, cute.size(frag_a.shape[2])) if cutlass.const_expr(k_blocks is None) else k_blocks
    for kb in cutlass.range_constexpr(begin, end):
        cute.gemm(atom, acc, frag_a[None, None, kb], frag_b[None, None, kb], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if cutlass.const_expr(wait >= 0):
        warpgroup.wait_group(wait)


def acc_layout_as_operand_a(acc_layout: cute.Layout) -> cute.Layout:
    """Views a 16-bit wgmma accumulator layout ((2, 2, N/8), M_tiles, N_tiles) as the RS A-operand layout
    ((2, 2, 2), M_tiles, (N/16, N_tiles)): two adjacent 8-column groups of S form one 16-wide k-block of P.
    """
    groups = acc_layout.shape[0][2]
    assert groups % 2 == 0, "the S tile width must be a multiple of 16 to feed P·V"
    split = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    return cute.make_layout(
        (
            (split.shape[0][0], split.shape[0][1], split.shape[0][2][0]),
            split.shape[1],
            (split.shape[0][2][1], split.shape[2]),
        ),
        stride=(
            (split.stride[0][0], split.stride[0][1], split.stride[0][2][0]),
            split.stride[1],
            (split.stride[0][2][1], split.stride[2]),
        ),
    )


@dsl_user_op
def _pack_f32x2(lo: Float32, hi: Float32, to_bf16: bool, *, loc=None, ip=None) -> Int32:
    # One cvt for two values; the generic TensorSSA conversion is not always paired by the compiler.
    return Int32(
        ptx_asm(
            T.i32(),
            [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
            f"cvt.rn.{'bf16x2' if to_bf16 else 'f16x2'}.f32 $0, $2, $1;",
            "=r,f,f",
        )
    )


@cute.jit
def convert_to_16bit(src: cute.Tensor, dst: cute.Tensor) -> None:
    """dst (fp16/bf16) = src (fp32), element for element in each tensor's own order (same sizes)."""
    dst_words = cute.recast_tensor(dst, Int32)
    to_bf16 = dst.element_type is cutlass.BFloat16
    for i in cutlass.range_constexpr(cute.size(dst_words)):
        dst_words[i] = _pack_f32x2(src[2 * i], src[2 * i + 1], to_bf16)


@cute.jit
def store_p_operand(acc_s: cute.Tensor, frag_p: cute.Tensor, k_blocks: cutlass.Constexpr = None) -> None:
    """Writes softmax probabilities (fp32 S accumulator) into the 16-bit A fragment of P·V (only k-blocks [begin,
    end) of `k_blocks` when given)."""
    acc_as_a = cute.make_tensor(acc_s.iterator, acc_layout_as_operand_a(acc_s.layout))
    if cutlass.const_expr(k_blocks is None):
        convert_to_16bit(acc_as_a, frag_p)
    else:
        for kb in cutlass.range_constexpr(*k_blocks):
            convert_to_16bit(acc_as_a[None, None, kb], frag_p[None, None, kb])

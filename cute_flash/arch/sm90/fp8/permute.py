"""P from the fp32 score accumulator to the e4m3 A operand of P·V, without a single shuffle.

An 8-bit wgmma A fragment (m64 k32) gives thread t (t4 = t % 4) the keys k = 4·t4 + i + 16·h (i < 4, h < 2) of rows
r and r + 8, four consecutive keys per register. The score accumulator gives the same thread the columns
2·t4 + c + 8·g (c < 2, g < 4 per 32 columns) of the same rows. The two key sets differ, which is why FlashAttention-3
and CUTLASS's FMHA exchange bytes between the 4 lanes of a quad (shuffles + byte permutes) for every P tile.

P·V sums over keys, so any permutation of the keys applied to both P's columns and V's rows leaves it unchanged.
We therefore read A's key position κ = 4·t4 + i + 16·h as the real key
    π(κ) = 2·t4 + (i & 1) + 8·(i >> 1) + 16·h          (a permutation within each group of 16 keys)
which this thread already holds in its accumulator (c = i & 1, g = (i >> 1) + 2·h), and store V in global memory
with its keys permuted the same way: position 16·j + p of a transposed V row holds key 16·j + V_KEY_PERM16[p]
(`cute_flash.fp8.quantize.V_KEY_PERM16`, written by the pre-pass). The conversion is then register renaming plus
`cvt.rn.satfinite.e4m3x2.f32`, two values per instruction.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Uint32

from ....fp8.e4m3 import e4m3x4


def acc_layout_as_fp8_operand_a(acc_layout: cute.Layout) -> cute.Layout:
    """Views a wgmma accumulator layout ((2, 2, N/8), M_tiles, N_tiles) as the e4m3 A-operand layout
    (((2, 2), 2, 2), M_tiles, (N/32, N_tiles)) under the key permutation π of the module docstring:
    A value ((c, g_lo), row half, h) of k-block b reads accumulator value (c, row half, g_lo + 2·h + 4·b).
    """
    (s_col, s_row, s_grp) = acc_layout.stride[0]
    groups = acc_layout.shape[0][2]
    assert groups % 4 == 0, "the score tile width must be a multiple of 32 to feed an e4m3 P·V"
    shape = (((2, 2), 2, 2), acc_layout.shape[1], (groups // 4, acc_layout.shape[2]))
    stride = (((s_col, s_grp), s_row, 2 * s_grp), acc_layout.stride[1], (4 * s_grp, acc_layout.stride[2]))
    return cute.make_layout(shape, stride=stride)


@cute.jit
def store_p_operand_e4m3(acc_s: cute.Tensor, frag_p: cute.Tensor) -> None:
    """frag_p (e4m3 A fragment of P·V) = acc_s (fp32 probabilities), keys permuted as in the module docstring."""
    src = cute.make_tensor(acc_s.iterator, acc_layout_as_fp8_operand_a(acc_s.layout))
    words = cute.recast_tensor(frag_p, Uint32)
    for w in cutlass.range_constexpr(cute.size(words)):
        words[w] = e4m3x4(src[4 * w], src[4 * w + 1], src[4 * w + 2], src[4 * w + 3])

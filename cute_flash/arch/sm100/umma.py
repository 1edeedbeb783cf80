"""tcgen05 MMA issue shared by the sm100 kernels."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import tcgen05


@cute.jit
def gemm(tiled_mma, acc, a, b, accumulate):
    """acc (+)= a @ b over the K blocks of the fragments (issued by one warp; the compiler elects the issuing thread).

    A fresh atom per call carries the ACCUMULATE field: mutating the shared TiledMma inside staged control flow
    would leak values out of their regions. `accumulate` may be a Python or a runtime boolean.
    """
    atom = cute.make_mma_atom(tiled_mma.op)
    for k in cutlass.range_constexpr(cute.size(a, mode=[2])):
        atom.set(tcgen05.Field.ACCUMULATE, accumulate or k != 0)
        cute.gemm(atom, acc, a[None, None, k], b[None, None, k], acc)

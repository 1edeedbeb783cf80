"""tcgen05 MMA issue and the tcgen05 thread-sync fences, shared by the sm100 kernels."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import tcgen05
from cutlass.cutlass_dsl import dsl_user_op


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


def _fence(body: str, loc=None, ip=None) -> None:
    from cutlass._mlir.dialects import llvm

    llvm.inline_asm(None, [], body, "", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def fence_before_thread_sync(*, loc=None, ip=None) -> None:
    """tcgen05.fence::before_thread_sync: this thread's tcgen05 operations (TMEM loads / stores, MMAs) are ordered
    before the barrier or mbarrier arrive that follows (PTX ISA: tcgen05 memory consistency)."""
    _fence("tcgen05.fence::before_thread_sync;", loc, ip)


@dsl_user_op
def fence_after_thread_sync(*, loc=None, ip=None) -> None:
    """tcgen05.fence::after_thread_sync: this thread's tcgen05 operations after a barrier or mbarrier wait are ordered
    after what the threads before it did."""
    _fence("tcgen05.fence::after_thread_sync;", loc, ip)

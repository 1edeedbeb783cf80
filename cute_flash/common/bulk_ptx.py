"""PTX the backwards need and CuTe DSL 4.8.1 does not wrap: the bulk reduce-add of a shared-memory buffer into global
memory (sm90), and the acquire / release accesses of the semaphores that order such adds in deterministic mode (sm90,
sm100)."""

from __future__ import annotations

from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
import cutlass.cute as cute


@dsl_user_op
def bulk_reduce_add_f32(gmem: cute.Pointer, smem: cute.Pointer, num_bytes: int, *, loc=None, ip=None) -> None:
    """gmem[0:n] += smem[0:n] (fp32) by the bulk copy engine, in the calling thread's bulk group; both addresses and
    `num_bytes` must be multiples of 16. Commit with cp_async_bulk_commit_group, wait with cp_async_bulk_wait_group."""
    llvm.inline_asm(
        None,
        [gmem.toint(loc=loc, ip=ip).ir_value(), smem.toint(loc=loc, ip=ip).ir_value(), Int32(num_bytes).ir_value()],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def load_acquire_gpu(ptr: cute.Pointer, *, loc=None, ip=None) -> Int32:
    """An int32 load with acquire semantics at GPU scope (a semaphore read)."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [ptr.toint(loc=loc, ip=ip).ir_value()],
            "ld.acquire.gpu.global.b32 $0, [$1];",
            "=r,l",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def add_release_gpu(ptr: cute.Pointer, value: Int32, *, loc=None, ip=None) -> None:
    """*ptr += value with release semantics at GPU scope: every write this thread made before is visible to whoever
    acquires the new value."""
    llvm.inline_asm(
        None,
        [ptr.toint(loc=loc, ip=ip).ir_value(), Int32(value).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.s32 [$0], $1;",
        "l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )

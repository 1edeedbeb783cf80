"""Named hardware barriers of the sm90 forward kernel.

Barrier 0 belongs to `__syncthreads`. Ids 1..3 are the consumers' turn barriers (ping-pong), ids 4..6 the per-warpgroup
epilogue barriers (before a warpgroup's TMA store reads the O tile its 128 threads wrote to shared memory), ids 7..9
the FP8 kernel's exponential turns (`Fp8FwdConfig.exp_turns`).
"""

from __future__ import annotations

import enum

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .tile_config import WARPGROUP_THREADS

MAX_CONSUMER_WGS = 3


class BarrierId(enum.IntEnum):
    TURN_FIRST = 1  # TURN_FIRST + c: consumer c may issue its GEMMs
    EPILOGUE_FIRST = TURN_FIRST + MAX_CONSUMER_WGS  # EPILOGUE_FIRST + c: consumer c's O tile is in shared memory
    EXP_TURN_FIRST = EPILOGUE_FIRST + MAX_CONSUMER_WGS  # EXP_TURN_FIRST + c: consumer c may run its exponentials


class WarpGroupTurns:
    """Ping-pong between consumer warpgroups: they take turns issuing their GEMMs, so that while one warpgroup runs
    its softmax (FMA/MUFU units) the other's wgmmas own the tensor cores.

    Consumer c waits on barrier TURN_FIRST + c before issuing and, once issued, arrives on the next consumer's
    barrier. Each barrier counts the waiting warpgroup plus the arriving one (256 threads). The first consumer primes
    its own barrier once, so it goes first. With `enabled` False every call is a no-op. `first_barrier` picks the
    barrier set, so that two kinds of turns can coexist.
    """

    def __init__(self, consumer_idx: Int32, num_consumers: int, enabled: bool,
                 first_barrier: BarrierId = BarrierId.TURN_FIRST, zero_word: cute.Pointer = None):
        self.consumer_idx = consumer_idx
        self.num_consumers = num_consumers
        self.enabled = enabled and num_consumers > 1
        self.threads = 2 * WARPGROUP_THREADS
        self.first_barrier = int(first_barrier)
        self.zero_word = zero_word  # a shared-memory word holding 0, for the ordered turns below

    @cute.jit
    def prime(self) -> None:
        if cutlass.const_expr(self.enabled):
            if self.consumer_idx == 0:
                cute.arch.barrier_arrive(barrier_id=self.first_barrier, number_of_threads=self.threads)

    def wait_turn(self) -> None:
        if cutlass.const_expr(self.enabled):
            cute.arch.barrier(barrier_id=self.first_barrier + self.consumer_idx, number_of_threads=self.threads)

    def pass_turn(self) -> None:
        if cutlass.const_expr(self.enabled):
            nxt = (self.consumer_idx + 1) % self.num_consumers
            cute.arch.barrier_arrive(barrier_id=self.first_barrier + nxt, number_of_threads=self.threads)

    # ptxas moves arithmetic across bar.sync / bar.arrive freely (neither carries a data dependence), so a turn that
    # must hold some arithmetic, and keep other arithmetic out, is pinned by data. `zero` is a 0 read from shared
    # memory once (the compiler cannot know its value): the barrier id of the wait and of the arrive is offset by
    # (bits of a value AND zero), so the barrier cannot be issued before that value exists; the work inside the turn
    # adds a 0 read by a volatile load after the wait, which cannot be hoisted above the barrier.

    def load_zero(self) -> None:
        if cutlass.const_expr(self.enabled):
            self.zero = _load_shared_volatile(self.zero_word)

    def wait_turn_after(self, before: Float32) -> Float32:
        """wait_turn once `before` is computed; returns 0.0 as a value that only exists after the wait (add it to
        the inputs of the turn's work)."""
        if cutlass.const_expr(self.enabled):
            barrier_id = _add_masked_bits(Int32(self.first_barrier) + self.consumer_idx, before, self.zero)
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=self.threads)
            return _load_shared_volatile(self.zero_word)
        return Float32(0.0)

    def pass_turn_after(self, result: Float32) -> None:
        """pass_turn, issued only once `result` (e.g. a sum over the turn's outputs) has been computed."""
        if cutlass.const_expr(self.enabled):
            nxt = (self.consumer_idx + 1) % self.num_consumers
            barrier_id = _add_masked_bits(Int32(self.first_barrier) + nxt, result, self.zero)
            cute.arch.barrier_arrive(barrier_id=barrier_id, number_of_threads=self.threads)


@dsl_user_op
def _load_shared_volatile(ptr: cute.Pointer, *, loc=None, ip=None) -> Float32:
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Int32(ptr.toint()).ir_value(loc=loc, ip=ip)],
            "ld.volatile.shared.f32 $0, [$1];",
            "=f,r",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def _add_masked_bits(base: Int32, value: Float32, zero: Float32, *, loc=None, ip=None) -> Int32:
    """base + (bits(value) & bits(zero)): base, with a data dependence on value the compiler cannot fold away."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [
                Int32(base).ir_value(loc=loc, ip=ip),
                Float32(value).ir_value(loc=loc, ip=ip),
                Float32(zero).ir_value(loc=loc, ip=ip),
            ],
            "{\n.reg .b32 v, z;\nmov.b32 v, $2;\nmov.b32 z, $3;\nand.b32 v, v, z;\nadd.s32 $0, $1, v;\n}",
            "=r,r,f,f",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc,
            ip=ip,
        )
    )


def epilogue_sync(consumer_idx: Int32) -> None:
    """All 128 threads of one consumer warpgroup (its O tile is complete in shared memory)."""
    cute.arch.barrier(barrier_id=int(BarrierId.EPILOGUE_FIRST) + consumer_idx, number_of_threads=WARPGROUP_THREADS)

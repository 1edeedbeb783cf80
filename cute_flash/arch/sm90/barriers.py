"""Named hardware barriers of the sm90 kernels (ids are per kernel; barrier 0 belongs to `__syncthreads`).

Forward (`BarrierId`): ids 1..3 are the consumers' turn barriers (ping-pong), ids 4..6 one per consumer warpgroup
(its 128 threads: before the TMA store reads the O tile they wrote to shared memory, and in packed batches before
the first P·V reads the V tile whose tail rows they zeroed).
Backward (`BwdBarrierId`): see the enum.
"""

from __future__ import annotations

import enum

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cutlass_dsl import if_generate

from .tile_config import MAX_BWD_CONSUMER_WGS, WARPGROUP_THREADS

MAX_CONSUMER_WGS = 3


class BarrierId(enum.IntEnum):
    TURN_FIRST = 1  # TURN_FIRST + c: consumer c may issue its GEMMs
    WARPGROUP_FIRST = TURN_FIRST + MAX_CONSUMER_WGS  # WARPGROUP_FIRST + c: consumer c's 128 threads


class WarpGroupTurns:
    """Ping-pong between consumer warpgroups: they take turns issuing their GEMMs, so that while one warpgroup runs
    its softmax (FMA/MUFU units) the other's wgmmas own the tensor cores.

    Consumer c waits on barrier TURN_FIRST + c before issuing and, once issued, arrives on the next consumer's
    barrier. Each barrier counts the waiting warpgroup plus the arriving one (256 threads). The first consumer primes
    its own barrier once, so it goes first. With `enabled` False every call is a no-op.
    """

    def __init__(self, consumer_idx: Int32, num_consumers: int, enabled: bool):
        self.consumer_idx = consumer_idx
        self.num_consumers = num_consumers
        self.enabled = enabled and num_consumers > 1
        self.threads = 2 * WARPGROUP_THREADS

    @cute.jit
    def prime(self) -> None:
        if cutlass.const_expr(self.enabled):
            if self.consumer_idx == 0:
                cute.arch.barrier_arrive(barrier_id=int(BarrierId.TURN_FIRST), number_of_threads=self.threads)

    def wait_turn(self) -> None:
        if cutlass.const_expr(self.enabled):
            cute.arch.barrier(barrier_id=int(BarrierId.TURN_FIRST) + self.consumer_idx, number_of_threads=self.threads)

    def pass_turn(self) -> None:
        if cutlass.const_expr(self.enabled):
            nxt = (self.consumer_idx + 1) % self.num_consumers
            cute.arch.barrier_arrive(barrier_id=int(BarrierId.TURN_FIRST) + nxt, number_of_threads=self.threads)

    def take_turn_if(self, take) -> None:
        """A turn without GEMMs (a consumer without rows keeps the others going) where `take` (a runtime Boolean)."""
        if cutlass.const_expr(self.enabled):
            if_generate(take, lambda: (self.wait_turn(), self.pass_turn()))


def warpgroup_sync(consumer_idx: Int32) -> None:
    """All 128 threads of one consumer warpgroup (e.g. its O tile is complete in shared memory)."""
    cute.arch.barrier(barrier_id=int(BarrierId.WARPGROUP_FIRST) + consumer_idx, number_of_threads=WARPGROUP_THREADS)


class BwdBarrierId(enum.IntEnum):
    """Named barriers of the sm90 backward kernel."""

    DS_READY = 1  # (consumers) every consumer's dSᵀ rows of this query tile are in shared memory
    EPILOGUE = 2  # (consumers) around the dK / dV staging in shared memory; after zeroing packed tail rows
    DQ_EMPTY_FIRST = 3  # + c: (consumer c and the dQ warp) consumer c's dQ buffer may be written
    DQ_FULL_FIRST = DQ_EMPTY_FIRST + MAX_BWD_CONSUMER_WGS  # + c: consumer c's dQ is in its buffer

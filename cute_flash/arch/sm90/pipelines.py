"""TMA load pipelines of the sm90 forward kernel (mbarrier rings between the producer warp and the consumers).

Three `PipelineTmaAsync` rings: Q (one stage, loaded once per CTA), K and V (`num_stages` each). K and V have separate
rings because the consumers need K_j one step before V_j (Q·K_{j+1}ᵀ is issued before P_j·V_j); the producer issues
in consumption order: K_last, then (K_{j-1}, V_j) pairs, then V_first.

Full barriers are armed by the producer with the tile's byte count (TMA completes the transaction, zero-filled
out-of-bounds rows included). Empty barriers count one arrival per consumer warp (lane 0 of each warp releases).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass.cute as cute
from cutlass import pipeline

WARP_THREADS = 32


class LoadPipelines(NamedTuple):
    q: pipeline.PipelineTmaAsync
    k: pipeline.PipelineTmaAsync
    v: pipeline.PipelineTmaAsync


def make_load_pipelines(
    mbar_q: cute.Pointer,
    mbar_k: cute.Pointer,
    mbar_v: cute.Pointer,
    *,
    num_stages: int,
    num_consumer_threads: int,
    q_bytes: int,
    k_bytes: int,
    v_bytes: int,
) -> LoadPipelines:
    """Creates the rings without a CTA-wide sync; call `pipeline_init_arrive/wait` (or sync_threads) before use."""
    producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
    consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, num_consumer_threads // WARP_THREADS)

    def ring(ptr, stages, tx):
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=ptr,
            num_stages=stages,
            producer_group=producer,
            consumer_group=consumers,
            tx_count=tx,
            defer_sync=True,
        )

    return LoadPipelines(ring(mbar_q, 1, q_bytes), ring(mbar_k, num_stages, k_bytes), ring(mbar_v, num_stages, v_bytes))


def producer_state(num_stages: int) -> pipeline.PipelineState:
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, num_stages)


def consumer_state(num_stages: int) -> pipeline.PipelineState:
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, num_stages)


def consumer_wait(pipe: pipeline.PipelineTmaAsync, state: pipeline.PipelineState) -> None:
    """Waits until the stage `state` names is full: first one `mbarrier.try_wait` without a time hint, which the
    hardware may hold for a while by itself, and only if that returns unready the library's retry loop (its 10 ms
    hint becomes a NANOSLEEP.SYNCS, whose wake-up comes later than a plain re-test)."""
    pipe.consumer_wait(state, pipe.consumer_try_wait(state))

"""TMA load pipelines of the sm90 forward kernel (mbarrier rings between the producer warp and the consumers).

Three `PipelineTmaAsync` rings: Q (one stage, loaded once per CTA), K and V (`num_stages` each). K and V have separate
rings because the consumers need K_j one step before V_j (Q·K_{j+1}ᵀ is issued before P_j·V_j); the producer issues
in consumption order: K_last, then (K_{j-1}, V_j) pairs, then V_first.

Full barriers are armed by the producer with the tile's byte count (TMA completes the transaction, zero-filled
out-of-bounds rows included). Empty barriers count one arrival per consumer warp (lane 0 of each warp releases).
In a cluster of `cluster_m` CTAs sharing K / V by multicast, a CTA's K / V full barriers still expect the whole tile
(each CTA's half lands in both), and its empty barriers count one arrival per consumer warp of every CTA of the cluster
(lane r of each warp releases to CTA r): a stage is refilled only once every CTA that receives it is done with it.
Their consumers release K / V through `ClusterRing`, which skips the releases of a CTA's last `num_stages` tiles:
nothing waits for those, and without them no CTA signals another's barriers after that one may have exited, so the
cluster needs no barrier before its CTAs exit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import cutlass.cute as cute
from cutlass import Int32, pipeline
from cutlass.cutlass_dsl import if_generate

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
    cluster_m: int = 1,
) -> LoadPipelines:
    """Creates the rings without a CTA-wide sync; call `pipeline_init_arrive/wait` (or sync_threads) before use.
    cluster_m > 1: K and V are multicast within the cluster (Q stays the CTA's own)."""
    producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
    consumer_warps = num_consumer_threads // WARP_THREADS

    def ring(ptr, stages, tx, cluster_m=1):
        extra = {} if cluster_m == 1 else {"cta_layout_vmnk": cute.make_layout((1, cluster_m, 1, 1))}
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=ptr,
            num_stages=stages,
            producer_group=producer,
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps * cluster_m),
            tx_count=tx,
            defer_sync=True,
            **extra,
        )

    return LoadPipelines(
        ring(mbar_q, 1, q_bytes),
        ring(mbar_k, num_stages, k_bytes, cluster_m),
        ring(mbar_v, num_stages, v_bytes, cluster_m),
    )


@dataclass(frozen=True)
class ClusterRing:
    """A consumer's view of a ring whose tiles the CTAs of a cluster share (above; the backward's Q / dO rings alike,
    flash_bwd.Sm90FlashBackward.shared_ring): the releases of the tiles counted `releases` and on (the last num_stages
    of the CTA's walk: no producer waits for them) are skipped.

    Why that suffices: CTA X's producer waits for CTA Y's release of tile t before it loads tile t + num_stages, and
    X's consumers wait for that tile; so when X's consumers are done, every release Y sends X (tiles up to the walk's
    length - num_stages - 1) has arrived, and Y sends none later. Likewise every multicast write into X's shared
    memory is of a tile X consumes."""

    ring: pipeline.PipelineTmaAsync
    releases: Int32  # (a frozen dataclass: the DSL's loops carry its fields)

    def consumer_try_wait(self, state: pipeline.PipelineState):
        return self.ring.consumer_try_wait(state)

    def consumer_wait(self, state: pipeline.PipelineState, token=None) -> None:
        self.ring.consumer_wait(state, token)

    def consumer_release(self, state: pipeline.PipelineState) -> None:
        if_generate(state.count < self.releases, lambda: self.ring.consumer_release(state))


def cluster_rings(pipes: LoadPipelines, num_tiles, num_stages: int) -> LoadPipelines:
    """The consumers' rings of a CTA in a cluster that walks `num_tiles` K / V tiles (ClusterRing)."""
    releases = num_tiles - num_stages
    return pipes._replace(k=ClusterRing(pipes.k, releases), v=ClusterRing(pipes.v, releases))


def producer_state(num_stages: int) -> pipeline.PipelineState:
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, num_stages)


def consumer_state(num_stages: int) -> pipeline.PipelineState:
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, num_stages)


def consumer_wait(pipe: pipeline.PipelineTmaAsync, state: pipeline.PipelineState) -> None:
    """Waits until the stage `state` names is full: first one `mbarrier.try_wait` without a time hint, which the
    hardware may hold for a while by itself, and only if that returns unready the library's retry loop (its 10 ms
    hint becomes a NANOSLEEP.SYNCS, whose wake-up comes later than a plain re-test)."""
    pipe.consumer_wait(state, pipe.consumer_try_wait(state))

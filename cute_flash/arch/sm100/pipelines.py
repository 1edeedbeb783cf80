"""The mbarrier pipelines of the sm100 kernels, created with deferred initialisation (pipeline_init_arrive / _wait
follow in the kernel): one constructor per kind of hand-off, so that both kernels build them alike."""

from __future__ import annotations

import cutlass.pipeline as pipeline


def threads(n: int) -> pipeline.CooperativeGroup:
    return pipeline.CooperativeGroup(pipeline.Agent.Thread, n)


def tma_umma(num_stages: int, tx_count: int, barriers, cta_layout_vmnk) -> pipeline.PipelineTmaUmma:
    """TMA loads -> the MMA warp (one elected producer, released by tcgen05.commit)."""
    return pipeline.PipelineTmaUmma.create(
        num_stages=num_stages,
        producer_group=threads(1),
        consumer_group=threads(1),
        tx_count=tx_count,
        barrier_storage=barriers.data_ptr(),
        cta_layout_vmnk=cta_layout_vmnk,
        defer_sync=True,
    )


def umma_async(num_stages: int, consumers: int, barriers, cta_layout_vmnk) -> pipeline.PipelineUmmaAsync:
    """The MMA warp (tcgen05.commit) -> `consumers` threads, each arriving on release."""
    return pipeline.PipelineUmmaAsync.create(
        num_stages=num_stages,
        producer_group=threads(1),
        consumer_group=threads(consumers),
        barrier_storage=barriers.data_ptr(),
        cta_layout_vmnk=cta_layout_vmnk,
        defer_sync=True,
    )


def async_umma(num_stages: int, producers: int, barriers, cta_layout_vmnk) -> pipeline.PipelineAsyncUmma:
    """`producers` threads, each arriving on commit -> the MMA warp (released by tcgen05.commit)."""
    return pipeline.PipelineAsyncUmma.create(
        num_stages=num_stages,
        producer_group=threads(producers),
        consumer_group=threads(1),
        barrier_storage=barriers.data_ptr(),
        cta_layout_vmnk=cta_layout_vmnk,
        defer_sync=True,
    )


def thread_async(num_stages: int, producers: int, consumers: int, barriers) -> pipeline.PipelineAsync:
    """Threads -> threads."""
    return pipeline.PipelineAsync.create(
        num_stages=num_stages,
        producer_group=threads(producers),
        consumer_group=threads(consumers),
        barrier_storage=barriers.data_ptr(),
        defer_sync=True,
    )

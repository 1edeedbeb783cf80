"""The producer warp of the sm90 forward kernels: TMA loads of Q once, then K and V tiles right to left.

Shared by the bf16/fp16 kernel (`flash_fwd`) and the FP8 kernel (`fp8/flash_fwd`); they differ only in the V tile the
caller hands in (V (keys, dv) for 16-bit, Vᵀ (dv, keys) for e4m3) and in the byte counts of their pipelines.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from .pipelines import producer_state


@cute.jit
def load_q_k_v(
    pipes,
    atom_q: cute.CopyAtom,
    atom_k: cute.CopyAtom,
    atom_v: cute.CopyAtom,
    gQ: cute.Tensor,  # (rows, d, q slices) of this (batch, head)
    gK: cute.Tensor,  # (tile_n, d, key tiles) of this (batch, kv head)
    gV: cute.Tensor,  # the V tiles, tile index last
    sQ: cute.Tensor,
    sK: cute.Tensor,
    sV: cute.Tensor,
    first_q_slice: Int32,
    num_consumers: cutlass.Constexpr[int],
    num_stages: cutlass.Constexpr[int],
    n_min: Int32,
    n_max: Int32,
):
    """Q slices first_q_slice.. (one per consumer) once; then K_last; then K_{j-1} with V_j, so each consumer step
    finds both; V_first last (the consumers' order)."""
    no_cluster = cute.make_layout(1)
    tQsQ, tQgQ = cpasync.tma_partition(atom_q, 0, no_cluster, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
    tKsK, tKgK = cpasync.tma_partition(atom_k, 0, no_cluster, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
    tVsV, tVgV = cpasync.tma_partition(atom_v, 0, no_cluster, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))

    if n_max > n_min:
        q_state = producer_state(1)
        pipes.q.producer_acquire(q_state)
        for c in cutlass.range_constexpr(num_consumers):
            cute.copy(
                atom_q, tQgQ[None, first_q_slice + c], tQsQ[None, c], tma_bar_ptr=pipes.q.producer_get_barrier(q_state)
            )

        kv = producer_state(num_stages)
        n_last = n_max - 1
        pipes.k.producer_acquire(kv)
        cute.copy(atom_k, tKgK[None, n_last], tKsK[None, kv.index], tma_bar_ptr=pipes.k.producer_get_barrier(kv))
        for i in cutlass.range(n_max - 1 - n_min, unroll=1):
            n_v = n_last - i
            kv_v = kv.clone()
            kv.advance()
            pipes.k.producer_acquire(kv)
            cute.copy(atom_k, tKgK[None, n_v - 1], tKsK[None, kv.index], tma_bar_ptr=pipes.k.producer_get_barrier(kv))
            pipes.v.producer_acquire(kv_v)
            cute.copy(atom_v, tVgV[None, n_v], tVsV[None, kv_v.index], tma_bar_ptr=pipes.v.producer_get_barrier(kv_v))
        pipes.v.producer_acquire(kv)
        cute.copy(atom_v, tVgV[None, n_min], tVsV[None, kv.index], tma_bar_ptr=pipes.v.producer_get_barrier(kv))

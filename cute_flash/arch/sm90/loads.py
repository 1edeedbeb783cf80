"""The producer warp of the sm90 forward kernels: TMA loads of Q once, then K and V tiles right to left.

Shared by the bf16/fp16 kernel (`flash_fwd`) and the FP8 kernel (`fp8/flash_fwd`); they differ only in the V tile the
caller hands in (V (keys, dv) for 16-bit, Vᵀ (dv, keys) for e4m3) and in the byte counts of their pipelines.

In a cluster of `cluster_m` CTAs (FwdTileConfig.cluster_m) CTA r loads the r-th part of every K and V tile into the
same stage of every CTA of the cluster (TMA multicast); Q stays each CTA's own: its consumers' slices are
first_q_slice, first_q_slice + cluster_m, ... (cta.CtaWork.q_slice).
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
    cluster_m: cutlass.Constexpr[int] = 1,
    has_rows=None,
    key_tile=None,
):
    """Q slices first_q_slice.. (one per consumer) once; then K_last; then K_{j-1} with V_j, so each consumer step
    finds both; V_first last (the consumers' order). cluster_m > 1: K and V multicast (above), and Q only where
    `has_rows` (a CTA past its sequence's end still loads its part of K and V for the others). key_tile: the key
    tile at each position j in [n_min, n_max) (block-sparse builds, CtaWork.key_tile), else j itself."""
    if cutlass.const_expr(key_tile is None):
        key_tile = _same_tile
    no_cluster = cute.make_layout(1)
    tQsQ, tQgQ = cpasync.tma_partition(atom_q, 0, no_cluster, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
    rank, cluster, mcast_mask = 0, no_cluster, None
    if cutlass.const_expr(cluster_m > 1):
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster, mcast_mask = cute.make_layout(cluster_m), cutlass.Int16((1 << cluster_m) - 1)  # every CTA
    tKsK, tKgK = cpasync.tma_partition(atom_k, rank, cluster, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
    tVsV, tVgV = cpasync.tma_partition(atom_v, rank, cluster, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
    k_tiles = (pipes.k, atom_k, tKgK, tKsK, mcast_mask)
    v_tiles = (pipes.v, atom_v, tVgV, tVsV, mcast_mask)

    if n_max > n_min:
        if cutlass.const_expr(has_rows is None):
            load_q(pipes, atom_q, tQgQ, tQsQ, first_q_slice, num_consumers, cluster_m)
        else:
            if has_rows:
                load_q(pipes, atom_q, tQgQ, tQsQ, first_q_slice, num_consumers, cluster_m)

        kv = producer_state(num_stages)
        n_last = n_max - 1
        pipes.k.producer_acquire(kv)
        load_tile(k_tiles, key_tile(n_last), kv)
        for i in cutlass.range(n_max - 1 - n_min, unroll=1):
            n_v = n_last - i
            kv_v = kv.clone()
            kv.advance()
            pipes.k.producer_acquire(kv)
            load_tile(k_tiles, key_tile(n_v - 1), kv)
            pipes.v.producer_acquire(kv_v)
            load_tile(v_tiles, key_tile(n_v), kv_v)
        pipes.v.producer_acquire(kv)
        load_tile(v_tiles, key_tile(n_min), kv)


def _same_tile(j):
    return j


def load_tile(tiles, n: Int32, state) -> None:
    """Tile n of (ring, atom, gmem tiles, smem stages, multicast mask or None) into the stage `state` names."""
    ring, atom, src, dst, mcast_mask = tiles
    # (the barrier's address is taken after the tiles', in the order the single-CTA builds had before clusters, so
    # their PTX stays identical)
    if cutlass.const_expr(mcast_mask is None):
        cute.copy(atom, src[None, n], dst[None, state.index], tma_bar_ptr=ring.producer_get_barrier(state))
    else:
        bar = ring.producer_get_barrier(state)
        cute.copy(atom, src[None, n], dst[None, state.index], tma_bar_ptr=bar, mcast_mask=mcast_mask)


def load_q(pipes, atom_q, tQgQ: cute.Tensor, tQsQ: cute.Tensor, first_q_slice: Int32, num_consumers: int, step: int):
    """The Q slices of every consumer (consumer c's: first_q_slice + step * c), on the Q ring's one stage."""
    q_state = producer_state(1)
    pipes.q.producer_acquire(q_state)
    for c in range(num_consumers):  # (traced inline: a Python loop)
        cute.copy(
            atom_q,
            tQgQ[None, first_q_slice + step * c],
            tQsQ[None, c],
            tma_bar_ptr=pipes.q.producer_get_barrier(q_state),
        )

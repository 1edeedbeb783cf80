"""What one CTA of the sm90 forward kernels works on: its query tile, heads, and range of key tiles.

Grid: (query tiles, heads, batch) (split_kv: (query tiles, heads, splits x batch), below). With a causal mask the
tiles go in reverse, so that the CTAs with the most key tiles (the last rows) start first and the short ones fill in
behind them.

Packed (varlen) batches: grid (tiles, heads, 1) over every sequence's query tiles in order, sized by
`packed_tiles_bound` (at most batch + 1 tiles per head without work, `CtaWork.active`; in clusters of two, at most
2 (batch + 1) CTAs); a CTA finds its sequence and
tile (`packed_tile`; causal: in reverse, the last tile of the last sequence first) and reads the sequence's row
offsets and lengths from cu_seqlens (common/packed.py).

Clusters of cluster_m CTAs along the query tiles (FwdTileConfig.cluster_m; no mask): the grid's first dimension is a
multiple of cluster_m, and the CTAs of cluster c share the cluster_m query tiles from c * cluster_m of one (sequence,
head) (packed: the sequences' clusters of tiles are numbered in order as their tiles are otherwise). Their 64-row
slices are dealt out in turn (`CtaWork.q_slice`): CTA r's consumers take slices r, r + cluster_m, ... of the
cluster's. So a cluster whose rows end early still gives each CTA some rows where it can (a sequence's last 128 rows:
one consumer in each CTA) instead of leaving a whole CTA idle. A consumer without rows, and a CTA without rows in a
cluster that has some (`cluster_active`), still take part in the K / V multicast.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ...common.block_info import BlockInfo, split_kv_range
from ...common.packed import seq_rows
from ...common.packed_tiles import packed_tile
from .tile_config import ROWS_PER_CONSUMER


class CtaWork(NamedTuple):
    m_block: Int32
    head: Int32
    head_kv: Int32  # query heads share a KV head in groups (GQA/MQA)
    batch: Int32
    seqlen_q: Int32
    info: BlockInfo
    n_min: Int32  # key tiles [n_min, n_max) are visible to some row of the query tile
    n_max: Int32
    offset_q: object = None  # packed tensors: the sequence's first query / key row (None: dense, indexed by batch)
    offset_k: object = None
    out_batch: object = None  # split_kv: the batch index of this CTA's partial O and LSE (split * batch + b)
    key_tiles: object = None  # block-sparse builds: the key tiles to visit, ascending ((n,) int32; [n_min, n_max))

    def key_tile(self, j):
        """The key tile at position j of the walk: j itself, or the j-th of a block-sparse build's list."""
        return j if cutlass.const_expr(self.key_tiles is None) else self.key_tiles[j]

    def active(self, tile_m: int):
        """Whether the query tile holds a row of its sequence (always, dense without clusters: the grid is the
        sequence's tiles)."""
        return self.m_block * tile_m < self.seqlen_q

    def q_slice(self, consumer, num_consumers: int, cluster_m: int):
        """The 64-row query slice (of the sequence) that consumer `consumer` of this CTA owns: the CTA's tile's
        own, or in a cluster dealt out in turn (above), with m_block = cluster * cluster_m + the CTA's rank (bidx %
        cluster_m: the launch's cluster dims (cluster_m, 1, 1) make it the CTA's rank in its cluster, which
        loads.py reads from the hardware for the multicast)."""
        if cluster_m == 1:
            return self.m_block * num_consumers + consumer
        rank = self.m_block % cluster_m
        return (self.m_block - rank) * num_consumers + rank + cluster_m * consumer

    def slice_active(self, consumer, num_consumers: int, cluster_m: int):
        """Whether that slice holds a row of the sequence."""
        return self.q_slice(consumer, num_consumers, cluster_m) * ROWS_PER_CONSUMER < self.seqlen_q

    def cluster_active(self, tile_m: int, cluster_m: int):
        """Whether the first query tile of this CTA's cluster holds a row of the sequence (then every CTA of the
        cluster takes part in the loads)."""
        return self.m_block // cluster_m * cluster_m * tile_m < self.seqlen_q


@cute.jit
def cta_work(
    mQ: cute.Tensor,  # (s, d, h, b) coordinate view
    mK: cute.Tensor,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    mask_kind: cutlass.Constexpr[str],
    window_left: Int32,
    window_right: Int32,
    packed=None,
    split_kv: cutlass.Constexpr[bool] = False,
    cluster_m: cutlass.Constexpr[int] = 1,
) -> CtaWork:
    """packed: (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK or None) for packed tensors ((total, d, h) views), else None;
    split_kv: the grid's third dimension holds (split, batch) pairs (dense tensors only); cluster_m: above."""
    bidx, head, batch = cute.arch.block_idx()
    out_batch = None
    split = Int32(0)
    if cutlass.const_expr(split_kv):
        out_batch = batch
        split = batch // mQ.shape[3]
        batch = batch - split * mQ.shape[3]
    m_block = bidx
    if cutlass.const_expr(mask_kind == "causal"):
        m_block = cute.arch.grid_dim()[0] - 1 - bidx
    head_kv = head // (mQ.shape[2] // mK.shape[2])
    if cutlass.const_expr(packed is None):
        seqlen_q, seqlen_k, offset_q, offset_k = mQ.shape[0], mK.shape[0], None, None
    else:
        num_seqs = packed[0].shape[0] - 1
        if cutlass.const_expr(cluster_m == 1):
            batch, m_block = packed_tile(m_block, tile_m, packed[0])
        else:  # (no mask: m_block is bidx)
            batch, cluster = packed_tile(m_block // cluster_m, tile_m * cluster_m, packed[0])
            m_block = cluster * cluster_m + m_block % cluster_m
        idle = batch >= num_seqs  # past the last tile: no work (seqlen_q 0 below)
        batch = cutlass.min(batch, num_seqs - 1)
        seq = seq_rows(batch, *packed)
        seqlen_q, seqlen_k, offset_q, offset_k = seq.seqlen_q, seq.seqlen_k, seq.offset_q, seq.offset_k
        if idle:
            seqlen_q = Int32(0)
    info = BlockInfo(tile_m, tile_n, mask_kind, seqlen_q, seqlen_k, window_left, window_right)
    n_min, n_max = info.kv_block_range(m_block)
    if cutlass.const_expr(split_kv):
        n_min, n_max = split_kv_range(n_min, n_max, split, cute.arch.grid_dim()[2] // mQ.shape[3])
    return CtaWork(m_block, head, head_kv, batch, seqlen_q, info, n_min, n_max, offset_q, offset_k, out_batch)

"""What one CTA of the sm90 forward kernels works on: its query tile, heads, and range of key tiles.

Grid: (query tiles, heads, batch). With a causal mask the tiles go in reverse, so that the CTAs with the most key
tiles (the last rows) start first and the short ones fill in behind them.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ...common.block_info import BlockInfo


class CtaWork(NamedTuple):
    m_block: Int32
    head: Int32
    head_kv: Int32  # query heads share a KV head in groups (GQA/MQA)
    batch: Int32
    seqlen_q: Int32
    info: BlockInfo
    n_min: Int32  # key tiles [n_min, n_max) are visible to some row of the query tile
    n_max: Int32


@cute.jit
def cta_work(
    mQ: cute.Tensor,  # (s, d, h, b) coordinate view
    mK: cute.Tensor,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    mask_kind: cutlass.Constexpr[str],
    window_left: Int32,
    window_right: Int32,
) -> CtaWork:
    bidx, head, batch = cute.arch.block_idx()
    m_block = bidx
    if cutlass.const_expr(mask_kind == "causal"):
        m_block = cute.arch.grid_dim()[0] - 1 - bidx
    seqlen_q = mQ.shape[0]
    head_kv = head // (mQ.shape[2] // mK.shape[2])
    info = BlockInfo(tile_m, tile_n, mask_kind, seqlen_q, mK.shape[0], window_left, window_right)
    n_min, n_max = info.kv_block_range(m_block)
    return CtaWork(m_block, head, head_kv, batch, seqlen_q, info, n_min, n_max)

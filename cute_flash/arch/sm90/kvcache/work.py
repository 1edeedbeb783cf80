"""What one CTA of the sm90 KV-cache kernels works on (both: flash_fwd.py's wgmma consumers and swapped.py's).

Grid (row tiles, h_kv, splits x b): a CTA owns `tile_m` rows of one (sequence, KV head), the (query token, query
head) pairs of the group's heads (views.py), the key tiles [n_min, n_max) its rows see (BlockInfo with
rows_per_query = group: the mask and the key range follow each row's token, bottom-right aligned with seqlens_k[b])
and, split, its run of them (arch/split_kv.py). With a causal mask the row tiles go in reverse (the rows with the
most keys first). Lengths come from the device (seqlens_k, cu_seqlens_q), so nothing on the host depends on them.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from ....common.block_info import BlockInfo, split_kv_range
from ..cta import CtaWork


@cute.jit
def kvcache_cta_work(
    mQ: cute.Tensor,  # views.gqa_rows_view of q: ((group, tokens), d, h_kv, b or 1)
    mSeqlensK: cute.Tensor,
    mCuSeqlensQ,  # Optional[cute.Tensor]: packed q
    capacity: Int32,
    window_left: Int32,
    window_right: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    mask_kind: cutlass.Constexpr[str],
    packed_q: cutlass.Constexpr[bool],
    split_kv: cutlass.Constexpr[bool],
) -> CtaWork:
    """This CTA's rows and key tiles; its sequence's length clamped into [0, capacity] (and packed q's rows into
    [0, total_q)).

    CtaWork as filled here: head = head_kv = the KV head; seqlen_q = the sequence's packed rows (tokens x group);
    offset_q = its first row in the packed views (cu_seqlens_q[b] x group; 0 for dense q); out_batch = the last
    index of the O / LSE views (b; split: split x b + b, or the split for packed q)."""
    bidx, head_kv, z = cute.arch.block_idx()
    num_seqs = mSeqlensK.shape[0]
    batch, split = z, Int32(0)
    if const_expr(split_kv):
        split = z // num_seqs
        batch = z - split * num_seqs
    m_block = bidx
    if const_expr(mask_kind == "causal"):  # the rows with the most keys first
        m_block = cute.arch.grid_dim()[0] - 1 - bidx
    group = mQ.shape[0][0]
    seqlen_q, offset_q = mQ.shape[0][1], Int32(0)
    out_batch = z if const_expr(split_kv) else batch
    if const_expr(packed_q):
        # cu_seqlens_q is not checked on the host (it would need its values): the sequence's rows are clamped into
        # [0, total_q), so that no value makes the kernel read q or write out / lse outside their rows.
        total_q = seqlen_q
        offset_q = cutlass.min(cutlass.max(mCuSeqlensQ[batch], 0), total_q)
        seqlen_q = cutlass.min(cutlass.max(mCuSeqlensQ[batch + 1], offset_q), total_q) - offset_q
        out_batch = split
    seqlen_k = cutlass.max(cutlass.min(mSeqlensK[batch], capacity), 0)
    info = BlockInfo(
        tile_m, tile_n, mask_kind, seqlen_q, seqlen_k, window_left, window_right, rows_per_query=group,
    )  # fmt: skip
    n_min, n_max = info.kv_block_range(m_block)
    if const_expr(split_kv):
        n_min, n_max = split_kv_range(n_min, n_max, split, cute.arch.grid_dim()[2] // num_seqs)
    rows = seqlen_q * group
    return CtaWork(m_block, head_kv, head_kv, batch, rows, info, n_min, n_max, offset_q * group, None, out_batch)

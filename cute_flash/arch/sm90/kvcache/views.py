"""Global views of the KV-cache forward: the query heads of a KV head packed as rows (GQA in the tile), and the cache.

A CTA's rows are (query token s, query head j) pairs of one KV head g, row r = s * group + j (query head
g * group + j, FlashAttention-4's pack_gqa order). In the views below mode 0 is that pair, (group, tokens) with the
head stride first, so a flat row index r addresses it directly (CuTe splits r into j = r % group, s = r // group);
tokens are a sequence's own (dense q) or the packed batch's (q (total_q, h, d), cu_seqlens_q), where sequence b's
rows start at cu_seqlens_q[b] * group. The last mode indexes sequences (dense), splits (the partials), or is 1.
Learnable sinks are per query head: `gqa_sink_view` maps a row to its head's logit.
"""

from __future__ import annotations

import cutlass.cute as cute


def gqa_rows_view(t: cute.Tensor, group) -> cute.Tensor:
    """(b, s, h, d) -> ((group, s), d, h / group, b); (total, h, d) -> ((group, total), d, h / group, 1)."""
    if cute.rank(t) == 4:
        (b, s, h, d), (sb, ss, sh, sd) = t.shape, t.stride
        shape, stride = ((group, s), d, h // group, b), ((sh, ss), sd, sh * group, sb)
    else:
        (n, h, d), (sn, sh, sd) = t.shape, t.stride
        shape, stride = ((group, n), d, h // group, 1), ((sh, sn), sd, sh * group, 0)
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


def gqa_stats_view(t: cute.Tensor, group, packed: bool) -> cute.Tensor:
    """Per-row statistics: (b, h, s) -> ((group, s), h / group, b); packed (h, total) -> ((group, total), h / group,
    1)."""
    if not packed:
        (b, h, s), (sb, sh, ss) = t.shape, t.stride
        shape, stride = ((group, s), h // group, b), ((sh, ss), sh * group, sb)
    else:
        (h, n), (sh, sn) = t.shape, t.stride
        shape, stride = ((group, n), h // group, 1), ((sh, sn), sh * group, 0)
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


def cache_view(t: cute.Tensor) -> cute.Tensor:
    """A cache (pages, page_size, h_kv, d) -> (page_size, d, h_kv, pages); a dense one (b, seqlen_cache, h_kv, d) ->
    (seqlen_cache, d, h_kv, b), sequence b its own page: TMA boxes never leave a (page, KV head)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))


def gqa_sink_view(t: cute.Tensor, group) -> cute.Tensor:
    """The (h,) sink logits (contiguous) as sink[row, KV head] for the rows above: ((group, 1), h / group) with
    strides ((1, 0), group), so row s * group + j of KV head g reads query head g * group + j's logit for every token
    s (the token mode's stride is 0: its extent does not matter). One view for dense and packed q alike, since the
    consumers index it by the row within the sequence."""
    shape = ((group, 1), t.shape[0] // group)
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=((1, 0), group)))

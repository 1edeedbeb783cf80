"""Decoding under GQA / MQA: one query row per sequence, several query heads per KV head ("pack_gqa").

Run as it comes, a decoding call gives every (batch, query head) a CTA of its own: each walks its KV head's whole
cache with one valid row in a 64- or 128-row query tile, so the cache is read once per query head and the other
rows are wasted tensor-core work (measured 2-5x slower than SDPA's decoding kernel, H100).
Here the query heads that share a KV head become the query rows of one (batch, KV head) problem, as
FlashAttention-4's pack_gqa does: q (b, 1, h, d) is viewed as (b, group, h_kv, d), out and lse likewise, without
copies, and the call runs as plain multi-head attention over the keys that its single query row sees (all of
them, or the slice its window leaves), without a mask: the same math (with a window the key blocks start at its
first key rather than at a multiple of the tile, so the sums may round differently than the unpacked call's).
On a family with `split_keys` (sm80, sm90) it packs at every batch: with few query tiles the packed problem's keys
are split over CTAs (arch/split_kv.py). Every forward launch goes through the call core's one launcher
(`core.launch.forward`: eager calls, the custom op under torch.compile, the ring's blocks), which takes it for every
call that qualifies (`keys_seen`), so they agree bit for bit. Learnable sinks follow the packed rows (`sink_rows`).
A window may leave the query row no key at all (a negative bound): then nothing is launched (out 0, lse -inf, or lse
= the sink). The packed problem runs the forward
kernel without a mask whatever the call's mask: `python -m cute_flash warmup` builds it with its default masks
("none" and "causal"); a warm-up restricted to other masks leaves it to the first decoding call.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .problem import KvCacheProblem, Problem
from .spec import AttentionSpec, normalize_mask


def keys_seen(problem: Problem, sm_count: int, split_keys: bool) -> Optional[Tuple[int, int]]:
    """The key rows [lo, hi) that the single query row of `problem` sees (lo >= hi: none), when the call decodes with
    several query heads per KV head (fp16 / bf16, seqlen_q 1, at least one key) and either has more (batch, query
    head) CTAs than the GPU has SMs (`sm_count`) or runs on a family that splits the keys of few query tiles over
    CTAs (`split_keys`, arch/split_kv.py, which then splits one problem per KV head rather than per query head); None
    otherwise (the call runs as it comes: with few CTAs and no split, packed measured no faster on an H100)."""
    p = problem
    if p.seqlen_q != 1 or p.seqlen_k == 0 or p.batch == 0 or p.nheads_kv == 0 or p.nheads == p.nheads_kv:
        return None
    if p.batch * p.nheads <= sm_count and not split_keys:
        return None
    if p.spec.dtype not in ("fp16", "bf16"):
        return None
    m = p.mask
    # Bottom-right alignment puts the query row at key position seqlen_k - 1: it sees keys seqlen_k - 1 - left ..
    # seqlen_k - 1 + right, clipped to the keys that exist ("none" and "causal": all of them). Either bound may be
    # negative, so the range may be empty (lo >= hi: the row sees no key).
    if m.kind != "local":
        return 0, p.seqlen_k
    return max(0, p.seqlen_k - 1 - m.left), min(p.seqlen_k, p.seqlen_k + m.right)


def pack_gqa(q, k, v, out, lse, nheads_kv: int, keys: Tuple[int, int]):
    """Views of one decoding call's tensors as the packed problem's: q (b, 1, h, d) -> (b, group, h_kv, d), out (b, 1,
    h, dv) -> (b, group, h_kv, dv), lse (b, h, 1) -> (b, h_kv, group) (query head g * group + j is row j of KV head
    g), and k, v cut to the rows [lo, hi) of `keys` (`keys_seen`)."""
    b, _, h, d = q.shape
    dv = out.shape[-1]
    group = h // nheads_kv
    sb, _, sh, sd = q.stride()
    q_rows = q.as_strided((b, group, nheads_kv, d), (sb, sh, group * sh, sd), q.storage_offset())
    ob, _, oh, od = out.stride()
    out_rows = out.as_strided((b, group, nheads_kv, dv), (ob, oh, group * oh, od), out.storage_offset())
    lo, hi = keys
    if (lo, hi) != (0, k.shape[1]):
        k, v = k[:, lo:hi], v[:, lo:hi]
    return q_rows, k, v, out_rows, lse.view(b, nheads_kv, group)


def sink_rows(sink: torch.Tensor, nheads_kv: int) -> torch.Tensor:
    """The packed problem's sink view (arch/base.FwdTensors.sink) of (h,) fp32 contiguous sinks: (group, h_kv) with
    strides (1, group), so that row j of KV head g reads the sink of query head g * group + j."""
    group = sink.shape[0] // nheads_kv
    return sink.as_strided((group, nheads_kv), (1, group))


# The KV-cache spec of each decoding spec (a growing cache's every step asks again: one lookup, not a new spec).
_kvcache_specs: Dict[AttentionSpec, AttentionSpec] = {}
_UNMASKED = normalize_mask(False, (None, None))


def kvcache_problem(problem: Problem, keys: Tuple[int, int]) -> KvCacheProblem:
    """A decoding call as the KV-cache forward's problem (`ArchBackend.forward_kvcache`): q (b, 1, h, d) against the
    dense "cache" of the keys [lo, hi) its query row sees (k[:, lo:hi], all of them valid), without a mask; the
    KV-cache kernels pack the query heads of each KV head into one tile themselves."""
    p, (lo, hi) = problem, keys
    s = p.spec
    spec = _kvcache_specs.get(s)
    if spec is None:
        spec = _kvcache_specs[s] = AttentionSpec(
            s.dtype, s.head_dim, s.head_dim_v, "none", s.out_dtype, softcap=s.softcap, softcap_wide=s.softcap_wide,
            sink=s.sink, kvcache=True,
        )  # fmt: skip
    return KvCacheProblem(
        p.batch, 1, p.batch, p.nheads, p.nheads_kv, p.head_dim, p.head_dim_v, hi - lo, p.batch, spec, _UNMASKED,
        p.softmax_scale, p.softcap,
    )  # fmt: skip

"""The validated forms of a call that every layer shares: what `cute_flash.validation` returns and the backends
(arch/base.py) receive. Plain data: this module imports nothing of cute_flash but the spec, so the kernel contract can
name these types without importing the checks (which reach the FP8 helpers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from .spec import AttentionSpec, MaskBounds


@dataclass(frozen=True)
class Semantics:
    """What a call means, independent of how it is computed: shapes, the mask and the softmax scale."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    head_dim: int
    head_dim_v: int
    mask: MaskBounds
    softmax_scale: float


@dataclass(frozen=True)
class Problem(Semantics):
    """A validated kernel call: its semantics (shapes, the runtime mask, the softmax scale) and the compile spec;
    softcap: the soft-capping value where spec.softcap (0.0: none)."""

    spec: AttentionSpec
    softcap: float = 0.0


class PackedSeqs(NamedTuple):
    """Where the sequences of a packed (varlen) batch lie: int32 `cu_seqlens_*` (batch + 1,) and optional
    `seqused_k` (batch,) on the device, host ints bounding every sequence's length. The five arguments of
    `attention_varlen` travel as this one value from its signature to the kernels (`validate_varlen` checks it)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    seqused_k: Optional[torch.Tensor]
    max_seqlen_q: int
    max_seqlen_k: int

    def with_used_queries(self, seqused_q: Optional[torch.Tensor]) -> "PackedSeqs":
        """The same attention with only the first seqused_q[b] query rows of each sequence b computed, as packed
        sequences the kernels take: sequence b splits into its used rows (against its keys, bottom-right aligned on
        the used count, as FlashAttention's seqused_q) and its other rows, a sequence that sees no key (out 0, lse
        -inf or the sink's logit, zero gradients). On the device, no host copy; values past a sequence's length
        count as its length."""
        if seqused_q is None:
            return self
        cu_q, cu_k = self.cu_seqlens_q, self.cu_seqlens_k
        used_q = torch.minimum(seqused_q.clamp(min=0), cu_q[1:] - cu_q[:-1])
        used_k = cu_k[1:] - cu_k[:-1] if self.seqused_k is None else self.seqused_k
        q_ends = torch.stack([cu_q[:-1] + used_q, cu_q[1:]], 1).flatten()
        k_ends = torch.stack([cu_k[1:], cu_k[1:]], 1).flatten()
        used = torch.stack([used_k, torch.zeros_like(used_k)], 1).flatten()
        return PackedSeqs(
            torch.cat([cu_q[:1], q_ends]).to(torch.int32),
            torch.cat([cu_k[:1], k_ends]).to(torch.int32),
            used.to(torch.int32),
            self.max_seqlen_q,
            self.max_seqlen_k,
        )


@dataclass(frozen=True)
class VarlenProblem:
    """A validated packed (variable-length) call: shapes, the compile spec (varlen=True) and the runtime mask."""

    batch: int
    total_q: int
    total_k: int
    nheads: int
    nheads_kv: int
    head_dim: int
    head_dim_v: int
    max_seqlen_q: int
    max_seqlen_k: int
    spec: AttentionSpec
    mask: MaskBounds
    softmax_scale: float
    softcap: float = 0.0  # where spec.softcap (0.0: none)


# The most CTAs that may share one query tile's keys in the KV-cache forward (batch 1 under MQA: 128 CTAs of a few
# key tiles each keep 128 SMs' bytes in flight); attention_with_kvcache's num_splits is checked against it.
KVCACHE_MAX_SPLITS = 128
# Split calls need every split's partial LSE (m * scale + log l, fp32) to be finite: where softmax_scale x score
# overflows fp32 (a hard max; the unsplit kernels keep its exact answer, common/online_softmax.py) the partials are
# +-inf and the combine could not weigh them. Calls with a scale above this run unsplit (num_splits=0) or are refused
# (num_splits > 1); no model comes near it (1 / sqrt(d) <= 1).
MAX_SPLIT_SCALE = 2.0**64


@dataclass(frozen=True)
class KvCacheProblem:
    """A validated `attention_with_kvcache` call: the shapes, the compile spec (spec.kvcache) and the runtime mask.

    seqlen_q: query tokens per sequence (dense q), or the longest sequence's (packed q, `cu_seqlens_q`); total_q:
    the packed rows (batch * seqlen_q for dense q). max_seqlen_k bounds every sequence's keys (the cache's capacity:
    max_pages * page_size, or seqlen_cache), so splits and grids are chosen on the host without reading lengths.
    The mask is bottom-right aligned per sequence: query row s of sequence b sees key j iff
    s + off_b - left <= j <= s + off_b + right, off_b = seqlen_k[b] - seqlen_q[b]."""

    batch: int
    seqlen_q: int
    total_q: int
    nheads: int
    nheads_kv: int
    head_dim: int
    head_dim_v: int
    max_seqlen_k: int
    num_pages: int  # pages of the cache (batch for a dense cache)
    spec: AttentionSpec
    mask: MaskBounds
    softmax_scale: float
    softcap: float = 0.0
    packed_q: bool = False  # q is (total_q, h, d) with cu_seqlens_q

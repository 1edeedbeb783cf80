"""DRAM bytes one attention call should move, to hold Nsight Compute's measured DRAM bytes against.

Two predictions per call:
  compulsory  every input read once and every output written once: the floor no implementation beats.
  tiled       FlashAttention's IO analysis with no help from L2: the forward reads Q and writes O (and the LSE)
              once, but reads the K/V rows each query tile can see once per query tile (tile_m rows), which is
              Θ(N² d² / M) for on-chip memory M ~ tile_m · d. The backward (FA2 order, key tiles outermost) reads
              K/V once and writes dK/dV once, but reads the visible Q, dO, LSE and D rows once per key tile
              (tile_n keys) and accumulates dQ in fp32 (a read and a write per visit), then converts dQ once.
Measured bytes between the two mean L2 is absorbing part of the re-reads; above `tiled` means extra traffic
(spills, redundant loads, poor locality).
"""

from __future__ import annotations

from typing import Dict

ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp8": 2}  # the fp8 path takes bf16 inputs and returns bf16 (see validation)
LSE_BYTES = 4
ACCUM_BYTES = 4


def _visible_key_range(m0: int, m1: int, seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """Keys any of query rows [m0, m1) can see (bottom-right aligned causal)."""
    if not causal:
        return seqlen_k
    hi = min(seqlen_k, (m1 - 1) + (seqlen_k - seqlen_q) + 1)
    return max(0, hi)


def _visible_query_range(n0: int, n1: int, seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """Query rows that can see any of keys [n0, n1)."""
    if not causal:
        return seqlen_q
    first = max(0, n0 - (seqlen_k - seqlen_q))  # row i sees key j iff j <= i + off
    return max(0, seqlen_q - first)


def predicted_bytes(case, tile_m: int = 128, tile_n: int = 128) -> Dict[str, float]:
    """{"compulsory": bytes, "tiled": bytes} for a `cute_flash.bench.grid.Case`."""
    s = case.shape
    e = ELEMENT_BYTES[case.dtype]
    q = s.batch * s.seqlen_q * s.heads * s.head_dim * e
    o = s.batch * s.seqlen_q * s.heads * s.head_dim_v * e
    k = s.batch * s.seqlen_k * s.heads_kv * s.head_dim * e
    v = s.batch * s.seqlen_k * s.heads_kv * s.head_dim_v * e
    lse = s.batch * s.heads * s.seqlen_q * LSE_BYTES
    if case.direction == "fwd":
        compulsory = q + k + v + o + lse
        kv_row = (s.head_dim + s.head_dim_v) * e
        reread = sum(
            _visible_key_range(m0, min(m0 + tile_m, s.seqlen_q), s.seqlen_q, s.seqlen_k, case.causal)
            for m0 in range(0, s.seqlen_q, tile_m)
        )
        tiled = q + o + lse + s.batch * s.heads * reread * kv_row
        return {"compulsory": float(compulsory), "tiled": float(tiled)}
    # Backward: reads q, k, v, o, dO, lse; writes dq, dk, dv (D = rowsum(dO * O) is computed from o and dO).
    dout = o
    compulsory = 2 * (q + k + v) + o + dout + lse
    q_row = (s.head_dim + s.head_dim_v) * e + 2 * LSE_BYTES + 2 * s.head_dim * ACCUM_BYTES
    revisits = sum(
        _visible_query_range(n0, min(n0 + tile_n, s.seqlen_k), s.seqlen_q, s.seqlen_k, case.causal)
        for n0 in range(0, s.seqlen_k, tile_n)
    )
    dq_convert = s.batch * s.seqlen_q * s.heads * s.head_dim * ACCUM_BYTES + q  # fp32 accumulator -> dQ
    preprocess = o + dout + lse  # D = rowsum(dO * O)
    tiled = 2 * (k + v) + preprocess + s.batch * s.heads * revisits * q_row + dq_convert
    return {"compulsory": float(compulsory), "tiled": float(tiled)}

"""Reference attention in plain torch, on any device.

`attention_reference` materialises the score matrix in a chosen precision (float64 by default), one block of query
rows at a time (REFERENCE_BLOCK_ELEMS scores per block); it is the ground truth every kernel is tested against.
Both functions validate their arguments exactly as `cute_flash.attention` does (`validation.validate_reference`: the
same shapes, heads, head dims, masks and scales are accepted, with the same errors), except for what only a kernel
needs: they run on any device, on any strides, and take float32 / float64 inputs besides fp16 / bf16.
`attention_tiled` is the FlashAttention algorithm itself in readable form: it visits one (block_m x block_n) score
tile at a time, keeps a running row max and row sum, skips tiles the mask hides entirely, and never holds more than
one tile of scores.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from .common.block_info import BlockInfo
from .spec import MaskBounds
from .validation import PackedSeqs, validate_reference, varlen_offsets

Window = Tuple[Optional[int], Optional[int]]

# Scores per block of query rows in `attention_reference`: 256 MiB in float64, so that a 16k x 16k reference holds
# about a GiB of temporaries instead of tens (the GPU suites run ten tests at once on one GPU). Rows are independent,
# so the blocks change no result.
REFERENCE_BLOCK_ELEMS = 1 << 25


def visible_keys(
    seqlen_q: int, seqlen_k: int, mask: MaskBounds, device=None, row_start: int = 0, row_end: Optional[int] = None
) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k): True where query i may attend to key j (bottom-right aligned); only the query
    rows [row_start, row_end) when given."""
    i = torch.arange(row_start, seqlen_q if row_end is None else row_end, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    diag = i + (seqlen_k - seqlen_q)
    return (j >= diag - mask.left) & (j <= diag + mask.right)


def _expand_kv(x: torch.Tensor, nheads: int) -> torch.Tensor:
    """(b, s, h_kv, d) -> (b, s, h, d): each kv head serves h // h_kv consecutive query heads."""
    return x.repeat_interleave(nheads // x.shape[2], dim=2)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Window = (None, None),
    compute_dtype: torch.dtype = torch.float64,
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention with the semantics of `cute_flash.attention`, computed in `compute_dtype`.

    Returns out (b, sq, h, dv) in `compute_dtype` and, if asked, lse (b, h, sq) in float32. Rows that see no key give
    out = 0 and lse = -inf. With compute_dtype equal to the inputs' dtype this is "plain torch in the input dtype",
    the baseline of FlashAttention's acceptance rule.

    Every finite softmax_scale >= 0 is exact: the row max is subtracted from the raw scores before they are scaled,
    so neither scale * score overflowing (a hard max) nor scale = 0 (uniform attention over the visible keys) gives
    inf - inf or -inf * 0, and the mask is applied after scaling.
    """
    sem = validate_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size)
    b, sq, h, d = q.shape
    sk = k.shape[1]
    kc = _expand_kv(k.to(compute_dtype), h)
    vc = _expand_kv(v.to(compute_dtype), h)
    rows = max(1, REFERENCE_BLOCK_ELEMS // max(1, b * h * sk))
    blocks = [
        _reference_rows(
            q[:, m0 : m0 + rows].to(compute_dtype),
            kc,
            vc,
            sem.softmax_scale,
            ~visible_keys(sq, sk, sem.mask, q.device, m0, min(m0 + rows, sq)),
        )
        for m0 in range(0, max(sq, 1), rows)  # one (empty) block when sq == 0
    ]
    out = torch.cat([o for o, _ in blocks], dim=1)
    if not return_lse:
        return out
    return out, torch.cat([lse for _, lse in blocks], dim=2)


def _reference_rows(
    qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float, hidden: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """out (b, rows, h, dv) and lse (b, h, rows) of some query rows `qc`; `hidden` (rows, sk) marks the keys they must
    not see."""
    raw = torch.einsum("bqhd,bkhd->bhqk", qc, kc)
    # The max over visible keys; a row that sees none gets 0 (its exp() is 0 below, not NaN). Detached: softmax does
    # not depend on the shift, and its gradient is then exactly the softmax's.
    row_max = raw.masked_fill(hidden, float("-inf")).amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max).detach()
    scores = ((raw - row_max) * scale).masked_fill(hidden, float("-inf"))  # <= 0 where visible
    p = torch.exp(scores)
    row_sum = p.sum(dim=-1, keepdim=True)
    safe_sum = torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
    out = torch.einsum("bhqk,bkhd->bqhd", p / safe_sum, vc)
    lse = (row_max * scale + torch.log(row_sum)).squeeze(-1).float()  # log(0) = -inf for fully masked rows
    return out, lse


def attention_tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Window = (None, None),
    block_m: int = 64,
    block_n: int = 64,
    compute_dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """FlashAttention's forward pass, one score tile at a time.

    Returns (out, lse, tiles_visited); tiles_visited lets tests check that fully masked tiles are skipped.
    """
    sem = validate_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size)
    b, sq, h, d = q.shape
    sk, dv = k.shape[1], v.shape[3]
    scale, mask = sem.softmax_scale, sem.mask
    kc = _expand_kv(k, h)
    vc = _expand_kv(v, h)
    out = torch.zeros(b, sq, h, dv, dtype=compute_dtype, device=q.device)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
    tiles_visited = 0
    # The kernels' own block arithmetic decides which tiles are visited, so these tests cover it too.
    blocks = BlockInfo(block_m, block_n, mask.kind, sq, sk, window_left=mask.left, window_right=mask.right)
    for m0 in range(0, sq, block_m):
        m1 = min(m0 + block_m, sq)
        n_lo, n_hi = blocks.kv_block_range(m0 // block_m)
        q_tile = q[:, m0:m1].to(compute_dtype)
        row_max = torch.full((b, h, m1 - m0, 1), float("-inf"), dtype=compute_dtype, device=q.device)
        row_sum = torch.zeros((b, h, m1 - m0, 1), dtype=compute_dtype, device=q.device)
        acc = torch.zeros((b, h, m1 - m0, dv), dtype=compute_dtype, device=q.device)
        for n_block in range(n_lo, n_hi):
            tiles_visited += 1
            n0, n1 = n_block * block_n, min((n_block + 1) * block_n, sk)
            s = torch.einsum("bqhd,bkhd->bhqk", q_tile, kc[:, n0:n1].to(compute_dtype)) * scale
            allowed = visible_keys(sq, sk, mask, device=q.device)[m0:m1, n0:n1]
            s = s.masked_fill(~allowed, float("-inf"))
            new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))
            # Rows with no visible key so far keep max = -inf; exp against 0 keeps their p at 0, never NaN.
            safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            correction = torch.exp(row_max - safe_max)
            p = torch.exp(s - safe_max)
            row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
            acc = acc * correction + torch.einsum("bhqk,bkhd->bhqd", p, vc[:, n0:n1].to(compute_dtype))
            row_max = new_max
        safe_sum = torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
        out[:, m0:m1] = (acc / safe_sum).permute(0, 2, 1, 3)
        lse[:, :, m0:m1] = (row_max + torch.log(row_sum)).squeeze(-1).float()
    return out, lse, tiles_visited


def attention_varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Window = (None, None),
    seqused_k: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float64,
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention over packed sequences (issue 16's `attention_varlen` semantics), one `attention_reference` call per
    sequence: q (total_q, h, d), k / v (total_k, h_kv, d / dv); sequence i is q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]
    against the first seqused_k[i] (default: all) keys of k[cu_seqlens_k[i]:cu_seqlens_k[i+1]], with causal / window
    alignment per sequence exactly as `attention` defines it. Returns out (total_q, h, dv) in `compute_dtype` and,
    if asked, lse (h, total_q) float32; a row that sees no key (a sequence with no keys included) gets 0 / -inf."""
    cq, ck = varlen_offsets(q, k, v, PackedSeqs(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k))
    used = None if seqused_k is None else seqused_k.tolist()
    h, dv = q.shape[1], v.shape[2]
    out = torch.zeros(q.shape[0], h, dv, dtype=compute_dtype, device=q.device)
    lse = torch.full((h, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if used is not None:
            if not 0 <= used[i] <= k1 - k0:
                raise ValueError(f"seqused_k[{i}] = {used[i]} is not within [0, {k1 - k0}] (that sequence's keys)")
            k1 = k0 + used[i]
        if q1 == q0 or k1 == k0:  # no rows, or rows that see no key (out 0, lse -inf as initialised)
            continue
        o, l_ = attention_reference(
            q[None, q0:q1],
            k[None, k0:k1],
            v[None, k0:k1],
            causal=causal,
            softmax_scale=softmax_scale,
            window_size=window_size,
            compute_dtype=compute_dtype,
            return_lse=True,
        )
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l_[0]
    return (out, lse) if return_lse else out

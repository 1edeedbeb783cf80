"""Reference attention in plain torch, on any device.

`attention_reference` materialises the score matrix in a chosen precision (float64 by default), one block of query
rows at a time (REFERENCE_BLOCK_ELEMS scores per block); it is the ground truth every kernel is tested against.
Both functions validate their arguments exactly as `cute_flash.attention` does (`validation.validate_reference`: the
same shapes, heads, head dims, masks, scales, softcap and sinks are accepted, with the same errors), except for what
only a kernel needs: they run on any device, on any strides, and take float32 / float64 inputs besides fp16 / bf16.
`attention_tiled` is the FlashAttention algorithm itself in readable form: it visits one (block_m x block_n) score
tile at a time, keeps a running row max and row sum, skips tiles the mask hides entirely, and never holds more than
one tile of scores. `attention_varlen_reference` (packed sequences) and `kvcache_reference` (decoding from a dense
or paged KV cache, new tokens appended) run `attention_reference` once per sequence.

Semantics (FlashAttention-4's `attention_ref`): with softcap > 0 a score becomes softcap * tanh(score * softmax_scale
/ softcap) before the mask; a learnable sink (one natural-log logit per query head) is one more term of every row's
softmax denominator that attends to no value, and the LSE includes it. A row that sees no key gets out 0 and lse
-inf, or lse = its head's sink with sinks. Gradients (dq, dk, dv and, for a sink that requires grad, dsink) come from
autograd through the float64 computation.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

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


def expand_kv(x: torch.Tensor, nheads: int) -> torch.Tensor:
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
    softcap: float = 0.0,
    learnable_sink: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float64,
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention with the semantics of `cute_flash.attention`, computed in `compute_dtype`.

    Returns out (b, sq, h, dv) in `compute_dtype` and, if asked, lse (b, h, sq) in float32. Rows that see no key
    (every row when seqlen_k is 0) give out = 0 and lse = -inf, or lse = the head's sink with `learnable_sink` (h,).
    With compute_dtype equal to the inputs' dtype this is "plain torch in the input dtype", the baseline of
    FlashAttention's acceptance rule. softcap > 0 caps every score at softcap * tanh(score * scale / softcap) before
    the mask. A `learnable_sink` that requires grad receives dsink through autograd.

    Every finite softmax_scale >= 0 is exact: the row max is subtracted from the raw scores before they are scaled,
    so neither scale * score overflowing (a hard max) nor scale = 0 (uniform attention over the visible keys) gives
    inf - inf or -inf * 0, and the mask is applied after scaling. (Capped scores are bounded by softcap, so the
    softcap path needs no such care.)
    """
    sem = validate_reference(
        q,
        k,
        v,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        softcap=softcap,
        learnable_sink=learnable_sink,
    )
    b, sq, h, d = q.shape
    sk = k.shape[1]
    kc = expand_kv(k.to(compute_dtype), h)
    vc = expand_kv(v.to(compute_dtype), h)
    sink = None if learnable_sink is None else learnable_sink.to(compute_dtype)
    rows = max(1, REFERENCE_BLOCK_ELEMS // max(1, b * h * sk))
    blocks = [
        _reference_rows(
            q[:, m0 : m0 + rows].to(compute_dtype),
            kc,
            vc,
            sem.softmax_scale,
            ~visible_keys(sq, sk, sem.mask, q.device, m0, min(m0 + rows, sq)),
            float(softcap),
            sink,
        )
        for m0 in range(0, max(sq, 1), rows)  # one (empty) block when sq == 0
    ]
    out = torch.cat([o for o, _ in blocks], dim=1)
    if not return_lse:
        return out
    return out, torch.cat([lse for _, lse in blocks], dim=2)


def _reference_rows(
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    scale: float,
    hidden: torch.Tensor,
    softcap: float = 0.0,
    sink: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """out (b, rows, h, dv) and lse (b, h, rows) of some query rows `qc`; `hidden` (rows, sk) marks the keys they must
    not see; sink: (h,) logits in the compute dtype, or None."""
    raw = torch.einsum("bqhd,bkhd->bhqk", qc, kc)
    # The softmax's logits are base * mult: the raw scores times the scale, or the capped scores (times 1).
    if softcap:
        base, mult = softcap * torch.tanh(raw * (scale / softcap)), 1.0
    else:
        base, mult = raw, scale
    # The max over visible keys; a row that sees none (or a problem without keys) gets 0: its exp() is 0 below, not
    # NaN. Detached: softmax does not depend on the shift, and its gradient is then exactly the softmax's.
    if base.shape[-1] == 0:
        row_max = base.new_zeros(base.shape[:-1] + (1,))
    else:
        row_max = base.masked_fill(hidden, float("-inf")).amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max).detach()
    scores = ((base - row_max) * mult).masked_fill(hidden, float("-inf"))  # <= 0 where visible
    top = row_max * mult  # the largest logit, subtracted from all of them
    sink_term = None
    if sink is not None:
        # The sink is one more logit: the larger of it and the keys' max is subtracted instead. Written with min /
        # max so that a scaled max of +-inf (a hard max) gives no inf - inf.
        s = sink.view(1, -1, 1, 1)
        lift = torch.clamp(top - s, max=0.0).detach()  # <= 0: how far the sink lies above the keys' max
        top = torch.maximum(top, s).detach()
        scores = scores + lift
        sink_term = torch.exp(s - top)
    p = torch.exp(scores)
    row_sum = p.sum(dim=-1, keepdim=True)
    if sink_term is not None:
        row_sum = row_sum + sink_term
    safe_sum = torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
    out = torch.einsum("bhqk,bkhd->bqhd", p / safe_sum, vc)
    lse = (top + torch.log(row_sum)).squeeze(-1).float()  # log(0) = -inf for rows that see no key (and no sink)
    return out, lse


def attention_tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Window = (None, None),
    softcap: float = 0.0,
    learnable_sink: Optional[torch.Tensor] = None,
    block_m: int = 64,
    block_n: int = 64,
    compute_dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """FlashAttention's forward pass, one score tile at a time; softcap and the sink as the kernels apply them (the
    tanh on each tile's scaled scores before the mask; the sink folded into each row's sum once, after the last tile,
    as `OnlineSoftmax.finalize(sinks_log2)` does).

    Returns (out, lse, tiles_visited); tiles_visited lets tests check that fully masked tiles are skipped.
    """
    sem = validate_reference(
        q,
        k,
        v,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        softcap=softcap,
        learnable_sink=learnable_sink,
    )
    b, sq, h, d = q.shape
    sk, dv = k.shape[1], v.shape[3]
    scale, mask = sem.softmax_scale, sem.mask
    kc = expand_kv(k, h)
    vc = expand_kv(v, h)
    sink = None if learnable_sink is None else learnable_sink.to(compute_dtype).view(1, h, 1, 1)
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
            if softcap:
                s = softcap * torch.tanh(s / softcap)
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
        if sink is not None:
            # One more term exp(sink - M) of the sum, M = max(row max, sink); it adds nothing to acc. A row that saw
            # no key has row max -inf: its keys' weight is 0 and its lse the sink.
            top = torch.maximum(row_max, sink)
            keys_weight = torch.exp(row_max - top)
            row_sum = row_sum * keys_weight + torch.exp(sink - top)
            acc = acc * keys_weight
            row_max = top
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
    softcap: float = 0.0,
    learnable_sink: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float64,
    return_lse: bool = False,
    seqused_q: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention over packed sequences (issue 16's `attention_varlen` semantics), one `attention_reference` call per
    sequence: q (total_q, h, d), k / v (total_k, h_kv, d / dv); sequence i is q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]
    against the first seqused_k[i] (default: all) keys of k[cu_seqlens_k[i]:cu_seqlens_k[i+1]], with causal / window
    alignment per sequence exactly as `attention` defines it. Returns out (total_q, h, dv) in `compute_dtype` and,
    if asked, lse (h, total_q) float32; a row that sees no key (a sequence with no keys included) gets 0 / -inf (lse
    = its head's sink with `learnable_sink`). seqused_q: only the first seqused_q[i] rows of sequence i attend
    (aligned on that count); its other rows see no key."""
    cq, ck = varlen_offsets(q, k, v, PackedSeqs(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k))
    used = None if seqused_k is None else seqused_k.tolist()
    used_q = None if seqused_q is None else seqused_q.tolist()
    h, dv = q.shape[1], v.shape[2]
    out = torch.zeros(q.shape[0], h, dv, dtype=compute_dtype, device=q.device)
    lse = torch.full((h, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if used is not None:
            if not 0 <= used[i] <= k1 - k0:
                raise ValueError(f"seqused_k[{i}] = {used[i]} is not within [0, {k1 - k0}] (that sequence's keys)")
            k1 = k0 + used[i]
        # seqused_q: the first used_q[i] rows attend (aligned on that count); the others see no key.
        n = q1 - q0 if used_q is None else min(max(used_q[i], 0), q1 - q0)
        for r0, r1, kend in ((q0, q0 + n, k1), (q0 + n, q1, k0)):
            if r1 == r0:
                continue
            o, l_ = attention_reference(
                q[None, r0:r1],
                k[None, k0:kend],
                v[None, k0:kend],
                causal=causal,
                softmax_scale=softmax_scale,
                window_size=window_size,
                softcap=softcap,
                learnable_sink=learnable_sink,
                compute_dtype=compute_dtype,
                return_lse=True,
            )
            out[r0:r1] = o[0]
            lse[:, r0:r1] = l_[0]
    return (out, lse) if return_lse else out


# --- The KV-cache forward (serving) -----------------------------------------------------------------------------
class KvCacheResult(NamedTuple):
    """What `kvcache_reference` returns: out like q (with dv) in the compute dtype; lse (b, h, sq) or, for packed q,
    (h, total_q) float32 (None unless asked); the caches after appending the new tokens (copies, in their dtype)."""

    out: torch.Tensor
    lse: Optional[torch.Tensor]
    k_cache: torch.Tensor
    v_cache: torch.Tensor


KV_FP8_DTYPE = torch.float8_e4m3fn


def kvcache_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor,
    page_table: Optional[torch.Tensor] = None,
    k_new: Optional[torch.Tensor] = None,
    v_new: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    window_size: Window = (None, None),
    softcap: float = 0.0,
    learnable_sink: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> KvCacheResult:
    """Attention from a KV cache with new tokens appended (decoding, speculative decoding, chunked prefill), one
    `attention_reference` call per sequence.

    q: (b, sq, h, d), or packed (total_q, h, d) with int32 `cu_seqlens_q` (b + 1,) and `max_seqlen_q`.
    k_cache / v_cache: dense (b, seqlen_cache, h_kv, d / dv), or paged (num_pages, page_size, h_kv, d / dv) with
    `page_table` (b, max_pages) int32: key position j of sequence b lives in row j % page_size of page
    page_table[b, j // page_size]. Pages may be shared between sequences (a common prefix) and in any order.
    cache_seqlens (b,) int32: the keys each sequence holds before this call. k_new / v_new (optional, both or
    neither, the caches' dtype; q's for an fp8 cache, which stores k_new / k_descale rounded to e4m3, saturated):
    the new tokens' keys, (b, s_new, h_kv, d) (every sequence s_new tokens) or, with
    packed q, packed (total_q, h_kv, d) (each query token brings one key: sequence b's are the rows of cu_seqlens_q).
    They are written into copies of the caches at positions cache_seqlens[b] onwards; sequence b then attends to its
    cache_seqlens[b] + new keys, the mask bottom-right aligned per sequence as in `attention` (causal by default).
    float8_e4m3fn caches take `k_descale` / `v_descale` (b, h_kv) float32: sequence b's keys of KV head g are
    k_cache * k_descale[b, g] (q stays fp16 / bf16 / float).

    Raises ValueError for a malformed call: a new token past the cache's capacity, a page index out of range where a
    sequence's keys reach, or a new token written into a slot another sequence reads or writes.
    """
    paged = page_table is not None
    packed = cu_seqlens_q is not None
    batch, rows = _kvcache_layout(
        q, k_cache, v_cache, cache_seqlens, page_table, k_new, v_new, cu_seqlens_q, max_seqlen_q, k_descale, v_descale
    )
    old_lens = cache_seqlens.tolist()
    new_rows = _new_rows(k_new, rows, batch)
    lens = [old_lens[i] + new_rows[i][1] - new_rows[i][0] for i in range(batch)]
    slots = _key_slots(k_cache, page_table, lens, paged)
    _check_writes(slots, old_lens, k_cache.shape[0] * k_cache.shape[1] if paged else None)
    k_out, v_out = k_cache.clone(), v_cache.clone()
    if k_new is not None:
        for i in range(batch):
            n0, n1 = new_rows[i]
            written = slots[i][old_lens[i] :]
            for cache, new, descale in ((k_out, k_new, k_descale), (v_out, v_new, v_descale)):
                part = new[i, n0:n1] if new.dim() == 4 else new[n0:n1]
                if cache.dtype == KV_FP8_DTYPE:
                    # stored = new / descale, rounded to nearest and saturated to e4m3's +-448 (the append kernel's)
                    part = (part.float() / descale[i].view(1, -1, 1)).clamp(-448.0, 448.0)
                _flat(cache, i, paged)[written] = part.to(cache.dtype)

    h = q.shape[-2]
    dv = v_cache.shape[-1]
    out = torch.zeros(*q.shape[:-1], dv, dtype=compute_dtype, device=q.device)
    lse_shape = (h, q.shape[0]) if packed else (batch, h, q.shape[1])
    lse = torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(batch):
        r0, r1 = rows[i]
        qi = q[r0:r1][None] if packed else q[i : i + 1]
        keys, values = (
            _dequantised(_flat(cache, i, paged)[slots[i]], descale, i, compute_dtype)
            for cache, descale in ((k_out, k_descale), (v_out, v_descale))
        )
        o, l_ = attention_reference(
            qi.to(compute_dtype),
            keys[None].to(compute_dtype),
            values[None].to(compute_dtype),
            causal=causal,
            softmax_scale=softmax_scale,
            window_size=window_size,
            softcap=softcap,
            learnable_sink=learnable_sink,
            compute_dtype=compute_dtype,
            return_lse=True,
        )
        if packed:
            out[r0:r1], lse[:, r0:r1] = o[0], l_[0]
        else:
            out[i], lse[i] = o[0], l_[0]
    return KvCacheResult(out, lse if return_lse else None, k_out, v_out)


def _flat(cache: torch.Tensor, i: int, paged: bool) -> torch.Tensor:
    """The rows sequence i may address: every (page, row) of a paged cache as one dimension, or its own dense rows."""
    return cache.flatten(0, 1) if paged else cache[i]


def _dequantised(x: torch.Tensor, descale: Optional[torch.Tensor], i: int, compute_dtype: torch.dtype) -> torch.Tensor:
    """Sequence i's keys or values (s, h_kv, d) times their per-KV-head descale (fp8: in float64 for a float64
    reference, else in float32), else as they are."""
    if descale is None:
        return x
    wide = torch.promote_types(compute_dtype, torch.float32)
    return x.to(wide) * descale[i].to(wide).view(1, -1, 1)


def _new_rows(k_new: Optional[torch.Tensor], rows, batch: int):
    """[n0, n1) of sequence i's new tokens within k_new's token dimension (empty without k_new)."""
    if k_new is None:
        return [(0, 0)] * batch
    if k_new.dim() == 4:
        return [(0, k_new.shape[1])] * batch
    return list(rows)


def _key_slots(k_cache: torch.Tensor, page_table: Optional[torch.Tensor], lens, paged: bool):
    """Per sequence, the index of each of its key positions 0..lens[i]-1 in `_flat(cache, i)`."""
    capacity = page_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    slots = []
    for i, n in enumerate(lens):
        if n > capacity:
            raise ValueError(
                f"sequence {i} needs {n} keys (cache_seqlens + new tokens) but its cache holds {capacity} "
                f"({'max_pages x page_size' if paged else 'seqlen_cache'})"
            )
        pos = torch.arange(n, device=k_cache.device)
        if not paged:
            slots.append(pos)
            continue
        page_size, num_pages = k_cache.shape[1], k_cache.shape[0]
        pages = page_table[i, : -(-n // page_size)].to(device=k_cache.device, dtype=torch.long)
        if pages.numel() and not (0 <= int(pages.min()) and int(pages.max()) < num_pages):
            raise ValueError(f"page_table[{i}] holds a page outside [0, {num_pages}) where its {n} keys reach")
        slots.append(pages[pos // page_size] * page_size + pos % page_size)
    return slots


def _check_writes(slots, old_lens, num_slots: Optional[int]) -> None:
    """New tokens go to slots no other sequence reads or writes (paged caches; a dense cache's rows are its own)."""
    if num_slots is None:
        return
    owner = torch.full((num_slots,), -1, dtype=torch.long, device=slots[0].device if slots else None)
    for i, (s, old) in enumerate(zip(slots, old_lens)):
        written = s[old:]
        if bool((owner[written] != -1).any()) or written.unique().numel() != written.numel():
            raise ValueError(f"sequence {i} writes a new token into a page slot another sequence also writes")
        owner[written] = i
    for i, s in enumerate(slots):
        readers = owner[s]
        if ((readers != -1) & (readers != i)).any():
            raise ValueError(
                f"sequence {i} reads a page slot sequence {int(readers[(readers != -1) & (readers != i)][0])} writes "
                f"a new token into; new tokens must go to pages of their own sequence"
            )


def _kvcache_layout(
    q, k_cache, v_cache, cache_seqlens, page_table, k_new, v_new, cu_seqlens_q, max_seqlen_q, k_descale, v_descale
):
    """Shapes and dtypes of a `kvcache_reference` call (what attention_reference checks per sequence is left to it).
    Returns the batch and each sequence's query rows [r0, r1) (of q's token dimension for packed q)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be (b, seqlen_cache, h_kv, d) "
            f"or (num_pages, page_size, h_kv, d) and agree in their first three dimensions"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache has dtype {k_cache.dtype} but v_cache {v_cache.dtype}")
    if cache_seqlens.dtype != torch.int32 or cache_seqlens.dim() != 1:
        raise ValueError(
            f"cache_seqlens must be an int32 tensor of shape (batch,), got {cache_seqlens.dtype} "
            f"{tuple(cache_seqlens.shape)}"
        )
    batch = cache_seqlens.shape[0]
    if (cache_seqlens < 0).any():
        raise ValueError(f"cache_seqlens must be >= 0, got {cache_seqlens.tolist()}")
    if page_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(
                f"a dense cache has one row per sequence: k_cache batch {k_cache.shape[0]}, cache_seqlens {batch}"
            )
    elif page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.shape[0] != batch:
        raise ValueError(
            f"page_table must be an int32 tensor of shape (batch, max_pages) = ({batch}, ...), got "
            f"{page_table.dtype} {tuple(page_table.shape)}"
        )
    if cu_seqlens_q is None:
        if q.dim() != 4 or q.shape[0] != batch:
            raise ValueError(
                f"q must be (batch, seqlen_q, nheads, head_dim) with batch {batch} (or packed with "
                f"cu_seqlens_q), got {tuple(q.shape)}"
            )
        rows = [(0, q.shape[1])] * batch
    else:
        if q.dim() != 3:
            raise ValueError(f"with cu_seqlens_q, q must be packed (total_q, nheads, head_dim), got {tuple(q.shape)}")
        if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.shape != (batch + 1,):
            raise ValueError(f"cu_seqlens_q must be an int32 tensor of shape (batch + 1,) = ({batch + 1},)")
        if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
            raise ValueError(f"max_seqlen_q must be a host int >= 0 with cu_seqlens_q, got {max_seqlen_q!r}")
        cu = cu_seqlens_q.tolist()
        if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] != q.shape[0]:
            raise ValueError(f"cu_seqlens_q must start at 0, never decrease and end at {q.shape[0]}, got {cu}")
        if any(b - a > max_seqlen_q for a, b in zip(cu, cu[1:])):
            raise ValueError(f"a sequence of cu_seqlens_q is longer than max_seqlen_q {max_seqlen_q}: {cu}")
        rows = list(zip(cu, cu[1:]))
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new go together: pass both or neither")
    if k_new is not None:
        packed_new = cu_seqlens_q is not None and k_new.dim() == 3
        if (k_new.dim() != 4 and not packed_new) or k_new.shape[0] != (q.shape[0] if packed_new else batch):
            raise ValueError(
                f"k_new must be (batch, s_new, h_kv, d), or packed (total_q, h_kv, d) like a packed q; got "
                f"{tuple(k_new.shape)}"
            )
        if (
            k_new.shape[:-1] != v_new.shape[:-1]
            or k_new.shape[-2:] != k_cache.shape[-2:]
            or v_new.shape[-1] != v_cache.shape[-1]
        ):
            raise ValueError(
                f"k_new {tuple(k_new.shape)} / v_new {tuple(v_new.shape)} must match each other and the caches' heads "
                f"and head dims ({tuple(k_cache.shape[2:])}, {tuple(v_cache.shape[2:])})"
            )
        if k_cache.dtype == KV_FP8_DTYPE:
            if KV_FP8_DTYPE in (k_new.dtype, v_new.dtype):
                raise ValueError("k_new / v_new for a float8_e4m3fn cache come in q's dtype (quantised on append)")
        elif k_new.dtype != k_cache.dtype or v_new.dtype != v_cache.dtype:
            raise ValueError(
                f"k_new / v_new must have the caches' dtype {k_cache.dtype}, got {k_new.dtype} / {v_new.dtype}"
            )
    fp8 = k_cache.dtype == KV_FP8_DTYPE
    if fp8 != (k_descale is not None) or (k_descale is None) != (v_descale is None):
        raise ValueError(
            "a float8_e4m3fn cache takes k_descale and v_descale (batch, nheads_kv) float32; other caches "
            "take neither"
        )
    if fp8:
        for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != (batch, k_cache.shape[2]):
                raise ValueError(
                    f"{name} must be a float32 tensor of shape (batch, nheads_kv) = ({batch}, {k_cache.shape[2]})"
                )
    return batch, rows

"""Which blocks a rank computes at each ring step, and the mask each block gets.

The global rule (self-attention over the whole sequence, so no offset): query at global position p sees the key at
t iff  p - left <= t <= p + right  (causal: right = 0; None: unbounded; either bound may be negative, and with
left + right < 0 no query sees any key: every pair is skipped). A kernel call over q rows [0, m) and keys
[0, n) applies the bottom-right-aligned rule  i + off - L <= j <= i + off + R,  off = n - m  (`cute_flash.spec`).

For a query chunk at global [qs, qe) and a key chunk at [ks, ke) (`layout.Chunk`), `pair_task` first trims the pair
to the rows that see some key and the keys that some row sees:
    qs' = max(qs, ks - right)   qe' = min(qe, ke + left)   ks' = max(ks, qs - left)   ke' = min(ke, qe + right)
(nothing visible is lost: a dropped row sees no key of the chunk, a dropped key is seen by no row), and skips the
pair when nothing is left. On the trimmed rectangle, with delta = ke' - qe', the kernel's rule equals the global one
for  L = left + delta,  R = right - delta,  and the trimming guarantees L >= 0 (ke' = ke gives L = left + ke - qe'
>= 0 as qe' <= ke + left; ke' = qe + right gives L >= left + right) and likewise R >= 0 whenever some key is
visible (left + right >= 0): no kernel ever sees a negative window bound, also for negative global bounds. A side
that cuts no (row, key) pair of the rectangle is dropped (UNBOUNDED_WINDOW), so fully visible pairs are kind "none",
a diagonal pair "causal", others "local".

Per step, a shard pair holds up to 2 x 2 chunk pairs (zigzag); `step_tasks` fuses them into one launch where one
rectangle with a "none" or "causal" mask reproduces the global rule exactly (checked row by row, `reproduces`):
with a causal mask, zigzag's own step is one causal launch over the whole shard, and every other step one dense
launch over half of it. Plans are plain Python integers, cached per (ranks, sizes, layout, window).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from ..spec import UNBOUNDED_WINDOW, MaskBounds
from .layout import Chunk, chunks

Bound = Optional[int]  # None: unbounded


@dataclass(frozen=True)
class BlockTask:
    """One kernel launch of a ring step: local q rows [q_start, q_end) against local k rows [k_start, k_end) of the
    K/V shard held at that step, with the kernel mask `mask`."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    mask: MaskBounds


def global_bounds(mask: MaskBounds, seqlen: int) -> Tuple[Bound, Bound]:
    """(left, right) of a normalised mask over a sequence of `seqlen` positions; None where a bound reaches past every
    position (then it cuts nothing)."""
    left = None if mask.left >= max(seqlen, 1) else mask.left
    right = None if mask.right >= max(seqlen, 1) else mask.right
    return left, right


def _kernel_mask(m: int, n: int, qs: int, ks: int, left: Bound, right: Bound) -> MaskBounds:
    """The kernel mask of a trimmed rectangle of m rows at global qs and n keys at global ks (m, n > 0)."""
    qe, ke = qs + m, ks + n
    delta = ke - qe
    # The largest key-minus-query distance in the rectangle, and the smallest.
    left_cuts = left is not None and ks - (qe - 1) < -left
    right_cuts = right is not None and (ke - 1) - qs > right
    if not left_cuts and not right_cuts:
        return MaskBounds("none", UNBOUNDED_WINDOW, UNBOUNDED_WINDOW)
    kernel_left = left + delta if left_cuts else UNBOUNDED_WINDOW
    kernel_right = right - delta if right_cuts else UNBOUNDED_WINDOW
    assert kernel_left >= 0 and kernel_right >= 0, "trimming keeps the bounds non-negative"
    if not left_cuts and kernel_right == 0:
        return MaskBounds("causal", UNBOUNDED_WINDOW, 0)
    return MaskBounds("local", min(kernel_left, UNBOUNDED_WINDOW), min(kernel_right, UNBOUNDED_WINDOW))


def pair_task(q_chunk: Chunk, k_chunk: Chunk, left: Bound, right: Bound) -> Optional[BlockTask]:
    """The launch for one (query chunk, key chunk) pair under the global rule, or None when no query sees any key."""
    if left is not None and right is not None and left + right < 0:  # an empty window: p - left > p + right
        return None
    qs, qe = q_chunk.global_start, q_chunk.global_start + q_chunk.length
    ks, ke = k_chunk.global_start, k_chunk.global_start + k_chunk.length
    qs2, qe2, ks2, ke2 = qs, qe, ks, ke
    if right is not None:
        qs2, ke2 = max(qs, ks - right), min(ke, qe + right)
    if left is not None:
        qe2, ks2 = min(qe, ke + left), max(ks, qs - left)
    if qs2 >= qe2 or ks2 >= ke2:
        return None
    mask = _kernel_mask(qe2 - qs2, ke2 - ks2, qs2, ks2, left, right)
    dq, dk = q_chunk.local_start - qs, k_chunk.local_start - ks  # global -> local row
    return BlockTask(qs2 + dq, qe2 + dq, ks2 + dk, ke2 + dk, mask)


def _row_intervals(task: BlockTask, rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[lo, hi) of the local keys that local q rows `rows` see under the task's kernel mask (before clipping)."""
    m, n = task.q_end - task.q_start, task.k_end - task.k_start
    diag = rows - task.q_start + (n - m) + task.k_start
    return diag - task.mask.left, diag + task.mask.right + 1


def reproduces(
    task: BlockTask, q_chunks: Iterable[Chunk], k_chunks: Iterable[Chunk], left: Bound, right: Bound
) -> bool:
    """Whether the task's kernel mask over its rectangle sees exactly the (query, key) pairs the global rule allows
    there: per query row and key chunk, the visible keys form one interval under both rules; compare them."""
    big = 1 << 62
    for qc in q_chunks:
        r0, r1 = max(task.q_start, qc.local_start), min(task.q_end, qc.local_start + qc.length)
        if r0 >= r1:
            continue
        rows = torch.arange(r0, r1, dtype=torch.int64)
        p = rows - qc.local_start + qc.global_start
        lo_k, hi_k = _row_intervals(task, rows)
        for kc in k_chunks:
            u, w = max(task.k_start, kc.local_start), min(task.k_end, kc.local_start + kc.length)
            if u >= w:
                continue
            to_local = kc.local_start - kc.global_start
            lo_g = p - (big if left is None else left) + to_local
            hi_g = p + (big if right is None else right) + 1 + to_local
            a0, a1 = lo_k.clamp(u, w), hi_k.clamp(u, w)
            b0, b1 = lo_g.clamp(u, w), hi_g.clamp(u, w)
            empty_a, empty_b = a0 >= a1, b0 >= b1
            same = (empty_a & empty_b) | (~empty_a & ~empty_b & (a0 == b0) & (a1 == b1))
            if not bool(same.all()):
                return False
    return True


def _bounding(tasks: List[BlockTask], mask: MaskBounds) -> BlockTask:
    return BlockTask(
        min(t.q_start for t in tasks),
        max(t.q_end for t in tasks),
        min(t.k_start for t in tasks),
        max(t.k_end for t in tasks),
        mask,
    )


_FUSED_MASKS = (MaskBounds("none", UNBOUNDED_WINDOW, UNBOUNDED_WINDOW), MaskBounds("causal", UNBOUNDED_WINDOW, 0))


def _fuse(tasks: List[BlockTask], qc, kc, left: Bound, right: Bound) -> Optional[BlockTask]:
    for mask in _FUSED_MASKS:
        cand = _bounding(tasks, mask)
        if reproduces(cand, qc, kc, left, right):
            return cand
    return None


def _fuse_groups(tasks: List[BlockTask], key, qc, kc, left: Bound, right: Bound) -> List[BlockTask]:
    groups: Dict[Tuple[int, int], List[BlockTask]] = {}
    for t in tasks:
        groups.setdefault(key(t), []).append(t)
    out: List[BlockTask] = []
    for group in groups.values():
        fused = _fuse(group, qc, kc, left, right) if len(group) > 1 else None
        out.extend([fused] if fused is not None else group)
    return out


@functools.lru_cache(maxsize=1024)
def step_tasks(
    rank: int, src: int, world_size: int, seqlen_local: int, layout: str, left: Bound, right: Bound
) -> Tuple[BlockTask, ...]:
    """The launches of rank `rank` against the K/V shard of rank `src` (empty: the pair is skipped)."""
    qc = chunks(rank, world_size, seqlen_local, layout)
    kc = chunks(src, world_size, seqlen_local, layout)
    tasks = [t for a in qc for b in kc if (t := pair_task(a, b, left, right)) is not None]
    if len(tasks) > 1:
        whole = _fuse(tasks, qc, kc, left, right)
        if whole is not None:
            tasks = [whole]
        else:
            tasks = _fuse_groups(tasks, lambda t: (t.q_start, t.q_end), qc, kc, left, right)
            tasks = _fuse_groups(tasks, lambda t: (t.k_start, t.k_end), qc, kc, left, right)
    return tuple(sorted(tasks, key=lambda t: (t.q_start, t.k_start)))


def ring_plan(
    rank: int, world_size: int, seqlen_local: int, layout: str, left: Bound, right: Bound
) -> Tuple[Tuple[BlockTask, ...], ...]:
    """Rank `rank`'s launches at each ring step; at step s it holds the K/V shard of rank (rank - s) mod world_size."""
    return tuple(
        step_tasks(rank, (rank - s) % world_size, world_size, seqlen_local, layout, left, right)
        for s in range(world_size)
    )

"""Ring attention: exact attention over a sequence sharded along its length over the ranks of a process group.

Each rank keeps its query shard; the K/V shards travel around the ring (rank r sends to r+1 and receives from r-1),
so at step s rank r holds the K/V shard of rank (r - s) mod W. The next shard's send/receive is posted before the
current step's blocks are computed, so that communication and compute overlap (on CUDA the point-to-point calls are
issued from a side stream; NCCL runs them on its own streams, which the compute stream waits for only when it needs
the received shard). Partial results merge exactly through their log-sum-exps (`merge`), in float32 or wider.

Backward: the same ring. Each step adds this rank's dq share locally and its dk/dv share to a float32 accumulator
that travels with the K/V shard it belongs to; after W hops every accumulator is back on its owner. The block
backward gets the final out and lse (see `blocks`), so its dq/dk/dv are exact shares of the full gradient.

Memory per rank is O(seqlen_local): the local shards, one K/V shard in flight, the float32 out (forward) or dq and
one dk/dv accumulator in flight (backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..arch.base import BwdTensors
from ..interface import _Attention
from ..validation import validate_reference
from .blocks import BlockCompute, default_blocks
from .layout import LAYOUTS, check_layout
from .merge import merge_into
from .plan import BlockTask, global_bounds, ring_plan

Plan = Tuple[Tuple[BlockTask, ...], ...]


class _Transfer:
    """One posted exchange: `recv` holds the tensors from the previous rank once `wait` returns."""

    def __init__(self, works, recv: List[torch.Tensor]):
        self._works = works
        self.recv = recv

    def wait(self) -> List[torch.Tensor]:
        # On CUDA, Work.wait() makes the *current* (compute) stream wait for the transfer; on CPU it blocks.
        for w in self._works:
            w.wait()
        return self.recv


class _Ring:
    """Point-to-point exchanges with the ring neighbours of this rank in `group`."""

    def __init__(self, group, rank: int, world_size: int, device: torch.device):
        self.group = group
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next = to_global((rank + 1) % world_size)
        self.prev = to_global((rank - 1) % world_size)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def exchange(self, tensors: Sequence[torch.Tensor]) -> _Transfer:
        """Posts: send `tensors` to the next rank, receive tensors of the same shapes from the previous one."""
        send = [t.contiguous() for t in tensors]
        recv = [torch.empty_like(t) for t in send]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag=i) for i, t in enumerate(send)]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag=i) for i, t in enumerate(recv)]
        if self.stream is None:
            return _Transfer(dist.batch_isend_irecv(ops), recv)
        # The side stream first waits for what the compute stream queued so far (the tensors to send are written
        # there); the buffers are also marked used on it, so the allocator does not recycle them under the transfer.
        self.stream.wait_stream(torch.cuda.current_stream(send[0].device))
        with torch.cuda.stream(self.stream):
            works = dist.batch_isend_irecv(ops)
        for t in send + recv:
            t.record_stream(self.stream)
        return _Transfer(works, recv)


@dataclass(frozen=True)
class _Config:
    group: object
    rank: int
    world_size: int
    plan: Plan
    softmax_scale: float
    blocks: BlockCompute

    # What the autograd node (`interface._Attention`) asks of the config it carries.
    def forward_saving(self, q, k, v):
        out, lse = _ring_forward(q, k, v, self)
        return q, k, v, out, lse

    def backward_saved(self, dout, q, k, v, out, lse, dlse=None):
        return _ring_backward(dout, q, k, v, out, lse, self, dlse)


def _rows(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return t[:, start:end]


def _ring_forward(q, k, v, cfg: _Config) -> Tuple[torch.Tensor, torch.Tensor]:
    """out (b, s, h, dv) in q's dtype and lse (b, h, s) in the accumulation dtype (float32 or wider)."""
    b, s, h, _ = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(b, s, h, v.shape[3], dtype=acc, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
    ring = _Ring(cfg.group, cfg.rank, cfg.world_size, q.device) if cfg.world_size > 1 else None
    kv = [k, v]
    for step, tasks in enumerate(cfg.plan):
        pending = ring.exchange(kv) if step + 1 < cfg.world_size else None  # overlaps this step's compute
        for t in tasks:
            o, l = cfg.blocks.forward(
                _rows(q, t.q_start, t.q_end),
                _rows(kv[0], t.k_start, t.k_end),
                _rows(kv[1], t.k_start, t.k_end),
                t.mask,
                cfg.softmax_scale,
            )
            merge_into(out[:, t.q_start : t.q_end], lse[:, :, t.q_start : t.q_end], o, l)
        if pending is not None:
            kv = pending.wait()
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, cfg: _Config, dlse=None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    ring = _Ring(cfg.group, cfg.rank, cfg.world_size, q.device) if cfg.world_size > 1 else None
    kv = [k, v]
    dkv_pending = None
    dkv: List[torch.Tensor] = []
    for step, tasks in enumerate(cfg.plan):
        kv_pending = ring.exchange(kv) if step + 1 < cfg.world_size else None
        # This step's shares of the gradient of the K/V shard held now (that of rank (rank - step) mod W), kept as
        # the blocks return them until that shard's accumulator has arrived.
        shares = []
        for t in tasks:
            rows = BwdTensors(
                _rows(dout, t.q_start, t.q_end),
                _rows(q, t.q_start, t.q_end),
                _rows(kv[0], t.k_start, t.k_end),
                _rows(kv[1], t.k_start, t.k_end),
                _rows(out, t.q_start, t.q_end),
                lse[:, :, t.q_start : t.q_end],
                None if dlse is None else dlse[:, :, t.q_start : t.q_end],  # lse's gradient: D - dlse, per block
            )
            dq_b, dk_b, dv_b = cfg.blocks.backward(rows, t.mask, cfg.softmax_scale)
            dq[:, t.q_start : t.q_end] += dq_b
            shares.append((t, dk_b, dv_b))
        if dkv_pending is None:
            dkv = [torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
        else:
            # The accumulator of this K/V shard comes from the previous rank, which finished this shard's previous
            # step while we computed ours: waiting only now keeps the transfer off the compute stream's path.
            dkv = dkv_pending.wait()
        for t, dk_b, dv_b in shares:
            dkv[0][:, t.k_start : t.k_end] += dk_b
            dkv[1][:, t.k_start : t.k_end] += dv_b
        del shares
        if ring is not None:
            # Onwards with the K/V shard; after the last step this sends each accumulator home.
            dkv_pending = ring.exchange(dkv)
        if kv_pending is not None:
            kv = kv_pending.wait()
    if dkv_pending is not None:
        dkv = dkv_pending.wait()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _group_rank_and_size(group) -> Tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("ring_attention got a process group but torch.distributed is not initialised")
        return 0, 1  # one process: plain attention
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("ring_attention: this process is not a member of `group`")
    return rank, dist.get_world_size(group)


def _check_same_on_every_rank(q, k, v, options: Sequence[int], group, world_size: int) -> None:
    """One all-gather of the shapes (and options) of every rank; every rank raises the same error on a mismatch."""
    mine = torch.tensor([*q.shape, *k.shape, *v.shape, *options], dtype=torch.int64, device=q.device)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine, group=group)
    rows = [t.tolist() for t in everyone]
    for r, row in enumerate(rows):
        if row[:12] != rows[0][:12]:
            shapes = lambda x: f"q {tuple(x[0:4])}, k {tuple(x[4:8])}, v {tuple(x[8:12])}"
            raise ValueError(
                "ring_attention: q, k and v must have the same shape on every rank (each rank holds an equal shard "
                f"of the sequence); rank 0 has {shapes(rows[0])}, rank {r} has {shapes(row)}"
            )
        if row[12:] != rows[0][12:]:
            raise ValueError(
                "ring_attention: causal, window_size and layout must be the same on every rank; "
                f"rank 0 has {rows[0][12:]}, rank {r} has {row[12:]} (causal, left, right, layout index)"
            )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    layout: str = "zigzag",
    return_lse: bool = False,
    blocks: Optional[BlockCompute] = None,
    check_shapes: bool = True,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention of a sequence sharded over the ranks of `group` (default: the world), differentiable.

    q (batch, seqlen_local, nheads, head_dim), k/v (batch, seqlen_local, nheads_kv, head_dim[_v]): this rank's shards
    of one sequence of seqlen_local · W positions in `layout` ("zigzag" or "contiguous", see
    `cute_flash.distributed.layout`; `shard_sequence` / `unshard_sequence` convert). Every rank must call this with
    the same shapes and options (and, for gradients, run the backward too: it is collective as well).

    causal and window_size=(left, right) follow `cute_flash.attention` on the full sequence (query at global position
    p sees key t iff p - left <= t <= p + right; causal: right = 0). Returns this rank's rows of out (input dtype)
    and, with return_lse, of the float32 lse (batch, nheads, seqlen_local).

    blocks: the per-step computation (`cute_flash.distributed.blocks`); default KernelBlocks on CUDA (cute-flash's
    kernels, fp16/bf16), ReferenceBlocks elsewhere (plain torch, e.g. float64 on CPUs with gloo). Without an
    initialised process group (and group=None) this is one rank: plain attention through the same code.

    check_shapes: compare shapes and options across the ranks first (ValueError on every rank when they differ).
    That costs one small all-gather and a host synchronisation per call; a training loop whose shapes are known to
    agree may pass False (ranks with different shapes then fail or hang inside the transfers).
    """
    sem = validate_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size)
    check_layout(layout)
    seqlen_local = q.shape[1]
    if k.shape[1] != seqlen_local:
        raise ValueError(
            f"ring_attention is self-attention over one sharded sequence: q and k/v must hold the same number of "
            f"positions per rank, got q {seqlen_local}, k {k.shape[1]}"
        )
    if layout == "zigzag" and seqlen_local % 2:
        raise ValueError(
            f"the zigzag layout needs an even seqlen_local (each rank holds two chunks of seqlen_local / 2), "
            f"got {seqlen_local}"
        )
    rank, world_size = _group_rank_and_size(group)
    left_opt, right_opt = window_size
    options = [
        int(causal),
        -1 if left_opt is None else int(left_opt),
        -1 if right_opt is None else int(right_opt),
        LAYOUTS.index(layout),
    ]
    if world_size > 1 and check_shapes:
        _check_same_on_every_rank(q, k, v, options, group, world_size)

    left, right = global_bounds(sem.mask, seqlen_local * world_size)
    plan = ring_plan(rank, world_size, seqlen_local, layout, left, right)
    if blocks is None:
        blocks = default_blocks(q.device)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    # Every rank checks the mask kinds of every rank's plan, so that all raise together or none does.
    kinds = {
        t.mask.kind
        for r in range(world_size)
        for tasks in ring_plan(r, world_size, seqlen_local, layout, left, right)
        for t in tasks
    }
    blocks.check(q, k, v, kinds, needs_grad)
    cfg = _Config(group, rank, world_size, plan, sem.softmax_scale, blocks)
    k, v = k.contiguous(), v.contiguous()  # sent as they are
    if needs_grad:
        out, lse = _Attention.apply(q, k, v, cfg)
    else:
        with torch.no_grad():
            out, lse = _ring_forward(q, k, v, cfg)
    if not return_lse:
        return out
    return out, lse.float()

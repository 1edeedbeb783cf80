"""Ring attention: exact attention over a sequence sharded along its length over the ranks of a process group.

Each rank keeps its query shard; the K/V shards travel around the ring (rank r sends to r+1 and receives from r-1),
so at step s rank r holds the K/V shard of rank (r - s) mod W. The next shard's send/receive is posted before the
current step's blocks are computed, so that communication and compute overlap (on CUDA the point-to-point calls are
issued from a side stream; NCCL runs them on its own streams, which the compute stream waits for only when it needs
the received shard). Partial results merge exactly through their log-sum-exps (`merge`), in float32 or wider.

Backward: the same ring. Each step adds this rank's dq share locally and its dk/dv share to a float32 accumulator
that travels with the K/V shard it belongs to; after W hops every accumulator is back on its owner. The block
backward gets the final out and lse (see `blocks`), so its dq/dk/dv are exact shares of the full gradient.

Soft-capping applies per score, inside every block. Learnable sinks (one logit per query head) join only the final
merge, as a key set of their own with out 0 (`merge.merge_sink_into`); their gradient needs the final lse and
D = rowsum(dO * O) alone (`arch.base.sink_grad`), so each rank returns its own rows' share of dsink, as for any
parameter replicated over the group (sum it over the group, as data parallelism does).

Memory per rank is O(seqlen_local): the local shards, one K/V shard in flight, the float32 out (forward) or dq and
one dk/dv accumulator in flight (backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..arch.base import BwdTensors, sink_grad
from ..core.autograd import Attention
from ..validation import check_learnable_sink, check_softcap, validate_reference
from .blocks import BlockCompute, default_blocks
from .layout import LAYOUTS, check_layout
from .merge import merge_into, merge_sink_into
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
    softcap: float = 0.0

    # What the call core's autograd node (core/autograd.py) asks of its `run`.
    def forward_saving(self, q, k, v, sink, seqs):
        out, lse = _ring_forward(q, k, v, self, sink)
        return q, k, v, out, lse

    def backward(self, dout, q, k, v, out, lse, dlse, sink, seqs):
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, self, dlse)
        return dq, dk, dv, None if sink is None else _sink_grad(dout, out, lse, dlse, sink)


def _sink_grad(dout, out, lse, dlse, sink) -> torch.Tensor:
    """This rank's share of dsink (h,): its rows' P_sink * (dlse - D), D = rowsum(dO * O) over the final O."""
    d = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1).transpose(1, 2)  # (b, h, s)
    if dlse is not None:
        d = d - torch.where(torch.isneginf(lse), 0.0, dlse.to(lse.dtype))
    dsink = torch.empty(sink.shape, dtype=lse.dtype, device=lse.device)
    sink_grad(dsink, sink, lse, d)
    return dsink


def _rows(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return t[:, start:end]


def _ring_forward(q, k, v, cfg: _Config, sink=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """out (b, s, h, dv) in q's dtype and lse (b, h, s) in the accumulation dtype (float32 or wider); sink: the (h,)
    learnable sinks, merged once after every block."""
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
                cfg.softcap,
            )
            merge_into(out[:, t.q_start : t.q_end], lse[:, :, t.q_start : t.q_end], o, l)
        if pending is not None:
            kv = pending.wait()
    if sink is not None:
        merge_sink_into(out, lse, sink.detach())
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
            dq_b, dk_b, dv_b = cfg.blocks.backward(rows, t.mask, cfg.softmax_scale, cfg.softcap)
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


_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


def _dims(t) -> List[int]:
    """A tensor's 4 dims for the all-gather (padded, so that every rank's payload has one length)."""
    shape = list(t.shape) if isinstance(t, torch.Tensor) else []
    return (shape + [-1] * 4)[:4] if len(shape) <= 4 else [-2] * 4


def _check_same_on_every_rank(q, k, v, options: Sequence[int], group, world_size: int, error) -> None:
    """One all-gather of every rank's shapes, dtypes, options and whether its own checks failed; every rank raises
    (its own error, or the same ValueError) when any rank failed or the ranks differ, so that none waits in a
    transfer the others never start."""
    dtypes = [_DTYPE_CODES.get(getattr(t, "dtype", None), 0) for t in (q, k, v)]
    mine = torch.tensor([int(error is not None), *_dims(q), *_dims(k), *_dims(v), *dtypes, *options],
                        dtype=torch.int64, device=q.device)  # fmt: skip
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine, group=group)
    rows = [t.tolist() for t in everyone]
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        raise ValueError(f"ring_attention: the arguments of rank(s) {failed} were refused there (see their error)")
    rows = [row[1:] for row in rows]
    for r, row in enumerate(rows):
        if row[:12] != rows[0][:12]:
            shapes = lambda x: f"q {tuple(x[0:4])}, k {tuple(x[4:8])}, v {tuple(x[8:12])}"
            raise ValueError(
                "ring_attention: q, k and v must have the same shape on every rank (each rank holds an equal shard "
                f"of the sequence); rank 0 has {shapes(rows[0])}, rank {r} has {shapes(row)}"
            )
        if row[12:15] != rows[0][12:15]:
            raise ValueError(f"ring_attention: q, k and v must have the same dtypes on every rank; rank 0 has codes "
                             f"{rows[0][12:15]}, rank {r} {row[12:15]} (1 fp16, 2 bf16, 3 fp32, 4 fp64)")  # fmt: skip
        if row[15:] != rows[0][15:]:
            raise ValueError(
                "ring_attention: causal, window_size, layout, softcap, softmax_scale and whether learnable_sink is "
                f"given must be the same on every rank; rank 0 has {rows[0][15:]}, rank {r} has {row[15:]} (causal, "
                "left unbounded, left, right unbounded, right, layout index, softcap's float64 bits, sinks, scale "
                "given, its float64 bits)"
            )


def _check_locally(q, k, v, causal, softmax_scale, window_size, layout, softcap, learnable_sink):
    """This rank's own checks of a call: (the reference problem's semantics, softcap as a float)."""
    sem = validate_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size)
    softcap = check_softcap(softcap)
    # (float64 sinks beside float64 reference blocks: checked as a float32 stand-in of the same shape and device)
    wide = isinstance(learnable_sink, torch.Tensor) and learnable_sink.dtype == torch.float64
    check_learnable_sink(learnable_sink.detach().float() if wide else learnable_sink, sem.nheads, q.device)
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
    return sem, softcap


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
    softcap: float = 0.0,
    learnable_sink: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention of a sequence sharded over the ranks of `group` (default: the world), differentiable.

    q (batch, seqlen_local, nheads, head_dim), k/v (batch, seqlen_local, nheads_kv, head_dim[_v]): this rank's shards
    of one sequence of seqlen_local · W positions in `layout` ("zigzag" or "contiguous", see
    `cute_flash.distributed.layout`; `shard_sequence` / `unshard_sequence` convert). Every rank must call this with
    the same shapes and options (and, for gradients, run the backward too: it is collective as well).

    causal and window_size=(left, right) follow `cute_flash.attention` on the full sequence (query at global position
    p sees key t iff p - left <= t <= p + right; causal: right = 0; bounds may be negative). Returns this rank's rows
    of out (input dtype) and, with return_lse, of the float32 lse (batch, nheads, seqlen_local).

    softcap and learnable_sink as in `cute_flash.attention`: softcap > 0 caps every score at
    softcap * tanh(score * softmax_scale / softcap) before the mask; a (nheads,) learnable_sink (the same on every
    rank) is one more logit per query head in every row's softmax denominator, attending to no value (lse includes
    it; a row without keys gets out 0 and lse = sink_h). Its gradient on each rank is that rank's rows' share,
    dsink_h = sum over batch and local rows of P_sink * (dlse - D): sum it over the group as any replicated
    parameter's.

    blocks: the per-step computation (`cute_flash.distributed.blocks`); default KernelBlocks on CUDA (cute-flash's
    kernels, fp16/bf16), ReferenceBlocks elsewhere (plain torch, e.g. float64 on CPUs with gloo). Without an
    initialised process group (and group=None) this is one rank: plain attention through the same code.

    check_shapes: compare shapes and options across the ranks first (ValueError on every rank when they differ).
    That costs one small all-gather and a host synchronisation per call; a training loop whose shapes are known to
    agree may pass False (ranks with different shapes then fail or hang inside the transfers).
    """
    rank, world_size = _group_rank_and_size(group)
    error = None
    try:
        sem, softcap = _check_locally(q, k, v, causal, softmax_scale, window_size, layout, softcap, learnable_sink)
    except (ValueError, TypeError, NotImplementedError) as e:
        if world_size == 1 or not check_shapes or not isinstance(q, torch.Tensor):
            raise
        error = e  # (raised after the all-gather, so that the other ranks raise too instead of waiting)
    left_opt, right_opt = window_size if error is None else (None, None)
    bits = lambda x: torch.tensor(float(x), dtype=torch.float64).view(torch.int64).item()  # noqa: E731
    options = [
        int(causal),
        int(left_opt is None),  # (a flag beside each bound: a bound may be any int, -1 included)
        0 if left_opt is None else int(left_opt),
        int(right_opt is None),
        0 if right_opt is None else int(right_opt),
        LAYOUTS.index(layout) if layout in LAYOUTS else -1,
        bits(softcap) if error is None else 0,
        int(learnable_sink is not None),
        int(softmax_scale is not None),
        bits(softmax_scale) if softmax_scale is not None and error is None else 0,
    ]
    if world_size > 1 and check_shapes:
        _check_same_on_every_rank(q, k, v, options, group, world_size, error)
    seqlen_local = q.shape[1]

    left, right = global_bounds(sem.mask, seqlen_local * world_size)
    plan = ring_plan(rank, world_size, seqlen_local, layout, left, right)
    if blocks is None:
        blocks = default_blocks(q.device)
    sink = learnable_sink
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sink))
    # Every rank checks the mask kinds of every rank's plan, so that all raise together or none does.
    kinds = {
        t.mask.kind
        for r in range(world_size)
        for tasks in ring_plan(r, world_size, seqlen_local, layout, left, right)
        for t in tasks
    }
    blocks.check(q, k, v, kinds, needs_grad, softcap)
    cfg = _Config(group, rank, world_size, plan, sem.softmax_scale, blocks, softcap)
    k, v = k.contiguous(), v.contiguous()  # sent as they are
    if needs_grad:
        out, lse = Attention.apply(cfg, q, k, v, sink)
    else:
        with torch.no_grad():
            out, lse = _ring_forward(q, k, v, cfg, sink)
    if not return_lse:
        return out
    return out, lse.float()

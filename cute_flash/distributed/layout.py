"""Which positions of the global sequence each rank holds, and moving between a full sequence and its shards.

Two layouts of a sequence of N positions over W ranks, every rank holding seqlen_local = N / W positions:

  contiguous  rank r holds [r·N/W, (r+1)·N/W). With a causal mask the last rank does W times the work of the first.
  zigzag      the sequence cut into 2·W chunks of N / (2W); rank r holds chunk r then chunk 2W-1-r. Every rank then
              holds one early and one late chunk, so causal work is the same on every rank (load balance).

A rank's shard is its chunks concatenated along the sequence dimension, in increasing global order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class Chunk:
    """A run of consecutive global positions held by one rank: global [global_start, global_start + length) lies at
    local rows [local_start, local_start + length) of the shard."""

    global_start: int
    local_start: int
    length: int


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _check_world(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank {rank} of world_size {world_size}")


def chunk_indices(rank: int, world_size: int, layout: str) -> Tuple[int, ...]:
    """Which of the layout's equal chunks (W for contiguous, 2W for zigzag) rank `rank` holds, in local order."""
    check_layout(layout)
    _check_world(rank, world_size)
    return (rank,) if layout == "contiguous" else (rank, 2 * world_size - 1 - rank)


def chunks(rank: int, world_size: int, seqlen_local: int, layout: str) -> Tuple[Chunk, ...]:
    """The chunks of rank `rank`'s shard, in local order (which is also increasing global order)."""
    indices = chunk_indices(rank, world_size, layout)
    if seqlen_local % len(indices):
        raise ValueError(
            f"the zigzag layout needs an even seqlen_local (each rank holds two chunks of seqlen_local / 2), "
            f"got {seqlen_local}"
        )
    c = seqlen_local // len(indices)
    return tuple(Chunk(i * c, n * c, c) for n, i in enumerate(indices))


def global_positions(rank: int, world_size: int, seqlen_local: int, layout: str) -> torch.Tensor:
    """int64 (seqlen_local,): the global position of each local row."""
    parts = [
        torch.arange(ch.global_start, ch.global_start + ch.length)
        for ch in chunks(rank, world_size, seqlen_local, layout)
    ]
    return torch.cat(parts)


def _seqlen_local(seqlen: int, world_size: int, layout: str) -> int:
    parts = world_size * (2 if layout == "zigzag" else 1)
    if seqlen % parts:
        raise ValueError(
            f"a sequence of {seqlen} positions cannot be split evenly in the {layout} layout over {world_size} ranks: "
            f"it needs a multiple of {parts} ({'2 · world_size chunks' if layout == 'zigzag' else 'world_size shards'})"
        )
    return seqlen // world_size


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s shard of the full sequence `x` (the sequence along `dim`: 1 for q/k/v/out, 2 for lse); a new
    tensor (never a view of `x`)."""
    check_layout(layout)
    _check_world(rank, world_size)
    seqlen_local = _seqlen_local(x.shape[dim], world_size, layout)
    parts = [x.narrow(dim, ch.global_start, ch.length) for ch in chunks(rank, world_size, seqlen_local, layout)]
    return torch.cat(parts, dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (`shards[r]` from rank r); inverse of `shard_sequence`."""
    check_layout(layout)
    world_size = len(shards)
    if world_size == 0:
        raise ValueError("unshard_sequence needs at least one shard")
    seqlen_local = shards[0].shape[dim]
    for r, s in enumerate(shards):
        if s.shape != shards[0].shape:
            raise ValueError(
                f"every shard must have the same shape; shard 0 has {tuple(shards[0].shape)}, shard {r} "
                f"{tuple(s.shape)}"
            )
    pieces: List[Optional[torch.Tensor]] = [None] * (world_size * (2 if layout == "zigzag" else 1))
    for r, s in enumerate(shards):
        for i, ch in zip(chunk_indices(r, world_size, layout), chunks(r, world_size, seqlen_local, layout)):
            pieces[i] = s.narrow(dim, ch.local_start, ch.length)
    return torch.cat(pieces, dim=dim)


def gather_sequence(local: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The full sequence on every rank, from each rank's shard `local` (an all-gather over `group`)."""
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local.contiguous(), group=group)
    return unshard_sequence(gathered, layout, dim)

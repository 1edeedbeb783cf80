"""Block masks: which (query tile, key tile) pairs of a mask_mod are empty, partial or full, so that a kernel skips
empty tiles and applies the per-element mask only on partial ones (FlexAttention's `create_block_mask`, FA4's
block-sparse tensors). Built on the mask's device with torch, chunk by chunk; users with their own sparsity may
build a `BlockMask` directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from .graph import ModGraph, evaluate, trace_mask_mod

EMPTY, PARTIAL, FULL = 0, 1, 2
_CHUNK_ELEMENTS = 1 << 26  # visibility booleans evaluated at once (64 MiB)


@dataclass(frozen=True)
class BlockMask:
    """Per (batch, query head, query tile): the key tiles to visit. batch / heads are 1 where the mask does not
    depend on them (broadcast). partial_index / full_index hold, in ascending order, the first partial_count /
    full_count key-tile indices of each row tile (the rest of the row is padding: unspecified)."""

    tile_m: int
    tile_n: int
    seqlen_q: int
    seqlen_k: int
    partial_count: torch.Tensor  # (B, H, M) int32: key tiles that need the per-element mask
    partial_index: torch.Tensor  # (B, H, M, N) int32
    full_count: torch.Tensor  # (B, H, M) int32: key tiles every in-range element of which is visible
    full_index: torch.Tensor  # (B, H, M, N) int32
    # Whether a batch / heads extent of 1 broadcasts over the call's (create_block_mask: where the mask_mod does not
    # read b / h); False: built for a batch / heads of 1, and only such calls take it.
    broadcast_batch: bool = True
    broadcast_heads: bool = True
    mask_key: Optional[tuple] = None  # the traced mask_mod's key (create_block_mask): a call checks its own against it

    def tile_states(self) -> torch.Tensor:
        """(B, H, M, N) int8: EMPTY, PARTIAL or FULL per tile pair."""
        b, h, m, n = self.partial_index.shape
        states = torch.zeros(b, h, m, n, dtype=torch.int8, device=self.partial_index.device)
        cols = torch.arange(n, device=states.device)
        for count, index, state in ((self.partial_count, self.partial_index, PARTIAL),
                                    (self.full_count, self.full_index, FULL)):  # fmt: skip
            valid = cols < count.unsqueeze(-1)
            rows = torch.nonzero(valid, as_tuple=True)
            states[(*rows[:3], index[valid].long())] = state
        return states


def _states(graph: ModGraph, batch: int, heads: int, seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int,
            device) -> torch.Tensor:  # fmt: skip
    m, n = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
    states = torch.empty(batch, heads, m, n, dtype=torch.int8, device=device)
    kv = torch.arange(n * tile_n, device=device)
    rows_per_chunk = max(tile_m, (_CHUNK_ELEMENTS // max(1, batch * heads * n * tile_n)) // tile_m * tile_m)
    b_idx = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h_idx = torch.arange(heads, device=device).view(1, -1, 1, 1)
    for r0 in range(0, m * tile_m, rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, m * tile_m)
        q = torch.arange(r0, r1, device=device)
        # Positions past the sequences are clamped into them before the mask reads its tables (what they see
        # counts for neither state below), as a kernel must clamp the positions of a tile's tail.
        q_in, kv_in = q.clamp(max=max(seqlen_q - 1, 0)), kv.clamp(max=max(seqlen_k - 1, 0))
        vis = evaluate(
            graph, {"b": b_idx, "h": h_idx, "q_idx": q_in.view(1, 1, -1, 1), "kv_idx": kv_in.view(1, 1, 1, -1)}
        ).expand(batch, heads, r1 - r0, n * tile_n)
        inside = (q.view(-1, 1) < seqlen_q) & (kv.view(1, -1) < seqlen_k)  # out-of-range rows / keys count for neither
        shape = (batch, heads, (r1 - r0) // tile_m, tile_m, n, tile_n)
        any_ = (vis & inside).reshape(shape).any(5).any(3)
        all_ = (vis | ~inside).reshape(shape).all(5).all(3)
        states[:, :, r0 // tile_m : r1 // tile_m] = torch.where(all_, FULL, torch.where(any_, PARTIAL, EMPTY)).to(
            torch.int8
        )
    return states


def _lists(selected: torch.Tensor):
    """Counts and ascending indices of the selected tiles of each row tile (the selected ones first)."""
    count = selected.sum(-1, dtype=torch.int32)
    index = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count, index


def create_block_mask(
    mask_mod: Union[Callable, ModGraph],
    batch: Optional[int],
    heads: Optional[int],
    seqlen_q: int,
    seqlen_k: int,
    *,
    tile_m: int = 128,
    tile_n: int = 128,
    device: Union[str, torch.device, None] = None,
) -> BlockMask:
    """The block mask of `mask_mod(b, h, q_idx, kv_idx)` over (batch, heads, seqlen_q, seqlen_k) for tiles of
    tile_m query rows x tile_n keys. batch / heads None: the mask does not depend on them (a mask that does raises).
    Evaluated on `device` (default: the device of its first captured tensor, else the CPU)."""
    graph = mask_mod if isinstance(mask_mod, ModGraph) else trace_mask_mod(mask_mod)
    if graph.kind != "mask":
        raise ValueError("create_block_mask needs a mask_mod")
    for name, value in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k), ("tile_m", tile_m), ("tile_n", tile_n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name.startswith("seq") else 1):
            raise ValueError(f"{name} must be an int >= {0 if name.startswith('seq') else 1}, got {value!r}")
    dims = {}
    for name, value, sym in (("batch", batch, "b"), ("heads", heads, "h")):
        if value is None:
            if graph.uses(sym):
                raise ValueError(f"the mask_mod reads {sym}: give {name}")
            value = 1
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        dims[name] = value if graph.uses(sym) else 1
    if device is None:
        device = graph.aux[0].device if graph.aux else torch.device("cpu")
    states = _states(graph, dims["batch"], dims["heads"], seqlen_q, seqlen_k, tile_m, tile_n, torch.device(device))
    partial_count, partial_index = _lists(states == PARTIAL)
    full_count, full_index = _lists(states == FULL)
    return BlockMask(tile_m, tile_n, seqlen_q, seqlen_k, partial_count, partial_index, full_count, full_index,
                     not graph.uses("b"), not graph.uses("h"), graph.key)  # fmt: skip

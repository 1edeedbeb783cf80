"""`cute_flash.attention(..., score_mod=..., mask_mod=...)`: the call path of attention with FlexAttention-style
callables, eager (under torch.compile a graph break: `attention_mods`), and `attention_varlen`'s over packed
sequences (`attention_varlen_mods`). On Hopper the sm90 kernels (arch/sm90/flash_fwd_mods.py, flash_bwd_mods.py; a
block mask's empty tiles skipped, its full tiles without the mask_mod: lists by query tile for the forward, by key
tile for the backward), else the sm80 family's (every tile visited); both dense and packed. What the callables may
contain: mods/graph.py.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch

from ..core import device as gpu
from ..spec import AttentionSpec, ModsSpec
from ..problem import PackedSeqs
from ..validation import validate, validate_varlen
from ..kernel_layout import kernel_view
from .block_mask import BlockMask
from .graph import BOOL, F32, MAX_TABLES, ModGraph, score_derivative, trace_mask_mod, trace_score_mod

_STORAGE = {F32: torch.float32, BOOL: torch.uint8}
MAX_POSITIONS = 1 << 24  # (mods/codegen.py: float32 holds every position exactly)


def _tables(graphs: List[Optional[ModGraph]], device: torch.device) -> List[torch.Tensor]:
    """The graphs' captured tensors as the kernel reads them: float32 / int32 / uint8 (booleans), contiguous, a
    scalar as a 1-element vector; they must live on q's device (no silent copies)."""
    out = []
    for graph in graphs:
        for t, (read, _) in zip(graph.aux if graph is not None else (), graph.aux_types if graph is not None else ()):
            if t.device != device:
                raise ValueError(f"a tensor the score_mod / mask_mod reads is on {t.device}, q on {device}")
            stored = t.to(torch.uint8) if read == BOOL else t.to(_STORAGE.get(read, torch.int32))
            out.append(stored.contiguous().reshape(t.shape or (1,)))
    if len(out) > MAX_TABLES:
        raise NotImplementedError(f"score_mod and mask_mod read {len(out)} captured tensors; at most {MAX_TABLES}")
    return out


def mods_problem(problem, score_mod: Optional[Callable], mask_mod: Optional[Callable], block_sparse: bool = False):
    """(the problem with its ModsSpec, [score graph, mask graph]) of a validated dense problem (also `explain`'s);
    block_sparse: a block mask comes with the call."""
    score_graph = trace_score_mod(score_mod) if score_mod is not None else None
    mask_graph = trace_mask_mod(mask_mod) if mask_mod is not None else None
    base = {f.name: getattr(problem.spec, f.name) for f in dataclasses.fields(AttentionSpec)}
    spec = ModsSpec(
        **base,
        score_mod=score_graph.key if score_graph is not None else None,
        mask_mod=mask_graph.key if mask_graph is not None else None,
        block_sparse=block_sparse,
    )
    return dataclasses.replace(problem, spec=spec), [score_graph, mask_graph]


def attention_mods(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Optional[Callable],
    mask_mod: Optional[Callable],
    causal: bool,
    softmax_scale: Optional[float],
    window_size: Tuple[Optional[int], Optional[int]],
    return_lse: bool,
    block_mask: Optional[BlockMask] = None,
):
    args = (q, k, v, score_mod, mask_mod, causal, softmax_scale, window_size, return_lse, block_mask)
    return _call(_attention_mods, _attention_mods_eager, args)


def _call(run: Callable, run_eager: Callable, args: tuple):
    """run(*args), or under torch.compile run_eager(*args): the callables are traced by mods/graph.py, not by dynamo,
    so the call runs eagerly, a graph break (fullgraph=True reports it), its autograd node between the compiled
    graphs. torch.export has no break to fall back on: NotImplementedError."""
    if torch.compiler.is_compiling():
        if not torch.compiler.is_dynamo_compiling() or torch.compiler.is_exporting():
            raise NotImplementedError("score_mod / mask_mod calls cannot be exported (torch.export): no custom op")
        return run_eager(*args)
    return run(*args)


def _check_positions(seqlen_q: int, seqlen_k: int) -> None:
    if max(seqlen_q, seqlen_k) >= MAX_POSITIONS:
        raise ValueError(f"score_mod / mask_mod calls take sequences of fewer than {MAX_POSITIONS} positions (the "
                         "kernels convert positions to float32 exactly); got seqlen_q, seqlen_k = "
                         f"{seqlen_q}, {seqlen_k}")  # fmt: skip


def _autocast(q, k, v):
    """torch.autocast("cuda"): the inputs in its dtype first, as `attention` does (core/call.autocast_inputs)."""
    if not torch.is_autocast_enabled("cuda"):
        return q, k, v
    from ..core.call import autocast_inputs

    return autocast_inputs(q, k, v)


def _attention_mods(q, k, v, score_mod, mask_mod, causal, softmax_scale, window_size, return_lse, block_mask):
    q, k, v = _autocast(q, k, v)
    problem = validate(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size, dtype=None)
    _check_positions(problem.seqlen_q, problem.seqlen_k)
    problem, graphs = mods_problem(problem, score_mod, mask_mod, block_mask is not None)
    # Layouts the kernels cannot take are copied once (differentiably), as the plain path does.
    q, k, v = (kernel_view(t, name=n) for n, t in (("q", q), ("k", k), ("v", v)))
    tables = _tables(graphs, q.device)
    backend = gpu.route(problem.spec, q, backward=False)
    blocks = None
    if block_mask is not None:
        check_block_mask(block_mask, problem, q.device, graphs[1].key if graphs[1] is not None else None)
        tiles = backend.mods_key_tiles(problem.spec)  # None: the family visits every tile
        if tiles is None:
            problem = dataclasses.replace(problem, spec=dataclasses.replace(problem.spec, block_sparse=False))
        else:
            blocks = key_tile_lists(block_mask, *tiles, q.device)
    return _run(q, k, v, problem, graphs, tables, backend, blocks, block_mask, None, return_lse)


def attention_varlen_mods(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqs: PackedSeqs,
    score_mod: Optional[Callable],
    mask_mod: Optional[Callable],
    causal: bool,
    softmax_scale: Optional[float],
    window_size: Tuple[Optional[int], Optional[int]],
    return_lse: bool,
):
    """`attention_varlen(..., score_mod=, mask_mod=)`: packed sequences, the callables seeing b = the sequence and
    q_idx / kv_idx = positions within it (each sequence's own 0..). No block mask."""
    args = (q, k, v, seqs, score_mod, mask_mod, causal, softmax_scale, window_size, return_lse)
    return _call(_attention_varlen_mods, _attention_varlen_mods_eager, args)


def _attention_varlen_mods(q, k, v, seqs, score_mod, mask_mod, causal, softmax_scale, window_size, return_lse):
    q, k, v = _autocast(q, k, v)
    problem = validate_varlen(q, k, v, seqs, causal=causal, softmax_scale=softmax_scale, window_size=window_size)
    _check_positions(int(seqs.max_seqlen_q), int(seqs.max_seqlen_k))
    problem, graphs = mods_problem(problem, score_mod, mask_mod)
    q, k, v = (kernel_view(t, name=n) for n, t in (("q", q), ("k", k), ("v", v)))
    used = seqs.seqused_k
    seqs = seqs._replace(cu_seqlens_q=seqs.cu_seqlens_q.contiguous(), cu_seqlens_k=seqs.cu_seqlens_k.contiguous(),
                         seqused_k=None if used is None else used.contiguous())  # fmt: skip
    tables = _tables(graphs, q.device)
    backend = gpu.route(problem.spec, q, backward=False)
    return _run(q, k, v, problem, graphs, tables, backend, None, None, seqs, return_lse)


def _run(q, k, v, problem, graphs, tables, backend, blocks, block_mask, seqs, return_lse):
    """The forward, through the autograd node where gradients are wanted."""
    captured = [t for g in graphs if g is not None for t in g.aux]
    if torch.is_grad_enabled() and any(t.requires_grad for t in captured):
        raise NotImplementedError(
            "a tensor the score_mod / mask_mod reads requires grad: gradients of captured tensors are not computed "
            "(detach it, or compute that part outside attention)"
        )
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        # (refuses before the forward where no backward serves it; the backward takes this route, as the plain
        # path's plans do, whatever CUTE_FLASH_ARCH says by then)
        back = gpu.route(problem.spec, q, backward=True)
        if graphs[0] is not None:
            score_derivative(graphs[0])  # (raises ModError now, not in the backward, where it has none)
        out, lse = _ModsAttention.apply(q, k, v, problem, (backend, back), blocks, block_mask, seqs, *tables)
    else:
        out, lse = _forward(q, k, v, problem, backend, tables, blocks, seqs)
    return (out, lse) if return_lse else out


_attention_mods_eager = torch.compiler.disable(_attention_mods)
_attention_varlen_mods_eager = torch.compiler.disable(_attention_varlen_mods)


def _empty(q: torch.Tensor, k: torch.Tensor) -> bool:
    """No query row, or no key at all (dense or packed): no kernel runs (out 0, lse -inf, zero gradients)."""
    return q.numel() == 0 or k.shape[-3] == 0


def _forward(q, k, v, problem, backend, tables, blocks, seqs=None):
    *rows, h, _ = q.shape  # dense (b, sq) or packed (total_q,)
    out = q.new_empty(*rows, h, v.shape[-1])
    lse = torch.empty(*rows[:-1], h, rows[-1], dtype=torch.float32, device=q.device)  # (b, h, sq) or (h, total_q)
    if _empty(q, k):
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    with gpu.guard(q):
        backend.forward_mods(q, k, v, out, lse, problem, tables, blocks, seqs)
    return out, lse


def check_block_mask(block_mask: BlockMask, problem, device: torch.device, mask_key: Optional[tuple] = None) -> None:
    """A block mask fits a call when it was built for its lengths, its batch / heads (or broadcasts them) and its
    mask_mod (where it says which: create_block_mask's), with tensors of one consistent shape on q's device."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a cute_flash.mods.BlockMask, got {type(block_mask).__name__}")
    bm = block_mask
    b, sq, sk, h = problem.batch, problem.seqlen_q, problem.seqlen_k, problem.nheads
    if (bm.seqlen_q, bm.seqlen_k) != (sq, sk):
        raise ValueError(f"block_mask was built for seqlen_q, seqlen_k = {bm.seqlen_q}, {bm.seqlen_k}; the call has "
                         f"{sq}, {sk}")  # fmt: skip
    if mask_key is not None and bm.mask_key is not None and bm.mask_key != mask_key:
        raise ValueError("block_mask was built from another mask_mod than the call's")
    for name, tile in (("tile_m", bm.tile_m), ("tile_n", bm.tile_n)):
        if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
            raise ValueError(f"block_mask.{name} must be an int >= 1, got {tile!r}")
    tensors = {n: getattr(bm, n) for n in ("partial_count", "partial_index", "full_count", "full_index")}
    if not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise TypeError("a BlockMask's counts and indices must be torch tensors")
    mb, mh, m = bm.partial_count.shape if bm.partial_count.dim() == 3 else (-1, -1, -1)
    n = -(-sk // bm.tile_n)
    want = {"partial_count": (mb, mh, m), "full_count": (mb, mh, m), "partial_index": (mb, mh, m, n),
            "full_index": (mb, mh, m, n)}  # fmt: skip
    for name, t in tensors.items():
        if tuple(t.shape) != want[name] or m != -(-sq // bm.tile_m):
            raise ValueError(f"block_mask.{name} has shape {tuple(t.shape)}; a mask of {sq} x {sk} positions in "
                             f"{bm.tile_m} x {bm.tile_n} tiles needs {want[name][:2]} + ({-(-sq // bm.tile_m)}"
                             f"{', ' + str(n) if 'index' in name else ''})")  # fmt: skip
        if t.dtype not in (torch.int32, torch.int64) or t.device != device:
            raise ValueError(f"block_mask.{name} must be an int32 / int64 tensor on {device}, got {t.dtype} on "
                             f"{t.device}")  # fmt: skip
    if mb not in (1, b) or mh not in (1, h):
        raise ValueError(f"block_mask has batch x heads {mb} x {mh}; the call {b} x {h} (or 1 to broadcast)")
    if (mb == 1 and b != 1 and not bm.broadcast_batch) or (mh == 1 and h != 1 and not bm.broadcast_heads):
        raise ValueError(f"block_mask was built for batch x heads {mb} x {mh} of a mask_mod that reads them; the "
                         f"call has {b} x {h}")  # fmt: skip


def _versions(block_mask: BlockMask) -> Optional[tuple]:
    """The mask tensors' versions (an in-place change makes new lists), or None for inference tensors (no
    counter: not cached)."""
    tensors = (block_mask.partial_count, block_mask.partial_index, block_mask.full_count, block_mask.full_index)
    if any(t.is_inference() for t in tensors):
        return None
    return tuple(t._version for t in tensors)


class KeyTileLists(NamedTuple):
    """A block mask as a kernel of tile_m x tile_n tiles reads it, int32 on the device: the forward's lists (a CTA per
    query tile, walking key tiles) or, by key tile (`query_tile_lists`), the backward's (a CTA per key tile, walking
    query tiles); below for the forward, the backward's with the two kinds of tile swapped. Its CTAs take the query
    tiles in `tiles` order, the one with the most key tiles first (what a causal kernel's reversed grid does, for any
    mask: a long tile started last would run alone at the end); count and index are by that launch position, full by
    query tile."""

    count: torch.Tensor  # (B, H, M): key tiles to visit, of the query tile at each launch position
    index: torch.Tensor  # (B, H, M, N): those key tiles, ascending, in the row's last count entries (the first a
    # kernel walks is the row's last entry: read without waiting for the count)
    full: torch.Tensor  # (B, H, M, N): 1 where a query tile's key tile needs no mask_mod, by query tile and key tile
    tiles: torch.Tensor  # (B, H, M): the query tile at each launch position


def key_tile_lists(block_mask: BlockMask, tile_m: int, tile_n: int, device) -> KeyTileLists:
    """The lists of the kernel's tile_m x tile_n tiles that overlap a non-empty tile of the block mask (whatever its
    own tile sizes); a kernel tile is full (the kernel skips the mask_mod on it) when every mask tile it overlaps is.
    On the device, no host sync; derived once per mask and tile shape."""
    return _tile_lists(block_mask, tile_m, tile_n, device, by_key=False)


def query_tile_lists(block_mask: BlockMask, tile_m: int, tile_n: int, device) -> KeyTileLists:
    """`key_tile_lists` by key tile, for the backward: count (B, H, N) and index (B, H, N, M) by launch position, the
    query tiles each key tile visits; full (B, H, N, M) by key tile; tiles (B, H, N) the key tile at each position."""
    return _tile_lists(block_mask, tile_m, tile_n, device, by_key=True)


def _tile_lists(block_mask: BlockMask, tile_m: int, tile_n: int, device, by_key: bool) -> KeyTileLists:
    cache = block_mask.__dict__.setdefault("_key_tile_lists", {})
    versions = _versions(block_mask)
    key = (tile_m, tile_n, by_key, versions)
    if versions is not None and key in cache:
        return cache[key]
    n = block_mask.partial_index.shape[-1]

    def marked(count: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # (B, H, m, n) 0 / 1
        grid = torch.zeros(index.shape, dtype=torch.float32, device=device)
        valid = (torch.arange(n, device=device) < count.unsqueeze(-1)).float()  # (no host sync: no nonzero)
        # (the padding past a row's count is unspecified: any value, scattered nowhere)
        safe = torch.where(valid > 0, index.long(), 0).clamp(0, max(n - 1, 0))
        return (grid.scatter_add_(-1, safe, valid) > 0).float()

    partial = marked(block_mask.partial_count, block_mask.partial_index)
    full = marked(block_mask.full_count, block_mask.full_index)
    m = partial.shape[-2]

    def overlap(kernel_tile: int, mask_tile: int, tiles_of_mask: int, length: int) -> torch.Tensor:
        tiles = max(1, -(-length // kernel_tile))
        starts = torch.arange(tiles, device=device) * kernel_tile
        ends = torch.clamp(starts + kernel_tile, max=max(length, 1)) - 1
        cols = torch.arange(tiles_of_mask, device=device)
        return ((cols >= (starts // mask_tile).unsqueeze(1)) & (cols <= (ends // mask_tile).unsqueeze(1))).float()

    rows = overlap(tile_m, block_mask.tile_m, m, block_mask.seqlen_q)  # (M, m)
    cols = overlap(tile_n, block_mask.tile_n, n, block_mask.seqlen_k)  # (N, n)
    touched = rows.sum(1, keepdim=True) * cols.sum(1)  # (M, N): mask tiles under each kernel tile
    full_cover = rows @ full @ cols.T  # (B, H, M, N): how many of them are full
    selected = ((rows @ partial @ cols.T) + full_cover) > 0
    full = full_cover == touched
    if by_key:  # (the lists by key tile: (B, H, N, M))
        selected, full = selected.transpose(-1, -2), full.transpose(-1, -2)
    count = selected.sum(-1, dtype=torch.int32)
    index = torch.argsort(selected.to(torch.int8), dim=-1, stable=True).to(torch.int32)  # (the selected last)
    order = torch.argsort(count, dim=-1, descending=True, stable=True)
    lists = KeyTileLists(
        count.gather(-1, order).contiguous(),
        index.gather(-2, order.unsqueeze(-1).expand_as(index)).contiguous(),
        full.to(torch.int32).contiguous(),
        order.to(torch.int32).contiguous(),
    )
    if versions is not None and not gpu.capturing(lists.count):  # (lists built in a capture exist only in it)
        for stale in [k for k in cache if k[3] != versions]:  # (lists of the tensors' older contents)
            del cache[stale]
        cache[key] = lists
    return lists


class _ModsAttention(torch.autograd.Function):
    """The autograd node of a score_mod / mask_mod call: the routed families' forward and backward (the backward's
    route fixed at the forward) with the call's tables; lse is differentiable (its gradient folds into D)."""

    @staticmethod
    def forward(ctx, q, k, v, problem, backends, blocks, block_mask, seqs, *tables):
        out, lse = _forward(q, k, v, problem, backends[0], list(tables), blocks, seqs)
        ctx.save_for_backward(q, k, v, out, lse, *tables)
        ctx.problem, ctx.block_mask = problem, block_mask  # (the backward's lists: its family's tiles, by key tile)
        ctx.backend, ctx.seqs = backends[1], seqs
        ctx.versions = None if block_mask is None else _versions(block_mask)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from ..arch.base import BwdTensors, Grads

        q, k, v, out, lse, *tables = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dout = kernel_view(dout, name="dout")  # (autograd may hand over a broadcast: out.sum().backward())
        grads = Grads(torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        nones = (None,) * (5 + len(tables))  # (problem, backend, blocks, block_mask, seqs, tables)
        if _empty(q, k):
            return (grads.dq.zero_(), grads.dk.zero_(), grads.dv.zero_(), *nones)
        problem, block_mask, backend = ctx.problem, ctx.block_mask, ctx.backend
        if block_mask is not None and _versions(block_mask) != ctx.versions:
            raise RuntimeError("the block mask was changed in place between the forward and its backward")
        tiles = backend.mods_query_tiles(problem.spec) if block_mask is not None else None
        blocks = None if tiles is None else query_tile_lists(block_mask, *tiles, q.device)
        if problem.spec.block_sparse != (blocks is not None):  # (without lists: every tile of the mask range)
            spec = dataclasses.replace(problem.spec, block_sparse=blocks is not None)
            problem = dataclasses.replace(problem, spec=spec)
        with gpu.guard(q):
            backend.backward_mods(BwdTensors(dout, q, k, v, out, lse, dlse), grads, problem, tables, blocks, ctx.seqs)
        return (grads.dq, grads.dk, grads.dv, *nones)

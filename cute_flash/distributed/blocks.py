"""The per-step block computation of ring attention, as an object the ring calls.

A block is one (query rows, key rows, kernel mask) launch of a ring step (`plan.BlockTask`); the mask is the
kernel's bottom-right-aligned rule (`cute_flash.spec.MaskBounds`). Two implementations:

  ReferenceBlocks  plain torch on any device and dtype (float64 in the CPU tests), written out explicitly;
  KernelBlocks     cute-flash's routed kernels on CUDA (fp16/bf16), called exactly as `cute_flash.attention` does.

Protocol (`BlockCompute`):
  forward(q, k, v, mask, softmax_scale, softcap) -> (out, lse)
      attention of q over k/v alone: out (b, m, h, dv), lse (b, h, m) (float32 or wider); rows that see no key give
      out 0 and lse -inf. softcap > 0: every score is softcap * tanh(score * softmax_scale / softcap) before the mask
      (0: none). Learnable sinks are not the blocks': the ring merges them once, after every block.
  backward(t: BwdTensors, mask, softmax_scale, softcap) -> (dq, dk, dv)
      t = (dout, q, k, v, out, lse), as a kernel backend's backward reads them (`cute_flash.arch.base`); this block's
      share of the gradients, given the FINAL out and lse of the query rows over all keys of the ring:
      P = exp(S·scale - lse) is then the block's slice of the global softmax, and dS = P∘(dP - D) with
      D = rowsum(dO∘O) over the final O (lse and O include the sinks: the key gradients need nothing else); dq, dk,
      dv of the blocks add up to the gradients of the whole attention.
  check(q, k, v, mask_kinds, backward, softcap) -> None
      raises before any communication when the blocks cannot serve these shards (every rank raises alike).
"""

from __future__ import annotations

from typing import Iterable, Optional, Protocol, Tuple

import torch

from ..arch.base import BwdTensors
from ..core import launch, plan
from ..kernel_layout import kernel_view
from ..reference import visible_keys
from ..spec import MaskBounds


class BlockCompute(Protocol):
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: MaskBounds,
        softmax_scale: float,
        softcap: float = 0.0,
    ) -> Tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip

    def backward(
        self, t: BwdTensors, mask: MaskBounds, softmax_scale: float, softcap: float = 0.0
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def check(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask_kinds: Iterable[str],
        backward: bool,
        softcap: float = 0.0,
    ) -> None: ...  # fmt: skip


def _expand_heads(x: torch.Tensor, nheads: int) -> torch.Tensor:
    """(b, n, h_kv, d) -> (b, n, h, d): query head i reads kv head i // (h // h_kv)."""
    return x.repeat_interleave(nheads // x.shape[2], dim=2)


def _fold_heads(g: torch.Tensor, nheads_kv: int) -> torch.Tensor:
    """(b, n, h, d) -> (b, n, h_kv, d): the sum over the query heads that share each kv head."""
    b, n, h, d = g.shape
    return g.reshape(b, n, nheads_kv, h // nheads_kv, d).sum(dim=3)


class ReferenceBlocks:
    """Blocks in plain torch, computed in `compute_dtype` (default: the inputs' dtype; float32 for fp16/bf16)."""

    def __init__(self, compute_dtype: Optional[torch.dtype] = None):
        self.compute_dtype = compute_dtype

    def _dtype(self, t: torch.Tensor) -> torch.dtype:
        if self.compute_dtype is not None:
            return self.compute_dtype
        return torch.promote_types(t.dtype, torch.float32)

    def check(self, q, k, v, mask_kinds, backward, softcap=0.0) -> None:
        return None  # plain torch serves every shape the ring's validation lets through

    def _scores(self, q, k, mask: MaskBounds, scale: float, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """Scaled scores S·scale (b, h, m, n) and the visibility (m, n) of the kernel rule."""
        h = q.shape[2]
        s = torch.einsum("bqhd,bkhd->bhqk", q.to(dtype), _expand_heads(k.to(dtype), h)) * scale
        return s, visible_keys(q.shape[1], k.shape[1], mask, device=q.device)

    def forward(self, q, k, v, mask, softmax_scale, softcap=0.0):
        dtype = self._dtype(q)
        s, visible = self._scores(q, k, mask, softmax_scale, dtype)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~visible, float("-inf"))
        row_max = s.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)  # no key: exp(-inf) = 0
        p = torch.exp(s - row_max)
        row_sum = p.sum(dim=-1, keepdim=True)
        lse = (row_max + torch.log(row_sum)).squeeze(-1)  # log(0) = -inf for rows with no key
        p = p / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
        out = torch.einsum("bhqk,bkhd->bqhd", p, _expand_heads(v.to(dtype), q.shape[2]))
        return out, lse

    def backward(self, t: BwdTensors, mask, softmax_scale, softcap=0.0):
        dout, q, k, v, out, lse, dlse = t[:7]
        dtype = self._dtype(q)
        h, h_kv = q.shape[2], k.shape[2]
        s, visible = self._scores(q, k, mask, softmax_scale, dtype)
        if softcap:
            tanh = torch.tanh(s / softcap)
            s = softcap * tanh
        lse_c = lse.to(dtype).unsqueeze(-1)
        # P is this block's slice of the softmax over all keys of the ring (lse is the final one). Rows with no key
        # anywhere (lse -inf) and hidden keys get P = 0.
        keep = visible & ~torch.isneginf(lse_c)
        p = torch.where(keep, torch.exp(s - torch.where(keep, lse_c, torch.zeros_like(lse_c))), torch.zeros_like(s))
        do = dout.to(dtype)
        ve = _expand_heads(v.to(dtype), h)
        ke = _expand_heads(k.to(dtype), h)
        d_row = (do * out.to(dtype)).sum(dim=-1).transpose(1, 2).unsqueeze(-1)  # D = rowsum(dO∘O), (b, h, m, 1)
        if dlse is not None:  # lse's gradient: D - dlse (arch/base.fold_lse_grad); rows without keys keep D
            d_row = d_row - torch.where(torch.isneginf(lse_c), 0.0, dlse.to(dtype).unsqueeze(-1))
        dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
        dp = torch.einsum("bqhd,bkhd->bhqk", do, ve)
        ds = p * (dp - d_row)
        if softcap:  # through the cap: d(softcap * tanh(x / softcap)) / dx = 1 - tanh^2
            ds = ds * (1 - tanh.square())
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, ke) * softmax_scale
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(dtype)) * softmax_scale
        return dq, _fold_heads(dk, h_kv), _fold_heads(dv, h_kv)


def _call_mask(mask: MaskBounds) -> dict:
    """The (causal, window_size) of `cute_flash.attention` whose normalised mask is `mask` (a block's kernel mask)."""
    if mask.kind == "none":
        return dict(causal=False, window_size=(None, None))
    if mask.kind == "causal":
        return dict(causal=True, window_size=(None, None))
    return dict(causal=False, window_size=(mask.left, mask.right))


class KernelBlocks:
    """Blocks on cute-flash's kernels (CUDA, fp16/bf16), planned and launched by the call core exactly as
    `cute_flash.attention` calls are (core/plan.py, core/launch.py: one plan per block shape and mask, cached).

    deterministic: ask for the backward that sums in a fixed order (see `cute_flash.attention`)."""

    def __init__(self, deterministic: bool = False):
        self.deterministic = deterministic

    def _plan(self, q, k, v, mask: MaskBounds, softmax_scale, softcap: float):
        return plan.of_call(
            q, k, v, **_call_mask(mask), softmax_scale=float(softmax_scale), deterministic=self.deterministic,
            softcap=softcap, learnable_sink=None,
        )  # fmt: skip

    def check(self, q, k, v, mask_kinds, backward, softcap=0.0) -> None:
        # The shard as one call of each mask kind: device, dtype, head dims, launch limits (errors name the argument),
        # then the route of each direction (a family without a kernel for it raises before any communication).
        for kind in sorted(set(mask_kinds)) or ["none"]:
            planned = self._plan(q, k, v, MaskBounds(kind, 1, 0), 1.0, softcap)
            if backward:
                planned.backward_backend(q)

    def forward(self, q, k, v, mask, softmax_scale, softcap=0.0):
        planned = self._plan(q, k, v, mask, softmax_scale, softcap)
        return launch.forward(planned, *launch.kernel_inputs(planned, q, k, v))

    def backward(self, t: BwdTensors, mask, softmax_scale, softcap=0.0):
        planned = self._plan(t.q, t.k, t.v, mask, softmax_scale, softcap)
        q, k, v = launch.kernel_inputs(planned, t.q, t.k, t.v)
        # The kernels read out in the inputs' dtype and lse (b, h, m) contiguous float32.
        out, lse = kernel_view(t.out.to(q.dtype)), t.lse.float().contiguous()
        dq, dk, dv, _ = launch.backward(planned, t.dout, q, k, v, out, lse, t.dlse)
        return dq, dk, dv


def default_blocks(device: torch.device) -> BlockCompute:
    """KernelBlocks on CUDA, ReferenceBlocks elsewhere."""
    return KernelBlocks() if device.type == "cuda" else ReferenceBlocks()

"""FP8 (e4m3) quantisation with one scale per tile-sized block: the torch reference of the pre-pass kernel.

Scale convention (shared with `prepass_kernel.py` and the attention kernel):
  amax     = max |x| over one block (after the optional Hadamard rotation), in float32;
  descale  = amax / 448  (1 when amax == 0), stored as float32;    x ≈ e4m3(x · 448 / amax) · descale;
  the quantised value is round-to-nearest-even of x · (448 / amax), saturated to ±448 (PTX `cvt.rn.satfinite`).

Blocks (per (batch, head), over all of head_dim):
  Q: `block_m` consecutive query rows  -> q_descale (b, h,    ceil(sq / block_m))
  K: `block_n` consecutive key rows    -> k_descale (b, h_kv, ceil(sk / block_n))
  V: the same `block_n` key rows       -> v_descale (b, h_kv, ceil(sk / block_n))
The attention kernel's key tile equals block_n, so each K/V tile needs one K and one V scale; its query tile is a
multiple of block_m.

V is stored transposed, (b, h_kv, dv, sk_pad) with the sequence contiguous: the FP8 wgmma needs both operands
K-major, and for O = P·V the reduction (K) dimension is the sequence. Within every group of 16 keys the columns are
permuted: column 16·j + p holds key 16·j + V_KEY_PERM16[p]. That is the key order in which the attention kernel's
score accumulator already holds P in registers, so P needs no shuffle to become the e4m3 A operand (see
`cute_flash.arch.sm90.fp8.permute`). sk_pad rounds sk up to a multiple of 16; the padding columns are zero (the
kernel reads them: a padding key may sit at a position below sk after the permutation; its P is 0).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .hadamard import rotate as hadamard_rotate

E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
V_SEQ_ALIGN = 16  # elements (= bytes for fp8): TMA needs 16-byte aligned row strides; also the permutation group
# Column p of a 16-key group of transposed V holds key V_KEY_PERM16[p]:
# p = 4·t + i holds key 2·t + (i & 1) + 8·(i >> 1).
V_KEY_PERM16 = tuple(2 * (p // 4) + (p % 4 & 1) + 8 * (p % 4 >> 1) for p in range(16))


def num_blocks(seqlen: int, block: int) -> int:
    return (seqlen + block - 1) // block


def padded_seqlen(seqlen: int) -> int:
    return (seqlen + V_SEQ_ALIGN - 1) // V_SEQ_ALIGN * V_SEQ_ALIGN


def block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """max |x| over blocks of `block` rows of dim 1 and all of the last dim: (b, s, h, d) -> (b, h, nblocks) fp32."""
    b, s, h, d = x.shape
    nb = num_blocks(s, block)
    xa = x.abs().to(torch.float32)
    if nb * block != s:
        xa = torch.nn.functional.pad(xa, (0, 0, 0, 0, 0, nb * block - s))
    return xa.reshape(b, nb, block, h, d).amax(dim=(2, 4)).permute(0, 2, 1).contiguous()


def quant_factors(amax: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(multiplier, descale) for a block maximum: 448 / amax and amax / 448, both 1 for an all-zero block."""
    zero = amax == 0
    safe = torch.where(zero, torch.ones_like(amax), amax)
    # A true division, as the kernel's div.rn: torch evaluates `scalar / tensor` as reciprocal(tensor) * scalar,
    # two roundings that can move x · mult across an e4m3 rounding boundary.
    mult = torch.where(zero, torch.ones_like(amax), torch.full_like(safe, E4M3_MAX).div(safe))
    descale = torch.where(zero, torch.ones_like(amax), safe / E4M3_MAX)
    return mult, descale


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest even, saturating at ±448 (torch's own cast turns overflow into NaN)."""
    return x.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def _expand_blocks(per_block: torch.Tensor, block: int, seqlen: int) -> torch.Tensor:
    """(b, h, nblocks) -> (b, seqlen, h, 1): each row gets its block's value."""
    rows = per_block.repeat_interleave(block, dim=2)[:, :, :seqlen]
    return rows.permute(0, 2, 1).unsqueeze(-1)


def quantize_blocks(
    x: torch.Tensor, block: int, signs: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(b, s, h, d) fp16/bf16/fp32 -> (e4m3 (b, s, h, d), descale (b, h, nblocks)); rotated first when `signs`."""
    xf = hadamard_rotate(x, signs) if signs is not None else x.to(torch.float32)
    mult, descale = quant_factors(block_amax(xf, block))
    return to_e4m3(xf * _expand_blocks(mult, block, x.shape[1])), descale


def dequantize_blocks(x8: torch.Tensor, descale: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of `quantize_blocks` up to rounding (and the rotation, which it does not undo): float32."""
    return x8.to(torch.float32) * _expand_blocks(descale, block, x8.shape[1])


def v_key_order(seqlen_pad: int, device=None) -> torch.Tensor:
    """Key held by each column of a transposed V row of `seqlen_pad` (a multiple of 16) columns."""
    perm = torch.tensor(V_KEY_PERM16, dtype=torch.int64, device=device)
    return (torch.arange(0, seqlen_pad, V_SEQ_ALIGN, device=device).unsqueeze(1) + perm).reshape(-1)


def transpose_v(v8: torch.Tensor) -> torch.Tensor:
    """(b, sk, h_kv, dv) e4m3 -> (b, h_kv, dv, sk_pad) e4m3, sequence contiguous, keys permuted per 16 and zero
    padded (see the module docstring)."""
    b, sk, hkv, dv = v8.shape
    sk_pad = padded_seqlen(sk)
    # Work on bytes: not every torch build has fp8 copy kernels for strided views or index_select.
    padded = torch.zeros(b, sk_pad, hkv, dv, dtype=torch.uint8, device=v8.device)
    padded[:, :sk].copy_(v8.view(torch.uint8))
    permuted = padded.index_select(1, v_key_order(sk_pad, v8.device))
    return permuted.permute(0, 2, 3, 1).contiguous().view(FP8_DTYPE)


def untranspose_v(v_t: torch.Tensor, seqlen: int) -> torch.Tensor:
    """Inverse of `transpose_v`: (b, h_kv, dv, sk_pad) -> (b, sk, h_kv, dv), for tests."""
    order = v_key_order(v_t.shape[-1], v_t.device)
    natural = torch.empty_like(v_t.view(torch.uint8))
    natural[..., order] = v_t.view(torch.uint8)
    return natural[..., :seqlen].permute(0, 3, 1, 2).contiguous().view(FP8_DTYPE)


def quantize_v_transposed(v: torch.Tensor, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(b, sk, h_kv, dv) -> (V transposed e4m3 (b, h_kv, dv, sk_pad), descale (b, h_kv, nblocks))."""
    v8, descale = quantize_blocks(v, block)
    return transpose_v(v8), descale


def quantize_per_tensor(x: torch.Tensor, signs: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor (the plain-FP8 baseline of the accuracy study): (e4m3, descale scalar)."""
    xf = hadamard_rotate(x, signs) if signs is not None else x.to(torch.float32)
    mult, descale = quant_factors(xf.abs().amax().reshape(1))
    return to_e4m3(xf * mult), descale


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_block: int, kv_block: int, per_block: bool):
    """Pre-quantised inputs as `attention(q8, k8, v8, descale=...)` takes them, and what they dequantise to:
    ((q8, k8, v8), (q, k, v descales), [q, k, v dequantised]). per_block: one factor per `q_block` query rows and per
    `kv_block` keys; otherwise one per (batch, KV head), FlashAttention-3's convention."""
    if per_block:
        pairs = [quantize_blocks(x, blk) for x, blk in ((q, q_block), (k, kv_block), (v, kv_block))]
        deq = [dequantize_blocks(x8, xd, blk) for (x8, xd), blk in zip(pairs, (q_block, kv_block, kv_block))]
        return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs), deq
    b, heads_kv = k.shape[0], k.shape[2]

    def per_head(x: torch.Tensor):
        heads_per_kv = x.shape[2] // heads_kv
        amax = x.float().abs().amax(dim=(1, 3)).reshape(b, heads_kv, heads_per_kv).amax(-1)
        descale = amax / E4M3_MAX
        scale = descale.repeat_interleave(heads_per_kv, dim=1)[:, None, :, None]
        x8 = to_e4m3(x.float() / scale)
        return x8, descale, x8.float() * scale

    (q8, qd, q_deq), (k8, kd, k_deq), (v8, vd, v_deq) = per_head(q), per_head(k), per_head(v)
    return (q8, k8, v8), (qd, kd, vd), [q_deq, k_deq, v_deq]

"""FP8 attention emulated in torch, tile by tile, the way the sm90 FP8 kernel computes it.

Used by the accuracy study to compare quantisation schemes before (and beside) the kernel, on CPU or GPU:
  - Q, K, V quantised to e4m3 per tensor or per block (optionally after the randomised Hadamard rotation of Q and K);
  - S = Q8·K8ᵀ with fp32 accumulation, times the Q and K descales and the softmax scale (the kernel folds all three
    into one per-tile factor of the exponent);
  - online softmax over key tiles from the right-most tile to the left (the kernel's order), P = 2^(S·c - m + 8)
    rounded to e4m3 (the +8 puts P in [0, 256] instead of [0, 1] so that small probabilities stay out of e4m3's
    subnormal range; the row sum carries the same factor, so it cancels);
  - O += P8·V8 with fp32 accumulation (exact products), times the V descale of the tile.
The fp32 row sum is taken from P before rounding, as in the kernel. This is a model of the arithmetic, not of the
tensor core's internal accumulation width; the kernel itself is measured on the GPU.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ..reference import expand_kv, visible_keys
from ..spec import normalize_mask
from .hadamard import DEFAULT_SEED, hadamard_signs
from .quantize import E4M3_MAX, FP8_DTYPE, dequantize_blocks, quantize_blocks, quantize_per_tensor, to_e4m3

SCHEMES = ("bf16", "fp8_tensor", "fp8_block", "fp8_block_rotate")
# Inputs that are already exactly e4m3 times their descales (pre-quantised): only P is rounded.
GIVEN = "fp8_given"
P_OFFSET_LOG2 = 8.0  # P in [0, 2^8]


def _dequant_inputs(q, k, v, scheme: str, block_m: int, block_n: int, seed: int):
    """Q, K, V as the kernel sees them (dequantised to float32; Q and K rotated when the scheme says so)."""
    if scheme == "bf16":
        return q.to(torch.bfloat16).float(), k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
    if scheme == GIVEN:
        return q.float(), k.float(), v.float()
    signs = hadamard_signs(q.shape[-1], seed, q.device) if scheme == "fp8_block_rotate" else None
    if scheme == "fp8_tensor":
        deq = []
        for t, s in ((q, signs), (k, signs), (v, None)):
            t8, descale = quantize_per_tensor(t, s)
            deq.append(t8.float() * descale)
        return tuple(deq)
    if scheme in ("fp8_block", "fp8_block_rotate"):
        q8, dq = quantize_blocks(q, block_m, signs)
        k8, dk = quantize_blocks(k, block_n, signs)
        v8, dv = quantize_blocks(v, block_n)
        return (
            dequantize_blocks(q8, dq, block_m),
            dequantize_blocks(k8, dk, block_n),
            dequantize_blocks(v8, dv, block_n),
        )
    raise ValueError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}")


def emulated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scheme: str,
    causal: bool = False,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    softmax_scale: Optional[float] = None,
    block_m: int = 64,
    block_n: int = 128,
    seed: int = DEFAULT_SEED,
    p_offset_log2: float = P_OFFSET_LOG2,
    sum_rounded_p: bool = False,
) -> torch.Tensor:
    """out (b, sq, h, dv) float32 of `scheme` (SCHEMES, or GIVEN); q, k, v (b, s, h, d) in any float dtype."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    scale_log2 = (softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)) * math.log2(math.e)
    qf, kf, vf = _dequant_inputs(q, k, v, scheme, block_m, block_n, seed)
    kf, vf = expand_kv(kf, h), expand_kv(vf, h)
    allowed = visible_keys(sq, sk, normalize_mask(causal, window_size), device=q.device)
    fp8 = scheme != "bf16"
    row_max = torch.full((b, h, sq, 1), float("-inf"), device=q.device)
    row_sum = torch.zeros((b, h, sq, 1), device=q.device)
    acc = torch.zeros((b, h, sq, vf.shape[-1]), device=q.device)
    n_blocks = (sk + block_n - 1) // block_n
    for n in reversed(range(n_blocks)):
        n0, n1 = n * block_n, min((n + 1) * block_n, sk)
        s = torch.einsum("bqhd,bkhd->bhqk", qf, kf[:, n0:n1]) * scale_log2
        s = s.masked_fill(~allowed[:, n0:n1], float("-inf"))
        new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))
        safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        offset = p_offset_log2 if fp8 else 0.0
        p = torch.exp2(s - safe + offset)
        p_used = to_e4m3(p).float() if fp8 else p.to(torch.bfloat16).float()
        corr = torch.exp2(row_max - safe)
        row_sum = row_sum * corr + (p_used if sum_rounded_p else p).sum(dim=-1, keepdim=True)
        acc = acc * corr + torch.einsum("bhqk,bkhd->bhqd", p_used, vf[:, n0:n1])
        row_max = new_max
    safe_sum = torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
    return (acc / safe_sum).permute(0, 2, 1, 3)


__all__ = ["SCHEMES", "emulated_attention", "E4M3_MAX", "FP8_DTYPE"]

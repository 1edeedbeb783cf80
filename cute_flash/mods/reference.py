"""The float64 reference of attention with a score_mod and / or a mask_mod (FlexAttention's semantics), in plain
torch on any device. It calls the user's callables themselves on broadcast index tensors, not their traced graphs,
so it also checks the tracing (tests compare the two).

Semantics: scores are q . k * softmax_scale; score_mod(score, b, h, q_idx, kv_idx) replaces each, then keys where
mask_mod(b, h, q_idx, kv_idx) is False (and outside `causal` / `window_size`, bottom-right aligned as in
`cute_flash.attention`) are removed before the softmax. q_idx / kv_idx are positions 0.. within the sequence, h the
query head (GQA: key head h // (h / h_kv)). A row that sees no key gives out 0 and lse -inf. Gradients come from
autograd through the float64 computation (score_mod's derivative included).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import torch

from ..reference import expand_kv, visible_keys
from ..spec import normalize_mask

Window = Tuple[Optional[int], Optional[int]]


def attention_mods_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    score_mod: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    causal: bool = False,
    window_size: Window = (None, None),
    softmax_scale: Optional[float] = None,
    compute_dtype: torch.dtype = torch.float64,
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """q (b, sq, h, d), k / v (b, sk, h_kv, d / dv); out (b, sq, h, dv) in compute_dtype, lse (b, h, sq) float32."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (batch, seqlen, heads, head_dim)")
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if h % hk or v.shape[:3] != k.shape[:3] or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    qf, kf, vf = (x.to(compute_dtype) for x in (q, k, v))
    kf, vf = expand_kv(kf, h), expand_kv(vf, h)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    dev = q.device
    bi = torch.arange(b, device=dev).view(b, 1, 1, 1)
    hi = torch.arange(h, device=dev).view(1, h, 1, 1)
    qi = torch.arange(sq, device=dev).view(1, 1, sq, 1)
    ki = torch.arange(sk, device=dev).view(1, 1, 1, sk)
    if score_mod is not None:
        s = torch.as_tensor(score_mod(s, bi, hi, qi, ki), dtype=compute_dtype, device=dev).expand(b, h, sq, sk)
    visible = visible_keys(sq, sk, normalize_mask(causal, window_size), device=dev).view(1, 1, sq, sk)
    if mask_mod is not None:
        visible = visible & torch.as_tensor(mask_mod(bi, hi, qi, ki), device=dev).to(torch.bool)
    visible = visible.expand(b, h, sq, sk)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for a row that sees nothing
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("bhqk,bkhd->bqhd", p, vf)
    return (out, lse.float()) if return_lse else out


def attention_varlen_mods_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    score_mod: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    causal: bool = False,
    window_size: Window = (None, None),
    softmax_scale: Optional[float] = None,
    seqused_k: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float64,
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Packed sequences (`attention_varlen`'s layout: q (total_q, h, d), k / v (total_k, h_kv, d / dv)): sequence b
    through `attention_mods_reference` with the callables seeing b itself and positions within the sequence (only
    its first seqused_k[b] keys with seqused_k). out (total_q, h, dv) in compute_dtype, lse (h, total_q) float32."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used = None if seqused_k is None else seqused_k.tolist()
    outs, lses = [], []

    def shifted(fn: Optional[Callable], b: int, score: bool) -> Optional[Callable]:
        if fn is None:
            return None
        if score:
            return lambda s, bi, h, qi, ki: fn(s, bi + b, h, qi, ki)
        return lambda bi, h, qi, ki: fn(bi + b, h, qi, ki)

    for b in range(len(cu_q) - 1):
        k_end = cu_k[b + 1] if used is None else cu_k[b] + min(used[b], cu_k[b + 1] - cu_k[b])
        qs, ks, vs = q[cu_q[b] : cu_q[b + 1]], k[cu_k[b] : k_end], v[cu_k[b] : k_end]
        out, lse = attention_mods_reference(
            qs[None], ks[None], vs[None], score_mod=shifted(score_mod, b, True), mask_mod=shifted(mask_mod, b, False),
            causal=causal, window_size=window_size, softmax_scale=softmax_scale, compute_dtype=compute_dtype,
            return_lse=True,
        )  # fmt: skip
        outs.append(out[0])
        lses.append(lse[0])
    out, lse = torch.cat(outs), torch.cat(lses, dim=-1)
    return (out, lse) if return_lse else out

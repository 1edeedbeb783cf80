"""`attention_varlen`: attention over packed sequences of different lengths (cu_seqlens), forward and backward.

Served by the kernel families that have a packed (varlen) variant: the sm80 family (FlashAttention-2 design) on
Ampere, and on Hopper the sm90 packed forward and backward (deterministic too); sm100 has none, so on a Blackwell GPU
the router sends the call to the sm80 kernels built for sm_100a (never run there). `explain_varlen` shows the
skipped families with their reasons.

The kernels read each sequence's offsets from cu_seqlens on the GPU, so a call makes no device-to-host copy and can
be captured in a CUDA graph. The sm90 forward and backward main kernels launch one CTA per tile that exists (plus at
most batch + 1 idle ones per head; common/packed_tiles.py); the sm80 kernels and the pre- / postprocess kernels span
max_seqlen's blocks for every sequence, and the CTAs whose block lies past their own sequence's end exit at once.

Under torch.compile the call is traced as the custom ops `cute_flash::fwd` / `bwd` with their packed-sequence
arguments (cute_flash/ops.py), without a graph break; eager calls run the same steps without the custom-op dispatch
(the call core, cute_flash/core/: plan cached per signature, autograd node, the one forward / backward launcher), as
`attention` does.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import torch

from .core import call
from .core import device as gpu
from .problem import PackedSeqs
from .routing import Explanation, explaining, parse_capability
from .validation import validate_seqused, validate_varlen, validate_varlen_layout

Window = Tuple[Optional[int], Optional[int]]


def attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Window = (None, None),
    seqused_k: Optional[torch.Tensor] = None,
    seqused_q: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_lse: bool = False,
    softcap: float = 0.0,
    learnable_sink: Optional[torch.Tensor] = None,
    score_mod: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Exact attention over a batch of packed sequences, on a CUDA GPU.

    q (total_q, nheads, head_dim), k (total_k, nheads_kv, head_dim), v (total_k, nheads_kv, head_dim_v); sequence b
    is rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q against rows cu_seqlens_k[b]:cu_seqlens_k[b+1] of k and v (only
    the first seqused_k[b] of them when seqused_k, int32 (batch,), is given). cu_seqlens_* are int32 (batch + 1,) on
    q's device, start at 0, never decrease and end at total_q / total_k (rows past the end would never be written: give
    padding rows a sequence of their own); max_seqlen_* are host ints at least every
    sequence's length (not checked: that would need a device-to-host copy). Sequences of length 0 are allowed.

    causal / window_size / softmax_scale as in `cute_flash.attention`, aligned per sequence (bottom-right: query i of
    a sequence sees key j iff j <= i + seqlen_k - seqlen_q; window bounds may be negative). A row that sees no key
    gets out 0 and lse -inf. Returns out (total_q, nheads, head_dim_v) in q's dtype and, with return_lse, lse
    (nheads, total_q) float32 (differentiable like out).

    seqused_q, int32 (batch,), as FlashAttention's: only the first seqused_q[b] query rows of sequence b are
    attended (aligned on that count); its other rows get out 0, lse -inf (the sink's logit with a learnable_sink)
    and zero gradients. Its values are not read on the host: one past a sequence's length counts as that length.

    softcap and learnable_sink as in `cute_flash.attention`: softcap > 0 caps every score at
    softcap * tanh(score * softmax_scale / softcap) before the mask and the softmax; a (nheads,) learnable_sink adds
    one logit per query head to each row's softmax denominator (attending to no value; lse includes it; a row
    without keys gets out 0 and lse = sink_h); dsink_h = sum over rows of P_sink,i * (dlse_i - D_i).

    Differentiable in q, k, v (and learnable_sink). deterministic=True asks for a backward that sums in a fixed order
    (the sm90 family's on Hopper); where the sm80 family would train, which has none, it raises NotImplementedError
    before the forward when gradients are needed.

    score_mod / mask_mod as in `cute_flash.attention` (docs/mods.md), with b the sequence's index and q_idx /
    kv_idx positions within the sequence (0 at its first row); forward and backward on the sm90 kernels on Hopper,
    elsewhere (Ampere, Blackwell) the sm80 family's, whose backward takes head_dim == head_dim_v, a multiple of 32.
    Not with seqused_q, deterministic, softcap or learnable_sink.
    """
    if score_mod is not None or mask_mod is not None:
        if seqused_q is not None or deterministic or softcap or learnable_sink is not None:
            raise NotImplementedError(
                "score_mod / mask_mod over packed sequences do not combine with seqused_q, deterministic, softcap or "
                "learnable_sink"
            )
        from .mods.call import attention_varlen_mods

        seqs = PackedSeqs(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k)
        return attention_varlen_mods(q, k, v, seqs, score_mod, mask_mod, causal, softmax_scale, window_size,
                                     return_lse)  # fmt: skip
    seqs = _with_used_queries(q, k, v, PackedSeqs(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k),
                              seqused_q)  # fmt: skip
    return call.packed(
        q, k, v, seqs, causal, softmax_scale, window_size, deterministic, softcap, learnable_sink, return_lse
    )


@explaining(attention_varlen)
def explain_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, seqused_q, capability, **call
) -> Explanation:
    """Which family would serve `attention_varlen(...)` with these arguments (attention_varlen's, return_lse
    aside), forward and backward, why the others were skipped (e.g. on Blackwell, "sm100" without a varlen kernel),
    and what the call asks of it (mask and window, softcap, learnable sinks). Validates like `attention_varlen`.
    capability: explain for a GPU of that compute capability, (9, 0), "9.0" or "sm90" (then the inputs may be CPU or
    meta tensors), as in `cute_flash.explain`."""
    given = None if capability is None else parse_capability(capability)
    seqs = PackedSeqs(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k)
    if seqused_q is not None:
        validate_seqused("seqused_q", seqused_q, validate_varlen_layout(q, k, v, seqs), q)
    mods = call.pop("score_mod"), call.pop("mask_mod")
    problem = validate_varlen(q, k, v, seqs, **call, any_device=given is not None)
    if mods != (None, None):
        from .mods.call import mods_problem

        problem, _ = mods_problem(problem, *mods)
    return Explanation.of(problem, gpu.capability(q) if given is None else given, call["deterministic"])


def _with_used_queries(q, k, v, seqs: PackedSeqs, seqused_q: Optional[torch.Tensor]) -> PackedSeqs:
    """seqs with seqused_q applied (PackedSeqs.with_used_queries), after the checks it needs."""
    if seqused_q is None:
        return seqs
    validate_seqused("seqused_q", seqused_q, validate_varlen_layout(q, k, v, seqs), q)
    return seqs.with_used_queries(seqused_q)

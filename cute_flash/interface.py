"""The public torch API: `attention`, `backend` and `explain` (the call core, cute_flash/core/, does the work)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Tuple, Union

import torch

from .arch import resolve_arch
from .core import call
from .core import device as gpu
from .core.plan import clear_call_cache  # noqa: F401  (public: forget every cached call plan)
from .routing import Explanation, explaining, parse_capability
from .validation import validate

if TYPE_CHECKING:
    from .mods.block_mask import BlockMask


def backend(device: Optional[Union[torch.device, int, str]] = None) -> str:
    """The kernel family a GPU prefers ("sm80", "sm90", "sm100"; default: the current CUDA device).

    A call whose spec that family has no kernel for goes to the next family the GPU runs (sm80 on Hopper); `explain`
    says which family serves a given call. The environment variable CUTE_FLASH_ARCH forces one family, e.g. to run
    the sm80 kernels on an H100.
    """
    capability = None
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
    return resolve_arch(capability)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    dtype: Optional[str] = None,
    return_lse: bool = False,
    fp8_rotate: bool = True,
    descale: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    deterministic: bool = False,
    softcap: float = 0.0,
    learnable_sink: Optional[torch.Tensor] = None,
    score_mod: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    block_mask: Optional[BlockMask] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention softmax(q kᵀ · scale + mask) v on a CUDA GPU, by the kernel family that serves it.

    q (batch, seqlen_q, nheads, head_dim); k (batch, seqlen_k, nheads_kv, head_dim); v (batch, seqlen_k, nheads_kv,
    head_dim_v); nheads % nheads_kv == 0 (GQA/MQA). Returns out (batch, seqlen_q, nheads, head_dim_v) in the inputs'
    dtype and, with return_lse, the float32 log-sum-exp (batch, nheads, seqlen_q) of the scaled scores (natural log;
    differentiable like out: a loss may use both).

    causal: bottom-right aligned, query i sees key j iff j <= i + seqlen_k - seqlen_q. window_size=(left, right)
    restricts that further to i + off - left <= j <= i + off + right (off = seqlen_k - seqlen_q; None = unlimited;
    either bound may be negative, moving that edge past the diagonal). A row that sees no key gives out 0 and lse
    -inf. dtype=None computes in the inputs' dtype; dtype="fp8" asks for the FP8 path.
    Differentiable when the serving family has a backward kernel (the error says so when it has none).

    softcap > 0 (Gemma 2's logit soft-capping): every score becomes softcap * tanh(score * softmax_scale / softcap),
    before the mask and the softmax (0: off).

    learnable_sink (gpt-oss's attention sinks): None, or a (nheads,) float32 / bfloat16 / float16 tensor, one
    natural-log logit per query head that joins each row's softmax denominator and attends to no value:
    out_i = sum_j exp(s_ij - lse_i) v_j with lse_i = log(exp(sink_h) + sum_j exp(s_ij)); lse includes it, and a row
    without keys gets out 0 and lse = sink_h. Its gradient (in its dtype) is dsink_h = sum over batch and rows of
    P_sink,i * (dlse_i - D_i), P_sink,i = exp(sink_h - lse_i), D_i = rowsum(dout_i * out_i).

    FP8 (forward only; see docs/fp8.md): dtype="fp8" with fp16/bf16 inputs quantises q, k, v on the GPU to e4m3 with
    one scale per block, after multiplying q and k by a random orthogonal (Hadamard) matrix unless
    fp8_rotate=False; out keeps the inputs' dtype. Already quantised float8_e4m3fn inputs take
    descale=(q_descale, k_descale, v_descale), float32 of shape (batch, nheads_kv) or per block (see
    cute_flash.fp8.prepare); their out is bf16. A gradient through the FP8 path raises NotImplementedError, as do
    softcap and learnable_sink there.

    deterministic: the backward sums dQ (and, under GQA/MQA, dK and dV) in a fixed order, so that repeated runs give
    bitwise-equal gradients (slower: see docs/performance.md). Families whose backward cannot do that raise
    NotImplementedError when gradients are needed.

    score_mod(score, b, h, q_idx, kv_idx) -> score and mask_mod(b, h, q_idx, kv_idx) -> bool (FlexAttention's
    callables, on the scaled score; docs/mods.md says what they may contain): eager (under torch.compile a graph
    break); forward and backward on the sm90 kernels on Hopper, the sm80 family's elsewhere (docs/mods.md).
    block_mask (cute_flash.mods.create_block_mask of the mask_mod, or your own `BlockMask` covering every key it
    keeps, with full flags only where the mask_mod keeps every key of the tile): forward and backward visit only its
    non-empty tiles and skip the mask_mod on its full ones (the sm90 kernels; the others visit every tile).
    """
    if block_mask is not None and mask_mod is None:
        raise ValueError("block_mask needs the mask_mod it covers (the per-element mask inside its tiles)")
    if score_mod is not None or mask_mod is not None:
        if dtype is not None or descale is not None or softcap or learnable_sink is not None or deterministic:
            raise NotImplementedError(
                "score_mod / mask_mod do not combine with dtype, descale, softcap, learnable_sink or deterministic"
            )
        from .mods.call import attention_mods

        return attention_mods(q, k, v, score_mod, mask_mod, causal, softmax_scale, window_size, return_lse, block_mask)
    return call.dense(
        q, k, v, causal, softmax_scale, window_size, deterministic, softcap, learnable_sink, return_lse, dtype,
        fp8_rotate, descale,
    )  # fmt: skip


@explaining(attention)
def explain(q, k, v, capability, **call) -> Explanation:
    """Which family would serve `attention(q, k, v, ...)` with these arguments (attention's, return_lse aside),
    forward and backward, without compiling or launching anything, and what the call asks of it (mask and window,
    softcap, learnable sinks: see `Explanation`). Validates like `attention` (and raises the same errors).

    deterministic: explain the route of a deterministic backward (which families can sum in a fixed order).
    capability: explain for a GPU of this compute capability, (9, 0), "9.0" or "sm90", instead of q's own; then q, k,
    v may be CPU or meta tensors (only their shapes and dtypes are used). CUTE_FLASH_ARCH applies as in `attention`.
    """
    given = None if capability is None else parse_capability(capability)
    mods = call.pop("score_mod"), call.pop("mask_mod")
    block_mask = call.pop("block_mask")
    problem = validate(q, k, v, **call, any_device=given is not None)
    if mods != (None, None):
        from .mods.call import mods_problem

        problem, _ = mods_problem(problem, *mods, block_sparse=block_mask is not None)
    return Explanation.of(problem, gpu.capability(q) if given is None else given, call["deterministic"])

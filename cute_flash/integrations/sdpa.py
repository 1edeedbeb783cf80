"""cute-flash as the flash backend of `torch.nn.functional.scaled_dot_product_attention`.

    import cute_flash.integrations.sdpa as cfs
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl
    cfs.register()                            # makes "cute_flash" known to torch (torch >= 2.9)
    activate_flash_attention_impl("cute_flash")
    ...  # SDPA calls that pick the flash backend run cute-flash's kernels, forward and backward
    restore_flash_attention_impl()

Activation overrides, for CUDA tensors, the two ATen operators behind SDPA's flash backend
(`aten::_scaled_dot_product_flash_attention` and its backward); SDPA still decides per call which backend serves it
(`torch.nn.attention.sdpa_kernel` picks one), and autograd wiring stays torch's.

SDPA's meaning is kept: `is_causal` is aligned to the top left (query i sees keys j <= i), while cute-flash's causal
mask is aligned to the bottom right. With sq == sk they agree; with sq > sk the call becomes a window whose right edge
is the top-left diagonal; with sq < sk the keys no query sees (j >= sq) are dropped, and their gradients are zero.
`scale` is the softmax scale (None: 1/sqrt(d)); GQA (fewer kv heads, `enable_gqa=True`) is served natively. Dropout
and the debug mask raise, as do inputs cute-flash does not serve (the error names the reason).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

DEFAULT_NAME = "cute_flash"


def _available() -> bool:
    import torch.nn.attention as attn

    return hasattr(attn, "register_flash_attention_impl")


def _mask(is_causal: bool, sq: int, sk: int):
    """(causal, window_size, keys kept) giving SDPA's top-left causal mask with cute-flash's bottom-right one."""
    if not is_causal or sq == sk:
        return is_causal, (None, None), sk
    if sq > sk:  # j <= i + (sk - sq) + right with right = sq - sk
        return False, (None, sq - sk), sk
    return True, (None, None), sq  # keys sq.. are seen by no query: drop them; then sq == sk


def _check(dropout_p: float, return_debug_mask: bool = False) -> None:
    if dropout_p != 0.0:
        raise NotImplementedError(f"cute_flash SDPA backend: dropout_p must be 0, got {dropout_p}")
    if return_debug_mask:
        raise NotImplementedError("cute_flash SDPA backend: return_debug_mask is not supported")


def _planned(q, k, v, causal, scale, window, deterministic=False):
    """The call core's plan of the (b, s, h, d) views (cached per signature, as an eager call's), and the views in the
    kernels' layout."""
    from cute_flash.core import launch, plan

    call = dict(causal=causal, softmax_scale=scale, window_size=window, deterministic=deterministic)
    planned = plan.of_call(q, k, v, **call, softcap=0.0, learnable_sink=None)
    return (planned, *launch.kernel_inputs(planned, q, k, v))


def forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """aten::_scaled_dot_product_flash_attention on (b, h, s, d) tensors."""
    from cute_flash.core import launch

    _check(dropout_p, return_debug_mask)
    sq, sk = query.shape[2], key.shape[2]
    causal, window, kept = _mask(is_causal, sq, sk)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (b, s, h, d) views
    if kept != sk:
        k, v = k[:, :kept], v[:, :kept]
    plan, q, k, v = _planned(q, k, v, causal, scale, window)
    out, lse = launch.forward(plan, q, k, v)
    # out is (b, s, h, d) contiguous: returned as the (b, h, s, d) view, the layout torch's own flash kernel gives.
    rng_state = torch.empty(2, dtype=torch.uint64, device=query.device)
    unused = torch.empty((), dtype=torch.uint64, device=query.device)
    debug = torch.empty(0, dtype=query.dtype, device=query.device)
    return out.transpose(1, 2), lse, None, None, sq, sk, rng_state, unused, debug


def backward(
    grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
    philox_seed, philox_offset, *, scale=None,
):  # fmt: skip
    """aten::_scaled_dot_product_flash_attention_backward on (b, h, s, d) tensors."""
    from cute_flash.core import launch
    from cute_flash.kernel_layout import kernel_view

    _check(dropout_p)
    sq, sk = query.shape[2], key.shape[2]
    causal, window, kept = _mask(is_causal, sq, sk)
    q, k, v, o, do = (t.transpose(1, 2) for t in (query, key, value, out, grad_out))
    if kept != sk:
        k, v = k[:, :kept], v[:, :kept]
    plan, q, k, v = _planned(q, k, v, causal, scale, window, torch.are_deterministic_algorithms_enabled())
    dq, dk, dv, _ = launch.backward(plan, do, q, k, v, kernel_view(o), logsumexp)
    if kept != sk:  # the dropped keys get no gradient
        dk_full = torch.zeros(key.transpose(1, 2).shape, dtype=key.dtype, device=key.device)
        dv_full = torch.zeros(value.transpose(1, 2).shape, dtype=value.dtype, device=value.device)
        dk_full[:, :kept] = dk
        dv_full[:, :kept] = dv
        dk, dv = dk_full, dv_full
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


@dataclass
class Handle:
    """What `activate_flash_attention_impl` keeps while cute-flash is active; `remove` drops the overrides."""

    library: Optional[torch.library.Library]

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


def _activate() -> Handle:
    lib = torch.library.Library("aten", "IMPL", "CUDA")
    lib.impl("_scaled_dot_product_flash_attention", forward, "CUDA")
    lib.impl("_scaled_dot_product_flash_attention_backward", backward, "CUDA")
    return Handle(lib)


def register(name: str = DEFAULT_NAME) -> str:
    """Makes cute-flash an SDPA flash implementation under `name` (returned), to be switched on with
    `torch.nn.attention.activate_flash_attention_impl(name)`. Raises RuntimeError where torch has no such registry
    (before torch 2.9)."""
    if not _available():
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.nn.attention.register_flash_attention_impl; call "
            "cute_flash.attention directly"
        )
    from torch.nn.attention import register_flash_attention_impl

    register_flash_attention_impl(name, register_fn=_activate)
    return name

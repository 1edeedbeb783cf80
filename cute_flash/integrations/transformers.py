"""cute-flash as a `transformers` attention implementation.

    import cute_flash.integrations.transformers as cft
    cft.register()  # once per process, before the model runs
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="cute_attn")
    # or, on a model already built: model.config._attn_implementation = "cute_attn"  (set_attn_implementation)

`register` adds an attention function to `transformers.AttentionInterface` and a mask function to
`transformers.masking_utils.AttentionMaskInterface` under the same name. The mask function is needed: transformers
builds no mask at all for a name its mask interface does not know, so a padded batch would otherwise be attended as
if it had no padding. The default name holds no "flash": transformers 5.x treats such names as kernels to fetch from
the Hub.

What is served: causal (decoder) self-attention, GQA / MQA (cute-flash reads the shared kv heads itself), sliding-window
layers (the `sliding_window` argument: query i sees keys i - sliding_window < j <= i, as transformers' masks), the
model's `scaling`, decoding against a cache (queries aligned to the last keys). What raises instead of answering
wrongly: a padding or custom mask, packed sequences (position_ids restarting inside a row make transformers build a
mask), attention dropout during training, soft-capping, attention sinks, non-causal attention. (Padded and packed
batches would go through `cute_flash.attention_varlen` after unpadding; this plug-in does not do that yet.)
"""

from __future__ import annotations

from typing import Optional

import torch

DEFAULT_NAME = "cute_attn"

# Keyword arguments that change the result and that cute-flash does not implement: refused when set.
_UNSUPPORTED = {
    "softcap": "logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "cu_seq_lens_q": "packed (variable-length) sequences",
    "cu_seq_lens_k": "packed (variable-length) sequences",
    "cu_seqlens_q": "packed (variable-length) sequences",
    "cu_seqlens_k": "packed (variable-length) sequences",
    "position_bias": "an additive position bias",
}


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
):
    """transformers' attention-function contract: query (b, h, sq, d), key / value (b, h_kv, sk, d) in; returns
    (out (b, sq, h, dv), None)."""
    import cute_flash

    if attention_mask is not None:
        raise NotImplementedError(
            "cute_flash (transformers plug-in): this call has an attention mask (padding, a static cache, packed or "
            "custom masking); the plug-in serves unpadded causal batches only (it does not unpad into "
            "cute_flash.attention_varlen yet). Use attn_implementation='sdpa' for padded or packed batches."
        )
    if dropout:
        raise NotImplementedError(
            f"cute_flash (transformers plug-in): attention dropout {dropout} is not implemented; set the config's "
            "attention_dropout to 0 for training (evaluation passes 0 already)"
        )
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"cute_flash (transformers plug-in): {what} ({name}=...) is not implemented")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        raise NotImplementedError("cute_flash (transformers plug-in): only causal (decoder) attention is served")
    window = (None, None)
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(
                f"cute_flash (transformers plug-in): sliding_window must be an int >= 1, got {sliding_window!r}"
            )
        window = (sliding_window - 1, 0)  # transformers: key j visible from query i iff i - sliding_window < j <= i
    # (b, h, s, d) -> (b, s, h, d): views, no copies (cute_flash takes any outer strides that keep 16-byte rows).
    out = cute_flash.attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        causal=True,
        softmax_scale=scaling,
        window_size=window,
    )
    return out, None


def mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Optional[torch.Tensor] = None,
    allow_is_causal_skip: bool = True,
    local_size: Optional[int] = None,
    config=None,
    **kwargs,
):
    """transformers' mask-interface contract. Returns None (no mask: the attention function applies the causal /
    sliding-window pattern itself) when the batch has no padding and the pattern is the plain causal or the config's
    sliding window; otherwise the materialised mask, which the attention function refuses with a clear error."""
    from transformers.masking_utils import sdpa_mask

    plain = allow_is_causal_skip and "allow_is_bidirectional_skip" not in kwargs
    if local_size is not None and local_size != getattr(config, "sliding_window", None):
        plain = False  # a chunked-attention pattern (local_size = chunk size), not the sliding window
    if plain and attention_mask is not None:
        # A 2D padding mask (b, seen + q) that is all ones over exactly the keys is no mask (one host sync, as
        # transformers' own flash-attention mask does).
        plain = attention_mask.dim() == 2 and attention_mask.shape[-1] == kv_length and bool(attention_mask.all())
    if plain:
        return None
    kwargs.pop("allow_is_bidirectional_skip", None)
    mask = sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        local_size=local_size,
        config=config,
        **kwargs,
    )
    if mask is None:  # cannot happen with the skip disabled; never let a masked call look unmasked
        mask = torch.zeros(batch_size, 1, q_length, kv_length, dtype=torch.bool)
    return mask


def register(name: str = DEFAULT_NAME) -> str:
    """Registers cute-flash with transformers under `name` (returned): afterwards
    `from_pretrained(..., attn_implementation=name)` and `config._attn_implementation = name` select it."""
    if "flash" in name.lower():
        raise ValueError(
            f"name {name!r} contains 'flash': transformers 5.x treats such names as Hub kernels to download; "
            f"pick another (default {DEFAULT_NAME!r})"
        )
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # transformers < 4.53 has no mask interface: masks are built by each model's own code
        return name
    AttentionMaskInterface.register(name, mask_function)
    return name

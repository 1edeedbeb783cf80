"""What a kernel is compiled for, and how the mask of one call is described.

`AttentionSpec` holds exactly the properties that change generated code; it is the arch-independent part of every
compile-cache key. Sequence lengths, batch, head counts, strides, the softmax scale and the window bounds are runtime
values and never appear here (nor do a packed batch's cu_seqlens: only whether the batch is packed, `varlen`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Tuple

MaskKind = Literal["none", "causal", "local"]
ComputeDtype = Literal["fp16", "bf16", "fp8"]

# Window bound passed to kernels for "unbounded". Any value >= max(seqlen_q, seqlen_k) behaves the same; it stays far
# from Int32 overflow when kernels add seqlen differences to it.
UNBOUNDED_WINDOW = 1 << 30


def op_window_bound(w: Optional[int]) -> Optional[int]:
    """A window bound as a custom op's int64 argument (None: unbounded): clamped as `normalize_mask` clamps it."""
    return None if w is None else _clamp_bound(w)


# The largest cap whose capped logits (in [-softcap, softcap]) fit a fixed softmax reference: 2 * softcap * log2(e)
# binades must stay within what common/softcap.CappedSoftmax places between 2^-120 and 2^64 (softcap <= 63.8).
WIDE_SOFTCAP = 60.0


def softcap_fields(softcap: float) -> dict:
    """The spec fields of a call's cap (0: none): `softcap`, and `softcap_wide` above WIDE_SOFTCAP."""
    return dict(softcap=softcap > 0, softcap_wide=softcap > WIDE_SOFTCAP)


@dataclass(frozen=True)
class AttentionSpec:
    dtype: ComputeDtype  # operand dtype of the matrix products
    head_dim: int
    head_dim_v: int
    mask: MaskKind
    out_dtype: Literal["fp16", "bf16"] = "bf16"  # differs from dtype only on the fp8 path
    # Packed sequences (`cute_flash.attention_varlen`): q/k/v are (total, h, d) with per-sequence offsets read from
    # cu_seqlens inside the kernel. A separate compiled variant; only families with a varlen kernel serve it.
    varlen: bool = False
    # Soft-capping (Gemma 2): scores become softcap * tanh(score * softmax_scale / softcap) before the mask and the
    # softmax. The flag changes generated code; the cap itself is a runtime value (`Problem.softcap`).
    softcap: bool = False
    # A cap above WIDE_SOFTCAP (`softcap_fields`): the capped logits span more binades than a fixed softmax reference
    # leaves room for, so the sm90 bf16 forward keeps the running row max for it (common/softcap.CappedSoftmax);
    # other kernels build the same code either way.
    softcap_wide: bool = False
    # A learnable sink per query head (gpt-oss): one extra logit that joins every row's softmax denominator and
    # attends to no value. The logits are a runtime fp32 tensor (`FwdTensors.sink`, arch/base.py).
    sink: bool = False
    # The KV-cache forward (`cute_flash.attention_with_kvcache`, serving): K / V come from a cache with per-sequence
    # lengths read on the device, the query heads of a KV head are packed as the rows of one tile (GQA), and the
    # keys may be split over CTAs. page_size: 0 for a dense cache (batch, seqlen_cache, h_kv, d), else the rows per
    # page of a paged cache (num_pages, page_size, h_kv, d) read through a page table. kv_fp8: the cache holds
    # float8_e4m3fn with per-(sequence, KV head) descales (q and out stay fp16 / bf16).
    kvcache: bool = False
    page_size: int = 0
    kv_fp8: bool = False

    @property
    def causal(self) -> bool:
        return self.mask == "causal"

    @property
    def local(self) -> bool:
        return self.mask == "local"


@dataclass(frozen=True)
class ModsSpec(AttentionSpec):
    """An AttentionSpec with a score_mod and / or a mask_mod (cute_flash/mods): their traced graphs' keys
    (ModGraph.key: the operations and the tables' types, not the tables' values) change generated code. A class of
    its own, so that the plain specs' keys stay as they are."""

    score_mod: Optional[tuple] = None
    mask_mod: Optional[tuple] = None
    block_sparse: bool = False  # a block mask's key-tile lists (mods/block_mask.py): the forward visits those only


@dataclass(frozen=True)
class MaskBounds:
    """Runtime window of one call. Query i sees key j iff i + off - left <= j <= i + off + right, off = sk - sq.
    Either bound may be negative (a window shifted off the diagonal, FlashAttention-4's convention): (None, -w) keeps
    the keys at least w before the diagonal, (-w, None) those at least w after it; a row may then see no key."""

    kind: MaskKind
    left: int  # UNBOUNDED_WINDOW when unlimited
    right: int  # UNBOUNDED_WINDOW when unlimited


def normalize_mask(causal: bool, window_size: Tuple[Optional[int], Optional[int]]) -> MaskBounds:
    """Folds `causal` and `window_size` into one mask description.

    Causal is a window whose right bound is 0; with a finite left bound as well it becomes a general local window,
    which kernels handle with runtime bounds so that every window size shares one compiled kernel. Bounds are clamped
    to +-UNBOUNDED_WINDOW (any bound >= max(seqlen_q, seqlen_k) means the same, and so does any bound below minus
    that): kernels add sequence lengths to them in Int32, where a bound near 2^31 would wrap and hide every key.
    """
    left, right = window_size
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is None and right is None:
        return MaskBounds("none", UNBOUNDED_WINDOW, UNBOUNDED_WINDOW)
    if causal and left is None and right == 0:
        return MaskBounds("causal", UNBOUNDED_WINDOW, 0)
    return MaskBounds(
        "local",
        UNBOUNDED_WINDOW if left is None else _clamp_bound(left),
        UNBOUNDED_WINDOW if right is None else _clamp_bound(right),
    )


def _clamp_bound(w: int) -> int:
    """A window bound in [-UNBOUNDED_WINDOW, UNBOUNDED_WINDOW]: beyond either end every bound means the same (all keys
    on that side, or none), and kernels add sequence lengths to it in Int32."""
    return max(-UNBOUNDED_WINDOW, min(int(w), UNBOUNDED_WINDOW))

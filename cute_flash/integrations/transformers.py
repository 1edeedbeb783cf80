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
model's `scaling`, logit soft-capping (the `softcap` keyword, e.g. Gemma 2's attn_logit_softcapping), learnable
attention sinks (the `s_aux` keyword, gpt-oss's `sinks` parameter, or `sinks`), decoding against a cache (dynamic or
static), and two kinds of batches that go through `cute_flash.attention_varlen`:
  - padded batches (a 2D `attention_mask`, left or right padding, prefill, training and decoding): the mask function
    hands the attention function the 2D padding mask instead of a materialised 4D one; the attention function runs
    each row's valid tokens as a packed sequence over the call's own rows (views of q / k / v, no gather, no
    scatter; padded query rows get 0 and padded rows zero gradients). Rows whose valid tokens have gaps (no window)
    are gathered into packed sequences and scattered back. Decoding a padded batch (one new token per row) reads
    the cache in place: one packed sequence per (row, KV head) over the cache's own (b, h_kv, S, d) layout.
  - packed sequences (several documents in one row, marked by `position_ids` restarting, or by the `cu_seq_lens_q` /
    `cu_seq_lens_k` / `max_length_q` / `max_length_k` keywords of transformers' DataCollatorWithFlattening): one packed
    sequence per document. transformers materialises a 4D mask for these; it is checked once per forward (the same
    mask object reaches every layer) to be exactly the documents' causal (or sliding-window) pattern, so a mask
    that says anything else is refused, not ignored.
Both cost a device-to-host copy per forward and mask (the packed lengths are host ints), as transformers' own
flash-attention path does: graph breaks under torch.compile, refused during CUDA-graph capture. Decoding (one query
per row) against a materialised 4D bool mask (a static cache's steps) reads nothing on the host: the KV-cache
forward over the cache in place, one page per key slot, page tables of the visible slots built on the device
(`_masked_decoding`), which a CUDA graph captures.

The window a layer's mask was built for travels with the mask (an attribute of the tensor the mask function returns),
so models whose attention modules do not pass `sliding_window` (PhiMoE, Qwen2-MoE) still get it, and a module whose
`sliding_window` disagrees with its mask raises. A copy of the mask (accelerate's device_map hooks move it with
.to(device), which drops attributes) keeps its values: its window is then the module's (`sliding_window`, or its
layer's entry in config.layer_types), and one that cannot be told raises.

What raises instead of answering wrongly: any other mask (custom 4D masks, bidirectional or chunked patterns, a mask
that does not match its documents, a 2D mask wider than the positions seen, which transformers reads from the left),
a sliding window over a padded row whose valid tokens are not contiguous (the window is a distance in positions;
packing would close the gaps), sparse attention (`indices`, `block_indices`), attention dropout during training,
non-causal attention, attention weights (`output_attentions=True`). A caller that turns `allow_is_causal_skip` off
gets the materialised mask it asked for.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch

from ..validation import MAX_ELEMENTS_PER_HEAD, packed_elements_per_head

DEFAULT_NAME = "cute_attn"

# Keyword arguments that change the result and that cute-flash does not implement: refused when set.
_UNSUPPORTED = {
    "cu_seqlens_q": "packed sequences by `cu_seqlens_q` (transformers' keyword is `cu_seq_lens_q`)",
    "cu_seqlens_k": "packed sequences by `cu_seqlens_k` (transformers' keyword is `cu_seq_lens_k`)",
    "position_bias": "an additive position bias",
    "block_indices": "block-sparse attention (block_indices)",
    "indices": "sparse attention (indices)",
}
_PACKED_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _err(message: str) -> NotImplementedError:
    return NotImplementedError(f"cute_flash (transformers plug-in): {message}")


def _tracing(t: Optional[torch.Tensor] = None) -> bool:
    """Whether device values cannot be read here: CUDA-graph capture (a host copy would break it) or a fake tensor
    (export, meta tracing). Under torch.compile the reads are graph breaks (errors with fullgraph=True), as in
    transformers' own flash-attention path."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return True
    return t is not None and isinstance(t, torch._subclasses.FakeTensor)


# --- per-forward results, shared by the layers -------------------------------------------------------------------
class _Derived:
    """Results derived from a mask (and position) tensor, reused by every layer of one forward: transformers hands
    the same mask object to each layer, so the device-to-host copy and the mask check happen once per forward.

    Cached where the key's tensors prove their contents: a mask built by `mask_function` (a new tensor every call,
    never changed in place), or tensors whose version counter tells every in-place write (a caller's 4D mask or
    cu_seq_lens in eager code: the packed-training path keeps one device-to-host copy per forward, not per layer).
    Derived anew on every call: anything holding an inference tensor (no version counter) or a CUDA-graph tree's
    output (torch.compile mode="reduce-overhead" returns the same tensor from every replay, with the replay's
    contents and its version unchanged), unless a mask built this forward is in the key. Keyed on identities and
    versions, held by weak reference."""

    def __init__(self, size: int = 8):
        self._entries: dict = {}
        self._size = size

    def get(self, tensors: tuple, extra: tuple, compute):
        present = tuple(t for t in tensors if t is not None)
        if not (any(_fresh(t) for t in present) or all(_versioned(t) for t in present)):
            return compute()
        versions = tuple(-1 if t.is_inference() else t._version for t in present)
        key = (tuple(id(t) for t in present), versions, extra)
        hit = self._entries.get(key)
        if hit is not None and all(r() is t for r, t in zip(hit[0], present)):
            return hit[1]
        value = compute()
        self._entries = {k: e for k, e in self._entries.items() if all(r() is not None for r in e[0])}
        if len(self._entries) >= self._size:
            self._entries.pop(next(iter(self._entries)))
        self._entries[key] = (tuple(weakref.ref(t) for t in present), value)
        return value


# A CUDA-graph tree's outputs are "cached tensors": the same tensor from replay to replay (torch._inductor.
# cudagraph_trees registers them with torch._C._add_cached_tensor).
_is_graph_output = getattr(torch._C, "_is_cached_tensor", lambda t: False)


def _versioned(t: torch.Tensor) -> bool:
    """Whether every in-place write to `t` bumps its version (see `_Derived`)."""
    return not t.is_inference() and not _is_graph_output(t)


def _fresh(t: torch.Tensor) -> bool:
    """Whether `t` is new this forward (see `_Derived`): built by the mask function and not a CUDA-graph output."""
    return getattr(t, _BUILT_TAG, False) and not _is_graph_output(t)


_DERIVED = _Derived()


class _Packing(NamedTuple):
    """Packed sequences over the rows of the call's (batch, seqlen) grid. q_rows / k_rows None: the rows in their own
    order (q flattened over (batch, seqlen), k / v over (batch, k_width)), with the gaps between the sequences that
    matter given sequences of their own that see no key; else the (batch index, position) tensors of every packed
    query / key row, gathered (and the outputs scattered back)."""

    q_rows: Optional[tuple]
    k_rows: Optional[tuple]
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    seqused_k: Optional[torch.Tensor] = None
    k_width: int = 0  # key slots per batch row that cu_seqlens_k counts in (q_rows None)


# The window a mask was built for travels with it (an attribute of the tensor the mask function returns): some
# models' attention modules do not pass `sliding_window` although their mask is a sliding-window one.
_WINDOW_TAG = "_cute_flash_window"
_FULL_TAG = "_cute_flash_full"
_GAPS_TAG = "_cute_flash_gaps"  # whether a row's valid tokens have gaps, read once by the mask function
_BUILT_TAG = "_cute_flash_built"  # built by `mask_function` (not a caller's tensor): new every forward (`_Derived`)


def _tagged(mask: torch.Tensor, window: Optional[int], full: bool = False, gaps: Optional[bool] = None):
    setattr(mask, _BUILT_TAG, True)
    setattr(mask, _WINDOW_TAG, window)
    setattr(mask, _FULL_TAG, full)
    setattr(mask, _GAPS_TAG, gaps)
    return mask


def _valid_ranges(mask: torch.Tensor):
    """Per row of a 2D bool mask: its valid tokens' count, the first one's index (0 for none), and whether they have
    gaps (as a 0-d bool tensor: any row's valid tokens not contiguous)."""
    width = mask.shape[1]
    lens = mask.sum(1, dtype=torch.int32)
    first = mask.to(torch.int8).argmax(1).int()
    last = width - 1 - mask.flip(1).to(torch.int8).argmax(1).int()
    return lens, torch.where(lens > 0, first, 0), ((last - first + 1 != lens) & (lens > 0)).any()


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def _rows(flat_index: torch.Tensor, width: int) -> tuple:
    return flat_index // width, flat_index % width


def _unpad(mask: torch.Tensor, q_length: int, windowed: bool, k_width: int, gaps: Optional[bool] = None):
    """Packed sequences (a `_Packing`) of a 2D padding mask (b, L) over the layer's first L key slots, whose last
    q_length slots are the queries; the key rows are counted in k_width slots per batch row (k_width >= L). None: no
    padding (every row full). `gaps`: whether some row's valid tokens have gaps, when the mask function has read it
    (then nothing is read from the device here, and the longest sequences are bounded by q_length / k_width); else
    one device-to-host copy.

    Where every row's valid tokens are contiguous (left or right padding), nothing is gathered: row i becomes three
    sequences over the call's own rows, the padding queries before its valid ones (seeing no key: out 0), its valid
    queries against its valid keys (seqused_k: the slots after them are never read and get zero gradients), and the
    padding queries after them. The valid queries are the last of the valid key slots, so the kernels' bottom-right
    alignment of queries to keys is the positions' own, windows included."""
    b, width = mask.shape
    lens_k, ka, any_gap = _valid_ranges(mask)
    # The three sequences per row (above), in rows of the flattened q (b * q_length) and k (b * k_width).
    kb = ka + lens_k
    qa = (ka - (width - q_length)).clamp(0, q_length)
    qb = torch.maximum((kb - (width - q_length)).clamp(max=q_length), qa)
    row = torch.arange(b, dtype=torch.int32, device=mask.device)
    q_ends = torch.stack([qa, qb, torch.full_like(qa, q_length)], 1) + (row * q_length)[:, None]
    k_ends = torch.stack([ka, torch.full_like(ka, k_width), torch.full_like(ka, k_width)], 1) + (row * k_width)[:, None]
    cu_q, cu_k = _cu_from_ends(q_ends), _cu_from_ends(k_ends)
    if gaps is None:
        zero = lens_k.new_zeros(())
        max_q = cu_q.diff().max() if b else zero
        max_k = cu_k.diff().max() if b else zero
        max_q, max_k, gaps, all_full = torch.stack(
            [max_q, max_k, any_gap.int(), (lens_k == width).all().int()]
        ).tolist()
        if all_full:
            return None
    else:
        max_q, max_k = q_length, k_width
    if gaps:
        if windowed:
            raise _err(
                "a sliding-window layer got a padded row whose valid tokens are not contiguous: packing them would "
                "change the distances the window is measured in. Pad on one side only (left or right)."
            )
        mq = mask[:, width - q_length :]
        lens_q = mq.sum(1, dtype=torch.int32)
        return _Packing(
            _rows(mq.flatten().nonzero().flatten(), q_length),
            _rows(mask.flatten().nonzero().flatten(), width),
            _cu_seqlens(lens_q),
            _cu_seqlens(lens_k),
            int(lens_q.max()),
            int(lens_k.max()),
        )
    used = torch.stack([torch.zeros_like(lens_k), lens_k, torch.zeros_like(lens_k)], 1).flatten()
    return _Packing(None, None, cu_q, cu_k, max_q, max_k, used, k_width)


def _cu_from_ends(ends: torch.Tensor) -> torch.Tensor:
    """cu_seqlens (n + 1,) int32 of consecutive sequences ending at `ends` (any shape, row-major order)."""
    return torch.nn.functional.pad(ends.flatten().to(torch.int32), (1, 0))


def _single_queries(visible: torch.Tensor) -> _Packing:
    """Packed sequences of one query per row against the keys `visible` (b, L) marks."""
    b, width = visible.shape
    lens = visible.sum(1, dtype=torch.int32)
    max_k = int(lens.max()) if b else 0
    rows = torch.arange(b, device=visible.device)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=visible.device)
    k_rows = _rows(visible.flatten().nonzero().flatten(), width)
    return _Packing((rows, torch.zeros_like(rows)), k_rows, cu_q, _cu_seqlens(lens), 1, max_k)


def _documents(starts: torch.Tensor, b: int, s: int) -> _Packing:
    """Packed sequences of documents over a (b, s) grid: `starts` (b, s) bool marks each document's first token
    (every row's first token included)."""
    begin = starts.flatten().nonzero().flatten()
    cu = torch.cat([begin, begin.new_full((1,), b * s)]).to(torch.int32)
    max_len = int(cu.diff().max()) if cu.numel() > 1 else 0
    return _Packing(None, None, cu, cu, max_len, max_len, None, s)


def _check_documents(mask: torch.Tensor, starts: torch.Tensor, window: Optional[int]) -> None:
    """Refuses a materialised 4D mask (b, 1, s, s) that is not exactly causal (window) attention within documents."""
    b, s = starts.shape
    doc = starts.cumsum(1)
    i = torch.arange(s, device=mask.device)
    want = (doc[:, :, None] == doc[:, None, :]) & (i[None, :] <= i[:, None])
    if window is not None:
        want &= i[:, None] - i[None, :] < window
    if mask.dtype != torch.bool or mask.shape[1] != 1 or not torch.equal(mask[:, 0], want):
        raise _err(
            "this call's attention mask is not the causal pattern within its packed documents (a custom or "
            f"bidirectional mask, or causal with padding?). {_FOUR_D_SERVED}"
        )


def _packing_from_keywords(kwargs: dict, b: int, s: int, device):
    """(document starts (b, s), their `_Packing`) from DataCollatorWithFlattening's cu_seq_lens_* keywords, or None
    when not given. One host read, the checks and the longest document together: without a mask to key the forward
    on (a full-attention layer gets none), this runs in every layer (`_Derived`)."""
    given = [kwargs.get(n) is not None for n in _PACKED_KEYWORDS]
    if not any(given):
        return None
    if not all(given):
        raise _err(f"packed sequences need all of {', '.join(_PACKED_KEYWORDS)}")
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
    if cu_q.dim() != 1 or cu_q.shape != cu_k.shape or cu_q.numel() == 0:
        raise _err("cu_seq_lens_q and cu_seq_lens_k must be the same 1D offsets: only self-attention is served")
    cu, n = cu_q.to(device=device, dtype=torch.long), b * s
    lens = cu.diff()
    checks = [
        cu_k is cu_q or (cu == cu_k.to(device=device, dtype=torch.long)).all(),
        cu[0] == 0,
        cu[-1] == n,
        (lens >= 0).all(),
        torch.isin(torch.arange(0, n, max(s, 1), device=device), cu).all(),  # every row's first token starts one
        lens.max() if lens.numel() else cu.new_zeros(()),
    ]
    same, first, last, rising, rows, longest = torch.stack(
        [torch.as_tensor(c, device=device).long() for c in checks]
    ).tolist()
    if not same:
        raise _err("cu_seq_lens_q != cu_seq_lens_k: only self-attention over packed documents is served")
    if not (first and last and rising):
        raise _err(f"cu_seq_lens_q must run from 0 to the {n} tokens of the call without decreasing")
    if not rows:
        raise _err("a packed document crosses a batch row")
    starts = torch.zeros(n + 1, dtype=torch.bool, device=device)
    starts[cu] = True  # (no host read; an empty document's start is the next one's)
    cu = cu.to(torch.int32)
    return starts[:n].view(b, s), _Packing(None, None, cu, cu, longest, longest, None, s)


def _packing_from_positions(position_ids: Optional[torch.Tensor], b: int, s: int) -> Optional[torch.Tensor]:
    """Document starts (b, s) where position_ids restart (transformers' rule: a step other than +1), or None."""
    if position_ids is None or position_ids.shape[-1] != s:
        return None
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, b):
        raise _err(
            f"packed documents need position_ids of shape (batch, seqlen), got {tuple(position_ids.shape)} (e.g. "
            "multimodal rope's 3D positions): give cu_seq_lens_q / cu_seq_lens_k instead"
        )
    pos = position_ids.expand(b, s)
    starts = torch.ones(b, s, dtype=torch.bool, device=pos.device)
    starts[:, 1:] = pos[:, 1:] - pos[:, :-1] != 1
    return starts


# --- the attention function --------------------------------------------------------------------------------------
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

    if dropout:
        raise _err(
            f"attention dropout {dropout} is not implemented; set the config's attention_dropout to 0 for training "
            "(evaluation passes 0 already)"
        )
    if kwargs.get("output_attentions"):
        # (transformers would return a tuple of Nones where the weights should be: refused, not left empty)
        raise _err(
            "output_attentions=True: cute-flash never materialises the attention weights; use "
            'attn_implementation="eager" for a forward that returns them'
        )
    for name in _UNSUPPORTED:
        if name in kwargs and kwargs[name] is not None:
            raise _err(f"{_UNSUPPORTED[name]} ({name}=...) is not implemented")
    if (
        not (query.dim() == key.dim() == value.dim() == 4)
        or key.shape[:3] != value.shape[:3]
        or (key.shape[0] != query.shape[0])
    ):
        raise ValueError(
            f"cute_flash (transformers plug-in): query (b, h, s, d), key / value (b, h_kv, s_k, d) of one batch and "
            f"length, got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        raise _err("only causal (decoder) attention is served")
    features = _features(kwargs)
    sliding_window = _layer_window(attention_mask, sliding_window, module)
    packed = any(kwargs.get(n) is not None for n in _PACKED_KEYWORDS)
    if packed and _padded(attention_mask):
        # Which would win is not defined: the documents' offsets count tokens the padding mask says are not there.
        raise _err(
            "packed documents (cu_seq_lens_q / cu_seq_lens_k) and a padded batch's attention_mask together are "
            "ambiguous: give one of them (DataCollatorWithFlattening's batches need no attention_mask)"
        )
    window = (None, None)
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(
                f"cute_flash (transformers plug-in): sliding_window must be an int >= 1, got {sliding_window!r}"
            )
        window = (sliding_window - 1, 0)  # transformers: key j visible from query i iff i - sliding_window < j <= i
    if attention_mask is not None:
        folded = _padded_decoding(query, key, value, attention_mask, scaling, sliding_window, features)
        if folded is not None:
            return folded, None
        decoded = _masked_decoding(query, key, value, attention_mask, scaling, features)
        if decoded is not None:
            return decoded, None
    # (b, h, s, d) -> (b, s, h, d): views, no copies (cute_flash takes any outer strides that keep 16-byte rows).
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    b, s = q.shape[:2]
    if attention_mask is None and not packed:  # (plain causal: every key slot, nothing to derive)
        packing = k.shape[1]
    else:
        packing = _packing(attention_mask, q, k, v, sliding_window, kwargs)
    if isinstance(packing, int):  # no padding: the layer's first `packing` key slots, queries aligned to their end
        if packing != k.shape[1]:
            k, v = k[:, :packing], v[:, :packing]
        out = cute_flash.attention(q, k, v, causal=True, softmax_scale=scaling, window_size=window, **features)
        return out, None
    own_rows = packing.q_rows is None  # the call's own rows: views where the layouts allow, no gather, no scatter
    if own_rows:
        q, k, v = q.reshape(b * s, *q.shape[2:]), _flat_rows(k, packing.k_width), _flat_rows(v, packing.k_width)
    else:
        q, k, v = q[packing.q_rows], k[packing.k_rows], v[packing.k_rows]
    out = cute_flash.attention_varlen(
        q,
        k,
        v,
        packing.cu_seqlens_q,
        packing.cu_seqlens_k,
        packing.max_seqlen_q,
        packing.max_seqlen_k,
        causal=True,
        softmax_scale=scaling,
        window_size=window,
        seqused_k=packing.seqused_k,
        **features,
    )
    if own_rows:
        return out.view(b, s, *out.shape[1:]), None
    full = out.new_zeros(b, s, *out.shape[1:])  # padded query rows: 0 (as FlashAttention's own unpadding)
    return full.index_put(packing.q_rows, out), None


def _padded(attention_mask) -> bool:
    """Whether the call's mask is the mask function's 2D padding mask with padding in it (not its all-visible one)."""
    return attention_mask is not None and attention_mask.dim() == 2 and not getattr(attention_mask, _FULL_TAG, False)


def _flat_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """(b, sk, h, d) -> (b * width, h, d): the first `width` key slots of every batch row, a view where the layout
    allows (a copy of those slots otherwise)."""
    return x[:, :width].reshape(-1, *x.shape[2:])


def _padded_decoding(query, key, value, attention_mask, scaling, sliding_window, features):
    """Decoding a padded batch (one query token per row, a 2D padding mask whose rows' valid keys are contiguous,
    a cache laid out (b, h_kv, S, d) contiguously, as transformers' caches are): the cache is read in place, not
    copied. Each (batch row, KV head) becomes one packed sequence over the cache flattened to (b * h_kv * S) rows of
    one head: its group's query heads are its rows, its keys the row's valid slots (those the sliding window keeps),
    without a causal mask (the query is the last slot). None where that does not apply (then the general path).
    Learnable sinks differ per query head, which this layout makes rows of one head: they take the general path."""
    b, h, s = query.shape[:3]
    h_kv, sk = key.shape[1], key.shape[2]
    if (
        s != 1
        or attention_mask is None
        or attention_mask.dim() != 2
        or getattr(attention_mask, _GAPS_TAG, None) is not False
        or features["learnable_sink"] is not None
        or not (key.is_contiguous() and value.is_contiguous())
        or h % h_kv
        or attention_mask.shape[0] != b
        or not 1 <= attention_mask.shape[1] <= sk
        # the flattened cache's rows within the kernels' Int32 indexing (b * h_kv sequences and the leading one)
        or packed_elements_per_head(b * h_kv * sk, b * h_kv + 1, max(query.shape[3], value.shape[3]))
        > MAX_ELEMENTS_PER_HEAD
    ):
        return None
    return _decode_in_place(query, key, value, attention_mask, scaling, sliding_window, features)


@torch.compiler.disable  # as _packing_from_masks: per-forward results cached by the mask's identity
def _decode_in_place(query, key, value, attention_mask, scaling, sliding_window, features):
    """_padded_decoding's call, once its plain checks (traceable, so no graph break on other calls) hold."""
    import cute_flash

    b, h = query.shape[:2]
    h_kv, sk = key.shape[1], key.shape[2]
    group = h // h_kv
    seqs = _DERIVED.get(
        (attention_mask,),
        ("fold", h_kv, sk, group, sliding_window, key.device),
        lambda: _fold(attention_mask.to(key.device, torch.bool), h_kv, sk, group, sliding_window),
    )
    cu_q, cu_k, used = seqs
    d, dv = query.shape[3], value.shape[3]
    out = cute_flash.attention_varlen(
        query.reshape(b * h, 1, d),
        key.view(b * h_kv * sk, 1, d),
        value.view(b * h_kv * sk, 1, dv),
        cu_q,
        cu_k,
        group,
        2 * sk,  # a sequence's key rows run to the next one's first: at most two rows' slots
        causal=False,
        softmax_scale=scaling,
        seqused_k=used,
        softcap=features["softcap"],
    )
    return out.view(b, h, 1, dv).transpose(1, 2)


def _masked_decoding(query, key, value, attention_mask, scaling, features):
    """Decoding (one query token per row) with a materialised 4D bool mask (a static cache's, or any mask transformers
    builds for one query): the KV-cache forward over the cache in place, each key slot a page of one row (page_size
    1), each row's page table its visible slots in order. Built on the device: no host read, no gather of the keys,
    so a CUDA graph captures it and its replays follow the mask's new contents. None where the layout does not
    allow it, no family has that KV-cache kernel (page size 1: the sm80 family's gathers, which CUTE_FLASH_ARCH=sm90
    excludes) or the paged view is refused (e.g. slots not 16-byte aligned): the general path then runs, and raises
    its own error where it cannot serve the call either."""
    if query.shape[2] != 1 or attention_mask is None or attention_mask.dim() != 4:
        return None  # (traceable: calls without such a mask do not graph-break here)
    if torch.compiler.is_compiling():  # (traced into the graph: a static cache's decoding step is one CUDA graph)
        return _masked_decoding_served(query, key, value, attention_mask, scaling, features, derive=False)
    return _masked_decoding_call(query, key, value, attention_mask, scaling, features)


@torch.compiler.disable  # as _packing_from_masks: eager, its tables cached by the mask's identity across layers
def _masked_decoding_call(query, key, value, attention_mask, scaling, features):
    return _masked_decoding_served(query, key, value, attention_mask, scaling, features, derive=True)


def _masked_decoding_served(query, key, value, attention_mask, scaling, features, derive: bool):
    """`_masked_decoding`'s call; derive: its tables kept per forward (eager), else made in every layer (a trace, whose
    graph makes them on the device at every replay)."""
    args = _masked_decoding_args(query, key, value, attention_mask, derive)
    if args is None:
        return None
    import cute_flash

    q, k_pages, v_pages, lens, table = args
    try:
        return cute_flash.attention_with_kvcache(
            q, k_pages, v_pages, cache_seqlens=lens, page_table=table, causal=False, softmax_scale=scaling, **features
        )
    except (NotImplementedError, ValueError):  # (nothing written: no append, out is the call's own)
        return None


def _masked_decoding_args(query, key, value, attention_mask, derive: bool = True):
    """attention_with_kvcache's (q, k_cache, v_cache, cache_seqlens, page_table) for one query token per row against
    the keys a (b, 1, 1, sk) bool mask marks, the cache (b, h_kv, sk, d) read in place as pages of one slot: slot s
    of row r is page r * (row stride / slot stride) + s. Device operations only. None where that does not apply
    (not one query per row, another mask, slot strides that do not divide the row strides or differ between K and
    V)."""
    b, h, s, _ = query.shape
    h_kv, sk = key.shape[1], key.shape[2]
    if s != 1 or attention_mask is None or attention_mask.dim() != 4 or attention_mask.dtype != torch.bool:
        return None
    if attention_mask.shape[1:] != (1, 1, sk) or attention_mask.shape[0] not in (1, b) or h % h_kv:
        return None
    if key.shape[0] != b or value.shape[0] != b or value.shape[1:3] != (h_kv, sk):
        return None  # (the general path then serves or refuses the call)
    if (b - 1) * key.stride(0) // max(key.stride(2), 1) + sk > 2**31 - 1:  # page indices are int32
        return None
    rows = []
    for x in (key, value):
        if x.stride(-1) != 1 or x.stride(2) <= 0 or x.stride(0) % x.stride(2):
            return None
        rows.append(x.stride(0) // x.stride(2))
    if rows[0] != rows[1]:
        return None

    def tables():
        visible = attention_mask[:, 0, 0, :].expand(b, sk).to(key.device)
        lens = visible.sum(-1, dtype=torch.int32)
        order = torch.argsort((~visible).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # visible slots first
        return lens, order + torch.arange(b, dtype=torch.int32, device=key.device).mul_(rows[0]).unsqueeze(1)

    if not derive or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        lens, table = tables()  # (inside the graph: its replays recompute them from the mask's contents then)
    else:  # once per forward: every layer gets the same mask object
        lens, table = _DERIVED.get((attention_mask,), ("pages", b, sk, rows[0], key.device), tables)
    pages = (b - 1) * rows[0] + sk

    def as_pages(x):
        shape, stride = (pages, 1, h_kv, x.shape[3]), (x.stride(2), x.stride(2), x.stride(1), 1)
        return x.as_strided(shape, stride)  # (x's own storage offset)

    return query.transpose(1, 2), as_pages(key), as_pages(value), lens, table


def _fold(mask: torch.Tensor, h_kv: int, sk: int, group: int, window: Optional[int]):
    """_padded_decoding's packed sequences (cu_seqlens_q, cu_seqlens_k, seqused_k), built on the device (no host
    read). A leading sequence with no rows covers the first keys, so that cu_seqlens start at 0."""
    b, width = mask.shape
    lens, ka, _ = _valid_ranges(mask)
    kb = ka + lens
    if window is not None:  # the query (slot width - 1) sees slots > width - 1 - window
        ka = torch.maximum(ka, torch.full_like(ka, width - window))
    used = torch.where(kb == width, (kb - ka).clamp(min=0), 0)  # a padded query slot sees nothing
    n = b * h_kv
    seq = torch.arange(n, dtype=torch.int32, device=mask.device)
    zero = seq.new_zeros(1)
    cu_k = torch.cat([zero, seq * sk + ka.repeat_interleave(h_kv), seq.new_full((1,), n * sk)])
    cu_q = torch.cat([zero, zero, (seq + 1) * group])
    return cu_q.int(), cu_k.int(), torch.cat([zero, used.int().repeat_interleave(h_kv)])


def _key_width(k: torch.Tensor, width: int, head_dim: int) -> int:
    """Key slots per batch row to pack over: all of them where (batch, slot) flattens to one row index without a
    copy (the padding sequences then cover the slots past `width`) and the flattened cache stays within the kernels'
    Int32 indexing (validation's rule for packed calls, three sequences per row), else the `width` in use (a copy of
    fewer rows)."""
    b, sk = k.shape[:2]
    flat = sk <= 1 or b <= 1 or k.stride(0) == sk * k.stride(1)
    fits = packed_elements_per_head(b * sk, 3 * b, head_dim) <= MAX_ELEMENTS_PER_HEAD
    return sk if flat and fits else width


def _features(kwargs: dict) -> dict:
    """cute_flash's softcap and learnable_sink from transformers' keywords: `softcap` (None or 0: none; Gemma 2 / 3
    pass the config's attn_logit_softcapping) and the sinks, `s_aux` (transformers' name, gpt-oss) or `sinks`."""
    softcap = kwargs.get("softcap")
    sinks = [kwargs[n] for n in ("s_aux", "sinks") if kwargs.get(n) is not None]
    if len(sinks) == 2 and sinks[0] is not sinks[1]:
        raise _err("both s_aux and sinks are given and differ: pass the attention sinks once")
    return {"softcap": 0.0 if softcap is None else softcap, "learnable_sink": sinks[0] if sinks else None}


def _layer_window(attention_mask, sliding_window, module=None):
    """The layer's window: what its mask was built for (the mask function's tag), which the module's own
    `sliding_window` must agree with; without a mask, the plain causal pattern (no window) unless the module asks.
    A 2D mask without the tag (a copy of the plug-in's: `.to(device)` by accelerate's device_map hooks or a caller,
    `.clone()`; .contiguous() of a non-contiguous one) keeps its values, the key slots it covers, but not its window:
    that is taken from the module (`_module_window`), and refused where the module does not say."""
    if attention_mask is not None and attention_mask.dim() == 2 and not hasattr(attention_mask, _WINDOW_TAG):
        return _module_window(module, sliding_window)
    if attention_mask is None or not hasattr(attention_mask, _WINDOW_TAG):
        return sliding_window
    tagged = getattr(attention_mask, _WINDOW_TAG)
    if sliding_window is not None and sliding_window != tagged:
        raise _err(f"the layer asks for sliding_window={sliding_window} but its mask was built for {tagged}")
    return tagged


def _module_window(module, sliding_window):
    """The window of an attention module whose 2D mask lost its tag: the `sliding_window` it passes, else its layer's
    entry in `config.layer_types` (transformers' sliding / full layers), else none where the config has no window."""
    if sliding_window is not None:
        return sliding_window
    config = getattr(module, "config", None)
    layer_types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    known = layer_types is not None and isinstance(index, int) and 0 <= index < len(layer_types)
    kind = layer_types[index] if known else None
    if known:
        if kind == "full_attention":
            return None
        if kind == "sliding_attention" and getattr(config, "sliding_window", None) is not None:
            return config.sliding_window
    elif config is not None and getattr(config, "sliding_window", None) is None:
        return None  # no layer of this model has a window
    raise _err(
        "a 2D attention mask without the plug-in's tag (a copy of its padding mask, e.g. moved by .to(device)) "
        f"reached a layer whose window the module does not tell (no sliding_window argument, layer type {kind!r}, "
        f"config.sliding_window {getattr(config, 'sliding_window', None)!r}): hand the layers the mask transformers "
        "built, unchanged, or keep the model on one device"
    )


def _packing(attention_mask, q, k, v, sliding_window, kwargs):
    """How a call runs: an int (dense, over that many key slots) or a `_Packing` (packed sequences). The dense cases
    read nothing from the device (no graph break under torch.compile); the others do, in `_packing_from_masks`."""
    b, s, sk = q.shape[0], q.shape[1], k.shape[1]
    if attention_mask is None and all(kwargs.get(n) is None for n in _PACKED_KEYWORDS):
        return sk
    if attention_mask is not None and attention_mask.dim() == 2:  # from mask_function: padding only
        width = attention_mask.shape[1]
        if not s <= width <= sk or attention_mask.shape[0] != b:
            raise _err(f"a padding mask of shape {tuple(attention_mask.shape)} does not fit {b} rows of {s} queries "
                       f"and {sk} key slots")  # fmt: skip
        if getattr(attention_mask, _FULL_TAG, False) and all(kwargs.get(n) is None for n in _PACKED_KEYWORDS):
            return width
    return _packing_from_masks(attention_mask, q, k, v, sliding_window, kwargs)


_FOUR_D_SERVED = (
    "A materialised 4D mask over several queries is served only as causal (or the layer's sliding-window) attention "
    "within packed documents marked by position_ids restarting or cu_seq_lens_q / cu_seq_lens_k; over one query "
    "per row, any bool mask. Padding is served from the 2D attention_mask: pass that, not a 4D causal + padding "
    "mask (nor a custom, bidirectional or chunked one)"
)


@torch.compiler.disable  # host reads of the mask: run eagerly (a guard on the mask's identity would recompile)
def _packing_from_masks(attention_mask, q, k, v, sliding_window, kwargs):
    b, s, sk = q.shape[0], q.shape[1], k.shape[1]
    given = attention_mask  # (the per-forward results are keyed on the mask transformers hands every layer)
    if attention_mask is not None and getattr(attention_mask, _FULL_TAG, False):
        # No padding, but packed documents by the collator's keywords (a sliding-window layer gets this mask where a
        # full-attention layer gets None): the documents, as there (the mask still keys this forward's results).
        attention_mask = None
    if attention_mask is not None and attention_mask.dim() == 2:
        width = attention_mask.shape[1]
        if _tracing(attention_mask):
            raise _err("padded batches read their lengths on the host: not under CUDA-graph capture or fake tensors")
        windowed = sliding_window is not None
        # (v comes from the same cache; another layout is copied, not wrong)
        k_width = _key_width(k, width, max(q.shape[-1], v.shape[-1]))
        packing = _DERIVED.get(
            (attention_mask,),
            ("pad", s, windowed, k_width, q.device),
            lambda: _unpad(
                attention_mask.to(device=q.device, dtype=torch.bool),
                s,
                windowed,
                k_width,
                getattr(attention_mask, _GAPS_TAG, None),
            ),  # fmt: skip
        )
        return width if packing is None else packing
    if attention_mask is not None and attention_mask.dim() != 4:
        raise _err(f"an attention mask of {attention_mask.dim()} dims is not served")
    if attention_mask is not None and attention_mask.shape[0] == 1 and b > 1:
        attention_mask = attention_mask.expand(b, *attention_mask.shape[1:])  # broadcast over the batch, as SDPA
    if attention_mask is not None and s == 1:
        # One query per row (decoding, e.g. with a static cache, where transformers materialises the mask): any mask
        # is then just the set of keys that query sees, served exactly as a packed sequence. A sliding window is
        # inside the mask already; reapplied to the packed keys it removes none (packing moves keys no farther apart).
        if attention_mask.dtype != torch.bool or attention_mask.shape != (b, 1, 1, sk):
            raise _err(f"a decoding mask of shape {tuple(attention_mask.shape)} / {attention_mask.dtype} is not served")
        if _tracing(attention_mask):
            raise _err("masked decoding reads its lengths on the host: not under CUDA-graph capture or fake tensors")
        visible = attention_mask[:, 0, 0]
        return _DERIVED.get((given,), ("one", b, q.device), lambda: _single_queries(visible.to(q.device)))
    # Packed documents: a materialised 4D mask (or none, with the collator's keywords).
    if s != sk:
        raise _err(f"this mask (queries and keys of different lengths) is not served. {_FOUR_D_SERVED}")
    if _tracing(attention_mask):
        raise _err("packed documents read their lengths on the host: not under CUDA-graph capture or fake tensors")
    position_ids = kwargs.get("position_ids")

    def derive():
        documents = _packing_from_keywords(kwargs, b, s, q.device)
        if documents is None:
            starts = _packing_from_positions(position_ids, b, s)
            if starts is None:
                raise _err(f"this call's 4D mask marks no packed documents. {_FOUR_D_SERVED}")
            documents = starts.to(q.device), None
        starts, packing = documents
        if attention_mask is not None:
            _check_documents(attention_mask.to(q.device), starts, sliding_window)
        return packing if packing is not None else _documents(starts, b, s)

    tensors = (given, position_ids, kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"))
    return _DERIVED.get(tensors, ("docs", b, s, sliding_window, q.device), derive)


# --- the mask function -------------------------------------------------------------------------------------------
def _plain_pattern(mask_function, allow_is_causal_skip: bool, local_size, config, kwargs) -> bool:
    """Whether transformers asks for its plain causal pattern or the config's sliding window (nothing that padding
    and the attention function's own causal / window arguments do not already say). A caller that turns the skip off
    wants the materialised mask (some models index it; transformers also does so for decoding into a static cache,
    which the attention function serves from the 4D mask too)."""
    if not allow_is_causal_skip or "allow_is_bidirectional_skip" in kwargs:
        return False
    if local_size is not None:
        # The config's sliding window; another local_size is a chunked-attention pattern (chunk size).
        chunk = getattr(config, "attention_chunk_size", None)
        return local_size == getattr(config, "sliding_window", None) and local_size != chunk
    try:
        from transformers.masking_utils import causal_mask_function
    except ImportError:
        return True
    # Overlays (packing, image tokens, custom functions) wrap the plain function; they also turn the skip off.
    return mask_function is causal_mask_function or mask_function is None


def _padding(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, window, device):
    """For a plain pattern: None (no mask: plain causal, queries end where the layer's keys end, no padding), a 2D
    bool mask (b, L) over the layer's first L key slots whose last q_length are the queries, tagged with the window
    it was built for, or False (cannot be said so: materialise)."""
    if isinstance(q_offset, torch.Tensor):
        if _tracing(q_offset):
            return False
        q_offset = int(q_offset)
    end = q_offset + q_length - kv_offset  # key slots in use: the queries' own slot is the last of them
    if not q_length <= end <= kv_length:
        return False
    if attention_mask is not None:
        if attention_mask.dim() != 2 or _tracing(attention_mask) or attention_mask.shape[-1] != q_offset + q_length:
            return False  # e.g. a fixed-width mask with future slots, which transformers reads from kv_offset
        # A sliding layer's cache holds the last kv_length. Contiguous: a slice is a view with the mask's strides, and
        # generate() calls .contiguous() on the masks it builds (static caches), whose copy would lose the tags.
        mask = attention_mask[:, -kv_length:].to(torch.bool).contiguous()
        if mask.shape != (batch_size, end):
            return False
        # One host read per mask, as transformers' own masks: whether there is padding (one reduction, what every
        # decoding step of an unpadded batch pays), then for a padded batch whether its rows' valid tokens are
        # contiguous (what the attention function's packing needs: it reads nothing itself).
        if not bool(mask.all()):
            return _tagged(mask, window, gaps=bool(_valid_ranges(mask)[2]))
    if end == kv_length and window is None:
        return None
    return _tagged(torch.ones(batch_size, end, dtype=torch.bool, device=device), window, full=True)


def _own_mask(batch_size, q_length, q_offset, kv_offset, attention_mask, window):
    """The plug-in's own 2D mask where it comes back as the `attention_mask` to build from (Mistral's model builds its
    mask again from the one generate() built for a static cache), else None. It covers the layer's key slots, not the
    positions from 0 that transformers reads a 2D mask at: it is the answer for the pattern it was built for (its
    window, its slots ending at the queries'), and refused for any other."""
    if attention_mask is None or attention_mask.dim() != 2 or not hasattr(attention_mask, _WINDOW_TAG):
        return None
    if isinstance(q_offset, torch.Tensor):
        if _tracing(q_offset):
            raise _err("the plug-in's own padding mask came back to its mask function under tracing: pass the 2D mask")
        q_offset = int(q_offset)
    tagged, slots = getattr(attention_mask, _WINDOW_TAG), q_offset + q_length - kv_offset
    if tagged != window or tuple(attention_mask.shape) != (batch_size, slots):
        raise _err(
            f"the plug-in's own padding mask (sliding_window={tagged}, shape {tuple(attention_mask.shape)}) came back "
            f"to its mask function for another pattern (sliding_window={window}, {batch_size} rows of {slots} key "
            "slots): give transformers the 2D attention_mask over the tokens' positions instead"
        )
    return attention_mask


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
    """transformers' mask-interface contract. For the plain causal / sliding-window pattern: None (plain causal, no
    mask needed) or a 2D padding mask tagged with its window, which the attention function unpads into packed
    sequences. Anything else: the materialised 4D mask, which the attention function serves only when it is exactly
    causal attention within packed documents, or the keys of one query per row. Its own 2D mask, handed back, is
    returned as it is (`_own_mask`)."""
    from transformers.masking_utils import sdpa_mask

    window = local_size if local_size is not None and local_size == getattr(config, "sliding_window", None) else None
    own = _own_mask(batch_size, q_length, q_offset, kv_offset, attention_mask, window)
    plain = _plain_pattern(mask_function, allow_is_causal_skip, local_size, config, kwargs)
    if own is not None:
        if plain:
            return own
        # Materialised below from the positions it covers (the ones before, left as padding, are never read).
        attention_mask = torch.nn.functional.pad(own, (kv_offset, 0))
    elif plain:
        device = kwargs.get("device", "cpu")
        padding = _padding(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, window, device)
        if padding is not False:
            return padding
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
    if mask is None:  # cannot happen with the skip disallowed; never let a masked call look unmasked
        mask = torch.zeros(batch_size, 1, q_length, kv_length, dtype=torch.bool)
    # Contiguous (sdpa_mask expands a mask without padding over the batch): generate() calls .contiguous() on the
    # masks it builds for static caches, and a copy would lose the tags (then derived anew in every layer).
    mask = mask.contiguous()
    # The config's sliding window is part of this pattern (packed documents check it); a chunk size is not a window.
    setattr(mask, _BUILT_TAG, True)
    return _tagged(mask, window) if window is not None else mask


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

"""FlashAttention-4's `flash_attn.cute.interface` names on top of cute_flash, so FA4's own test files run against it.

A request for a feature cute-flash lacks skips with its reason (also appended to $OUT/skips.txt): a skip that
remains is a missing feature, a failure is a bug. num_splits / pack_gqa / scheduler metadata are scheduling hints;
cute-flash chooses its own split and GQA packing.
"""

import os

import pytest
import torch

import cute_flash


def _skip(reason):
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "skips.txt"), "a") as f:
            f.write(reason + "\n")
    pytest.skip("cute-flash lacks: " + reason)


def _unsupported(qv, gather_kv_indices, score_mod, mask_mod, block_sparse_tensors):
    if qv is not None:
        _skip("qv")
    if gather_kv_indices is not None:
        _skip("gather_kv_indices")
    if score_mod is not None or mask_mod is not None:
        _skip("score_mod/mask_mod")
    if block_sparse_tensors is not None:
        _skip("block sparsity")


def _window(window_size):
    return tuple(window_size) if window_size is not None else (None, None)


def _call(fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except NotImplementedError as e:
        _skip("NotImplementedError: " + str(e)[:100])


def flash_attn_func(
    q,
    k,
    v,
    qv=None,
    gather_kv_indices=None,
    softmax_scale=None,
    causal=False,
    window_size=(None, None),
    learnable_sink=None,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    aux_tensors=None,
    aux_scalars=None,
    block_sparse_tensors=None,
    block_sparse_tensors_bwd=None,
    return_lse=False,
):
    _unsupported(qv, gather_kv_indices, score_mod, mask_mod, block_sparse_tensors)
    return _call(
        cute_flash.attention,
        q,
        k,
        v,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=_window(window_size),
        deterministic=deterministic,
        softcap=softcap or 0.0,
        learnable_sink=learnable_sink,
        return_lse=True,
    )


def flash_attn_varlen_func(
    q,
    k,
    v,
    qv=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    min_seqlen_k=None,
    seqused_q=None,
    seqused_k=None,
    gather_kv_indices=None,
    page_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(None, None),
    learnable_sink=None,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    block_sparse_tensors=None,
    aux_tensors=None,
    aux_scalars=None,
    return_lse=False,
    scheduler_metadata=None,
    seqlen_k_per_split=None,
    disable_scheduler_metadata=False,
):
    _unsupported(qv, gather_kv_indices, score_mod, mask_mod, block_sparse_tensors)
    ws = _window(window_size)
    if page_table is not None:
        if cu_seqlens_k is not None or seqused_k is None:
            _skip("paged KV with cu_seqlens_k")
        if seqused_q is not None:
            _skip("seqused_q with a paged KV cache")
        # FA4's KV-cache form: a paged cache with per-sequence lengths (forward only here).
        if cu_seqlens_q is not None and max_seqlen_q is None:
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        return _call(
            cute_flash.attention_with_kvcache,
            q,
            k,
            v,
            cache_seqlens=seqused_k.to(q.device).int(),
            page_table=page_table,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q,
            causal=causal,
            softmax_scale=softmax_scale,
            window_size=ws,
            softcap=softcap or 0.0,
            learnable_sink=learnable_sink,
            return_lse=True,
        )
    # A padded (batch, seqlen) side (cu_seqlens None): its rows flattened, one sequence per batch row (seqused_q /
    # seqused_k then say how many of them count), so that the call is differentiable through attention_varlen.
    padded_q = cu_seqlens_q is None
    if padded_q:
        batch, seqlen_q = q.shape[:2]
        cu_seqlens_q, max_seqlen_q = _rows_cu(batch, seqlen_q, q.device), seqlen_q
        q = q.reshape(batch * seqlen_q, *q.shape[2:])
    if cu_seqlens_k is None:
        b_k, seqlen_k = k.shape[:2]
        k, v = k.reshape(b_k * seqlen_k, *k.shape[2:]), v.reshape(b_k * seqlen_k, *v.shape[2:])
        cu_seqlens_k, max_seqlen_k = _rows_cu(b_k, seqlen_k, q.device), seqlen_k
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_seqlen_k is None:
        max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
    result = _call(
        cute_flash.attention_varlen,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=ws,
        seqused_k=None if seqused_k is None else seqused_k.to(q.device).int(),
        seqused_q=None if seqused_q is None else seqused_q.to(q.device).int(),
        deterministic=deterministic,
        softcap=softcap or 0.0,
        learnable_sink=learnable_sink,
        return_lse=True,
    )
    if not padded_q:
        return result
    out, lse = result
    return out.view(batch, seqlen_q, *out.shape[1:]), lse.view(lse.shape[0], batch, seqlen_q).transpose(0, 1)


def _rows_cu(batch, seqlen, device):
    return torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)


def get_scheduler_metadata(*a, **kw):
    return None  # a hint; cute-flash schedules from shapes alone


def _flash_attn_fwd(*a, **kw):
    _skip("FA4 internal _flash_attn_fwd")


def _flash_attn_bwd(*a, **kw):
    _skip("FA4 internal _flash_attn_bwd")


def _flash_attn_bwd_sparse_mla(*a, **kw):
    _skip("sparse MLA backward")

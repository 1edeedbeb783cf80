"""`attention_with_kvcache`: attention of new query tokens against a KV cache (serving: decoding, speculative
decoding, chunked prefill), with the new tokens' K / V appended to the cache first.

One call does, on the current stream and without any host synchronisation (a decoding step captures in a CUDA
graph and replays with new lengths and page tables):
  1. if k_new / v_new are given, one append kernel (common/kv_append.py) writes them into the cache at each
     sequence's length (through the page table of a paged cache) and the sequences' new lengths;
  2. the family's KV-cache forward (`ArchBackend.forward_kvcache`): the query heads of each KV head packed as the
     rows of one tile (each cache byte read once per GQA group), keys split over CTAs when the grid would not fill
     the GPU (`num_splits`, combined exactly).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, Optional, Tuple, Union

import torch

from . import compile_cache
from .core import device as gpu
from .arch import ARCH_ENV_VAR
from .arch import split_kv
from .arch.base import KvCacheTensors
from .kernel_layout import kernel_view
from .spec import AttentionSpec, op_window_bound
from .validation import ALIGN_BYTES, KvCacheArgs, KvCacheProblem, check_kvcache_addresses, validate_kvcache

# (append kernel key) -> compiled append; (call signature) -> _Plan
_append_kernels: Dict[tuple, object] = compile_cache.memo()
_plans: Dict[tuple, "_Plan"] = compile_cache.memo()
_MAX_PLANS = 4096


class _Plan:
    """What a warm call of one signature needs: the validated problem, the serving backend, the split count, the
    append kernel (None without new tokens), the device."""

    __slots__ = ("problem", "backend", "splits", "append", "device", "device_index", "lse_shape", "out_shape")
    __slots__ += ("launch",)
    __slots__ += ("_scratch",)

    def __init__(self, problem: KvCacheProblem, backend, splits: int, append, device: torch.device):
        p = problem
        self.problem, self.backend, self.splits, self.append, self.device = problem, backend, splits, append, device
        self.out_shape = (p.total_q, p.nheads, p.head_dim_v) if p.packed_q else (
            p.batch, p.seqlen_q, p.nheads, p.head_dim_v
        )  # fmt: skip
        self.lse_shape = (p.nheads, p.total_q) if p.packed_q else (p.batch, p.nheads, p.seqlen_q)
        self.device_index = device.index if device.type == "cuda" else None
        self.launch = None  # the backend's kvcache_launcher, made at the first launch
        self._scratch = None

    def scratch_lse(self) -> torch.Tensor:
        """The lse buffer of calls that do not return it: kept by the plan, since the kernels only write it (calls on
        several streams may write it at once; nobody reads it)."""
        if self._scratch is None:
            # A normal tensor even when the first call runs under inference_mode: later calls outside it write it too.
            with torch.inference_mode(False):
                self._scratch = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        return self._scratch


def _signature(args: KvCacheArgs, max_seqlen_q, causal, softmax_scale, window_size, softcap, num_splits) -> tuple:
    """What validation, routing and the split depend on, from metadata only (no device values): every tensor's
    shape, strides, dtype and device, their addresses' 16-byte alignment, the scalars with their types (a cached
    `True` never answers for a rejected `1`) and CUTE_FLASH_ARCH. Plain loops: this runs on every decoding step."""
    key = [os.environ.get(ARCH_ENV_VAR), type(window_size), max_seqlen_q, causal, softmax_scale, *window_size]
    key += (softcap, num_splits, type(max_seqlen_q), type(causal), type(softmax_scale), type(softcap))
    key += (type(num_splits), *(type(w) for w in window_size))
    align = 0
    for t in args:
        if t is None:
            key.append(None)
        else:
            key += (t.shape, t.stride(), t.dtype, t.get_device())
            align |= t.data_ptr()
    key.append(align & (ALIGN_BYTES - 1))
    return tuple(key)


def append_kernel(dtype: str, kv_fp8: bool, head_dim: int, head_dim_v: int, paged: bool, packed: bool, target: str):
    """The compiled append of new tokens (common/kv_append.py) for one cache kind, on `target` (also `warmup`'s)."""
    key = ("kv_append", target, dtype, kv_fp8, head_dim, head_dim_v, paged, packed)
    kernel = _append_kernels.get(key)
    if kernel is None:

        def build():
            from .common.kv_append import compile_kv_append

            return compile_kv_append(dtype, kv_fp8, head_dim, head_dim_v, paged, packed, target)

        kernel = _append_kernels[key] = compile_cache.get_or_compile(key, build)
    return kernel


def _append_kernel(args: KvCacheArgs, p: KvCacheProblem, device: torch.device):
    if args.k_new is None:
        return None
    target = compile_cache.runtime_target(device)
    paged = args.page_table is not None
    return append_kernel(p.spec.dtype, p.spec.kv_fp8, p.head_dim, p.head_dim_v, paged, p.packed_q, target)


def _make_plan(args: KvCacheArgs, max_seqlen_q, causal, softmax_scale, window_size, softcap, num_splits) -> _Plan:
    problem = validate_kvcache(
        args, max_seqlen_q=max_seqlen_q, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, num_splits=num_splits,
    )  # fmt: skip
    device = args.q.device
    backend = gpu.route(problem.spec, args.q, backward=False)
    splits = num_splits or split_kv.auto_kvcache_splits(backend, problem, compile_cache.sm_count(device))
    return _Plan(problem, backend, splits, _append_kernel(args, problem, device), device)


def _plan(args: KvCacheArgs, *scalars) -> _Plan:
    try:
        key = _signature(args, *scalars)
        plan = _plans.get(key)
    except (TypeError, ValueError, AttributeError):
        key, plan = None, None
    if plan is None:
        plan = _make_plan(args, *scalars)
        if key is not None:
            if len(_plans) >= _MAX_PLANS:
                _plans.clear()
            _plans[key] = plan
    else:  # (the checks that depend on addresses, which the key leaves out)
        check_kvcache_addresses(args)
    return plan


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor,
    page_table: Optional[torch.Tensor] = None,
    k_new: Optional[torch.Tensor] = None,
    v_new: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    softcap: float = 0.0,
    learnable_sink: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    out: Optional[torch.Tensor] = None,
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention of q against a KV cache, after appending k_new / v_new to it. Forward only (no autograd).

    q: (batch, seqlen_q, nheads, head_dim), or packed (total_q, nheads, head_dim) with int32 cu_seqlens_q
    (batch + 1,) and the host int max_seqlen_q (varlen queries: chunked prefill, a different number of speculative
    tokens per sequence).
    k_cache / v_cache: a dense cache (batch, seqlen_cache, nheads_kv, head_dim / head_dim_v), or a paged cache
    (num_pages, page_size, nheads_kv, head_dim / head_dim_v) with page_table (batch, max_pages) int32, vLLM's
    layout: key position p of sequence b is row p % page_size of page page_table[b, p // page_size]. Page sizes
    1..256 (the sm80 family's gathers; on Hopper multiples of 8 take the sm90 kernel, larger ones too); pages may be
    permuted, shared between sequences and non-contiguous. In q's dtype, or float8_e4m3fn with
    k_descale / v_descale (batch, nheads_kv) float32: the cache stores K / descale (half the bytes; the sm90 and
    sm80 KV-cache forwards convert it exactly in the kernel).
    cache_seqlens: (batch,) int32, the tokens each sequence already has in the cache. It is read, not updated: the
    caller advances it (by the appended tokens) for the next step.
    k_new / v_new: tokens appended at positions cache_seqlens[b] .. before attending, in q's dtype (quantised with
    the descales into an fp8 cache): (batch, seqlen_new, nheads_kv, d) with dense q, packed like q (total_q,
    nheads_kv, d) with cu_seqlens_q (sequence b appends one token per query row).
    Sequence b attends to its cache_seqlens[b] + new tokens keys. The mask is bottom-right aligned per sequence:
    query row s of a sequence with n_q query rows and n_k keys sees key j iff
    s + n_k - n_q - left <= j <= s + n_k - n_q + right (causal: right = 0), so new tokens see each other causally.
    softmax_scale, window_size, softcap, learnable_sink: as in `cute_flash.attention` (FlashAttention-3's names, but
    causal defaults to True and an unlimited window bound is None: FA3's -1 is a shifted edge here).
    num_splits: how many CTAs share each query tile's keys (0: chosen from batch, heads, the cache's capacity and
    the GPU's SM count; the choice depends on shapes only, so a CUDA graph replays with new lengths). The combine
    is exact and, for a given split, deterministic. A softmax_scale above 2^64 (where scale x score may overflow
    fp32, a hard max) runs unsplit: num_splits > 1 then raises ValueError.
    out: a preallocated output (q's shape with head_dim_v, q's dtype, in place: unit last stride, 16-byte units),
    sharing no memory with any input. With k_new / v_new, k_cache and v_cache must share no element (a combined
    cache's K and V halves may share a tensor). q may have any strides with a unit last one (it is copied into the
    kernels' layout where it is not in it); the caches are used in place.
    Returns out, and with return_lse the float32 log-sum-exp, (batch, nheads, seqlen_q) or (nheads, total_q).

    Contract not checked on the host (it would need the values): cache_seqlens[b] plus the new tokens fit the
    cache (max_pages * page_size, or seqlen_cache) and every page index a sequence reaches lies in [0, num_pages).
    The kernels never read or write memory outside the cache whatever these values are; a call that breaks the
    contract has undefined results.
    """
    args = KvCacheArgs(
        q, k_cache, v_cache, cache_seqlens, page_table, k_new, v_new, cu_seqlens_q, learnable_sink, k_descale,
        v_descale, out,
    )  # fmt: skip
    if torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad
        for t in (q, k_cache, v_cache, k_new, v_new, learnable_sink, k_descale, v_descale, out)
    ):
        raise NotImplementedError(
            "attention_with_kvcache is forward-only (serving); for gradients use cute_flash.attention or "
            "cute_flash.attention_varlen, or call it under torch.no_grad()"
        )
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    # (a window that is not a pair goes to validation as given, which names the problem)
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    scalars = (max_seqlen_q, causal, softmax_scale, window, softcap, num_splits)
    if torch.compiler.is_compiling():
        return _traced(args, scalars, return_lse)
    plan = _plan(args, *scalars)
    if out is None:
        out = torch.empty(plan.out_shape, dtype=q.dtype, device=plan.device)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=plan.device) if return_lse else plan.scratch_lse()
    _launch_on_device(plan, args, out, lse)
    return (out, lse) if return_lse else out


def _launch_on_device(plan: _Plan, args: KvCacheArgs, out: torch.Tensor, lse: torch.Tensor) -> None:
    if plan.device_index is None or torch.cuda.current_device() == plan.device_index:
        _launch(plan, args, out, lse)
    else:
        with torch.cuda.device(plan.device):
            _launch(plan, args, out, lse)


def _launch(plan: _Plan, a: KvCacheArgs, out: torch.Tensor, lse: torch.Tensor) -> None:
    p = plan.problem
    seqlens_k = a.cache_seqlens
    max_new = 0 if plan.append is None else (p.seqlen_q if p.packed_q else a.k_new.shape[1])
    # q in the kernels' layout (it is only read: a misaligned or broadcast q is copied, as `attention` does); before
    # the append, so that nothing is written for a call that cannot launch.
    q = kernel_view(a.q, name="q")
    if max_new > 0 and p.batch:  # (no new token or no sequence: nothing to write, the lengths are the cache's)
        seqlens_k = torch.empty_like(a.cache_seqlens)
        plan.append(
            a.k_new, a.v_new, a.k_cache, a.v_cache, a.page_table, a.cache_seqlens, a.cu_seqlens_q, seqlens_k,
            a.k_descale, a.v_descale, max_new,
        )  # fmt: skip
    sink = a.learnable_sink
    if sink is not None and (sink.dtype != torch.float32 or not sink.is_contiguous()):
        sink = sink.float().contiguous()
    if p.total_q and p.nheads:
        t = KvCacheTensors(
            q, a.k_cache, a.v_cache, out, lse, seqlens_k, a.page_table, a.cu_seqlens_q, sink, a.k_descale,
            a.v_descale,
        )  # fmt: skip
        launch = plan.launch
        if launch is None:
            launch = plan.launch = plan.backend.kvcache_launcher(p, plan.device, plan.splits)
        launch(t)


# --- torch.compile: the call as one custom op -------------------------------------------------------------------
# torch.ops.cute_flash.kvcache_fwd(q, k_cache!, v_cache!, cache_seqlens, page_table, k_new, v_new, cu_seqlens_q,
#     max_seqlen_q, causal, softmax_scale, window_left, window_right, softcap, learnable_sink, k_descale, v_descale,
#     num_splits, out!) -> lse
# The caches and out are mutated in place (the append writes the caches; the op writes out, which the traced call
# allocates when the caller gave none). Eager calls do not go through it (the dispatch's host cost); a trace sees the
# call validated on metadata, the op, and out.
KVCACHE_SCHEMA = (
    "(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? page_table, Tensor? k_new, "
    "Tensor? v_new, Tensor? cu_seqlens_q, SymInt? max_seqlen_q, bool causal, float? softmax_scale, "
    "SymInt? window_left, SymInt? window_right, float softcap, Tensor? learnable_sink, Tensor? k_descale, "
    "Tensor? v_descale, SymInt num_splits, "
    "Tensor(c!) out) -> Tensor"
)


def _kvcache_op(q, k_cache, v_cache, cache_seqlens, page_table, k_new, v_new, cu_seqlens_q, max_seqlen_q, causal,
                softmax_scale, window_left, window_right, softcap, learnable_sink, k_descale, v_descale, num_splits,
                out):  # fmt: skip
    args = KvCacheArgs(q, k_cache, v_cache, cache_seqlens, page_table, k_new, v_new, cu_seqlens_q, learnable_sink,
                       k_descale, v_descale, out)  # fmt: skip
    plan = _plan(args, max_seqlen_q, causal, softmax_scale, (window_left, window_right), softcap, num_splits)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=plan.device)
    _launch_on_device(plan, args, out, lse)
    return lse


def _lse_shape(q: torch.Tensor, packed: bool) -> tuple:
    return (q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1])


def _kvcache_fake(q, k_cache, v_cache, cache_seqlens, page_table, k_new, v_new, cu_seqlens_q, *rest):
    return q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)


kvcache_fwd = torch.library.custom_op(
    "cute_flash::kvcache_fwd", _kvcache_op, mutates_args=("k_cache", "v_cache", "out"), schema=KVCACHE_SCHEMA
)
kvcache_fwd.register_fake(_kvcache_fake)


_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionSpec))


@torch.compiler.assume_constant_result
def _unserved(spec_fields: tuple, q: torch.Tensor) -> Optional[str]:
    """The router's reason why no family serves the spec of these fields (`_SPEC_FIELDS`: a trace hands plain values
    over, not the object it made) on q's GPU, or None; asked while torch.compile traces (a constant of the trace),
    so that a call no kernel serves fails there, as the eager call does, not when the graph runs (callers that fall
    back on an error, as the transformers plug-in, then fall back at trace time)."""
    try:
        gpu.route(AttentionSpec(*spec_fields), q, backward=False)
    except NotImplementedError as e:
        return str(e)
    return None


def _traced(args: KvCacheArgs, scalars: tuple, return_lse: bool):
    """`attention_with_kvcache` while torch.compile traces it: validated on metadata and routed (the eager call's
    errors), out allocated when not given, then the op."""
    max_seqlen_q, causal, softmax_scale, window, softcap, num_splits = scalars
    p = validate_kvcache(
        args, max_seqlen_q=max_seqlen_q, causal=causal, softmax_scale=softmax_scale, window_size=window,
        softcap=softcap, num_splits=num_splits,
    )  # fmt: skip
    reason = _unserved(tuple(getattr(p.spec, name) for name in _SPEC_FIELDS), args.q)
    if reason is not None:
        raise NotImplementedError(reason)
    out = args.out
    if out is None:
        rows = (p.total_q,) if p.packed_q else (p.batch, p.seqlen_q)
        out = args.q.new_empty(*rows, p.nheads, p.head_dim_v)
    a = args
    lse = torch.ops.cute_flash.kvcache_fwd(
        a.q, a.k_cache, a.v_cache, a.cache_seqlens, a.page_table, a.k_new, a.v_new, a.cu_seqlens_q, max_seqlen_q,
        causal, softmax_scale, op_window_bound(window[0]), op_window_bound(window[1]), float(softcap),
        a.learnable_sink, a.k_descale, a.v_descale, int(num_splits), out,
    )  # fmt: skip
    return (out, lse) if return_lse else out

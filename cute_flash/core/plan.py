"""Plans: everything a warm call needs, derived once per call signature (core/fields.py) and cached, so that a warm
eager call builds one tuple from tensor metadata, does one dict lookup, allocates and launches (docs/torch.md, "Host
time"). A miss validates completely (`cute_flash.validation`: the same errors as ever) and routes; errors are never
cached. FP8 calls are planned per call (their descales are per-call tensors, and the pre-pass costs more than the
checks).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from .. import compile_cache, decode, routing
from ..arch import split_kv
from ..arch.base import ArchBackend
from ..problem import PackedSeqs, Problem, VarlenProblem
from ..spec import normalize_mask
from ..validation import is_kernel_layout, problem_of, validate, validate_varlen, with_seqlen_k
from . import device, fields

OUT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class Plan:
    """One call signature's validated problem (dense `Problem` or packed `VarlenProblem`), its forward backend, the
    outputs' shapes, whether the inputs need `kernel_view`'s fix-ups (and packed calls' offsets `contiguous()`), and
    what the launchers bind on first use: the forward backend's launcher, the backward backend (routed at the first
    backward, separately: the family that ran the forward may have none) and its launcher, and for decoding under GQA
    the keys the query row sees and the packed problem's own plan (decode.py), and what the autograd node runs
    (core/launch.PlanRun). fp8: (descale, rotate) of an FP8 call, else None."""

    __slots__ = ("problem", "forward", "backward", "deterministic", "copies", "copy_seqs", "empty", "device")
    __slots__ += ("device_index", "out_shape", "out_dtype", "lse_shape", "rows", "launch", "backward_launch")
    __slots__ += ("decode_keys", "decode_plan", "decode_kvcache", "kv_backend", "fp8", "run", "forced")

    def __init__(
        self, problem, forward: ArchBackend, deterministic: bool, copies: bool, device_: torch.device,
        copy_seqs: bool = False, fp8: Optional[tuple] = None,
    ):  # fmt: skip
        p = problem
        self.problem, self.forward, self.backward, self.deterministic = problem, forward, None, deterministic
        self.copies, self.copy_seqs, self.device, self.fp8 = copies, copy_seqs, device_, fp8
        self.device_index = device_.index if device_.type == "cuda" else None
        self.out_dtype = OUT_DTYPES[p.spec.out_dtype]
        self.launch = self.backward_launch = self.decode_plan = self.run = self.decode_kvcache = None
        self.kv_backend = None  # (decode_kvcache's route of the KV-cache forward: None before it ran, False: none)
        self.decode_keys = None
        self.forced = routing.forced_family()  # (the family forced when the forward was planned: the backward's too)
        if p.spec.varlen:
            self.out_shape, self.lse_shape = (p.total_q, p.nheads, p.head_dim_v), (p.nheads, p.total_q)
            self.rows = p.total_q
            self.empty = 0 in (p.batch, p.total_q, p.nheads, p.max_seqlen_q, p.total_k, p.max_seqlen_k)
            return
        self.out_shape = (p.batch, p.seqlen_q, p.nheads, p.head_dim_v)
        self.lse_shape, self.rows = (p.batch, p.nheads, p.seqlen_q), p.seqlen_q
        self.empty = 0 in (p.batch, p.seqlen_q, p.seqlen_k, p.nheads)
        if fp8 is None and not self.empty:
            keys = decode.keys_seen(p, compile_cache.sm_count(device_), forward.split_keys)
            if keys is not None and keys[0] >= keys[1]:  # a window that leaves the query row no key: no launch
                self.empty = True
            else:
                self.decode_keys = keys

    def for_keys(self, seqlen_k: int) -> "Plan":
        """This decoding plan's call with `seqlen_k` keys (a call of its `fields.decode_key`: its cache grew): validated
        by `validation.with_seqlen_k`, on the same backends (their routes do not depend on the key count), its
        launchers bound at the first launch as any plan's (the split and the tile shape do)."""
        plan = Plan(with_seqlen_k(self.problem, seqlen_k), self.forward, self.deterministic, self.copies, self.device)
        plan.backward, plan.kv_backend = self.backward, self.kv_backend
        return plan

    def backward_backend(self, q: torch.Tensor) -> ArchBackend:
        arch = self.backward
        if arch is None:
            spec, det = self.problem.spec, self.deterministic
            if self.forced == routing.forced_family():
                arch = device.route(spec, q, backward=True, deterministic=det)
            else:  # CUTE_FLASH_ARCH changed since: the plan's key holds the old value
                arch = routing.route_forced(self.forced, spec, device.capability(q), True, det).backend
            self.backward = arch
        return arch


def packed_decode_plan(plan: Plan, q_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Plan:
    """The plan of a decoding plan's packed problem (decode.pack_gqa's views; `plan.decode_plan`, made at its first
    launch): plain multi-head attention without a mask over the keys the query row sees. The views' shapes, strides
    and alignment follow from the call's signature, so one plan serves every call of it; views of tensors in the
    kernels' layout are in it too (strides of whole 16-byte units, rows cut at 16 bytes)."""
    p = plan.problem
    unmasked = normalize_mask(False, (None, None))
    packed = problem_of(q_rows, k, v, unmasked, p.softmax_scale, None, p.softcap, p.spec.sink)
    return Plan(packed, device.route(packed.spec, q_rows, backward=False), plan.deterministic, False, plan.device)


# Plans by call signature, dense and packed. Bounded: a workload with ever-new shapes rebuilds it now and then instead
# of growing it. Emptied with the kernel cache (plans hold launchers).
_plans: Dict[tuple, Plan] = compile_cache.memo()
_MAX_PLANS = 4096
_call_caches: list = [_plans]


def clear_call_cache() -> None:
    """Forget every plan (and what registered with `call_cache`): tests that change routing, the device check or the
    backends call this."""
    for cache in _call_caches:
        cache.clear()


def call_cache(cache):
    """Registers another per-signature cache (anything with `clear()`) to be forgotten with the plans; returns it."""
    _call_caches.append(cache)
    return cache


def cached(signature: Callable[..., tuple], make: Callable[..., Plan], *args) -> Plan:
    """The plan kept under `signature(*args)`, else `make(key, *args)`'s (validating and routing, which raise what
    they raise; errors are never kept). A signature that cannot be built (not tensors, unhashable or malformed
    arguments) is not kept, and `make` gets key None. (Plain functions and their arguments, no closures: this runs on
    every eager call.)"""
    try:
        key = signature(*args)
        plan = _plans.get(key)
    except (TypeError, ValueError, AttributeError):
        key, plan = None, None
    if plan is None:
        plan = make(key, *args)
        if key is not None:
            if len(_plans) >= _MAX_PLANS:
                _plans.clear()
            _plans[key] = plan
    return plan


def _copies(q, k, v) -> bool:
    return not (is_kernel_layout(q) and is_kernel_layout(k) and is_kernel_layout(v))


# Decoding plans by `fields.decode_key` (the call without its key count): a cache that grows by a token per step
# (transformers' DynamicCache) would otherwise be validated, routed and bound afresh in every step's first layer.
_families: Dict[tuple, Plan] = call_cache(compile_cache.memo())


def _make_dense(key: Optional[tuple], q, k, v, scalars: tuple, window_size, tensors: tuple) -> Plan:
    family = None if key is None else fields.decode_key(q, k, v, key)
    if family is not None:
        template = _families.get(family)
        if template is not None:
            return template.for_keys(k.shape[1])
    kw = fields.keywords(scalars, window_size, tensors)
    problem: Problem = validate(q, k, v, dtype=None, **kw)
    forward = device.route(problem.spec, q, backward=False)
    plan = Plan(problem, forward, kw["deterministic"], _copies(q, k, v), q.device)
    if family is not None and plan.decode_keys is not None:
        if len(_families) >= _MAX_PLANS:
            _families.clear()
        _families[family] = plan
    return plan


def _make_packed(_key, q, k, v, scalars: tuple, window_size, tensors: tuple, seqs: PackedSeqs) -> Plan:
    kw = fields.keywords(scalars, window_size, tensors)
    problem: VarlenProblem = validate_varlen(q, k, v, seqs, **kw)
    copy_seqs = not all(t is None or t.is_contiguous() for t in seqs[:3])
    forward = device.route(problem.spec, q, backward=False)
    return Plan(problem, forward, kw["deterministic"], _copies(q, k, v), q.device, copy_seqs)


def dense(q, k, v, scalars: tuple, window_size, tensors: tuple) -> Plan:
    """The cached plan of an fp16/bf16 call: scalars and tensors in core/fields.py's CALL order, window_size the
    caller's own (left, right) object."""
    return cached(fields.key, _make_dense, q, k, v, scalars, window_size, tensors)


def packed(q, k, v, scalars: tuple, window_size, tensors: tuple, seqs: PackedSeqs) -> Plan:
    """The cached plan of a packed (`attention_varlen`) call, keyed like `dense` plus the packed-sequence fields."""
    return cached(fields.packed_key, _make_packed, q, k, v, scalars, window_size, tensors, seqs)


def of_call(q, k, v, seqs: Optional[PackedSeqs] = None, **call) -> Plan:
    """`dense` (`packed` with seqs) of a call given by keyword: every field by name (core/fields.py), window_size as
    the (left, right) pair; for callers off the hot path (the ring's blocks, the SDPA plug-in)."""
    scalars, tensors = fields.from_keywords(**call)
    if seqs is None:
        return dense(q, k, v, scalars, call["window_size"], tensors)
    return packed(q, k, v, scalars, call["window_size"], tensors, seqs)


def fp8(q, k, v, *, dtype, descale, fp8_rotate, **call) -> Plan:
    """The plan of an FP8 call (dtype="fp8" or float8_e4m3fn inputs), made per call; `call`: `validate`'s other
    keywords. Validation refuses everything else that reaches it (e.g. fp8_rotate=False without dtype="fp8")."""
    problem = validate(q, k, v, dtype=dtype, descale=descale, fp8_rotate=fp8_rotate, **call)
    assert problem.spec.dtype == "fp8", "only FP8 calls are planned here"
    forward = device.route(problem.spec, q, backward=False)
    return Plan(problem, forward, False, True, q.device, fp8=(descale, fp8_rotate))


def decode_kvcache(plan: Plan, q: torch.Tensor):
    """(launcher, seqlens_k) of a decoding plan on its GPU's KV-cache forward (decode.kvcache_problem; made at the
    first launch), or False when the forward's family has none for it (the call then runs packed, decode.py).
    seqlens_k is a constant (b,) int32 vector of the keys the query row sees (`lengths_vector`: a row of a table
    shared by the plans of other lengths, which nothing writes to)."""
    kv = decode.kvcache_problem(plan.problem, plan.decode_keys)
    backend = plan.kv_backend
    if backend is None:
        try:
            backend = device.route(kv.spec, q, backward=False)
        except NotImplementedError:
            backend = False
        plan.kv_backend = backend
    if not backend or not backend.kvcache or backend.name != plan.forward.name:
        # (another family's KV-cache kernel, e.g. the sm80 one for a head dim the sm90 KV-cache forward lacks on
        # Hopper: the forward's own family packs the rows instead, on its faster kernels)
        return False
    splits = split_kv.auto_kvcache_splits(backend, kv, compile_cache.sm_count(plan.device))
    lo, hi = plan.decode_keys
    return backend.kvcache_launcher(kv, plan.device, splits), lengths_vector(kv.batch, hi - lo, q)


# `lengths_vector`'s tables: (batch, device, block) -> (rows, batch) int32, row r filled with block * rows + r, where
# rows = _length_rows(batch) (at most _LENGTH_ELEMENTS elements a table).
_LENGTH_ELEMENTS = 1 << 20
_length_tables: Dict[tuple, torch.Tensor] = call_cache(compile_cache.memo())


def _length_rows(batch: int) -> int:
    return max(1, min(1024, _LENGTH_ELEMENTS // max(batch, 1)))


def lengths_vector(batch: int, n: int, q: torch.Tensor) -> torch.Tensor:
    """A (batch,) int32 vector of n on q's device that nothing writes to: a row of a table of up to 1024 lengths, so
    that a cache growing by a token per step fills one table per 1024 steps instead of a vector per step. A new
    table is waited for once (its fill on the current stream), so that any stream may read it. Under CUDA-graph
    capture a vector of its own (from the graph's pool, which lives as long as the graph: a table's memory is owned
    by this cache, which may forget it while the graph still reads it)."""
    if device.capturing(q):
        return torch.full((batch,), n, dtype=torch.int32, device=q.device)
    rows = _length_rows(batch)
    block, row = divmod(n, rows)
    key = (batch, q.device, block)
    table = _length_tables.get(key)
    if table is None:
        if len(_length_tables) >= 64:
            _length_tables.clear()
        first = block * rows
        filled = torch.arange(first, first + rows, dtype=torch.int32, device=q.device).view(-1, 1)
        table = _length_tables[key] = filled.expand(-1, batch).contiguous()
        if table.is_cuda:
            torch.cuda.current_stream(q.device).synchronize()
    return table[row]

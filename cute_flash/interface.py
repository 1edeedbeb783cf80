"""The public torch API: `attention`, `backend` and `explain`."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple, Union

import torch

from . import compile_cache, decode, native, ops, routing, validation  # noqa: F401  (ops: torch.ops.cute_flash.*)
from .arch import ARCH_ENV_VAR, resolve_arch
from .arch.base import ArchBackend, BoundForward, BwdTensors, FwdTensors, Grads, SplitForward
from .spec import AttentionSpec, normalize_mask
from .validation import ALIGN_BYTES, Problem, is_kernel_layout, kernel_view, problem_of, validate


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


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _device_capability(t: torch.Tensor) -> Tuple[int, int]:
    """The compute capability of the GPU holding `t`, read once per device (tests replace this function)."""
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())


def _route(spec: AttentionSpec, t: torch.Tensor, backward: bool, deterministic: bool = False) -> ArchBackend:
    """The backend serving `spec` on `t`'s GPU in one direction (a deterministic backward if asked);
    NotImplementedError naming every family's reason when none has a kernel. Looked up on every call
    (CUTE_FLASH_ARCH may change); decisions are cached."""
    return routing.route(spec, _device_capability(t), backward, deterministic).backend


def _device_guard(t: torch.Tensor):
    """Makes `t`'s GPU current while a kernel launches (tests on CPU tensors replace this function)."""
    return torch.cuda.device(t.device)


class _Plan:
    """Everything a warm eager call needs, derived once per call signature (`_signature`): the validated problem,
    the forward backend, the outputs' shapes, and whether the inputs need `kernel_view`'s fix-ups. The backward
    backend is routed on the first backward (a forward-only call never asks for it)."""

    __slots__ = ("problem", "forward", "backward", "deterministic", "copies", "empty", "device", "device_index")
    __slots__ += ("out_shape", "out_dtype", "lse_shape", "launch", "backward_launch", "decode_keys", "decode_plan")

    def __init__(self, problem: Problem, forward: ArchBackend, deterministic: bool, copies: bool, device):
        p = problem
        self.problem, self.forward, self.backward, self.deterministic = problem, forward, None, deterministic
        self.copies, self.empty, self.device = copies, _is_empty(p), device
        self.device_index = device.index if device.type == "cuda" else None
        self.out_shape = (p.batch, p.seqlen_q, p.nheads, p.head_dim_v)
        self.out_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[p.spec.out_dtype]
        self.lse_shape = (p.batch, p.nheads, p.seqlen_q)
        self.launch = None  # the forward backend's launcher for this problem, made at the first launch
        self.backward_launch = None  # the backward backend's, made at the first backward
        # decoding under GQA: packed (decode.py)
        self.decode_keys = decode.keys_seen(p, compile_cache.sm_count(device), getattr(forward, "split_keys", False))
        self.decode_plan = None  # the packed problem's plan, made at the first launch

    def backward_backend(self, q: torch.Tensor) -> ArchBackend:
        # Routed on its own: the family that ran the forward may have no backward for this spec while another does.
        arch = self.backward
        if arch is None:
            arch = self.backward = _route(self.problem.spec, q, backward=True, deterministic=self.deterministic)
        return arch

    # What `_Attention` asks of the plan it carries.
    def forward_saving(self, q, k, v):
        """(q, k, v, out, lse): the inputs in the kernels' layout, the outputs."""
        if self.copies:
            q, k, v = kernel_view(q), kernel_view(k), kernel_view(v)
        out, lse = _launch_forward(self, q, k, v)
        return q, k, v, out, lse

    def backward_saved(self, dout, q, k, v, out, lse, dlse=None):
        return _launch_backward(self, dout, q, k, v, out, lse, dlse)


# Plans by call signature. Bounded: a workload with ever-new shapes rebuilds it now and then instead of growing it.
_plans: Dict[tuple, _Plan] = compile_cache.memo()  # (emptied with the kernel cache: plans hold launchers)
_MAX_PLANS = 4096


def clear_call_cache() -> None:
    """Forget every plan (tests that change routing, the device check or the backends call this)."""
    for cache in _call_caches:
        cache.clear()


def call_cache(cache):
    """Registers another per-signature cache (anything with `clear()`) to be forgotten with the plans; returns it."""
    _call_caches.append(cache)
    return cache


class _NativeKeys:
    """The C++ call path's signatures (cute_flash/native.py), forgotten with the plans and the kernel cache."""

    def clear(self) -> None:
        lib = native.loaded()
        if lib is not None:
            lib.clear()


_native_keys = compile_cache.forget_with_cache(_NativeKeys())
_call_caches: list = [_plans, _native_keys]
# The C++ call path's `forward`, set when the first signature is registered (`_register_native`); None before.
_native_forward = None
# What the Python plan cache keys on besides the call and that only tests change (the device check, the capability
# lookup): the C++ path serves only while they are the objects its keys were registered under.
_native_device_types = _native_capability = None
_TVM_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_PLAIN = frozenset((type(None), bool, int, float))
_PAIRS = (tuple, list)  # what validation takes for window_size (with two entries)
_NATIVE_DEVICE_TYPES = ("cuda",)  # (profiling.host_overhead_cpu adds "cpu": no-op kernels on CPU tensors)


def _register_native(plan: _Plan, q, k, v, causal, softmax_scale, left, right, deterministic) -> None:
    """After the Python path launched a no-grad forward that the C++ path did not know: registers its signature,
    with what to launch when the plan's launcher is a plain bound kernel or a split-key pair (`SplitForward`) on
    tensors in the kernels' layout whose out is shaped like q, also for packed decoding under GQA (the launcher of
    the packed problem, with the views' group and the window's first key); or as Python's (layout copies, empty
    problems, head_dim_v != head_dim, FP8 or families without a bound form)."""
    global _native_forward, _native_device_types, _native_capability
    if q.device.type not in _NATIVE_DEVICE_TYPES:
        return
    lib = native.library(block=False)  # (being built in the background: the Python path serves meanwhile)
    if lib is None:
        return
    if _native_device_types is not validation.KERNEL_DEVICE_TYPES or _native_capability is not _device_capability:
        lib.clear()  # keys registered under other checks
        _native_device_types, _native_capability = validation.KERNEL_DEVICE_TYPES, _device_capability
    launch, p, dtype = plan.launch, plan.problem, _TVM_DTYPES[plan.out_dtype]
    group, keys_lo = 1, 0
    if plan.decode_keys is not None:  # the packed problem's launcher (made at the first launch) on decode.py's views
        launch = plan.decode_plan.launch if plan.decode_plan is not None else None
        if plan.decode_keys[1] != p.seqlen_k:  # the C++ views keep the keys from the window's first to the last
            launch = None
        group, keys_lo = p.nheads // p.nheads_kv, plan.decode_keys[0]
    kernel = combine = None
    splits = 1
    # out is allocated like q (attention's fast path): a kernel whose out is shaped otherwise stays Python's
    if not (plan.copies or plan.empty) and p.head_dim_v == p.head_dim:
        if isinstance(launch, BoundForward):
            kernel = native.launchable(launch.kernel)
        elif isinstance(launch, SplitForward):
            kernel, combine, splits = native.launchable(launch.kernel), native.launchable(launch.combine), launch.splits
            kernel = kernel if combine is not None else None
    if kernel is not None:
        lib.put(q, k, v, causal, softmax_scale, left, right, deterministic, kernel, launch.scale, launch.left,
                launch.right, dtype, combine, splits, group, keys_lo)  # fmt: skip
    else:
        lib.put(q, k, v, causal, softmax_scale, left, right, deterministic, None, 0.0, 0, 0, dtype, None, 1, 1, 0)
    _native_forward = lib.forward


def _signature(q, k, v, causal, softmax_scale, window_size, deterministic) -> tuple:
    """What a call's validation and routing depend on, read from tensor metadata only (no device sync): shapes,
    strides, dtypes, devices, the inputs' 16-byte alignment, the arguments (with their types, so that a cached
    `True` never answers for a rejected `1`), the device check in force and CUTE_FLASH_ARCH. Raises TypeError or
    ValueError for arguments that cannot be part of a key (the caller then validates them the slow way)."""
    left, right = window_size
    return (
        q.shape,
        q.stride(),
        k.shape,
        k.stride(),
        v.shape,
        v.stride(),
        q.dtype,
        k.dtype,
        v.dtype,
        q.device,
        k.device,
        v.device,
        (q.data_ptr() | k.data_ptr() | v.data_ptr()) & (ALIGN_BYTES - 1),
        causal,
        softmax_scale,
        left,
        right,
        deterministic,
        (type(causal), type(softmax_scale), type(left), type(right), type(deterministic), type(window_size)),
        validation.KERNEL_DEVICE_TYPES,
        os.environ.get(ARCH_ENV_VAR),
    )


def cached_plan(plans: dict, signature: Callable[..., tuple], make: Callable[..., object], *args):
    """The plan `plans` keeps under `signature(*args)`, else `make(*args)`'s (validating and routing, which raise what
    they raise; errors are never kept). A signature that cannot be built (not tensors, unhashable or malformed
    arguments) is not kept. Bounded: a workload with ever-new shapes rebuilds the dict now and then instead of
    growing it. (Plain functions and their arguments, no closures: this runs on every eager call.)"""
    try:
        key = signature(*args)
        plan = plans.get(key)
    except (TypeError, ValueError, AttributeError):
        key, plan = None, None
    if plan is None:
        plan = make(*args)
        if key is not None:
            if len(plans) >= _MAX_PLANS:
                plans.clear()
            plans[key] = plan
    return plan


def _make_plan(q, k, v, causal, softmax_scale, window_size, deterministic) -> _Plan:
    problem = validate(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size, dtype=None,
        deterministic=deterministic,
    )  # fmt: skip
    copies = not all(is_kernel_layout(t) for t in (q, k, v))
    return _Plan(problem, _route(problem.spec, q, backward=False), deterministic, copies, q.device)


def _plan(q, k, v, causal, softmax_scale, window_size, deterministic) -> _Plan:
    """The cached plan of an fp16/bf16 call (validating and routing it on a miss)."""
    return cached_plan(_plans, _signature, _make_plan, q, k, v, causal, softmax_scale, window_size, deterministic)


def _launch_forward(plan: _Plan, q, k, v, out=None, lse=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """out, lse of a planned call; q, k, v already in the kernels' layout (out, lse: given buffers, else new)."""
    if out is None:
        out = torch.empty(plan.out_shape, dtype=plan.out_dtype, device=plan.device)
        lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=plan.device)
    if plan.empty:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    if plan.decode_keys is not None:
        # One query row under GQA: the query heads of a KV head as the rows of one problem over the keys it sees.
        p = plan.problem
        q, k, v, out_rows, lse_rows = decode.pack_gqa(q, k, v, out, lse, p.nheads_kv, plan.decode_keys)
        # The views' shapes, strides and alignment follow from this plan's signature, so their plan is this plan's;
        # views of tensors in the kernels' layout are in it too (strides of whole 16-byte units, rows cut at 16 bytes).
        packed = plan.decode_plan
        if packed is None:
            packed = plan.decode_plan = _plan(q, k, v, False, p.softmax_scale, (None, None), plan.deterministic)
            assert not packed.copies
        _launch_forward(packed, q, k, v, out_rows, lse_rows)
        return out, lse
    launch = plan.launch
    if launch is None:
        with _device_guard(q):
            launch = plan.launch = plan.forward.forward_launcher(plan.problem, plan.device)
    if plan.device_index is not None and torch.cuda.current_device() == plan.device_index:
        launch(q, k, v, out, lse)
    else:
        with _device_guard(q):
            launch(q, k, v, out, lse)
    return out, lse


def _launch_backward(plan: _Plan, dout, q, k, v, out, lse, dlse=None):
    """(dq, dk, dv) of a planned call from the saved tensors (already in the kernels' layout); dout may have any
    layout autograd hands over; dlse: lse's gradient, or None."""
    arch = plan.backward_backend(q)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if plan.empty:
        for g in (dq, dk, dv):
            g.zero_()
        return dq, dk, dv
    dout = kernel_view(dout)  # (the launcher does not check layouts again)
    t, grads = BwdTensors(dout, q, k, v, out, lse, dlse), Grads(dq, dk, dv)
    launch = plan.backward_launch
    if launch is None:
        with _device_guard(q):
            launch = plan.backward_launch = arch.backward_launcher(plan.problem, plan.device, plan.deterministic)
    if plan.device_index is not None and torch.cuda.current_device() == plan.device_index:
        launch(t, grads)
    else:
        with _device_guard(q):
            launch(t, grads)
    return dq, dk, dv


class _Attention(torch.autograd.Function):
    """The autograd node of dense attention, eager (`run`: a `_Plan`) and ring (`distributed.ring`, `run`: its
    config). `run.forward_saving(q, k, v)` returns (q, k, v, out, lse), the tensors the backward reads (q, k, v as
    the forward ran them, e.g. in the kernels' layout); `run.backward_saved(dout, q, k, v, out, lse, dlse)` returns
    (dq, dk, dv) shaped like the saved q, k, v; dlse is lse's gradient, None when the loss does not use lse."""

    @staticmethod
    def forward(ctx, q, k, v, run):
        q, k, v, out, lse = run.forward_saving(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.run = run
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (no zero tensors to fold in)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        run = ctx.run
        grads = node_backward(lambda d: run.backward_saved(d, q, k, v, out, lse, dlse), dout, dlse, q, k, v, out)
        return (*grads, None)


def node_backward(run, dout, dlse, q, k, v, out):
    """What the autograd nodes of dense and packed attention do around their kernels' backward `run(dout)` ->
    (dq, dk, dv): a zero out gradient when only lse reached the loss, and under create_graph=True (grad mode on in a
    backward) the kernels run without recording and their gradients come back on a node that refuses a second
    backward (`refuse_second_order`). The usual backward (grad mode off) calls `run` directly."""
    if dout is None:
        dout = torch.zeros_like(out)
    if not torch.is_grad_enabled():
        return run(dout)
    with torch.no_grad():
        grads = run(dout)
    return refuse_second_order(grads, dout, dlse, q, k, v)


class _SecondOrderRefused(torch.autograd.Function):
    """The gradients a backward returned while recording a graph, passed through unchanged; a second backward that
    reaches them raises (the backward kernels have no derivative of their own)."""

    @staticmethod
    def forward(ctx, anchor, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(
            "cute_flash: the attention backward is not differentiable; a gradient of its gradients (double "
            "backward through create_graph=True) is not supported"
        )


def refuse_second_order(grads, *inputs):
    """`grads` of a backward that ran with create_graph=True, attached to a node that raises if a second backward
    reaches them, instead of handing them back detached (constants to that second backward, which would silently
    drop their second-order terms). A create_graph=True backward whose gradients no second backward uses works as
    before. inputs: the backward's inputs; the node hangs on one of them that requires grad (none: nothing to do)."""
    anchor = next((t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad), None)
    return grads if anchor is None else _SecondOrderRefused.apply(anchor, *grads)


def _run_backward(dout, q, k, v, out, lse, problem: Problem, deterministic: bool, dlse=None):
    """(dq, dk, dv) from inputs in the kernels' layout (`kernel_view`); dout may have any layout autograd hands over
    (expanded, transposed, offset, ...); dlse: lse's gradient, or None."""
    # Routed on its own: the family that ran the forward may have no backward for this spec while another does.
    arch = _route(problem.spec, q, backward=True, deterministic=deterministic)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if _is_empty(problem):
        for g in (dq, dk, dv):
            g.zero_()
        return dq, dk, dv
    with torch.cuda.device(q.device):
        t = BwdTensors(kernel_view(dout), q, k, v, out, lse, dlse)
        arch.backward(t, Grads(dq, dk, dv), problem, deterministic)
    return dq, dk, dv


def _is_empty(p: Problem) -> bool:
    return p.batch == 0 or p.seqlen_q == 0 or p.seqlen_k == 0 or p.nheads == 0


def _run_forward(q, k, v, problem: Problem, arch: ArchBackend, fp8=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp8: a callable returning `cute_flash.fp8.prepare.Fp8Inputs` when the spec computes in FP8 (run only when
    there is work to launch)."""
    spec: AttentionSpec = problem.spec
    out_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec.out_dtype]
    out = torch.empty(
        problem.batch, problem.seqlen_q, problem.nheads, problem.head_dim_v, dtype=out_dtype, device=q.device
    )
    lse = torch.empty(problem.batch, problem.nheads, problem.seqlen_q, dtype=torch.float32, device=q.device)
    if _is_empty(problem):
        # No key at all: every row is fully masked (out 0, lse -inf); nothing to launch.
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    split_keys = getattr(arch, "split_keys", False)
    keys = decode.keys_seen(problem, compile_cache.sm_count(q.device), split_keys) if fp8 is None else None
    if keys is not None:
        # Decoding under GQA, packed as the eager path packs it (`_launch_forward`; cute_flash/decode.py).
        q, k, v, out_rows, lse_rows = decode.pack_gqa(q, k, v, out, lse, problem.nheads_kv, keys)
        # (Views of an accepted call are accepted: rebuilt, not validated again, on this per-call path.)
        packed = problem_of(q, k, v, normalize_mask(False, (None, None)), problem.softmax_scale)
        problem, arch, out_view, lse_view = packed, _route(packed.spec, q, backward=False), out_rows, lse_rows
    else:
        out_view, lse_view = out, lse
    with torch.cuda.device(q.device):
        if fp8 is None:
            arch.forward(FwdTensors(q, k, v, out_view, lse_view), problem)
        else:
            # FP8: q, k e4m3 (b, s, h, d); v transposed e4m3 (b, h_kv, dv, sk_pad); block descales (see Fp8Inputs).
            f = fp8()
            arch.forward(FwdTensors(f.q, f.k, f.v_t, out, lse), problem, descale=f.descales())
    return out, lse


class _Fp8NoBackward(torch.autograd.Function):
    """Passes the FP8 output through; asking for its gradient raises (the FP8 path has no backward kernel)."""

    @staticmethod
    def forward(ctx, out, q, k, v):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        raise NotImplementedError(
            "cute_flash: the FP8 path (dtype='fp8' or float8_e4m3fn inputs) is forward-only; gradients need "
            "dtype=None (fp16/bf16 compute)"
        )


def _fp8_inputs(q, k, v, descale, fp8_rotate: bool, arch: ArchBackend, spec: AttentionSpec):
    from .fp8.prepare import check_prequantized, prepare_fp8_inputs

    block_n = arch.fp8_kv_scale_block(spec)
    if descale is not None:
        return lambda: check_prequantized(q, k, v, descale, block_n=block_n)
    return lambda: prepare_fp8_inputs(q, k, v, rotate=fp8_rotate, block_n=block_n)


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
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention softmax(q kᵀ · scale + mask) v on a CUDA GPU, by the kernel family that serves it.

    q (batch, seqlen_q, nheads, head_dim); k (batch, seqlen_k, nheads_kv, head_dim); v (batch, seqlen_k, nheads_kv,
    head_dim_v); nheads % nheads_kv == 0 (GQA/MQA). Returns out (batch, seqlen_q, nheads, head_dim_v) in the inputs'
    dtype and, with return_lse, the float32 log-sum-exp (batch, nheads, seqlen_q) of the scaled scores (natural log;
    differentiable like out: a loss may use both).

    causal: bottom-right aligned, query i sees key j iff j <= i + seqlen_k - seqlen_q. window_size=(left, right)
    restricts that further to i + off - left <= j <= i + off + right (None = unlimited). A row that sees no key gives
    out 0 and lse -inf. dtype=None computes in the inputs' dtype; dtype="fp8" asks for the FP8 path.
    Differentiable when the serving family has a backward kernel (the error says so when it has none).

    FP8 (forward only; see docs/fp8.md): dtype="fp8" with fp16/bf16 inputs quantises q, k, v on the GPU to e4m3 with
    one scale per block, after multiplying q and k by a random orthogonal (Hadamard) matrix unless
    fp8_rotate=False; out keeps the inputs' dtype. Already quantised float8_e4m3fn inputs take
    descale=(q_descale, k_descale, v_descale), float32 of shape (batch, nheads_kv) or per block (see
    cute_flash.fp8.prepare); their out is bf16. A gradient through the FP8 path raises NotImplementedError.

    deterministic: the backward sums dQ (and, under GQA/MQA, dK and dV) in a fixed order, so that repeated runs give
    bitwise-equal gradients (slower: see docs/performance.md). Families whose backward cannot do that raise
    NotImplementedError when gradients are needed.
    """
    if dtype is None and torch.is_autocast_enabled("cuda"):
        q, k, v = _autocast(q, k, v)
    if dtype is None and descale is None and fp8_rotate is True and not torch.compiler.is_compiling():
        # Register this call's signature with the C++ path after the Python path ran it: on the first call of the
        # process, or when the C++ path could take the call but did not know it (None). Not when it declined (False:
        # the signature is Python's) nor for calls it never takes (gradients, lse, other argument types).
        fast = _native_forward
        register = fast is None
        if fast is not None and not return_lse:
            # A warm no-grad call whose signature the Python path registered: one C++ call finds its kernel and
            # launches it into an out allocated here (cute_flash/native.py). A miss (None) falls through and
            # registers below; False: the Python path serves this call.
            try:
                left, right = window_size
                # The C++ key sees TVM-FFI's scalar kinds, which merge numpy's scalars with Python's: only Python's
                # own types go there, so that a value validation refuses is never answered from the key of one it
                # accepted (a numpy bool for causal, a numpy int in a window, a range as the window).
                go = type(causal) is bool and type(deterministic) is bool and type(softmax_scale) in _PLAIN
                go = go and type(left) in _PLAIN and type(right) in _PLAIN and type(window_size) in _PAIRS
                go = go and type(q) is torch.Tensor
                if go and torch.is_grad_enabled():
                    go = not (q.requires_grad or k.requires_grad or v.requires_grad)
                if go and not (
                    _native_device_types is validation.KERNEL_DEVICE_TYPES and _native_capability is _device_capability
                ):
                    go, register = False, True  # keys made under another device check: registering renews them
            except (AttributeError, TypeError, ValueError):  # not tensors, a malformed window: validated below
                go = False
            if go:
                # A plain torch allocation: the caching allocator owns it (record_stream works as on any tensor).
                out = torch.empty_like(q, memory_format=torch.contiguous_format)
                try:
                    launched = fast(q, k, v, out, causal, softmax_scale, left, right, deterministic)
                except Exception as e:  # noqa: BLE001 - e.g. a tensor DLPack cannot export: Python decides
                    native.warn_once(f"a call failed in the C++ call path and took the Python path ({e!r})")
                    launched = False
                if launched is True:
                    return out
                register = launched is None
        # The eager fp16/bf16 path: validation and routing come from the plan cached for this call signature, so a
        # warm call does one dict lookup before it allocates and launches (docs/torch.md, "Host time").
        plan = _plan(q, k, v, causal, softmax_scale, window_size, deterministic)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            if deterministic:  # fail before the forward, not in the middle of autograd
                plan.backward_backend(q)
            # The layouts are normalised inside the autograd function, so that a view or copy made for the kernels
            # records nothing on the autograd graph (the gradients come back in q, k, v's own shapes).
            out, lse = _Attention.apply(q, k, v, plan)
        else:
            qv, kv, vv = (kernel_view(q), kernel_view(k), kernel_view(v)) if plan.copies else (q, k, v)
            out, lse = _launch_forward(plan, qv, kv, vv)
            if register and not return_lse:
                _register_native(plan, q, k, v, causal, softmax_scale, *window_size, deterministic)
        return (out, lse) if return_lse else out

    problem = validate(
        q,
        k,
        v,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        dtype=dtype,
        descale=descale,
        fp8_rotate=fp8_rotate,
        deterministic=deterministic,
    )
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if problem.spec.dtype == "fp8":
        arch = _route(problem.spec, q, backward=False)
        with torch.no_grad():
            qv, kv, vv = kernel_view(q), kernel_view(k), kernel_view(v)
            fp8 = _fp8_inputs(qv, kv, vv, descale, fp8_rotate, arch, problem.spec)
            out, lse = _run_forward(qv, kv, vv, problem, arch, fp8=fp8)
        if needs_grad:
            out = _Fp8NoBackward.apply(out, q, k, v)
    elif torch.compiler.is_compiling():
        # Under torch.compile: one custom op (cute_flash.ops), traced without a graph break, whose registered
        # autograd formula runs the backward; routing and layouts are settled inside it, at run time. (Eager calls
        # take the path above, without the custom-op dispatch, which costs hundreds of µs of host time per call in
        # torch 2.11, docs/performance.md session 6.)
        m = problem.mask
        out, lse = torch.ops.cute_flash.fwd(
            q, k, v, problem.softmax_scale, m.kind, m.left, m.right, deterministic and needs_grad
        )
    else:  # only a compute dtype or FP8 inputs reach here, and they were handled above
        raise AssertionError("unreachable")
    return (out, lse) if return_lse else out


def _autocast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Under torch.autocast("cuda"), floating inputs in another precision are cast to the autocast dtype, as
    torch's scaled_dot_product_attention does (float8 inputs are left alone: they carry their own scales)."""
    target = torch.get_autocast_dtype("cuda")
    cast = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    return tuple(
        t.to(target) if isinstance(t, torch.Tensor) and t.dtype in cast and t.dtype != target else t for t in (q, k, v)
    )


@dataclass(frozen=True)
class Explanation:
    """Which kernel family serves a call, forward and backward, and why the families before it were skipped."""

    capability: Tuple[int, int]
    forward: routing.Route
    backward: routing.Route
    # The head dim the backward's kernels run at where it is wider than the call's head dims (operands zero-padded
    # to it, arch/padded_head_dims.py), else None.
    backward_padded_to: Optional[int] = None

    @property
    def forward_family(self) -> Optional[str]:
        return self.forward.family

    @property
    def backward_family(self) -> Optional[str]:
        return self.backward.family

    def __str__(self) -> str:
        cap = f"compute capability {self.capability[0]}.{self.capability[1]}"
        backward = self.backward.describe()
        if self.backward_padded_to is not None:
            backward += f" (its head dim {self.backward_padded_to} kernels, on operands zero-padded to it)"
        return f"{cap}: {self.forward.describe()}; {backward}"

    @classmethod
    def of(cls, spec: AttentionSpec, capability: Tuple[int, int], deterministic: bool) -> "Explanation":
        forward = routing.route(spec, capability, backward=False)
        backward = routing.route(spec, capability, backward=True, deterministic=deterministic)
        padded_to = None
        if backward.family is not None:
            dims = backward.backend.backward_head_dims(spec)
            padded_to = max(dims) if dims != (spec.head_dim, spec.head_dim_v) else None
        return cls(capability, forward, backward, padded_to)


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    dtype: Optional[str] = None,
    descale: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    fp8_rotate: bool = True,
    deterministic: bool = False,
    capability: Optional[Tuple[int, int]] = None,
) -> Explanation:
    """Which family would serve `attention(q, k, v, ...)` with these arguments, forward and backward, without
    compiling or launching anything. Validates like `attention` (and raises the same errors).

    deterministic: explain the route of a deterministic backward (which families can sum in a fixed order).
    capability: explain for a GPU of this compute capability, e.g. (9, 0), instead of q's own; then q, k, v may be
    CPU or meta tensors (only their shapes and dtypes are used). CUTE_FLASH_ARCH applies as in `attention`.
    """
    given = None if capability is None else tuple(capability)
    problem = validate(
        q,
        k,
        v,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        dtype=dtype,
        descale=descale,
        fp8_rotate=fp8_rotate,
        deterministic=deterministic,
        any_device=given is not None,
    )
    capability = _device_capability(q) if given is None else given
    return Explanation.of(problem.spec, capability, deterministic)

"""The eager forward's C++ call path, from Python's side (cute_flash/native.py builds and loads the library,
csrc/eager_forward.cc is the path itself; docs/torch.md, "The C++ call path").

A warm no-grad forward without lse or sinks, whose signature the Python path registered after launching it, is one
C++ call (`forward`): the library keys it on the same fields as the plan cache (core/fields.py: the tensors'
metadata, the scalar fields in order with their TVM-FFI kinds), finds the kernel and launches it into an out
allocated here. A miss answers None: the Python path then launches and `register`s the signature, with what to
launch or as Python's own (layout copies, empty problems, head_dim_v != head_dim, FP8, families without a bound
form, decoding that leaves keys past the window). Decoding launches as the plan does: on the sm90 KV-cache forward
(arch/base.BoundKvCache, with the plan's lengths vector) or as the packed GQA problem.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import compile_cache, native, validation
from ..arch.base import BoundForward, BoundKvCache, SplitForward
from . import device
from .plan import Plan, call_cache

# The library's `forward`, set when the first signature is registered; None before.
_forward = None
# What the plan cache keys on besides the call and that only tests change (the device check, the capability lookup):
# the C++ path serves only while they are the objects its keys were registered under.
_device_types = _capability = None
_TVM_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
# TVM-FFI merges numpy's scalars with Python's (a numpy bool arrives as a bool), so only Python's own types are sent:
# a value validation refuses is then never answered from the key of one it accepted.
_PLAIN = frozenset((type(None), bool, int, float))
DEVICE_TYPES = ("cuda",)  # (profiling/host_overhead_cpu.py adds "cpu": no-op kernels on CPU tensors)


class _Keys:
    """The library's signatures, forgotten with the plans and the kernel cache."""

    def clear(self) -> None:
        lib = native.loaded()
        if lib is not None:
            lib.clear()


call_cache(compile_cache.forget_with_cache(_Keys()))


def forward(q, k, v, causal, softmax_scale, window_left, window_right, deterministic, softcap):
    """out of a call the C++ path served; None: it does not know the signature (register it after the Python path
    launched it); False: the Python path serves this call (not registered again). For tensors that need no
    gradient (the caller knows); only plain torch tensors and Python scalars are tried. Takes the scalar fields in
    core/fields.py's order, one parameter each (tests/test_call_core.py checks the names): this runs on every warm
    call, and checking each by name is the cheapest."""
    fast = _forward
    if fast is None:
        return None
    if not (
        type(causal) is bool and type(deterministic) is bool and type(softmax_scale) in _PLAIN
        and type(window_left) in _PLAIN and type(window_right) in _PLAIN and type(softcap) in _PLAIN
        and type(q) is torch.Tensor
    ):  # fmt: skip
        return False
    if _device_types is not validation.KERNEL_DEVICE_TYPES or _capability is not device.capability:
        return None  # keys made under another device check: registering renews them
    # A plain torch allocation: the caching allocator owns it (record_stream works as on any tensor).
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    try:
        launched = fast(q, k, v, out, causal, softmax_scale, window_left, window_right, deterministic, softcap)
    except Exception as e:  # noqa: BLE001 - e.g. a tensor DLPack cannot export: Python decides
        native.warn_once(f"a call failed in the C++ call path and took the Python path ({e!r})")
        return False
    return out if launched is True else launched


def register(plan: Plan, q, k, v, scalars: tuple) -> None:
    """After the Python path launched a no-grad forward that the C++ path did not know: registers its signature, with
    what to launch when the plan's launcher is a plain bound kernel or a split-key pair (`SplitForward`) on tensors in
    the kernels' layout whose out is shaped like q, also for decoding under GQA (the bound KV-cache forward with the
    plan's lengths vector, or the launcher of the packed problem with the views' group; either with the window's
    first key); or as Python's."""
    global _forward, _device_types, _capability
    if q.device.type not in DEVICE_TYPES:
        return
    lib = native.library(block=False)  # (being built in the background: the Python path serves meanwhile)
    if lib is None:
        return
    if _device_types is not validation.KERNEL_DEVICE_TYPES or _capability is not device.capability:
        lib.clear()  # keys registered under other checks
        _device_types, _capability = validation.KERNEL_DEVICE_TYPES, device.capability
    launch, p = plan.launch, plan.problem
    group, keys_lo, seqlens = 1, 0, None
    if plan.decode_keys is not None:
        kv = plan.decode_kvcache
        if kv:  # the KV-cache forward (made at the first launch) over the keys the row sees, with its lengths
            launch, seqlens = kv
        else:  # the packed problem's launcher (made at the first launch) on decode.py's views
            launch = plan.decode_plan.launch if plan.decode_plan is not None else None
            group = p.nheads // p.nheads_kv
        if plan.decode_keys[1] != p.seqlen_k:  # the C++ views keep the keys from the window's first to the last
            launch = None
        keys_lo = plan.decode_keys[0]
    kernel = combine = None
    splits = 1
    # out is allocated like q (the fast path's): a kernel whose out is shaped otherwise stays Python's
    if not (plan.copies or plan.empty) and p.head_dim_v == p.head_dim:
        if isinstance(launch, BoundKvCache) and not launch.packed:
            kernel, splits = native.launchable(launch.kernel), launch.splits
            combine = native.launchable(launch.combine) if splits > 1 else None
            kernel = kernel if splits == 1 or combine is not None else None
        elif isinstance(launch, BoundForward):
            kernel = native.launchable(launch.kernel)
        elif isinstance(launch, SplitForward):
            kernel, combine, splits = native.launchable(launch.kernel), native.launchable(launch.combine), launch.splits
            kernel = kernel if combine is not None else None
    bound: Optional[tuple] = None
    if kernel is not None and seqlens is not None:  # (the KV-cache kernel's scalars: seqlen_q, scale, left, right)
        bound = (kernel, *launch.scalars[1:], launch.softcap, launch.features)
    elif kernel is not None:
        bound = (kernel, launch.scale, launch.left, launch.right, launch.softcap, launch.features)
    dtype = _TVM_DTYPES[plan.out_dtype]
    if bound is None:
        lib.put(q, k, v, *scalars, None, 0.0, 0, 0, 0.0, False, dtype, None, 1, 1, 0, None)
    else:
        lib.put(q, k, v, *scalars, *bound, dtype, combine, splits, group, keys_lo, seqlens)
    _forward = lib.forward

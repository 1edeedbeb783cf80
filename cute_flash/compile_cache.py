"""The one compile cache, and the few facts every backend needs to compile a kernel.

Keys hold only what changes generated code: kernel family, CuTe DSL target, kernel role, the `AttentionSpec` and the
tile configuration. Kernels are compiled once with fake tensors whose batch, sequence and head extents are symbolic,
so new shapes reuse the compiled function. They are built with TVM-FFI and read torch's current stream from the
environment, which keeps a warm call to a few microseconds of host time.

Three layers: this process's dict, then the disk (`disk_cache`: entries written by any earlier process, or by
`python -m cute_flash warmup`), then a build. CUTE_FLASH_DISK_CACHE=0 turns the disk layer off (docs/cache.md).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Callable, Dict, Hashable, Optional, Tuple

from . import disk_cache

_cache: Dict[Hashable, Callable] = {}
_compile_seconds: Dict[Hashable, float] = {}
_sources: Dict[Hashable, str] = {}
_lock = threading.Lock()
_memos: list = []  # launch-path dicts of kernels taken from this cache (`memo`), emptied with it


def memo() -> Dict[Hashable, object]:
    """A dict for a launch path to keep what it looked up here (e.g. all kernels of one call, behind one key);
    `clear` empties it with the cache, so it never holds a kernel the cache has forgotten."""
    d: Dict[Hashable, object] = {}
    _memos.append(d)
    return d


def forget_with_cache(obj):
    """Registers `obj` (anything with a `clear()` method) to be cleared with this cache, like a `memo`; returns it."""
    _memos.append(obj)
    return obj


def get_or_compile(key: Hashable, build: Callable[[], Callable]) -> Callable:
    """Returns the compiled kernel for `key`: from memory, else from the disk cache, else built (and written)."""
    fn = _cache.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _cache.get(key)
        if fn is None:
            start = time.perf_counter()
            disk = disk_cache.kernel_cache()
            if disk is None:
                fn, source = build(), "built-unsaved"
            else:
                fn, source = disk.get_or_build(key, build)
            _compile_seconds[key] = time.perf_counter() - start
            _sources[key] = source
            _cache[key] = fn
    return fn


def cache_info() -> Dict[Hashable, float]:
    """Seconds it took to get every cached kernel (compile, or load from disk), by key (the benchmark reports
    first-call cost from this)."""
    return dict(_compile_seconds)


def cache_sources() -> Dict[Hashable, str]:
    """Where every cached kernel came from: "disk", "built" (and written to disk) or "built-unsaved"."""
    return dict(_sources)


def clear() -> None:
    """Forgets this process's kernels (the disk cache stays)."""
    with _lock:
        _cache.clear()
        _compile_seconds.clear()
        _sources.clear()
        for d in _memos:
            d.clear()


def target_for_capability(capability: Tuple[int, int]) -> str:
    """The CuTe DSL target for a GPU; arch-specific features (wgmma, tcgen05) need the `a` variant."""
    major, minor = capability
    suffix = "a" if major >= 9 else ""
    return f"sm_{major}{minor}{suffix}"


def compile_options(target: str, *, tvm_ffi: bool = True, extra: str = "") -> str:
    opts = [f"--gpu-arch {target}"]
    if tvm_ffi:
        opts.append("--enable-tvm-ffi")
    if extra:
        opts.append(extra)
    return " ".join(opts)


def keep_artifacts_options(dump_dir: str, ptxas_report: bool = True) -> str:
    """Options that make `compiled.artifacts` hold the PTX and cubin (the dump dir must exist beforehand), and with
    `ptxas_report` make ptxas print its resource report (registers, spills), which `cute_flash.census` parses.

    Launch paths that only need the cubin pass ptxas_report=False: the report goes to the user's stderr."""
    os.makedirs(dump_dir, exist_ok=True)
    report = " remarks{ptx}" if ptxas_report else ""
    return f"--keep-ptx --keep-cubin --dump-dir {dump_dir}{report}"


def ensure_cute_dsl_arch(default_target: Optional[str]) -> None:
    """Sets CUTE_DSL_ARCH before cutlass is first imported, so that CPU-only processes can cross-compile.

    CuTe DSL reads its environment once, at import; later compiles pass `--gpu-arch` explicitly.
    """
    import sys

    if "cutlass" not in sys.modules and default_target and not os.environ.get("CUTE_DSL_ARCH"):
        os.environ["CUTE_DSL_ARCH"] = default_target


@functools.lru_cache(maxsize=None)
def _runtime_target_for_index(device_index: int) -> str:
    import torch

    target = target_for_capability(torch.cuda.get_device_capability(device_index))
    ensure_cute_dsl_arch(target)
    return target


@functools.lru_cache(maxsize=None)
def _sm_count_of(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device) -> int:
    """Streaming multiprocessors of `device` (a torch.device), looked up once per device; 0 for a device that is not
    a GPU (CPU tests of the host path)."""
    if device.type != "cuda":
        return 0
    import torch

    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


def runtime_target(device) -> str:
    """The CuTe DSL target for launching on `device` (a torch.device or index), looked up once per device.

    Also makes sure CuTe DSL is imported for that target: a kernel compiled while CUTE_DSL_ARCH names another arch
    does not load on this GPU, and the DSL reads the variable only at its first import.
    """
    index = device.index if hasattr(device, "index") else device
    if index is None:
        import torch

        index = torch.cuda.current_device()
    return _runtime_target_for_index(int(index))

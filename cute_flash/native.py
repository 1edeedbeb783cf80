"""The eager forward's C++ call path (csrc/eager_forward.cc): built with the machine's C++ compiler on first use,
kept beside the kernel cache, loaded through TVM-FFI.

A warm no-grad forward whose call signature Python has already planned allocates out (`torch.empty_like(q)`) and
makes one TVM-FFI call that finds the kernel and launches it (torch's current stream) with an lse nobody reads,
instead of Python's signature lookup, two `torch.empty` calls and the kernel's own call from Python; decoding calls
too (the sm90 KV-cache forward on the keys the row sees, or the packed GQA views made in C++; a split-key call's
partials and combine: arch/base.SplitForward, arch/base.BoundKvCache). Every other
call, and every first call of a signature, takes the Python path, which validates and routes it and then registers
what it launched (`core/native_path.register`). The key's layout comes from the call's fields (core/fields.py): the
library is compiled with their number of scalars (`-DCUTE_FLASH_KEY_SCALARS`).

CUTE_FLASH_NATIVE=0 turns it off (read when a process sets the path up, at its first registration). Without a C++
compiler (or when the build fails) calls take the Python path and a warning says why, once. The library lives in
`<cache dir>/native/<hash>/` (the hash covers the source, TVM-FFI's version and library, the compiler and Python's
version), written atomically: concurrent processes each build and the last rename wins, with identical files. With
the disk cache off it is built per process in a private temporary directory.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import threading
import warnings
from typing import Any, Optional

from . import disk_cache
from .core import fields

ENV_SWITCH = "CUTE_FLASH_NATIVE"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "eager_forward.cc")
_NAME = "eager_forward"
_lock = threading.Lock()
_library: Optional[Any] = None
_path: Optional[str] = None  # where the loaded library lives
_failed = False
_builder: Optional[threading.Thread] = None  # the background build `library(block=False)` started


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off", "")


def cxx_compiler() -> Optional[str]:
    return disk_cache.find_tool("CXX", ("c++", "g++", "clang++"))


@functools.lru_cache(maxsize=None)
def _build_hash(compiler: str) -> str:
    import tvm_ffi

    h = hashlib.sha256()
    with open(SOURCE, "rb") as f:
        h.update(f.read())
    h.update(f"\0{tvm_ffi.__version__}\0{compiler}\0{sys.version}\0{platform.machine()}\0".encode())
    h.update(" ".join(_defines()).encode())
    with open(tvm_ffi.libinfo.find_libtvm_ffi(), "rb") as f:  # the library this one links against
        h.update(f.read())
    return h.hexdigest()[:24]


@functools.lru_cache(maxsize=None)
def _private_dir() -> str:
    return tempfile.mkdtemp(prefix="cute_flash_native_")  # mode 0700, this process's own


def library_dir(compiler: str) -> str:
    """Beside the kernel cache; with the disk cache off, a directory of this process's own (a shared, predictable
    path in /tmp would let another user plant the library this process loads)."""
    base = disk_cache.cache_dir() if disk_cache.enabled() else _private_dir()
    return os.path.join(base, "native", _build_hash(compiler))


def _defines() -> list:
    """What the library is compiled for besides its source: the call's scalar fields (the key's layout)."""
    return [f"-DCUTE_FLASH_KEY_SCALARS={fields.NUM_SCALARS}"]


def _build(compiler: str, path: str) -> None:
    import tvm_ffi

    lib = tvm_ffi.libinfo.find_libtvm_ffi()
    includes = [tvm_ffi.libinfo.find_include_path(), tvm_ffi.libinfo.find_dlpack_include_path()]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".so")
    os.close(fd)
    try:
        cmd = [compiler, "-std=c++17", "-O2", "-fPIC", "-shared", *_defines(), SOURCE, "-o", tmp]
        cmd += [f"-I{p}" for p in includes]
        cmd += [f"-L{os.path.dirname(lib)}", "-ltvm_ffi", f"-Wl,-rpath,{os.path.dirname(lib)}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-400:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_warned = set()


def warn_once(message: str) -> None:
    """Says once why a call took the Python path. Under warnings-as-errors (-W error) the warning is not raised: the
    Python path serves the call either way, and a call whose kernel already ran must not fail afterwards."""
    if message not in _warned:
        _warned.add(message)
        try:
            warnings.warn(f"cute_flash: {message}", RuntimeWarning, stacklevel=3)
        except Warning:
            pass


def loaded_path() -> Optional[str]:
    """The file the loaded library came from (None before `library` loaded it)."""
    return _path


def loaded() -> Optional[Any]:
    """The library if this process has loaded it (nothing is built or loaded here)."""
    return _library


def launchable(kernel: Any) -> Optional[Any]:
    """The TVM-FFI function that the library launches for a compiled kernel, called with the same positional
    arguments; None when there is none. A kernel loaded from the disk cache is one; a freshly compiled one
    (CuTe DSL's wrapper of it, which maps keyword arguments) hands its function over through `__tvm_ffi_object__`.
    Kernels whose Python call converts pointer arguments first are not launchable here."""
    import tvm_ffi

    if getattr(getattr(kernel, "execution_args", None), "has_pointer_address_arg_specs", False):
        return None
    if isinstance(kernel, tvm_ffi.Function):
        return kernel
    get = getattr(kernel, "__tvm_ffi_object__", None)
    fn = get() if callable(get) else None
    return fn if isinstance(fn, tvm_ffi.Function) else None


def describe() -> str:
    """One line for `python -m cute_flash info`: whether the library is there, will be built, or cannot be."""
    if not enabled():
        return f"off ({ENV_SWITCH}={os.environ.get(ENV_SWITCH)!r}): warm calls take the Python path"
    if not disk_cache.enabled():
        return "built in a private temporary directory by each process, at its first warm no-grad call (disk cache off)"
    try:
        path = _library_path()
    except Exception as e:  # noqa: BLE001 - reported, never raised by `info`
        return f"unavailable ({e}): warm calls take the Python path"
    if os.path.exists(path):
        return f"built ({path})"
    return f"built at the first warm no-grad call (or by warmup) with {cxx_compiler()}, into {os.path.dirname(path)}"


class Library:
    """The loaded library's functions: forward, put, clear, size, noop_kernel. They run with the GIL held (TVM-FFI
    releases it by default): `forward` and `put` read CUTE_FLASH_ARCH with getenv, which must not race with a Python
    thread writing os.environ, and the calls are too short for another thread to gain anything meanwhile."""

    def __init__(self, module: Any):
        self.module = module
        for name in ("forward", "put", "clear", "size", "noop_kernel"):
            fn = getattr(module, name)
            fn.release_gil = False
            setattr(self, name, fn)


def _library_path() -> str:
    compiler = cxx_compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++ / g++ / clang++ or $CXX)")
    return os.path.join(library_dir(compiler), f"{_NAME}.so")


def library(block: bool = True) -> Optional[Library]:
    """The loaded library (`Library`); None when switched off or
    unavailable (warned once). A library already on disk is loaded (a millisecond); one to be built is built here
    (seconds), or with block=False in a background thread while this call returns None: the eager path asks that
    way, so that no call waits for a compiler (calls take the Python path until the library is there)."""
    global _library, _path, _failed, _builder
    if _library is not None or _failed:
        return _library
    if not enabled():
        _failed = True  # read once: later calls in this process return at once
        return None
    if not block:
        if _builder is None:
            try:
                on_disk = os.path.exists(_library_path())
            except Exception:  # noqa: BLE001 - reported by the blocking call below
                on_disk = True
            if on_disk:
                return library()
            _builder = threading.Thread(target=library, name="cute_flash native build", daemon=True)
            _builder.start()
        return _library
    with _lock:
        if _library is None and not _failed:
            try:
                import tvm_ffi

                path = _library_path()
                if not os.path.exists(path):
                    _build(cxx_compiler(), path)
                _library, _path = Library(tvm_ffi.load_module(path)), path
            except Exception as e:  # noqa: BLE001 - the Python path serves every call without it
                _failed = True
                warn_once(
                    f"the C++ call path is unavailable ({e}); warm calls take the Python path (slower host time, "
                    f"same results). {ENV_SWITCH}=0 silences this."
                )
    return _library

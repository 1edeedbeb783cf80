"""The on-disk layer of the compile cache: a kernel compiled once is loaded by every later process.

An entry is found by a digest of the compile key's text form (`key_text`) and a fingerprint of everything else that
changes the binary (`fingerprint`: cute_flash's version and a hash of its source files, the nvidia-cutlass-dsl and
apache-tvm-ffi versions, the CUDA toolkit flavour of the DSL, the host platform, and the CUTE_DSL_* settings that
change generated code; the target arch is part of every key). Files of one entry, under `<dir>/v1/`:

    <digest>.json   metadata, written last (the commit point): key text, fingerprint, function name, and the size and
                    sha256 of every binary file below
    <digest>.o      the object file the DSL exports (host launcher + embedded cubin)
    <digest>.so     the same object linked into a shared library, when a C compiler was found (faster to load)
    <digest>.lock   the per-key lock file (flock); never deleted

Safety: every file is written to a temporary name in the cache directory and moved in place with os.replace, so a
reader sees a whole file or none. A reader trusts nothing: the metadata must parse and name the same key and
fingerprint, every binary must have its recorded size and sha256, and loading must succeed; otherwise the entry is a
miss, rebuilt and overwritten. Processes that miss the same key at once take the key's flock: one builds, the others
wait (up to CUTE_FLASH_CACHE_LOCK_TIMEOUT seconds, default 900) and then load its entry. flock is released by the
kernel when its holder exits, crashed or not, so a dead builder never blocks the others. Any disk error degrades to
compiling in memory, with a warning.

Environment: CUTE_FLASH_CACHE_DIR (default $XDG_CACHE_HOME/cute_flash, else ~/.cache/cute_flash),
The layer is on unless CUTE_FLASH_DISK_CACHE=0 (see `enabled`). See docs/cache.md.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any, Callable, Dict, Hashable, Iterator, Optional, Protocol, Tuple

try:
    import fcntl
except ImportError:  # not POSIX: atomic writes still hold; concurrent misses may build twice
    fcntl = None

FORMAT_VERSION = 1
ENV_DIR = "CUTE_FLASH_CACHE_DIR"
ENV_SWITCH = "CUTE_FLASH_DISK_CACHE"
ENV_LOCK_TIMEOUT = "CUTE_FLASH_CACHE_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 900.0  # seconds; the slowest builds (sm80 spill-free candidate search) take a few minutes
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# CUTE_DSL_* variables that do not change the binary: the target (it is in every key), where the runtime and the
# DSL's own caches live, logging.
_DSL_ENV_IGNORED = re.compile(r"^CUTE_DSL_(ARCH|LIBS|CACHE_DIR|LOG.*|DISABLE_FILE_CACHING|NO_CACHE)$")


# --------------------------------------------------------------------------------------------------- settings
# On by default: the GPU suites run with it on, and a second process loads every kernel of a forward + backward
# from disk and computes the same results (tests/test_disk_cache_gpu.py, H100); CUTE_FLASH_DISK_CACHE=0 turns it off.
DEFAULT_SWITCH = "1"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, DEFAULT_SWITCH).strip().lower() not in ("0", "false", "no", "off", "")


def cache_dir() -> str:
    explicit = os.environ.get(ENV_DIR)
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cute_flash")


def entries_dir() -> str:
    return os.path.join(cache_dir(), f"v{FORMAT_VERSION}")


def lock_timeout() -> float:
    try:
        return float(os.environ.get(ENV_LOCK_TIMEOUT, DEFAULT_LOCK_TIMEOUT))
    except ValueError:
        return DEFAULT_LOCK_TIMEOUT


_warned = set()


def warn_once(topic: str, message: str) -> None:
    if topic not in _warned:
        _warned.add(topic)
        warnings.warn(f"cute_flash kernel cache: {message}", RuntimeWarning, stacklevel=3)


# --------------------------------------------------------------------------------------------------- keys
class UnstableKey(TypeError):
    """A key part without a text form that is the same in every process (it would never hit on disk)."""


def key_text(key: Any) -> str:
    """The text form of a compile key, equal across processes: tuples, str/int/float/bool/None, enums and
    dataclasses (field by field). Anything else raises UnstableKey (its repr may hold an address)."""
    if key is None or isinstance(key, (bool, int, str)):
        return repr(key)
    if isinstance(key, float):
        return float.hex(key)
    if isinstance(key, Enum):
        return f"{type(key).__name__}.{key.name}"
    if isinstance(key, (tuple, list)):
        inner = ", ".join(key_text(k) for k in key)
        return f"({inner},)" if isinstance(key, tuple) and len(key) == 1 else f"({inner})"
    if is_dataclass(key) and not isinstance(key, type):
        inner = ", ".join(f"{f.name}={key_text(getattr(key, f.name))}" for f in fields(key))
        return f"{type(key).__name__}({inner})"
    raise UnstableKey(f"no stable text form for a {type(key).__name__} in a compile key")


# --------------------------------------------------------------------------------------------------- fingerprint
@functools.lru_cache(maxsize=None)
def source_hash(package_dir: str = _PACKAGE_DIR) -> str:
    """sha256 over the package's .py files (relative path and contents): any edit to cute_flash invalidates."""
    h = hashlib.sha256()
    paths = []
    for root, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        paths += [os.path.join(root, f) for f in files if f.endswith(".py")]
    for path in sorted(paths):
        h.update(os.path.relpath(path, package_dir).replace(os.sep, "/").encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
        h.update(b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _dist_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


def _cutlass_dsl_root() -> Optional[str]:
    """The nvidia_cutlass_dsl package directory, found without importing cutlass (an import costs ~0.5 s)."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


@functools.lru_cache(maxsize=None)
def _driver_cuda_major() -> Optional[int]:
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return version.value // 1000
    except (OSError, AttributeError):
        pass
    return None


@functools.lru_cache(maxsize=None)
def toolkit_flavor() -> str:
    """The CUDA toolkit flavour ("cu13", "cu12") the DSL compiles with and runs on, chosen the DSL's way: the newest
    installed one that the driver supports, the newest without a driver. Compiler and runtime library differ per
    flavour, so it is part of the fingerprint. Found without importing cutlass."""
    root = _cutlass_dsl_root()
    if root is None:
        return "none"
    libs = os.path.join(root, "dsl_packages", "cutlass", "_mlir", "_mlir_libs")
    try:
        names = os.listdir(libs)
    except OSError:
        return "unknown"
    flavors = sorted({int(m.group(1)) for n in names if (m := re.match(r"^_cutlass_ir\.cu(\d+)\..*\.so$", n))})
    if not flavors:
        return "unknown"
    driver = _driver_cuda_major()
    usable = [f for f in flavors if driver is None or f <= driver] or flavors
    return f"cu{usable[-1]}"


def loaded_toolkit_flavor() -> Optional[str]:
    """The flavour the imported DSL really loaded (None before cutlass is imported)."""
    mod = sys.modules.get("cutlass._mlir._mlir_libs._cutlass_ir")
    m = re.search(r"_cutlass_ir\.(cu\d+)\.", getattr(mod, "__file__", "") or "")
    return m.group(1) if m else None


def fingerprint() -> Dict[str, str]:
    """What changes a compiled binary besides its key; part of every entry's digest and checked again on load."""
    from . import __version__

    dsl_env = ";".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("CUTE_DSL_"))
    dsl_env = ";".join(p for p in dsl_env.split(";") if p and not _DSL_ENV_IGNORED.match(p.split("=", 1)[0]))
    return {
        "format": str(FORMAT_VERSION),
        "cute_flash": __version__,
        "source": source_hash(),
        "nvidia-cutlass-dsl": _dist_version("nvidia-cutlass-dsl"),
        "apache-tvm-ffi": _dist_version("apache-tvm-ffi"),
        "toolkit": toolkit_flavor(),
        "host": f"{sys.platform}-{platform.machine()}",
        "dsl_env": dsl_env,
    }


def digest(text: str, fp: Dict[str, str]) -> str:
    blob = json.dumps({"key": text, "fingerprint": fp}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:40]


# --------------------------------------------------------------------------------------------------- codecs
class Codec(Protocol):
    """Turns a compiled object into files and back. `name` is a C identifier unique to the entry."""

    def export(self, obj: Any, workdir: str, name: str) -> Dict[str, str]:
        """Writes the object's files into workdir; returns {suffix: path}."""

    def load(self, paths: Dict[str, str], name: str) -> Any:
        """The object back from the files of one entry ({suffix: path}, every checksum verified)."""


# --------------------------------------------------------------------------------------------------- files
def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _atomic_write_bytes(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared (fleet) cache's metadata from other users
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def key_lock(path: str, timeout: float) -> Iterator[bool]:
    """Holds an exclusive flock on `path` (yields True), or yields False after `timeout` seconds without it.
    The kernel drops a flock when its process exits, however it exits, so a crashed holder frees the key."""
    if fcntl is None:
        yield False
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    acquired = False
    try:
        deadline = time.monotonic() + timeout
        pause = 0.01
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                acquired = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(pause)
                pause = min(pause * 2, 0.25)
        yield acquired
    finally:
        if acquired:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


class DiskCache:
    """Entries of one directory, for one codec."""

    def __init__(self, directory: str, codec: Codec):
        self.directory = directory
        self.codec = codec

    def _path(self, d: str, suffix: str) -> str:
        return os.path.join(self.directory, f"{d}.{suffix}")

    def load(self, text: str, fp: Dict[str, str]) -> Optional[Any]:
        """The entry's object, or None when it is missing, stale, corrupt or does not load."""
        d = digest(text, fp)
        try:
            with open(self._path(d, "json"), "rb") as f:
                meta = json.loads(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, UnicodeDecodeError):
            return None  # truncated or garbage metadata: a miss, rebuilt and overwritten
        if not isinstance(meta, dict) or meta.get("key") != text or meta.get("fingerprint") != fp:
            return None
        files = meta.get("files")
        if not isinstance(files, dict) or not files:
            return None
        paths = {}
        for suffix, info in files.items():
            path = self._path(d, suffix)
            try:
                if os.path.getsize(path) != info["size"] or _sha256_file(path) != info["sha256"]:
                    return None
            except (OSError, KeyError, TypeError):
                return None
            paths[suffix] = path
        try:
            return self.codec.load(paths, meta["function"])
        except Exception as e:  # noqa: BLE001 - a broken entry is rebuilt, never fatal
            warn_once(f"load:{type(e).__name__}", f"an entry did not load ({e}); rebuilding it")
            return None

    def store(self, text: str, fp: Dict[str, str], obj: Any) -> bool:
        """Writes the entry (binaries first, metadata last); False when the object cannot be exported."""
        d = digest(text, fp)
        name = "cute_flash_" + d[:24]
        workdir = tempfile.mkdtemp(dir=self.directory, prefix=".build-")
        try:
            produced = self.codec.export(obj, workdir, name)
            if not produced:
                return False
            files = {}
            for suffix, src in produced.items():
                dst = self._path(d, suffix)
                files[suffix] = {"size": os.path.getsize(src), "sha256": _sha256_file(src)}
                os.replace(src, dst)  # same directory tree and file system: atomic
            meta = {
                "key": text,
                "fingerprint": fp,
                "function": name,
                "files": files,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "pid": os.getpid(),
            }
            _atomic_write_bytes(self._path(d, "json"), json.dumps(meta, indent=1, sort_keys=True).encode())
            return True
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def get_or_build(self, key: Hashable, build: Callable[[], Any]) -> Tuple[Any, str]:
        """(object, source): source is "disk" (loaded), "built" (built and written) or "built-unsaved"."""
        try:
            text = key_text(key)
            fp = fingerprint()
            os.makedirs(self.directory, exist_ok=True)
        except (UnstableKey, OSError) as e:
            warn_once(f"setup:{type(e).__name__}", f"not used ({e})")
            return build(), "built-unsaved"
        obj = self.load(text, fp)
        if obj is not None:
            return obj, "disk"
        lock_path = self._path(digest(text, fp), "lock")
        try:
            lock = key_lock(lock_path, lock_timeout())
            acquired = lock.__enter__()
        except OSError as e:
            warn_once("lock", f"cannot lock {lock_path} ({e}); building without the lock")
            lock, acquired = None, False
        try:
            if acquired:
                obj = self.load(text, fp)  # another process may have built it while this one waited
                if obj is not None:
                    return obj, "disk"
            elif lock is not None and fcntl is not None:
                warn_once("lock-timeout", f"waited {lock_timeout():.0f} s for another process's build; building")
            obj = build()
            real = loaded_toolkit_flavor()
            if real is not None and fp["toolkit"] not in (real, "none"):
                # Written under a flavour a later lookup computes differently, an entry would never be found.
                warn_once("flavor", f"the DSL loaded {real}, not {fp['toolkit']}: entries are not written")
                return obj, "built-unsaved"
            try:
                saved = self.store(text, fp, obj)
            except Exception as e:  # noqa: BLE001 - a full disk or a read-only directory must not fail a call
                warn_once(f"store:{type(e).__name__}", f"an entry was not written ({e})")
                saved = False
            return obj, ("built" if saved else "built-unsaved")
        finally:
            if lock is not None:
                lock.__exit__(None, None, None)


# --------------------------------------------------------------------------------------------------- the kernel codec
def find_tool(env_var: str, names: Tuple[str, ...]) -> Optional[str]:
    """The program `$env_var` names when it is found, else the first of `names` on PATH (None: none)."""
    for name in (os.environ.get(env_var), *names):
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


def c_compiler() -> Optional[str]:
    return find_tool("CC", ("cc", "gcc", "clang"))


@functools.lru_cache(maxsize=None)
def _runtime_libraries() -> Tuple[str, ...]:
    """The DSL's runtime library for this toolkit flavour and TVM-FFI's, found without importing cutlass."""
    import tvm_ffi

    libs = []
    env = os.environ.get("CUTE_DSL_LIBS")
    if env:
        libs += [p for p in env.split(os.pathsep) if p.endswith("libcute_dsl_runtime.so")]
    else:
        root = _cutlass_dsl_root()
        flavor = toolkit_flavor()
        if root and flavor.startswith("cu"):
            libs.append(os.path.join(root, flavor, "lib", "libcute_dsl_runtime.so"))
    libs.append(tvm_ffi.libinfo.find_libtvm_ffi())
    missing = [p for p in libs if not os.path.exists(p)]
    if missing or len(libs) < 2:
        raise FileNotFoundError(f"runtime libraries not found: {missing or 'libcute_dsl_runtime.so'}")
    return tuple(libs)


_global_libs = []
_modules = []  # every loaded module lives as long as the process: its functions point into it


def _load_shared(path: str, name: str):
    """A linked entry through TVM-FFI alone: its undefined symbols resolve against the runtime libraries, loaded
    once into the global namespace."""
    import ctypes

    import tvm_ffi

    if not _global_libs:
        _global_libs.extend(ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL) for p in _runtime_libraries())
    # Bind every symbol now: an unresolved one raises here (and the object file is used) instead of ending the
    # process at the first call, as a lazily bound library would.
    _modules.append(ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL))
    _modules.append(tvm_ffi.load_module(path))
    return _modules[-1][name]


def _load_object(path: str, name: str):
    """An object file through the DSL's in-memory linker (JITLink): no C compiler, but it imports cutlass."""
    import cutlass.cute as cute

    _modules.append(cute.runtime.load_module(path, enable_tvm_ffi=True))
    return _modules[-1][name]


class TvmFfiKernelCodec:
    """Kernels compiled with `--enable-tvm-ffi`: exported with `export_to_c` as an object file (no compiler
    needed), also linked into a shared library when a C compiler is found. Both load as a `tvm_ffi.Function`, called
    with the same positional arguments as the compiled kernel, on torch's current stream (TVM-FFI's env stream)."""

    def export(self, obj: Any, workdir: str, name: str) -> Dict[str, str]:
        if not hasattr(obj, "export_to_c"):
            return {}
        obj_path = os.path.join(workdir, "kernel.o")
        obj.export_to_c(obj_path, function_name=name)
        paths = {"o": obj_path}
        cc = c_compiler()
        if cc is None:
            warn_once("cc", "no C compiler (cc/gcc/clang or $CC) to link entries: they load through the DSL's linker")
            return paths
        so_path = os.path.join(workdir, "kernel.so")
        proc = subprocess.run([cc, "-shared", "-o", so_path, obj_path], capture_output=True, text=True, timeout=120)
        if proc.returncode == 0 and os.path.exists(so_path):
            paths["so"] = so_path
        else:
            warn_once("link", f"{cc} could not link an entry ({proc.stderr.strip()[:200]}); loading the object file")
        return paths

    def load(self, paths: Dict[str, str], name: str) -> Any:
        if "so" in paths:
            try:
                return _load_shared(paths["so"], name)
            except Exception as e:  # noqa: BLE001 - the object file is the fallback
                warn_once("load-so", f"a linked entry did not load ({e}); using its object file")
        return _load_object(paths["o"], name)


@functools.lru_cache(maxsize=None)
def _kernel_cache(directory: str) -> DiskCache:
    return DiskCache(directory, TvmFfiKernelCodec())


def kernel_cache() -> Optional[DiskCache]:
    """The disk cache of compiled kernels, or None when it is switched off."""
    if not enabled():
        return None
    return _kernel_cache(entries_dir())

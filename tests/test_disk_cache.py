"""The disk layer of the compile cache (cute_flash/disk_cache.py): keys, fingerprint, atomic entries, corruption,
concurrent processes, the off switch, and warm-up by cross-compilation that a later process loads. CPU only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from cute_flash import compile_cache, disk_cache
from cute_flash.spec import AttentionSpec
from tests.cache_worker import BytesCodec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = ("sm90", "sm_90a", "fwd", AttentionSpec("bf16", 64, 64, "causal", "bf16"))


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


@pytest.fixture
def cache(tmp_path):
    return disk_cache.DiskCache(str(tmp_path), BytesCodec())


def _counting_build(value=b"v1"):
    calls = []

    def build():
        calls.append(1)
        return value

    return build, calls


# --------------------------------------------------------------------------------------------------- keys
@dataclass(frozen=True)
class _Tile:
    m: int
    n: int


def test_key_text_is_stable_and_rejects_addresses():
    text = disk_cache.key_text(("sm80", "sm_90a", "bwd", KEY[3], _Tile(128, 64), None, (("block_m", 64),)))
    assert text == (
        "('sm80', 'sm_90a', 'bwd', AttentionSpec(dtype='bf16', head_dim=64, head_dim_v=64, mask='causal', "
        "out_dtype='bf16', varlen=False, softcap=False, softcap_wide=False, sink=False, kvcache=False, page_size=0, "
        "kv_fp8=False), "
        "_Tile(m=128, n=64), None, (('block_m', 64),))"
    )
    with pytest.raises(disk_cache.UnstableKey):
        disk_cache.key_text(("sm90", object()))


def test_fingerprint_changes_with_what_changes_the_binary(tmp_path, monkeypatch):
    base = disk_cache.fingerprint()
    assert base["nvidia-cutlass-dsl"] and base["apache-tvm-ffi"] and base["toolkit"] and base["source"]
    text = disk_cache.key_text(KEY)
    d0 = disk_cache.digest(text, base)
    for field, value in (
        ("nvidia-cutlass-dsl", "9.9"),
        ("apache-tvm-ffi", "0.0"),
        ("cute_flash", "0.0"),
        ("toolkit", "cu12"),
        ("source", "0" * 64),
        ("host", "linux-aarch64"),
    ):
        assert disk_cache.digest(text, {**base, field: value}) != d0, field
    # another target arch is another key
    assert disk_cache.digest(disk_cache.key_text(("sm90", "sm_100a") + KEY[2:]), base) != d0
    # a CuTe DSL setting that changes code is in it; the target variable (part of the key) is not
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_80")
    assert disk_cache.fingerprint() == base
    monkeypatch.setenv("CUTE_DSL_LINEINFO", "1")
    assert disk_cache.fingerprint()["dsl_env"] == "CUTE_DSL_LINEINFO=1"
    # the source hash follows every .py file of the package
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    h0 = disk_cache.source_hash(str(pkg))
    disk_cache.source_hash.cache_clear()
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    assert disk_cache.source_hash(str(pkg)) != h0
    disk_cache.source_hash.cache_clear()


# --------------------------------------------------------------------------------------------------- entries
def test_store_then_load(cache, tmp_path):
    build, calls = _counting_build()
    assert cache.get_or_build(KEY, build) == (b"v1", "built")
    assert cache.get_or_build(KEY, build) == (b"v1", "disk")
    assert len(calls) == 1
    names = sorted(os.listdir(tmp_path))
    assert [n.rsplit(".", 1)[1] for n in names] == ["bin", "json", "lock"]  # no temporary file left behind
    meta = json.loads((tmp_path / names[1]).read_text())
    assert meta["key"] == disk_cache.key_text(KEY) and meta["fingerprint"] == disk_cache.fingerprint()


def test_atomic_write_leaves_the_old_file_or_the_new_one(tmp_path, monkeypatch):
    path = str(tmp_path / "entry.json")
    disk_cache._atomic_write_bytes(path, b"old")

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        disk_cache._atomic_write_bytes(path, b"new")
    assert open(path, "rb").read() == b"old" and os.listdir(tmp_path) == ["entry.json"]


def test_an_entry_without_metadata_is_not_used(cache, tmp_path, monkeypatch):
    # a writer that died after its binaries but before the metadata (the commit point) leaves a miss
    real = disk_cache._atomic_write_bytes
    monkeypatch.setattr(disk_cache, "_atomic_write_bytes", lambda *a: (_ for _ in ()).throw(OSError("killed")))
    with pytest.warns(RuntimeWarning):
        assert cache.get_or_build(KEY, _counting_build()[0])[1] == "built-unsaved"
    monkeypatch.setattr(disk_cache, "_atomic_write_bytes", real)
    build, calls = _counting_build(b"v2")
    assert cache.get_or_build(KEY, build) == (b"v2", "built") and calls == [1]


@pytest.mark.parametrize("damage", ["truncate-binary", "flip-binary", "garbage-metadata", "stale-fingerprint"])
def test_a_corrupt_or_stale_entry_is_rebuilt(cache, tmp_path, damage):
    cache.get_or_build(KEY, _counting_build(b"good-bytes")[0])
    (binary,) = tmp_path.glob("*.bin")
    (meta,) = tmp_path.glob("*.json")
    if damage == "truncate-binary":
        binary.write_bytes(binary.read_bytes()[:3])
    elif damage == "flip-binary":
        binary.write_bytes(b"G" + binary.read_bytes()[1:])
    elif damage == "garbage-metadata":
        meta.write_bytes(b'{"key": "trunc')
    else:
        m = json.loads(meta.read_text())
        m["fingerprint"]["nvidia-cutlass-dsl"] = "0.0.1"
        meta.write_text(json.dumps(m))
    build, calls = _counting_build(b"rebuilt")
    assert cache.get_or_build(KEY, build) == (b"rebuilt", "built") and calls == [1]
    assert cache.get_or_build(KEY, build) == (b"rebuilt", "disk") and calls == [1]


def test_an_entry_that_fails_to_load_is_rebuilt(cache, monkeypatch):
    cache.get_or_build(KEY, _counting_build()[0])
    monkeypatch.setattr(BytesCodec, "load", lambda self, paths, name: (_ for _ in ()).throw(RuntimeError("bad")))
    with pytest.warns(RuntimeWarning, match="did not load"):
        assert cache.get_or_build(KEY, _counting_build(b"v3")[0])[1] == "built"


def test_an_unstable_key_builds_without_the_disk(cache, tmp_path):
    with pytest.warns(RuntimeWarning):
        assert cache.get_or_build(("k", object()), lambda: b"x") == (b"x", "built-unsaved")
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------------------------------- processes
def test_concurrent_processes_build_once(tmp_path):
    log = tmp_path / "builds.log"
    entries = tmp_path / "entries"
    cmd = [sys.executable, os.path.join(ROOT, "tests", "cache_worker.py"), str(entries), str(log), "1.0", "2"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=_env()) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(log.read_text().split()) == 1, "more than one process built the kernel"
    assert sorted(o[0] for o in outs) == ["built", "disk"]
    assert {o[1] for o in outs} == {"kernel-bytes"}


def test_a_dead_lock_holder_frees_the_key(tmp_path):
    lock = str(tmp_path / "k.lock")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import fcntl,os,time; fd=os.open({lock!r}, os.O_RDWR|os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    with disk_cache.key_lock(lock, timeout=0.2) as acquired:
        assert not acquired  # held by a live process: the wait times out
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    start = time.monotonic()
    with disk_cache.key_lock(lock, timeout=10) as acquired:
        assert acquired and time.monotonic() - start < 5


# --------------------------------------------------------------------------------------------------- compile_cache
def test_off_switch_builds_in_memory_only(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_FLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CUTE_FLASH_DISK_CACHE", "0")
    assert disk_cache.kernel_cache() is None
    key = ("test-off", "sm_90a", "fwd", 1)
    build, calls = _counting_build()
    try:
        assert compile_cache.get_or_compile(key, build) == b"v1"
        assert compile_cache.get_or_compile(key, build) == b"v1" and calls == [1]
        assert compile_cache.cache_sources()[key] == "built-unsaved"
    finally:
        compile_cache._cache.pop(key, None)
    assert os.listdir(tmp_path) == []


def test_default_directory_is_per_user(monkeypatch):
    monkeypatch.delenv("CUTE_FLASH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/x/cache")
    assert disk_cache.cache_dir() == "/x/cache/cute_flash"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert disk_cache.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "cute_flash")


def test_an_object_that_cannot_be_exported_is_kept_in_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_FLASH_CACHE_DIR", str(tmp_path))
    key = ("test-unexportable", "sm_90a", "fwd", 2)
    try:
        assert compile_cache.get_or_compile(key, lambda: "not a kernel") == "not a kernel"
        assert compile_cache.cache_sources()[key] == "built-unsaved"
    finally:
        compile_cache._cache.pop(key, None)


# --------------------------------------------------------------------------------------------------- warm-up
_LOAD_IN_NEW_PROCESS = """
import json, sys
from cute_flash import compile_cache, warmup
from cute_flash.arch.sm90.backend import BACKEND
from cute_flash.spec import AttentionSpec
spec = AttentionSpec("bf16", 64, 64, "causal", "bf16")
fn = BACKEND._forward_kernel(spec, "sm_90a")
result = {"sources": list(compile_cache.cache_sources().values()), "cutlass": "cutlass" in sys.modules,
          "callable": callable(fn)}
compile_cache.clear()
result["rewarm"] = warmup.run([warmup.Config(spec)], (9, 0))["totals"]
print(json.dumps(result))
"""


def test_warmup_cross_compiles_entries_a_new_process_loads(tmp_path):
    env = _env(CUTE_FLASH_CACHE_DIR=str(tmp_path))
    env.pop("CUTE_DSL_ARCH", None)
    cmd = [sys.executable, "-m", "cute_flash", "warmup", "--arch", "sm90", "--head-dims", "64", "--masks", "causal"]
    proc = subprocess.run([*cmd, "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    (item,) = summary["items"]
    # the forward, and the split-key decoding build with its combine kernel (arch/split_kv.py)
    assert (item["status"], item["family"], item["kernels"]["built"]) == ("built", "sm90", 3), summary
    assert summary["target"] == "sm_90a" and summary["cache_dir"] == os.path.join(str(tmp_path), "v1")
    # the eager forward's C++ call path is built beside the kernels (cute_flash/native.py)
    from cute_flash import native

    if native.cxx_compiler() is not None:
        assert summary["native"].startswith(os.path.join(str(tmp_path), "native")), summary

    # A new process asking for the kernel the way the sm90 launch path does loads it: nothing is compiled, and with
    # a linked entry cutlass is not even imported.
    env["CUTE_DSL_ARCH"] = "sm_90a"
    proc = subprocess.run([sys.executable, "-c", _LOAD_IN_NEW_PROCESS], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["sources"] == ["disk"] and result["callable"]
    assert result["cutlass"] is (disk_cache.c_compiler() is None)
    # warming again finds everything on disk
    assert result["rewarm"] == {"built": 0, "cached": 1, "skipped": 0, "unsaved": 0, "failed": 0}


def test_warmup_reports_configurations_without_a_kernel(tmp_path):
    from cute_flash import warmup

    # the sm80 family has no deterministic backward: on an A100 no family serves it
    report = warmup.warm(warmup.Config(KEY[3], backward=True, deterministic=True), (8, 0))
    assert report["status"] == "no kernel" and "deterministic" in report["reason"]
    assert len(warmup.configs([64, 128], ["bf16"], ["none", "causal"], backward=True, gqa=(False, True))) == 12


def test_warmup_in_several_processes_keeps_the_order():
    from cute_flash import warmup

    # configurations without a kernel on an A100 (no deterministic sm80 backward): the workers compile nothing
    configs = warmup.configs([32, 64, 96], backward=True, deterministic=(True,), masks=["causal"])[1::2]
    items = warmup._run_in_processes(configs, (8, 0), jobs=2)
    assert [i["config"] for i in items] == [c.describe() for c in configs]
    assert {i["status"] for i in items} == {"no kernel"}, [i.get("reason") for i in items]

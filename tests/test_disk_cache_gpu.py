"""The disk kernel cache on a Hopper GPU: a second process loads every kernel of a forward + backward (MHA and GQA;
dense, and packed sequences whose forward launches clusters) from disk and computes the same results, and
`python -m cute_flash warmup` writes exactly the keys those calls look up. Each run is a fresh process with its own
cache directory.

Run: python -m pytest -q tests/test_disk_cache_gpu.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from cute_flash import disk_cache

pytestmark = [pytest.mark.sm90]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(cache_dir, out_path, *args) -> dict:
    env = dict(os.environ, CUTE_FLASH_CACHE_DIR=str(cache_dir))
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("CUTE_FLASH_ARCH", None)
    env.pop("CUTE_DSL_ARCH", None)
    cmd = [sys.executable, os.path.join(ROOT, "tests", "cache_gpu_child.py"), str(out_path), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_same(a, b):
    for name in a:
        out_a, *grads_a = a[name]
        out_b, *grads_b = b[name]
        torch.testing.assert_close(out_a, out_b, atol=0, rtol=0)  # the same kernel on the same inputs
        for ga, gb in zip(grads_a, grads_b):
            torch.testing.assert_close(ga, gb, atol=2e-2, rtol=2e-2)  # dQ's fp32 atomics may add in another order


@pytest.mark.parametrize("layout", ["dense", "packed"])
def test_a_second_process_loads_every_kernel_from_disk(tmp_path, layout):
    cache, args = tmp_path / "cache", ["packed"] if layout == "packed" else []
    first = _child(cache, tmp_path / "first.pt", *args)
    assert "built" in first["sources"] and "disk" not in first["sources"], first
    second = _child(cache, tmp_path / "second.pt", *args)
    assert set(second["sources"]) == {"disk"} and len(second["sources"]) == len(first["sources"]), second
    if disk_cache.c_compiler() is not None:
        assert not second["cutlass_imported"], "a linked entry should load through TVM-FFI alone"
    print(f"first calls: {first['seconds']:.2f} s compiling, {second['seconds']:.3f} s from disk")
    _assert_same(torch.load(tmp_path / "first.pt"), torch.load(tmp_path / "second.pt"))


def test_warmup_writes_the_keys_the_launch_path_looks_up(tmp_path):
    env = dict(os.environ, CUTE_FLASH_CACHE_DIR=str(tmp_path / "cache"))
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("CUTE_FLASH_ARCH", None)
    env.pop("CUTE_DSL_ARCH", None)
    cmd = [sys.executable, "-m", "cute_flash", "warmup", "--head-dims", "128", "--masks", "causal", "--backward"]
    proc = subprocess.run([*cmd, "--gqa", "both", "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["target"] == "sm_90a" and summary["totals"]["built"] == 3, summary
    result = _child(tmp_path / "cache", tmp_path / "out.pt")
    assert set(result["sources"]) == {"disk"}, result

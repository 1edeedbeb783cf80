"""GPU-family markers: a test marked sm80/sm90/sm100 runs only where that family's kernels can run.

sm80 kernels also run on Hopper and Blackwell, so an sm80-marked test there forces the sm80 backend through
CUTE_FLASH_ARCH. Unmarked tests run anywhere (the CPU cross-compile tests included).

The suite never touches the user's kernel cache: the disk cache of this session lives in a temporary directory,
removed at exit, which the processes it starts share (pytest-xdist workers too: a kernel one worker compiled, the
others load from disk, so the GPU suites also run loaded kernels).
"""

import atexit
import os
import shutil
import tempfile

import pytest
import torch

_SESSION_CACHE = "CUTE_FLASH_TEST_CACHE_DIR"  # set by the first pytest process, inherited by its workers
if not os.environ.get(_SESSION_CACHE):
    os.environ[_SESSION_CACHE] = tempfile.mkdtemp(prefix="cute_flash_test_cache_")
    atexit.register(shutil.rmtree, os.environ[_SESSION_CACHE], ignore_errors=True)
os.environ["CUTE_FLASH_CACHE_DIR"] = os.environ[_SESSION_CACHE]
os.environ.setdefault("CUTE_FLASH_DISK_CACHE", "1")  # on, as for users (a 0 already set is kept)

FAMILIES = ("sm80", "sm90", "sm100")


def _capability():
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def _can_run(family: str, cap) -> bool:
    if cap is None:
        return False
    if family == "sm80":
        return cap[0] >= 8
    if family == "sm90":
        return cap == (9, 0)
    return cap[0] == 10


def pytest_collection_modifyitems(config, items):
    cap = _capability()
    for item in items:
        for family in FAMILIES:
            if item.get_closest_marker(family) is not None and not _can_run(family, cap):
                where = "no CUDA GPU" if cap is None else f"GPU is compute capability {cap[0]}.{cap[1]}"
                item.add_marker(pytest.mark.skip(reason=f"needs a GPU that runs {family} kernels ({where})"))


@pytest.fixture(autouse=True)
def _force_family(request, monkeypatch):
    for family in FAMILIES:
        if request.node.get_closest_marker(family) is not None:
            monkeypatch.setenv("CUTE_FLASH_ARCH", family)
            break
    yield


@pytest.fixture(autouse=True)
def _fresh_call_cache():
    # cute_flash.attention caches validation and routing per call signature; tests that patch the device check,
    # the router or the backends must not see a plan made under another test's patches.
    from cute_flash.core import plan

    plan.clear_call_cache()
    yield
    plan.clear_call_cache()

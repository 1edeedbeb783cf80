"""pytest plugin: keep a deterministic sample of the collected cases (FA4_SAMPLE=0.012 keeps ~1.2%)."""

import os
import zlib


def pytest_collection_modifyitems(config, items):
    rate = float(os.environ.get("FA4_SAMPLE", "1"))
    if rate >= 1:
        return
    keep = [it for it in items if zlib.crc32(it.nodeid.encode()) % 100000 < rate * 100000]
    config.hook.pytest_deselected(items=[it for it in items if it not in keep])
    items[:] = keep

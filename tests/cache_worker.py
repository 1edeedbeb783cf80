"""A process that gets one key from a DiskCache with a byte codec and a slow fake build (tests/test_disk_cache.py).

usage: python tests/cache_worker.py DIR BUILD_LOG SLEEP_SECONDS PROCESSES; the PROCESSES workers start together (each
writes a file beside BUILD_LOG and waits for the others'), so that they miss the key at the same time. Prints the
source ("built" / "disk") and the value.
"""

import os
import sys
import time

from cute_flash import disk_cache


class BytesCodec:
    """Entries of one file holding the object's bytes."""

    def export(self, obj, workdir, name):
        path = os.path.join(workdir, "bin")
        with open(path, "wb") as f:
            f.write(obj)
        return {"bin": path}

    def load(self, paths, name):
        with open(paths["bin"], "rb") as f:
            return f.read()


def _wait_for_each_other(build_log: str, processes: int) -> None:
    ready = os.path.join(os.path.dirname(build_log), "ready")
    os.makedirs(ready, exist_ok=True)
    open(os.path.join(ready, str(os.getpid())), "w").close()
    deadline = time.monotonic() + 120
    while len(os.listdir(ready)) < processes and time.monotonic() < deadline:
        time.sleep(0.01)


def main(directory: str, build_log: str, sleep: float, processes: int) -> None:
    def build():
        with open(build_log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(sleep)
        return b"kernel-bytes"

    _wait_for_each_other(build_log, processes)
    value, source = disk_cache.DiskCache(directory, BytesCodec()).get_or_build(("fake", "sm_90a", "fwd", 64), build)
    print(source, value.decode())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))

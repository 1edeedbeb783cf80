"""`python -m cute_flash warmup`: fills the disk kernel cache for a list of configurations, also on a machine without a
GPU (the kernels are cross-compiled for the GPU's target), so that a fleet's processes load instead of compiling.

Each configuration is routed as a call on a GPU of that compute capability would be (cute_flash.routing: on a Hopper
GPU a forward the sm90 family has no tile for goes to the sm80 one), and the serving family's `warm` gets its
kernels through the launch path's own cache keys (arch/base.py). What a real call later looks up is therefore what
was written; the disk cache's fingerprint (disk_cache.py) keeps a warm-up made with other versions from being used.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

from . import compile_cache, disk_cache, native
from .routing import route
from .spec import AttentionSpec

Capability = Tuple[int, int]
FAMILY_CAPABILITY: Dict[str, Capability] = {"sm80": (8, 0), "sm90": (9, 0), "sm100": (10, 0)}


@dataclass(frozen=True)
class Config:
    """One call shape class to warm: the spec, and for the backward whether heads are grouped and the sums fixed."""

    spec: AttentionSpec
    backward: bool = False
    gqa: bool = False
    deterministic: bool = False

    def describe(self) -> str:
        s = self.spec
        dims = f"d{s.head_dim}" if s.head_dim == s.head_dim_v else f"d{s.head_dim}x{s.head_dim_v}"
        what = "backward" if self.backward else "forward"
        if s.kvcache:
            what = f"kvcache {'paged ' + str(s.page_size) if s.page_size else 'dense'}" + (" fp8" if s.kv_fp8 else "")
        flags = (("softcap", s.softcap), ("sink", s.sink), ("gqa", self.gqa), ("deterministic", self.deterministic))
        extras = [x for x, on in flags if on]
        return " ".join([what, s.dtype, dims, s.mask, *extras])


def configs(
    head_dims: Iterable[int],
    dtypes: Iterable[str] = ("bf16",),
    masks: Iterable[str] = ("none", "causal"),
    *,
    backward: bool = False,
    gqa: Iterable[bool] = (False,),
    deterministic: Iterable[bool] = (False,),
    head_dim_v: Optional[int] = None,
    softcap: bool = False,
    sink: bool = False,
    kvcache: bool = False,
    page_sizes: Iterable[int] = (0,),
    fp8_cache: Iterable[bool] = (False,),
) -> List[Config]:
    """Every forward configuration of the product, and with `backward` the backward ones too (GQA and deterministic
    variants change the backward's kernels only); softcap / sink: the builds with soft-capping / learnable sinks.
    kvcache: instead, the KV-cache forward's (`attention_with_kvcache`) for each page size (0: a dense cache) and
    cache dtype (fp8_cache True: float8_e4m3fn), with the append kernels of new tokens."""
    out = []
    for d, dtype, mask in itertools.product(head_dims, dtypes, masks):
        if kvcache:
            for page, fp8 in itertools.product(page_sizes, fp8_cache):
                out.append(Config(AttentionSpec(dtype, d, head_dim_v or d, mask, dtype, softcap=softcap, sink=sink,
                                                kvcache=True, page_size=page, kv_fp8=fp8)))  # fmt: skip
            continue
        spec = AttentionSpec(dtype, d, head_dim_v or d, mask, dtype, softcap=softcap, sink=sink)
        out.append(Config(spec))
        if backward:
            out += [Config(spec, True, g, det) for g, det in itertools.product(gqa, deterministic)]
    return list(dict.fromkeys(out))


def warm(config: Config, capability: Capability) -> dict:
    """Gets one configuration's kernels for a GPU of `capability`; a report of what was built or loaded."""
    target = compile_cache.target_for_capability(capability)
    r = route(config.spec, capability, config.backward, config.deterministic)
    report = {"config": config.describe(), "family": r.family, "target": target}
    if r.family is None:
        return {**report, "status": "no kernel", "reason": r.error()}
    before = compile_cache.cache_sources()
    start = time.perf_counter()
    try:
        r.backend.warm(
            config.spec, target, backward=config.backward, gqa=config.gqa, deterministic=config.deterministic
        )
        if config.spec.kvcache:  # the append of new tokens, for dense and packed queries
            from .kvcache import append_kernel

            s = config.spec
            for packed in (False, True):
                append_kernel(s.dtype, s.kv_fp8, s.head_dim, s.head_dim_v, s.page_size > 0, packed, target)
    except NotImplementedError as e:
        return {**report, "status": "unsupported", "reason": str(e)}
    seconds = time.perf_counter() - start
    new = {k: v for k, v in compile_cache.cache_sources().items() if k not in before}
    counts = {source: sum(1 for v in new.values() if v == source) for source in ("built", "disk", "built-unsaved")}
    status = "built" if counts["built"] else ("cached" if counts["disk"] or not new else "unsaved")
    if counts["built-unsaved"]:
        status = "unsaved"
    return {**report, "status": status, "kernels": counts, "seconds": round(seconds, 2)}


def prepare_target(capability: Capability) -> str:
    """Makes CuTe DSL compile for this capability's target: CUTE_DSL_ARCH must be set before cutlass is imported."""
    target = compile_cache.target_for_capability(capability)
    current = os.environ.get("CUTE_DSL_ARCH")
    if current and current != target:
        raise RuntimeError(
            f"CUTE_DSL_ARCH={current} but compute capability {capability[0]}.{capability[1]} needs {target}: unset "
            f"it, or warm up in a separate process per target"
        )
    compile_cache.ensure_cute_dsl_arch(target)
    if os.environ.get("CUTE_DSL_ARCH") != target:
        raise RuntimeError(f"cutlass was imported before the target {target} could be set; warm up in a new process")
    return target


def _shard_main() -> None:
    """A worker of `run(jobs > 1)`: reads {"capability", "configs"} as JSON on stdin, prints its reports as JSON."""
    job = json.loads(sys.stdin.read())
    capability = tuple(job["capability"])
    prepare_target(capability)
    configs_in = [Config(AttentionSpec(**c.pop("spec")), **c) for c in job["configs"]]
    print(json.dumps([warm(c, capability) for c in configs_in]))


def _run_in_processes(config_list: List[Config], capability: Capability, jobs: int) -> List[dict]:
    """Warms shards of the list in `jobs` processes at once (compiling is single-threaded); kernels that two
    configurations share are built once, by whichever process takes the key's lock first."""
    shards = [config_list[i::jobs] for i in range(jobs)]
    cmd = [sys.executable, "-c", "from cute_flash.warmup import _shard_main; _shard_main()"]
    # Each worker is a new process that compiles for this capability alone, whatever target this process was set to.
    env = {**os.environ, "CUTE_DSL_ARCH": compile_cache.target_for_capability(capability)}
    procs = []
    for shard in shards:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        job = {"capability": list(capability), "configs": [dataclasses.asdict(c) for c in shard]}
        proc.stdin.write(json.dumps(job))
        proc.stdin.close()
        procs.append(proc)
    items: List[dict] = [{} for _ in config_list]
    for i, (proc, shard) in enumerate(zip(procs, shards)):
        out, err = proc.stdout.read(), proc.stderr.read()
        proc.wait()
        try:
            reports = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            tail = (err.strip().splitlines() or ["no output"])[-1][:300]
            reports = [{"config": c.describe(), "family": None, "status": "failed", "reason": tail} for c in shard]
        items[i::jobs] = reports
    return items


def run(config_list: List[Config], capability: Capability, jobs: int = 1) -> dict:
    """Warms every configuration, in `jobs` processes; the summary `python -m cute_flash warmup` prints."""
    # Asking to warm the cache is asking for it: on for this process (and the shards it starts) unless switched off
    # explicitly; the processes that read the entries need it on too.
    os.environ.setdefault(disk_cache.ENV_SWITCH, "1")
    if disk_cache.kernel_cache() is None:
        raise RuntimeError(f"the disk kernel cache is off ({disk_cache.ENV_SWITCH}=0): nothing to warm")
    target = prepare_target(capability)
    start = time.perf_counter()
    jobs = max(1, min(jobs, len(config_list)))
    if jobs > 1:
        items = _run_in_processes(config_list, capability, jobs)
    else:
        items = [warm(c, capability) for c in config_list]
    totals = {s: sum(1 for i in items if i["status"] == s) for s in ("built", "cached", "unsaved", "failed")}
    native.library()  # the eager forward's C++ call path, built beside the kernels (None: unavailable, warned)
    return {
        "capability": f"{capability[0]}.{capability[1]}",
        "target": target,
        "cache_dir": disk_cache.entries_dir(),
        "items": items,
        "totals": {**totals, "skipped": len(items) - sum(totals.values())},
        "native": native.loaded_path(),
        "jobs": jobs,
        "seconds": round(time.perf_counter() - start, 2),
    }

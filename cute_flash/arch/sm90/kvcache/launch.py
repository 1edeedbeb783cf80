"""Building and launching the sm90 KV-cache forward: what the sm90 backend's kvcache_splits / forward_kvcache call.

  run_forward_kvcache(t, problem, num_splits)   fills t.out / t.lse (arch/base.KvCacheTensors' conventions)
  warm_kvcache(spec, target)                    builds every kernel a call of `spec` may launch
  compile_kvcache_artifacts(spec, target)       [KernelArtifact] of the decoding build (fake tensors, no GPU)

A call launches one kernel, or with num_splits > 1 the split build (fp32 partials, one torch allocation per call as
arch/base.SplitForward makes it: CUDA-graph capture takes it from its pool) and the shared combine
(common/split_combine.py) on the same stream, which waits for it by programmatic dependent launch. Packed q is
combined as one sequence of total_q rows (out (1, total_q, h, dv)); every row must belong to a sequence
(cu_seqlens_q[-1] == total_q: the front end's contract), since the combine writes every row.

Soft-capping and learnable sinks (spec.softcap / spec.sink): the builds' `kvcache_features` entry takes the cap and
the (h,) fp32 logits (KvCacheTensors.sink), which the kernel maps to its (token, head) rows itself. A split build
applies the cap and leaves the sink out of its partials; the combine's sink build adds it once per output row, whose
rows are the output's own (token, query head) pairs: it reads the logits as a (rows, h) view of row stride 0.
"""

from __future__ import annotations

import tempfile
from typing import List

import torch

from .... import compile_cache
from ....spec import AttentionSpec, softcap_fields
from ....validation import MAX_GRID_YZ, KvCacheProblem
from ...base import BoundKvCache, KernelArtifact, KvCacheTensors
from ... import split_kv
from . import tile_config as kv_tiles
from .tile_config import AnyKvCacheConfig, kvcache_configs

FAMILY = "sm90"

_kernels = compile_cache.memo()  # (spec, target, cfg, packed_q, split) -> compiled kernel


def kvcache_kernel(spec: AttentionSpec, cfg: AnyKvCacheConfig, target: str, packed_q: bool, split: bool, extra=""):
    """The compiled KV-cache forward (build.compile_forward_kvcache's calling convention)."""
    memo_key = (spec, target, cfg, packed_q, split)
    kernel = _kernels.get(memo_key) if not extra else None
    if kernel is not None:
        return kernel

    def build():
        from .. import build as sm90_build  # imports cutlass: only when a kernel is built

        return sm90_build.compile_forward_kvcache(spec, cfg, target, packed_q, split, extra)

    if extra:  # (artifacts for the compile command: not cached)
        return build()
    key = (FAMILY, target, "fwd_kvcache", spec, cfg, packed_q, split)
    kernel = _kernels[memo_key] = compile_cache.get_or_compile(key, build)
    return kernel


class KvCacheLauncher(BoundKvCache):
    """`forward_kvcache` of one problem on one device with a given split, everything that depends only on them
    settled once (the front end keeps one per call signature: a decoding step pays a few attribute reads, the
    allocation of a split's partials and the kernel calls). Its parts are BoundKvCache's (the C++ call path
    launches them itself for decoding calls of `cute_flash.attention`)."""

    def __init__(self, problem: KvCacheProblem, device, num_splits: int):
        p = self.problem = problem
        spec = p.spec
        self.packed = p.packed_q
        # (through the module: a study may replace kvcache_tile_config)
        cfg = kv_tiles.problem_tile_config(p, compile_cache.sm_count(device))
        target = compile_cache.runtime_target(device)
        num_splits = min(num_splits, MAX_GRID_YZ // max(p.batch, 1))  # grid z = splits x b (changes speed only)
        self.split = num_splits > 1
        self.splits = num_splits if self.split else 1
        self.kernel = kvcache_kernel(spec, cfg, target, self.packed, self.split)
        self.scalars = (int(p.seqlen_q), float(p.softmax_scale), int(p.mask.left), int(p.mask.right))
        self.features = spec.softcap or spec.sink  # the feature entry (build.compile_forward_kvcache)
        self.softcap = float(p.softcap)
        self.combine = split_kv.combine_kernel(spec, target) if self.split else None
        parts = num_splits * (1 if self.packed else p.batch)
        rows = p.total_q if self.packed else p.seqlen_q
        self.rows = rows
        self.o_shape = (parts, rows, p.nheads, p.head_dim_v)
        self.lse_shape = (parts, p.nheads, rows)
        self.o_elems = parts * rows * p.nheads * p.head_dim_v

    def __call__(self, t: KvCacheTensors) -> None:
        p = self.problem
        _check_features(t, p)
        tail = (t.seqlens_k, t.page_table, t.cu_seqlens_q, t.k_descale, t.v_descale, *self.scalars)
        if self.features:
            tail += (self.softcap, None if self.split else t.sink)
        if not self.split:
            self.kernel(t.q, t.k_cache, t.v_cache, t.out, t.lse, *tail)
            return
        block = torch.empty(self.o_elems + self.o_elems // p.head_dim_v, dtype=torch.float32, device=t.q.device)
        o_part = block[: self.o_elems].view(self.o_shape)
        lse_part = block[self.o_elems :].view(self.lse_shape)
        self.kernel(t.q, t.k_cache, t.v_cache, o_part, lse_part, *tail)
        out, lse = (t.out.unsqueeze(0), t.lse.unsqueeze(0)) if self.packed else (t.out, t.lse)
        if p.spec.sink:  # the combine's rows are the output's (token, query head) pairs: sink[head] for every token
            self.combine(o_part, lse_part, out, lse, t.sink.view(1, p.nheads).expand(self.rows, p.nheads))
        else:
            self.combine(o_part, lse_part, out, lse)


def run_forward_kvcache(t: KvCacheTensors, problem: KvCacheProblem, num_splits: int) -> None:
    KvCacheLauncher(problem, t.q.device, num_splits)(t)


def _check_features(t: KvCacheTensors, p: KvCacheProblem) -> None:
    """The runtime values a build for spec.softcap / spec.sink reads (the front end validates them; a kernel handed
    none would fail obscurely at launch): a cap > 0, and the (h,) contiguous fp32 logits."""
    spec = p.spec
    if spec.softcap and not p.softcap > 0:
        raise ValueError(f"a soft-capping build needs softcap > 0, got {p.softcap}")
    if spec.softcap_wide != softcap_fields(p.softcap)["softcap_wide"]:  # (the capped softmax's range: spec.py)
        raise ValueError(f"softcap {p.softcap} on a build with softcap_wide={spec.softcap_wide} (spec.softcap_fields)")
    if spec.sink:
        s = t.sink
        if s is None or s.dtype != torch.float32 or tuple(s.shape) != (p.nheads,) or not s.is_contiguous():
            raise ValueError(f"a build with learnable sinks needs the ({p.nheads},) contiguous float32 logits")
    elif t.sink is not None:
        raise ValueError("sink logits given to a build without learnable sinks (spec.sink is False)")


def warm_kvcache(spec: AttentionSpec, target: str) -> None:
    """Every build a call of `spec` may launch: each tile configuration of kvcache_configs, dense and packed q, split
    or not, and the combine."""
    for cfg in kvcache_configs(spec):
        for packed in (False, True):
            for split in (False, True):
                kvcache_kernel(spec, cfg, target, packed, split)
    split_kv.combine_kernel(spec, target)


def compile_kvcache_artifacts(spec: AttentionSpec, target: str) -> List[KernelArtifact]:
    """The decoding build (dense q, unsplit) for the `compile` command."""
    cfg = kvcache_configs(spec)[0]
    with tempfile.TemporaryDirectory(prefix="cute_flash_sm90_kvcache_") as dump:
        compiled = kvcache_kernel(spec, cfg, target, False, False, compile_cache.keep_artifacts_options(dump))
        config = {**cfg.as_dict(), "shared_bytes": kv_tiles.kvcache_smem_bytes(cfg, spec.head_dim, spec.head_dim_v)}
        config["threads"] = cfg.num_threads
        return [KernelArtifact("fwd_kvcache", compiled.artifacts.PTX, compiled.artifacts.CUBIN, config)]

"""The sm80 entry point for the front end (see cute_flash.arch.base.ArchBackend).

Forward: `flash_fwd.Sm80FlashForward`, compiled once per (target, spec, tile) with symbolic batch / seqlen / head
extents and launched through TVM-FFI on torch's current stream; decoding calls with few query blocks run its
split-key build and the shared combine kernel (arch/split_kv.py). Backward: delegated to `backward.py` (the sm80
backward kernels), imported only when asked for.
"""

from __future__ import annotations

import functools
import importlib
from typing import Dict, List, Optional, Tuple

import torch

from ... import compile_cache
from ...spec import AttentionSpec, ModsSpec
from ...validation import KvCacheProblem, Problem, VarlenProblem, kernel_view
from ..base import BackwardLauncher, BwdTensors, ForwardLauncher, FwdTensors, Grads, KernelArtifact, PackedSeqs
from ..base import BackendBase, BoundForward, KvCacheTensors, SplitForward, launch_packed_forward
from ..base import launch_mods_forward, prepare_build
from .. import split_kv
from . import kvcache
from .build import compile_forward, compile_runnable_forward
from .tile_config import FwdTileConfig, fwd_tile_candidates

FAMILY = "sm80"
MAX_HEAD_DIM = 256


def forward_unsupported_reason(spec: AttentionSpec) -> Optional[str]:
    if spec.dtype not in ("fp16", "bf16"):
        return f"the sm80 kernels compute in fp16 or bf16, not {spec.dtype} (fp8 needs sm90 or sm100)"
    if spec.out_dtype != spec.dtype:
        return f"the sm80 forward writes out in its input dtype ({spec.dtype}), not {spec.out_dtype}"
    for name, d in (("head_dim", spec.head_dim), ("head_dim_v", spec.head_dim_v)):
        if d <= 0 or d % 8 != 0 or d > MAX_HEAD_DIM:
            return f"{name} {d} is not supported by the sm80 forward (multiples of 8 up to {MAX_HEAD_DIM})"
    if spec.mask not in ("none", "causal", "local"):
        return f"unknown mask kind {spec.mask!r}"
    if isinstance(spec, ModsSpec):
        if spec.kvcache:
            return "score_mod / mask_mod have no KV-cache kernels"
        if spec.varlen and spec.block_sparse:
            return "score_mod / mask_mod over packed sequences take no block mask"
        if spec.softcap or spec.sink:
            return "score_mod / mask_mod do not combine with softcap or sinks yet (write softcap as a score_mod)"
    return None


@functools.lru_cache(maxsize=None)
def _first_tile(head_dim: int, head_dim_v: int, target: str) -> FwdTileConfig:
    """The first forward tile candidate (looked up once: `forward` builds a launcher on every call)."""
    return fwd_tile_candidates(head_dim, head_dim_v, target)[0]


def _backward_module():
    try:
        return importlib.import_module(__package__ + ".backward")
    except ModuleNotFoundError as e:
        if e.name == __package__ + ".backward":
            return None
        raise


# Split-key decoding from 2 splits on: an unsplit CTA of this family reads the cache at ~20 GB/s (the family forced
# on an H100, 64 CTAs: ~1.2 TB/s), so halving the keys per CTA already pays for the combine (1.5-12x the unsplit
# kernel at batch 1-8, H100, 2026-11-26).
SPLIT_MIN_SPLITS = 2

DETERMINISTIC_UNSUPPORTED = (
    "the sm80 backward adds dQ (and GQA's dK/dV) with fp32 atomics in no fixed order, so it has no deterministic mode"
)


class _Backend(BackendBase):
    name = FAMILY
    cute_arch = "sm_80"
    varlen = True  # has packed-sequence kernels (forward_varlen / backward_varlen); see routing
    split_keys = True  # split-key decoding (arch/split_kv.py)
    kvcache = True  # has a KV-cache forward (forward_kvcache: cp.async gathers, every page size); see routing

    def fp8_kv_scale_block(self, spec: AttentionSpec) -> int:
        raise NotImplementedError("the sm80 family has no FP8 kernel")

    def unsupported_reason(self, spec: AttentionSpec, backward: bool, deterministic: bool = False) -> Optional[str]:
        reason = forward_unsupported_reason(spec)
        if spec.kvcache:
            reason = kvcache.unsupported_reason(spec, reason)
            return reason if reason is not None or not backward else "the KV-cache forward has no backward"
        if reason is not None or not backward:
            return reason
        if deterministic:
            return DETERMINISTIC_UNSUPPORTED
        bwd = _backward_module()
        if bwd is None:
            return "sm80 backward not implemented yet"
        return bwd.backward_unsupported_reason(spec)

    def _forward_kernel(self, spec: AttentionSpec, target: str, split: bool = False):
        """The compiled forward of `spec` for `target` (split: its split-key build)."""
        # The tile is a function of (spec, target) (see compile_forward), so it needs no place in the key.
        key = (FAMILY, target, "fwd", spec) + (("split",) if split else ())
        return compile_cache.get_or_compile(key, lambda: compile_runnable_forward(spec, target, split=split))

    def kvcache_splits(self, problem: KvCacheProblem, sm_count: int) -> int:
        return kvcache.num_splits(problem, sm_count)

    def forward_kvcache(self, t: KvCacheTensors, problem: KvCacheProblem, num_splits: int) -> None:
        reason = self.unsupported_reason(problem.spec, backward=False)
        if reason is not None or not problem.spec.kvcache:
            raise NotImplementedError(reason or "forward_kvcache needs a KV-cache spec (spec.kvcache)")
        kvcache.forward(t, problem, num_splits)

    def forward_launcher(self, problem: Problem, device: torch.device) -> ForwardLauncher:
        spec = problem.spec
        reason = forward_unsupported_reason(spec)
        if spec.kvcache:
            reason = "a KV-cache spec runs through forward_kvcache"
        if reason is not None:
            raise NotImplementedError(reason)
        target = compile_cache.runtime_target(device)  # the device's own: a kernel loads only there (sm_90a on Hopper)
        # The first tile candidate's extents: compile_forward may keep a later one (fewer keys per tile) when the
        # first spills, which changes how well the split fits, not what the kernels compute (every candidate has
        # 128-row tiles, and the kernel derives its runs from the split count and its own tiles).
        tile = _first_tile(spec.head_dim, spec.head_dim_v, target)
        sm_count = compile_cache.sm_count(device)
        splits = split_kv.num_splits(problem, tile.tile_m, tile.tile_n, sm_count, SPLIT_MIN_SPLITS)
        if splits > 1:
            split = self._forward_kernel(spec, target, split=True)
            return SplitForward(split, split_kv.combine_kernel(spec, target), problem, splits)
        return BoundForward(self._forward_kernel(spec, target), problem)

    def forward_mods(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        problem: Problem, tables: List[torch.Tensor], blocks: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        seqs: Optional[PackedSeqs] = None,
    ) -> None:  # fmt: skip
        """The forward of a ModsSpec (score_mod / mask_mod, flash_fwd_mods.py): tables are the graphs' captured
        tensors as the kernel stores them (cute_flash/mods/call.py); packed with spec.varlen (seqs, tensors as
        forward_varlen's: the `packed_mods` entry, under forward_varlen's keys). No block lists (every tile)."""
        spec = problem.spec
        reason = forward_unsupported_reason(spec)
        if reason is None and not isinstance(spec, ModsSpec):
            reason = "forward_mods needs a ModsSpec"
        if reason is not None:
            raise NotImplementedError(reason)
        if blocks is not None:
            raise ValueError("the sm80 score_mod / mask_mod forward takes no block lists (it visits every tile)")
        if spec.varlen != (seqs is not None):
            raise ValueError("a packed score_mod / mask_mod build takes the sequences, and only it")
        target = compile_cache.runtime_target(q.device)
        if seqs is not None:
            kernel = self._varlen_kernel(spec, target, seqs.seqused_k is not None)
        else:
            kernel = self._forward_kernel(spec, target)
        launch_mods_forward(kernel, q, k, v, out, lse, problem, tables, None, seqs)

    def backward_mods(
        self, t: BwdTensors, grads: Grads, problem: Problem, tables: List[torch.Tensor], blocks: Optional[tuple] = None,
        seqs: Optional[PackedSeqs] = None,
    ) -> None:  # fmt: skip
        """The backward of `forward_mods` (flash_bwd_mods.py), with the same tables; every tile visited (no block
        lists: mods_query_tiles None); packed with seqs (as forward_mods')."""
        assert blocks is None and not problem.spec.block_sparse, "this family's backward takes no block lists"
        spec = problem.spec
        reason = self.unsupported_reason(spec, backward=True)
        if reason is None and not isinstance(spec, ModsSpec):
            reason = "backward_mods needs a ModsSpec"
        if reason is not None:
            raise NotImplementedError(reason)
        if spec.varlen != (seqs is not None):
            raise ValueError("a packed score_mod / mask_mod build takes the sequences, and only it")
        if seqs is not None:
            _backward_module().run_backward_varlen(t, grads, seqs, problem, tables=tuple(tables))
            return
        _backward_module().backward_launcher(problem, t.q.device)(t, grads, tables)

    def forward(self, t: FwdTensors, problem: Problem, descale: Optional[Dict[str, torch.Tensor]] = None) -> None:
        q, k, v, out, lse = t[:5]
        if descale is not None:
            raise NotImplementedError("the sm80 forward has no fp8 path, so it takes no descale factors")
        launch = self.forward_launcher(problem, q.device)  # (refuses what the family does not serve)
        q, k, v, out = (kernel_view(t, copy=False, name=n) for n, t in (("q", q), ("k", k), ("v", v), ("out", out)))
        launch(q, k, v, out, lse, t.sink)

    def forward_varlen(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        seqs: PackedSeqs, problem: VarlenProblem, sink: Optional[torch.Tensor] = None,
    ) -> None:  # fmt: skip
        """Packed forward: q (total_q, h, d), k / v (total_k, h_kv, d / dv), out (total_q, h, dv), lse (h, total_q);
        sink: spec.sink's (total_q, h) fp32 view (arch/base.py)."""
        spec = problem.spec
        reason = forward_unsupported_reason(spec)
        if reason is not None:
            raise NotImplementedError(reason)
        kernel = self._varlen_kernel(spec, compile_cache.runtime_target(q.device), seqs.seqused_k is not None)
        launch_packed_forward(kernel, q, k, v, out, lse, seqs, problem, sink)

    @staticmethod
    def _varlen_kernel(spec: AttentionSpec, target: str, seqused: bool):
        """The packed forward (reading seqused_k or not), under the key `warm` fills too."""
        key = (FAMILY, target, "fwd", spec, seqused)
        return compile_cache.get_or_compile(key, lambda: compile_runnable_forward(spec, target, seqused))

    def backward_head_dims(self, spec: AttentionSpec) -> Tuple[int, int]:
        return (_backward_module().kernel_width(spec),) * 2

    def backward_launcher(
        self, problem: Problem, device: torch.device, deterministic: bool = False
    ) -> BackwardLauncher:
        if deterministic:
            raise NotImplementedError(DETERMINISTIC_UNSUPPORTED)
        return _backward_module().backward_launcher(problem, device, checked=False)

    def backward(self, t: BwdTensors, grads: Grads, problem: Problem, deterministic: bool = False) -> None:
        if deterministic:
            raise NotImplementedError(DETERMINISTIC_UNSUPPORTED)
        _backward_module().run_backward(t, grads, problem)

    def warm(
        self, spec: AttentionSpec, target: str, *, backward: bool, gqa: bool = False, deterministic: bool = False
    ) -> None:
        prepare_build(self, spec, target, backward=backward, deterministic=deterministic, warming=True)
        if spec.kvcache:
            kvcache.warm(spec, target)
        elif backward:
            _backward_module().warm_backward(spec, target, gqa=gqa)
        elif spec.varlen:  # (the keys of forward_varlen: with and without seqused_k)
            for seqused in (False, True):
                self._varlen_kernel(spec, target, seqused)
        else:
            self._forward_kernel(spec, target)
            if split_kv.splittable(spec):  # decoding calls of this spec run the split build and its combine
                self._forward_kernel(spec, target, split=True)
                split_kv.combine_kernel(spec, target)

    def backward_varlen(
        self, t: BwdTensors, grads: Grads, seqs: PackedSeqs, problem: VarlenProblem, deterministic: bool = False
    ) -> None:
        """Packed backward: tensors as in forward_varlen, dq / dk / dv shaped like q / k / v."""
        if deterministic:
            raise NotImplementedError(DETERMINISTIC_UNSUPPORTED)
        _backward_module().run_backward_varlen(t, grads, seqs, problem)

    def compile_artifacts(self, spec: AttentionSpec, backward: bool, target: str) -> List[KernelArtifact]:
        prepare_build(self, spec, target, backward=backward)
        # remarks{ptx} makes ptxas print its register / spill report, which the compile command reads.
        if spec.kvcache:  # the dense-q, unsplit build
            fwd = kvcache.compile_kvcache(spec, target, packed_q=False, split=False, extra_options="remarks{ptx}")
        else:
            fwd = compile_forward(spec, target, "remarks{ptx}")
        config = {**fwd.tile.as_dict(), "candidates_tried": fwd.tried}
        config.update(shared_bytes=fwd.tile.smem_bytes(), threads=fwd.tile.num_threads)
        artifacts = [KernelArtifact(kernel="fwd", ptx=fwd.ptx, cubin=fwd.cubin, config=config)]
        if backward:
            artifacts += _backward_module().compile_backward_artifacts(spec, target)
        return artifacts


BACKEND = _Backend()

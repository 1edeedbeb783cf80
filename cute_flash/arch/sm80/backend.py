"""The sm80 entry point for the front end (see cute_flash.arch.base.ArchBackend).

Forward: `flash_fwd.Sm80FlashForward`, compiled once per (target, spec, tile) with symbolic batch / seqlen / head
extents and launched through TVM-FFI on torch's current stream; decoding calls with few query blocks run its
split-key build and the shared combine kernel (arch/split_kv.py). Backward: delegated to `backward.py` (the sm80
backward kernels), imported only when asked for.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ... import compile_cache
from ...spec import AttentionSpec
from ...validation import KvCacheProblem, Problem, VarlenProblem, kernel_view
from ..base import BackwardLauncher, BwdTensors, ForwardLauncher, FwdTensors, Grads, KernelArtifact, PackedSeqs
from ..base import BoundForward, KvCacheTensors, SplitForward, launch_packed_forward, prepare_build
from .. import split_kv
from . import kvcache
from ...census import cubin_resources
from ...common.dsl_types import dsl_dtype
from ...common.fake_tensors import fake_f32, fake_operand, fake_packed_forward_args
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


def fake_sink(rows=None, heads=None):
    """The (rows, h) fp32 sink view of arch/base.py for compiling: both strides symbolic (row stride 0 for the (h,)
    logits expanded along the rows, head stride other than 1 where decoding packs query heads as rows)."""
    import cutlass
    import cutlass.cute as cute

    shape = (rows if rows is not None else cute.sym_int(), heads if heads is not None else cute.sym_int())
    return cute.runtime.make_fake_tensor(cutlass.Float32, shape, (cute.sym_int64(), cute.sym_int64()), assumed_align=4)


def _feature_args(spec: AttentionSpec, rows, heads, split: bool) -> tuple:
    """The feature entries' extra arguments (softcap, sink view) for a spec.softcap / spec.sink build, else (): the
    split build takes no sink (its combine adds it)."""
    import cutlass

    if not (spec.softcap or spec.sink):
        return ()
    return cutlass.Float32(0.0), fake_sink(rows, heads) if spec.sink and not split else None


def _build_forward(spec: AttentionSpec, tile: FwdTileConfig, options: str, seqused: bool = False, split=False):
    """Compiles the forward kernel with fake tensors: batch, seqlens and head counts are symbolic; split: the
    split-key build, whose out / lse are the fp32 partials (splits * b, sq, h, dv) / (splits * b, h, sq). Specs with
    softcap or sinks compile the feature entries (common/entries.py)."""
    import cutlass
    import cutlass.cute as cute

    from .flash_fwd import Sm80FlashForward

    dtype = dsl_dtype(spec.dtype)
    if spec.varlen:
        return _build_forward_packed(spec, tile, options, seqused)
    batch, seqlen_q, seqlen_k, heads, heads_kv = (cute.sym_int() for _ in range(5))

    def operand(seqlen, nheads, d):
        return fake_operand(dtype, (batch, seqlen, nheads, d))

    q = operand(seqlen_q, heads, spec.head_dim)
    k = operand(seqlen_k, heads_kv, spec.head_dim)
    v = operand(seqlen_k, heads_kv, spec.head_dim_v)
    out = operand(seqlen_q, heads, spec.head_dim_v)
    lse = fake_f32((batch, heads, seqlen_q))
    if split:
        parts = cute.sym_int()
        out, lse = fake_f32((parts, seqlen_q, heads, spec.head_dim_v)), fake_f32((parts, heads, seqlen_q))
    kernel = Sm80FlashForward(spec, tile, split_kv=split)
    features = _feature_args(spec, None, heads, split)
    entry = kernel.features if features else kernel
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    scalars = (cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0))
    return cute.compile(entry, q, k, v, out, lse, *scalars, *features, stream, options=options)


def _build_forward_packed(spec: AttentionSpec, tile: FwdTileConfig, options: str, seqused: bool):
    """The packed (varlen) forward: q (total_q, h, d), ..., lse (h, total_q); batch = cu_seqlens_q's length - 1."""
    import cutlass.cute as cute

    from .flash_fwd import Sm80FlashForward

    dtype = dsl_dtype(spec.dtype)
    args = fake_packed_forward_args(dtype, spec.head_dim, spec.head_dim_v, seqused)
    kernel = Sm80FlashForward(spec, tile)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    features = _feature_args(spec, args[0].shape[0], args[0].shape[1], split=False)
    if features:  # the packed_features entry: (softcap, sink view) after the window bounds
        return cute.compile(kernel.packed_features, *args[:8], *features, *args[8:], stream, options=options)
    return cute.compile(kernel.packed, *args, stream, options=options)


# Split-key decoding from 2 splits on: an unsplit CTA of this family reads the cache at ~20 GB/s (H100, 64 CTAs:
# 1.3 TB/s), so halving the keys per CTA pays for the combine (docs/performance.md, session 18).
SPLIT_MIN_SPLITS = 2

DETERMINISTIC_UNSUPPORTED = (
    "the sm80 backward adds dQ (and GQA's dK/dV) with fp32 atomics in no fixed order, so it has no deterministic mode"
)
SPILL_FREE_MAX_HEAD_DIM = 128  # the contract: no register spills up to this head dim
_dump_root: Optional[str] = None


def _dump_dir() -> str:
    """A fresh directory for one compile's .ptx/.cubin, under a per-process root removed at exit."""
    global _dump_root
    if _dump_root is None:
        _dump_root = tempfile.mkdtemp(prefix="cute_flash_sm80_")
        atexit.register(shutil.rmtree, _dump_root, ignore_errors=True)
    return tempfile.mkdtemp(dir=_dump_root)


@dataclass
class CompiledForward:
    kernel: Callable  # the TVM-FFI launcher: (q, k, v, out, lse, softmax_scale, window_left, window_right)
    tile: FwdTileConfig
    ptx: str
    cubin: bytes
    tried: List[Dict[str, object]]  # every candidate compiled, with its stack frame (spill) bytes


def compile_forward(
    spec: AttentionSpec, target: str, extra_options: str = "", seqused: bool = False, split: bool = False
) -> CompiledForward:
    """Compiles the first tile candidate that ptxas fits in registers without spilling (see fwd_tile_candidates)."""
    candidates = fwd_tile_candidates(spec.head_dim, spec.head_dim_v, target)

    def build(tile: FwdTileConfig, options: str):
        return _build_forward(spec, tile, options, seqused, split)

    return compile_first_fitting(spec, candidates, build, target, extra_options)


def compile_first_fitting(
    spec: AttentionSpec, candidates: List[FwdTileConfig], build: Callable, target: str, extra_options: str = ""
) -> CompiledForward:
    """build(tile, options) for each candidate in turn; the first that ptxas compiles without spilling is kept.

    Spills are read from the cubin's stack frame size (the kernel has no local arrays, so any frame is spill space).
    Above SPILL_FREE_MAX_HEAD_DIM the first candidate is kept whatever it spills.
    """
    strict = max(spec.head_dim, spec.head_dim_v) <= SPILL_FREE_MAX_HEAD_DIM
    tried: List[Dict[str, object]] = []
    for i, tile in enumerate(candidates):
        keep = compile_cache.keep_artifacts_options(_dump_dir(), ptxas_report=False)
        compiled = build(tile, _options(target, tile, f"{keep} {extra_options}"))
        ptx, cubin = compiled.artifacts.PTX, compiled.artifacts.CUBIN
        frame = max((r.get("stack_frame_bytes", 0) for r in cubin_resources(cubin).values()), default=0)
        tried.append({**tile.as_dict(), "stack_frame_bytes": frame})
        if frame == 0 or not strict or i == len(candidates) - 1:
            return CompiledForward(compiled, tile, ptx, cubin, tried)
    raise AssertionError("unreachable: the last candidate always returns")


def check_runnable_target(target: str) -> None:
    """CuTe DSL only loads a kernel compiled for the arch it was imported for (CUTE_DSL_ARCH, else the GPU's own)."""
    dsl_arch = os.environ.get("CUTE_DSL_ARCH")
    if dsl_arch and dsl_arch != target:
        raise RuntimeError(
            f"CUTE_DSL_ARCH={dsl_arch} but this GPU runs {target} kernels; unset CUTE_DSL_ARCH (it is only for "
            f"cross-compiling without a GPU)"
        )


def _compile_runnable_forward(spec: AttentionSpec, target: str, seqused: bool = False, split: bool = False):
    check_runnable_target(target)
    return compile_forward(spec, target, seqused=seqused, split=split).kernel


def _options(target: str, tile: FwdTileConfig, extra: str = "") -> str:
    return compile_cache.compile_options(target, extra=f"--opt-level {tile.opt_level} {extra}".strip())


class _Backend:
    name = FAMILY
    cute_arch = "sm_80"
    varlen = True  # has packed-sequence kernels (forward_varlen / backward_varlen); see routing
    split_keys = True  # split-key decoding (arch/split_kv.py)

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
        return compile_cache.get_or_compile(key, lambda: _compile_runnable_forward(spec, target, split=split))

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
        target = compile_cache.runtime_target(q.device)
        seqused = seqs.seqused_k is not None
        key = (FAMILY, target, "fwd", spec, seqused)
        kernel = compile_cache.get_or_compile(key, lambda: _compile_runnable_forward(spec, target, seqused))
        launch_packed_forward(kernel, q, k, v, out, lse, seqs, problem, sink)

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

"""The sm90 entry point for the front end (see cute_flash.arch.base.ArchBackend).

Forward: `flash_fwd.Sm90FlashForward` (TMA + wgmma, warp-specialised ping-pong consumers), compiled once per
(target, spec, tile config) with symbolic shapes and launched through TVM-FFI on torch's current stream.
Backward: `backward.py` (TMA + wgmma, flash_bwd.Sm90FlashBackward), built for the head dims with a tile configuration
(tile_config.bwd_tile_config: d == dv in 64, 96, 128, 192, 256, and (192, 128)); every other fp16/bf16 call up to
256 runs the narrowest d == dv one at least as wide as its head dims on zero-padded operands (backward.kernel_dims,
arch/padded_head_dims.py), also after a forward of another family (its out / lse are taken as they are); soft-capping
and learnable sinks (spec.softcap, spec.sink) included (the cap: Problem.softcap; dsink: Grads.dsink).
FP8 (`spec.dtype == "fp8"`, forward only) is served by the `fp8` sub-package (`fp8.launch`; its kernel
`fp8/flash_fwd.py` is a subclass of the bf16 forward).
Packed sequences (`attention_varlen`): the forward's and the backward's packed builds (`build.compile_forward_packed`,
`build.compile_backward` with spec.varlen, entries `packed`; deterministic builds too).
KV cache (`spec.kvcache`, `attention_with_kvcache`: decoding and chunked prefill against a dense or paged cache) is
served by the `kvcache` sub-package (`kvcache.launch`; its kernel `kvcache/flash_fwd.py` is a subclass of the bf16
forward).
Soft-capping and learnable sinks (spec.softcap / spec.sink, fp16 / bf16): the forward builds' feature entries
(`features`, `packed_features`, common/entries.py) take the cap and the sink view (FwdTensors.sink); split-key
builds apply the cap and leave the sink to their combine (arch/split_kv.py).
"""

from __future__ import annotations

import tempfile
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ... import compile_cache
from ...spec import WIDE_SOFTCAP, AttentionSpec, ModsSpec
from ...validation import KvCacheProblem, PackedSeqs, Problem, VarlenProblem
from ..base import BackwardLauncher, BwdTensors, ForwardLauncher, FwdTensors, Grads, KernelArtifact, KvCacheTensors
from ..base import BoundForward, SplitForward, launch_packed_forward, launcher_through_forward, prepare_build
from ..base import BackendBase, launch_mods_forward
from .. import split_kv
from .tile_config import FwdTileConfig, budget_problem, fwd_tile_config, smem_bytes

FAMILY = "sm90"
# Head dims with a measured tile configuration (tile_config.py). head_dim and head_dim_v may differ, each one of
# these: the kernel's Q/K and V/O shared-memory layouts depend on one of the two only, and each is built (and tested
# on the GPU) at these widths.
SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)


def forward_unsupported_reason(spec: AttentionSpec) -> Optional[str]:
    if spec.dtype == "fp8":
        return _fp8().fp8_unsupported_reason(spec)
    if spec.dtype not in ("fp16", "bf16"):
        return f"the sm90 forward computes in fp16, bf16 or fp8, not {spec.dtype}"
    if spec.out_dtype != spec.dtype:
        return f"the sm90 forward writes out in its input dtype ({spec.dtype}), not {spec.out_dtype}"
    for name, d in (("head_dim", spec.head_dim), ("head_dim_v", spec.head_dim_v)):
        if d not in SUPPORTED_HEAD_DIMS:
            return f"the sm90 forward has tile configurations for head dims {SUPPORTED_HEAD_DIMS}, not {name} {d}"
    if spec.mask not in ("none", "causal", "local"):
        return f"unknown mask kind {spec.mask!r}"
    return budget_problem(fwd_tile_config(spec), spec.head_dim, spec.head_dim_v)


def _mods_unsupported_reason(spec: ModsSpec, backward: bool) -> Optional[str]:
    """score_mod / mask_mod: the dense fp16 / bf16 forward (flash_fwd_mods.py) and backward (flash_bwd_mods.py) at
    this family's head dims."""
    if spec.kvcache:
        return "score_mod / mask_mod have no KV-cache kernels"
    if spec.varlen and spec.block_sparse:
        return "score_mod / mask_mod over packed sequences take no block mask"
    if spec.softcap or spec.sink:
        return "score_mod / mask_mod do not combine with softcap or sinks yet (write softcap as a score_mod)"
    if spec.dtype == "fp8":
        return "score_mod / mask_mod have no FP8 kernels"
    if backward:
        return _bwd().backward_unsupported_reason(spec)
    return forward_unsupported_reason(spec)


def _fp8():
    from .fp8 import launch  # the FP8 forward (its own kernel subclass and tile configuration)

    return launch


def _kvcache():
    from .kvcache import launch  # the KV-cache forward (its own kernel subclass and tile configurations)

    return launch


def _bwd():
    from . import backward  # the sm90 backward (imports torch only; cutlass when a kernel is built)

    return backward


def _build_forward(
    spec: AttentionSpec, cfg: FwdTileConfig, target: str, extra_options: str = "", seqused=False, split=False
):
    from . import build  # imports cutlass: only when a kernel is needed

    if spec.varlen:
        return build.compile_forward_packed(spec, cfg, target, extra_options, seqused)
    if split:
        return build.compile_forward_split(spec, cfg, target, extra_options)
    return build.compile_forward(spec, cfg, target, extra_options)


def split_tile_config(spec: AttentionSpec) -> FwdTileConfig:
    """The tile configuration of `spec`'s split-key build: the forward's. One 64-row consumer, 3 stages or 64-key
    tiles measured at most 0.3-2% faster at batch 1-4 (H100, d128 decoding): not worth a second build. A study may
    replace this function."""
    return fwd_tile_config(spec)


# (spec, target, variant) -> compiled forward; variant: "" (dense), "seqused_k" (packed, reading seqused_k), "split"
# (split keys, arch/split_kv.py), "combine" (its combine kernel, shared by the families: split_kv.combine_kernel)
_forward_kernels: Dict[tuple, object] = compile_cache.memo()


class _Backend(BackendBase):
    name = FAMILY
    cute_arch = "sm_90a"
    varlen = True  # has packed-sequence kernels (forward_varlen / backward_varlen); see routing
    kvcache = True  # has a KV-cache forward (forward_kvcache, attention_with_kvcache); see routing
    split_keys = True  # split-key decoding (arch/split_kv.py)

    def fp8_kv_scale_block(self, spec: AttentionSpec) -> int:
        return _fp8().kv_scale_block(spec.head_dim, spec.head_dim_v)

    def backward_head_dims(self, spec: AttentionSpec) -> Tuple[int, int]:
        return _bwd().kernel_dims(spec)

    def unsupported_reason(self, spec: AttentionSpec, backward: bool, deterministic: bool = False) -> Optional[str]:
        if isinstance(spec, ModsSpec):
            return _mods_unsupported_reason(spec, backward)
        if spec.kvcache:
            if backward:
                return "the KV-cache forward (attention_with_kvcache) has no backward"
            from .kvcache.tile_config import kvcache_unsupported_reason

            return kvcache_unsupported_reason(spec)
        if backward:
            # The backward's own head dims bound it, not the forward's: the router picks each direction's family
            # separately (d72: the sm80 forward, then this backward on operands zero-padded to d96).
            if spec.dtype == "fp8":
                return "the sm90 FP8 path is forward-only: there is no FP8 backward"
            return _bwd().backward_unsupported_reason(spec)  # every configuration has a deterministic build
        reason = forward_unsupported_reason(spec)
        if reason is None and spec.varlen and spec.dtype == "fp8":
            reason = "the sm90 FP8 forward has no varlen (packed sequences) build"
        return reason

    def _forward_kernel(self, spec: AttentionSpec, target: str, variant: str = ""):
        """The compiled forward of `spec` for `target`; variant: "" dense (packed for spec.varlen), "seqused_k" the
        packed build that reads seqused_k, "split" the split-key build and "combine" its combine kernel
        (arch/split_kv.py). A spec this family does not serve raises NotImplementedError when its kernel would be built
        (a warm call does not check again: the router has)."""
        kernel = _forward_kernels.get((spec, target, variant))
        if kernel is not None:  # a warm call: one lookup, no tile configuration or cache key built again
            return kernel
        if variant == "combine":
            kernel = _forward_kernels[(spec, target, variant)] = split_kv.combine_kernel(spec, target)
            return kernel
        cfg = split_tile_config(spec) if variant == "split" else fwd_tile_config(spec)
        key = (FAMILY, target, "fwd", spec, cfg) + ((variant,) if variant else ())

        def build():
            reason = self.unsupported_reason(spec, backward=False)
            if reason is not None:
                raise NotImplementedError(reason)
            return _build_forward(spec, cfg, target, "", variant == "seqused_k", variant == "split")

        kernel = _forward_kernels[(spec, target, variant)] = compile_cache.get_or_compile(key, build)
        return kernel

    def forward_mods(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        problem: Problem, tables: List[torch.Tensor], blocks: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        seqs: Optional[PackedSeqs] = None,
    ) -> None:  # fmt: skip
        """The forward of a ModsSpec (score_mod / mask_mod, flash_fwd_mods.py), block-sparse with spec.block_sparse
        (blocks: the lists of `mods_key_tiles`' tiles), packed with spec.varlen (seqs; tensors as forward_varlen's)."""
        spec = problem.spec
        reason = self.unsupported_reason(spec, backward=False) if isinstance(spec, ModsSpec) else "needs a ModsSpec"
        if reason is not None:
            raise NotImplementedError(reason)
        if spec.block_sparse != (blocks is not None) or spec.varlen != (seqs is not None):
            raise ValueError("a block-sparse (packed) build takes the block lists (the sequences), and only it")
        variant = "seqused_k" if seqs is not None and seqs.seqused_k is not None else ""
        kernel = self._forward_kernel(spec, compile_cache.runtime_target(q.device), variant)
        launch_mods_forward(kernel, q, k, v, out, lse, problem, tables, blocks, seqs)

    def backward_mods(
        self, t: BwdTensors, grads: Grads, problem: Problem, tables: List[torch.Tensor], blocks: Optional[tuple] = None,
        seqs: Optional[PackedSeqs] = None,
    ) -> None:  # fmt: skip
        """The backward of `forward_mods` (flash_bwd_mods.py), with the same tables; block-sparse with
        spec.block_sparse (blocks: the lists by key tile of `mods_query_tiles`' tiles); packed with seqs."""
        spec = problem.spec
        reason = self.unsupported_reason(spec, backward=True) if isinstance(spec, ModsSpec) else "needs a ModsSpec"
        if reason is not None:
            raise NotImplementedError(reason)
        if seqs is not None:
            assert blocks is None, "packed builds take no block lists"
            _bwd().run_backward_varlen(t, grads, seqs, problem, tables=tuple(tables))
            return
        _bwd().backward_launcher(problem, t.q.device, tables=tuple(tables), blocks=blocks)(t, grads)

    def mods_query_tiles(self, spec: AttentionSpec) -> Optional[Tuple[int, int]]:
        return _bwd().mods_query_tiles(spec)

    def mods_key_tiles(self, spec: AttentionSpec) -> Optional[Tuple[int, int]]:
        cfg = fwd_tile_config(spec)
        return cfg.tile_m, cfg.tile_n

    def forward_launcher(self, problem: Problem, device: torch.device) -> ForwardLauncher:
        spec = problem.spec
        if spec.dtype == "fp8":
            return launcher_through_forward(self, problem)
        target = compile_cache.runtime_target(device)
        cfg = split_tile_config(spec)
        splits = split_kv.num_splits(problem, cfg.tile_m, cfg.tile_n, compile_cache.sm_count(device))
        if splits > 1:
            split = self._forward_kernel(spec, target, "split")
            return SplitForward(split, self._forward_kernel(spec, target, "combine"), problem, splits)
        return BoundForward(self._forward_kernel(spec, target), problem)

    def forward(self, t: FwdTensors, problem: Problem, descale: Optional[Dict[str, torch.Tensor]] = None) -> None:
        q, k, v, out, lse = t[:5]
        spec = problem.spec
        if spec.dtype == "fp8":
            _fp8().run_forward_fp8(
                q, k, v, out, lse, descale=descale, spec=spec, softmax_scale=problem.softmax_scale, mask=problem.mask
            )
            return
        if descale is not None:
            raise NotImplementedError("descale factors belong to the FP8 path; this call computes in " + spec.dtype)
        sink = t[5] if len(t) > 5 else None  # FwdTensors.sink (callers may pass the plain 5-tuple)
        _check_features(problem, sink)
        self.forward_launcher(problem, q.device)(q, k, v, out, lse, sink)

    def forward_varlen(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        seqs: PackedSeqs, problem: VarlenProblem, sink: Optional[torch.Tensor] = None,
    ) -> None:  # fmt: skip
        """Packed forward: q (total_q, h, d), k / v (total_k, h_kv, d / dv), out (total_q, h, dv), lse (h, total_q);
        sink (spec.sink): the (total_q, h) fp32 view, read at [row within its sequence, head]."""
        _check_features(problem, sink)
        variant = "seqused_k" if seqs.seqused_k is not None else ""
        kernel = self._forward_kernel(problem.spec, compile_cache.runtime_target(q.device), variant)
        launch_packed_forward(kernel, q, k, v, out, lse, seqs, problem, sink)

    def kvcache_splits(self, problem: KvCacheProblem, sm_count: int) -> int:
        from .kvcache.tile_config import kvcache_splits

        return kvcache_splits(problem, sm_count)

    def forward_kvcache(self, t: KvCacheTensors, problem: KvCacheProblem, num_splits: int) -> None:
        _kvcache().run_forward_kvcache(t, problem, num_splits)

    def kvcache_launcher(
        self, problem: KvCacheProblem, device: torch.device, num_splits: int
    ) -> Callable[[KvCacheTensors], None]:
        return _kvcache().KvCacheLauncher(problem, device, num_splits)

    def backward_launcher(
        self, problem: Problem, device: torch.device, deterministic: bool = False
    ) -> BackwardLauncher:
        return _bwd().backward_launcher(problem, device, deterministic, checked=False)

    def backward(self, t: BwdTensors, grads: Grads, problem: Problem, deterministic: bool = False) -> None:
        _bwd().run_backward(t, grads, problem, deterministic)

    def backward_varlen(
        self, t: BwdTensors, grads: Grads, seqs: PackedSeqs, problem: VarlenProblem, deterministic: bool = False
    ) -> None:
        """Packed backward: tensors as in forward_varlen, dq / dk / dv shaped like q / k / v."""
        _bwd().run_backward_varlen(t, grads, seqs, problem, deterministic)

    def warm(
        self, spec: AttentionSpec, target: str, *, backward: bool, gqa: bool = False, deterministic: bool = False
    ) -> None:
        prepare_build(self, spec, target, backward=backward, deterministic=deterministic, warming=True)
        if spec.kvcache:
            _kvcache().warm_kvcache(spec, target)
            return
        if backward:
            _bwd().warm_backward(spec, target, gqa=gqa, deterministic=deterministic)
        else:
            self._forward_kernel(spec, target)
            if split_kv.splittable(spec):  # decoding calls of this spec run the split build and its combine
                self._forward_kernel(spec, target, "split")
                self._forward_kernel(spec, target, "combine")

    def compile_artifacts(self, spec: AttentionSpec, backward: bool, target: str) -> List[KernelArtifact]:
        prepare_build(self, spec, target, backward=backward)
        if spec.dtype == "fp8":
            return _fp8().compile_fp8_artifacts(spec, target)
        if spec.kvcache:
            return _kvcache().compile_kvcache_artifacts(spec, target)
        artifacts = []
        # The forward where this family has one: a backward-only spec (d72: the sm80 forward's) builds its backward.
        if forward_unsupported_reason(spec) is None:
            cfg = fwd_tile_config(spec)
            with tempfile.TemporaryDirectory(prefix="cute_flash_sm90_") as dump:
                extra = compile_cache.keep_artifacts_options(dump)
                compiled = _build_forward(spec, cfg, target, extra)
                artifacts.append(
                    KernelArtifact(
                        kernel="fwd",
                        ptx=compiled.artifacts.PTX,
                        cubin=compiled.artifacts.CUBIN,
                        config={
                            **cfg.as_dict(),
                            "shared_bytes": smem_bytes(cfg, spec.head_dim, spec.head_dim_v),
                            "threads": cfg.num_threads,
                        },
                    )
                )
        if backward:
            artifacts += _bwd().compile_backward_artifacts(spec, target)
        return artifacts


def _check_features(problem, sink: Optional[torch.Tensor]) -> None:
    """The runtime values a build for spec.softcap / spec.sink reads: a cap > 0 and an fp32 sink view (the front end
    validates them; a kernel handed none would fail obscurely at launch)."""
    spec = problem.spec
    if spec.softcap and not problem.softcap > 0:
        raise ValueError(f"a soft-capping build needs softcap > 0, got {problem.softcap}")
    if spec.softcap_wide != (problem.softcap > WIDE_SOFTCAP):
        raise ValueError(
            f"softcap {problem.softcap} on a build with softcap_wide={spec.softcap_wide} (spec.softcap_fields)"
        )
    if spec.sink and (sink is None or sink.dtype != torch.float32 or sink.dim() != 2):
        raise ValueError("a build with learnable sinks needs the (rows, h) float32 sink view (arch/base.FwdTensors)")
    if not spec.sink and sink is not None:
        raise ValueError("sink logits given to a build without learnable sinks (spec.sink is False)")


BACKEND = _Backend()

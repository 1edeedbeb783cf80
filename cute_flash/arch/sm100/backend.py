"""The sm100 entry point for the front end (see cute_flash.arch.base.ArchBackend): the forward (1-CTA and 2-CTA) and
the backward (backward.py)."""

from __future__ import annotations

import math
import tempfile
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ... import compile_cache
from ...census import read_artifacts
from ...spec import AttentionSpec, ModsSpec
from ...validation import PackedSeqs, Problem, VarlenProblem, kernel_view
from ..base import BackwardLauncher, BwdTensors, ForwardLauncher, FwdTensors, Grads, KernelArtifact
from ..base import launch_packed_forward, launcher_through_forward, prepare_build
from ..base import BackendBase
from ...common.dsl_types import dsl_dtype
from ...common.fake_tensors import fake_f32, fake_feature_args, fake_operand
from . import tile_config as cfgmod


def _kernel_role(cfg: cfgmod.FwdTileConfig) -> str:
    return "fwd_2cta" if cfg.use_2cta else "fwd"


def _build(
    spec: AttentionSpec, cfg: cfgmod.FwdTileConfig, target: str, extra_options: str = "", seqused: bool = False
) -> Callable:
    """Compiles the forward kernel with fake tensors: batch, seqlens and head counts symbolic, strides symbolic;
    seqused (packed specs): the build reading seqused_k."""
    return _build_with_kernel(spec, cfg, target, extra_options, seqused)[0]


def _build_packed(spec: AttentionSpec, cfg: cfgmod.FwdTileConfig, target: str, extra_options: str, seqused: bool):
    """The packed forward (spec.varlen; arch/base.launch_packed_forward's convention): q (total_q, h, d), k / v
    (total_k, h_kv, d), out (total_q, h, dv), lse (h, total_q), cu_seqlens, seqused_k (or None), max_seqlen_q."""
    import cutlass
    import cutlass.cute as cute

    from ...common.fake_tensors import fake_cu_seqlens
    from .flash_fwd import Sm100FlashForward

    dt = dsl_dtype(spec.dtype)
    tq, tk, h, hk, n = (cute.sym_int() for _ in range(5))
    q, o = fake_operand(dt, (tq, h, spec.head_dim)), fake_operand(dt, (tq, h, spec.head_dim_v))
    k, v = fake_operand(dt, (tk, hk, spec.head_dim)), fake_operand(dt, (tk, hk, spec.head_dim_v))
    lse = fake_f32((h, tq))
    seqs = (fake_cu_seqlens(n), fake_cu_seqlens(n), fake_cu_seqlens(cute.sym_int()) if seqused else None)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = compile_cache.compile_options(target, extra=f"--opt-level {cfg.opt_level} {extra_options}".strip())
    kernel = Sm100FlashForward(spec, cfg)
    scalars = cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0)
    if spec.softcap or spec.sink:
        entry, features = kernel.packed_features, fake_feature_args(spec.sink)
    else:
        entry, features = kernel.packed, ()
    args = (q, k, v, o, lse, *scalars, *features, *seqs, cutlass.Int32(1))
    return cute.compile(entry, *args, stream, options=options), kernel


def _build_with_kernel(
    spec: AttentionSpec, cfg: cfgmod.FwdTileConfig, target: str, extra_options: str = "", seqused: bool = False
):
    import cutlass
    import cutlass.cute as cute

    from .flash_fwd import Sm100FlashForward

    in_dtype = dsl_dtype(spec.dtype)
    out_dtype = dsl_dtype(spec.out_dtype)
    b, sq, sk, h, hk = (cute.sym_int() for _ in range(5))

    strided = fake_operand  # last dim contiguous, the others multiples of 16 bytes (the front end; TMA needs it)
    if spec.varlen:
        return _build_packed(spec, cfg, target, extra_options, seqused)

    q = strided(in_dtype, (b, sq, h, spec.head_dim))
    k = strided(in_dtype, (b, sk, hk, spec.head_dim))
    if spec.dtype == "fp8":
        # The front end's fp8 V: transposed (b, h_kv, dv, sk_pad), keys contiguous (cute_flash.fp8.prepare).
        v = strided(in_dtype, (b, hk, spec.head_dim_v, cute.sym_int()))
    else:
        v = strided(in_dtype, (b, sk, hk, spec.head_dim_v))
    o = strided(out_dtype, (b, sq, h, spec.head_dim_v))

    fp32 = fake_f32

    lse = fp32((b, h, sq))
    descale = (None, None, None)
    if spec.dtype == "fp8":
        # Block scales: q per 64 query rows, k and v per 128-key block (config.FP8_*).
        descale = (fp32((b, h, cute.sym_int())), fp32((b, hk, cute.sym_int())), fp32((b, hk, cute.sym_int())))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = compile_cache.compile_options(target, extra=f"--opt-level {cfg.opt_level} {extra_options}".strip())
    kernel = Sm100FlashForward(spec, cfg)
    scalars = cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0)
    if spec.softcap or spec.sink:  # the feature entry: softcap and the sink view after the window bounds
        features = fake_feature_args(spec.sink)
        args = (q, k, v, o, lse, *scalars, *features, *descale)
        compiled = cute.compile(kernel.features, *args, stream, options=options)
    else:
        compiled = cute.compile(kernel, q, k, v, o, lse, *scalars, *descale, stream, options=options)
    return compiled, kernel


def _forward_kernel(spec: AttentionSpec, cfg: cfgmod.FwdTileConfig, target: str, seqused: bool = False) -> Callable:
    """The compiled forward of `spec` (packed specs: with or without seqused_k)."""
    key = ("sm100", target, _kernel_role(cfg), spec, cfg) + (("seqused_k",) if seqused else ())
    return compile_cache.get_or_compile(key, lambda: _build(spec, cfg, target, "", seqused))


def _fp8_args(spec: AttentionSpec, q, k, v, descale: Optional[Dict[str, torch.Tensor]]):
    """Checks the front end's fp8 contract (cute_flash.fp8.prepare.Fp8Inputs) and returns the kernel's descales.

    q (b, sq, h, d) and k (b, sk, h_kv, d) e4m3; v transposed (b, h_kv, dv, sk_pad >= sk) e4m3; float32 descales
    q (b, h, ceil(sq / 64)), k and v (b, h_kv, ceil(sk / 128)).
    """
    if spec.dtype != "fp8":
        if descale is not None:
            raise ValueError(f"descale factors are only meaningful for fp8 inputs, not {spec.dtype}")
        return (None, None, None)
    b, sq, h, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fp8 {name} must be torch.float8_e4m3fn, got {t.dtype}")
    if v.dim() != 4 or tuple(v.shape[:3]) != (b, hkv, spec.head_dim_v) or v.shape[3] < sk:
        raise ValueError(
            f"fp8 v must be transposed (batch, nheads_kv, head_dim_v, seqlen_k padded) = ({b}, {hkv}, "
            f"{spec.head_dim_v}, >= {sk}), got {tuple(v.shape)}"
        )
    if descale is None or any(name not in descale for name in ("q", "k", "v")):
        raise ValueError("the fp8 path needs descale tensors {'q', 'k', 'v'} (see cute_flash.fp8.prepare)")
    expected = {
        "q": (b, h, -(-sq // cfgmod.FP8_Q_SCALE_ROWS)),
        "k": (b, hkv, -(-sk // cfgmod.FP8_KV_SCALE_KEYS)),
        "v": (b, hkv, -(-sk // cfgmod.FP8_KV_SCALE_KEYS)),
    }
    out = []
    for name, shape in expected.items():
        t = descale[name]
        if tuple(t.shape) != shape or t.dtype != torch.float32:
            raise NotImplementedError(
                f"descale[{name!r}] is {t.dtype} {tuple(t.shape)}; the sm100 fp8 kernel reads float32 {shape} "
                f"(one factor per {cfgmod.FP8_Q_SCALE_ROWS} query rows for q, per {cfgmod.FP8_KV_SCALE_KEYS} keys "
                f"for k and v)"
            )
        out.append(t)
    return tuple(out)


class _Backend(BackendBase):
    name = "sm100"
    cute_arch = "sm_100a"
    split_keys = False
    varlen = True  # packed-sequence kernels (forward_varlen, backward_varlen)

    def fp8_kv_scale_block(self, spec: AttentionSpec) -> int:
        return cfgmod.FP8_KV_SCALE_KEYS

    def unsupported_reason(self, spec: AttentionSpec, backward: bool, deterministic: bool = False) -> Optional[str]:
        if isinstance(spec, ModsSpec):
            return "no score_mod / mask_mod kernel in this family yet (the sm80 family's serve them)"
        if backward:
            return _bwd().backward_unsupported_reason(spec)  # (every build has a deterministic twin)
        return cfgmod.unsupported_reason(spec)

    def forward_launcher(self, problem: Problem, device: torch.device) -> ForwardLauncher:
        return launcher_through_forward(self, problem)

    def forward(self, t: FwdTensors, problem: Problem, descale: Optional[Dict[str, torch.Tensor]] = None) -> None:
        q, k, v, out, lse = t[:5]
        spec, softmax_scale, mask = problem.spec, problem.softmax_scale, problem.mask
        reason = self.unsupported_reason(spec, backward=False)
        if reason is not None:
            raise NotImplementedError(reason)
        _check_capability(q.device)
        # softmax_scale >= 0 (validation). 0 works like any other: the kernel clamps the exponent's factor
        # softmax_scale * log2(e) into [FLT_MIN, FLT_MAX] (flash_fwd.py), so masked -inf scores never meet a 0.
        descale_args = _fp8_args(spec, q, k, v, descale)
        cfg = cfgmod.choose_config(spec, seqlen_q=q.shape[1])
        target = compile_cache.runtime_target(q.device)
        compiled = _forward_kernel(spec, cfg, target)
        # Builds for spec.softcap / spec.sink take the cap and the (rows, h) fp32 sink view after the window bounds.
        sink = t[5] if len(t) > 5 else None  # FwdTensors.sink (callers may pass the plain 5-tuple)
        features = (float(problem.softcap), sink) if spec.softcap or spec.sink else ()
        if spec.sink and (sink is None or sink.dtype != torch.float32):
            raise ValueError("a build with learnable sinks needs the (rows, h) float32 sink view (FwdTensors.sink)")
        compiled(
            *(kernel_view(t, copy=False, name=n) for n, t in (("q", q), ("k", k), ("v", v), ("out", out))),
            lse,
            softmax_scale * math.log2(math.e),
            int(mask.left),
            int(mask.right),
            *features,
            *descale_args,
        )

    def forward_varlen(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        seqs: PackedSeqs, problem: VarlenProblem, sink: Optional[torch.Tensor] = None,
    ) -> None:  # fmt: skip
        """Packed forward: q (total_q, h, d), k / v (total_k, h_kv, d), out (total_q, h, dv), lse (h, total_q); sink
        (spec.sink): the (total_q, h) fp32 view, read at [row within its sequence, head]. 1-CTA (tile_config)."""
        spec = problem.spec
        reason = self.unsupported_reason(spec, backward=False)
        if reason is not None:
            raise NotImplementedError(reason)
        _check_capability(q.device)
        if spec.sink and (sink is None or sink.dtype != torch.float32):
            raise ValueError("a build with learnable sinks needs the (rows, h) float32 sink view (FwdTensors.sink)")
        cfg = cfgmod.make_config(spec, use_2cta=False)
        kernel = _forward_kernel(spec, cfg, compile_cache.runtime_target(q.device), seqs.seqused_k is not None)
        launch_packed_forward(kernel, q, k, v, out, lse, seqs, problem, sink)

    def backward_head_dims(self, spec: AttentionSpec) -> Tuple[int, int]:
        width = cfgmod.bwd_kernel_dim(spec)  # (narrower calls run the kernel on zero-padded operands)
        return width, width

    def backward_launcher(
        self, problem: Problem, device: torch.device, deterministic: bool = False
    ) -> BackwardLauncher:
        _check_backward(problem, device)
        return _bwd().backward_launcher(problem, device, deterministic, checked=False)

    def backward(self, t: BwdTensors, grads: Grads, problem: Problem, deterministic: bool = False) -> None:
        _check_backward(problem, t.q.device)
        _bwd().backward_launcher(problem, t.q.device, deterministic)(t, grads)

    def backward_varlen(
        self, t: BwdTensors, grads: Grads, seqs: PackedSeqs, problem: VarlenProblem, deterministic: bool = False
    ) -> None:
        """Packed backward: tensors as in forward_varlen, dq / dk / dv shaped like q / k / v."""
        _check_backward(problem, t.q.device)
        _bwd().run_backward_varlen(t, grads, seqs, problem, deterministic)

    def warm(
        self, spec: AttentionSpec, target: str, *, backward: bool, gqa: bool = False, deterministic: bool = False
    ) -> None:
        prepare_build(self, spec, target, backward=backward, deterministic=deterministic, warming=True)
        if backward:
            _bwd().warm_backward(spec, target, deterministic)
            return
        for cfg in cfgmod.configs_for(spec):  # the 1-CTA and 2-CTA kernels: choose_config picks by seqlen_q
            _forward_kernel(spec, cfg, target)

    def compile_artifacts(self, spec: AttentionSpec, backward: bool, target: str) -> List[KernelArtifact]:
        prepare_build(self, spec, target, backward=backward)
        artifacts = []
        # The forward where this family has one: a backward-only spec (d32: the sm80 forward's) builds its backward.
        forward_configs = cfgmod.configs_for(spec) if cfgmod.unsupported_reason(spec) is None else []
        for cfg in forward_configs:
            with tempfile.TemporaryDirectory(prefix="cute_flash_sm100_") as dump:
                # remarks{ptx} makes ptxas print registers and spill bytes (the CLI parses them from stderr).
                extra = compile_cache.keep_artifacts_options(dump)
                compiled, kernel = _build_with_kernel(spec, cfg, target, extra_options=extra)
                ptx, cubin = read_artifacts(compiled)
            artifacts.append(
                KernelArtifact(
                    kernel=_kernel_role(cfg),
                    ptx=ptx,
                    cubin=cubin,
                    config={
                        "cta_group": cfg.cta_group,
                        "cluster": [cfg.cta_group, 1, 1],
                        "tile_m_per_cta": cfgmod.Q_STAGES * cfgmod.M_BLOCK,
                        "tile_n": cfgmod.N_BLOCK,
                        "kv_stages": cfg.kv_stages,
                        "regs_softmax/correction/other": [cfg.regs_softmax, cfg.regs_correction, cfg.regs_other],
                        "opt_level": cfg.opt_level,
                        "threads": 512,
                        "shared_bytes": kernel.smem_bytes,
                        "used_when": "seqlen_q > 256"
                        if cfg.use_2cta
                        else ("seqlen_q <= 256" if cfgmod.two_cta_eligible(spec) else "always"),
                    },
                )
            )
        if spec.dtype == "fp8":
            artifacts.extend(_fp8_prepass_artifacts(spec, target))
        if backward:
            artifacts.extend(_bwd().compile_backward_artifacts(spec, target))
        return artifacts


def _bwd():
    from . import backward

    return backward


def _check_capability(device: torch.device) -> None:
    capability = torch.cuda.get_device_capability(device)
    if capability[0] != 10:
        raise NotImplementedError(
            f"the sm100 kernels need a compute capability 10.x GPU (tcgen05, tensor memory); this one is "
            f"{capability[0]}.{capability[1]}. CUTE_FLASH_ARCH=sm100 elsewhere can only cross-compile: "
            f"python -m cute_flash compile --arch sm100 ..."
        )


def _check_backward(problem: Problem, device: torch.device) -> None:
    reason = _bwd().backward_unsupported_reason(problem.spec)
    if reason is not None:
        raise NotImplementedError(reason)
    _check_capability(device)


def _fp8_prepass_artifacts(spec: AttentionSpec, target: str) -> List[KernelArtifact]:
    """The front end's fp16/bf16 -> e4m3 pre-pass, built for this target: on a B200 `attention(..., dtype="fp8")`
    runs it before the forward kernel."""
    from ...fp8.prepass_kernel import prepass_artifacts

    return prepass_artifacts(spec, target, cfgmod.FP8_Q_SCALE_ROWS, cfgmod.FP8_KV_SCALE_KEYS)


BACKEND = _Backend()

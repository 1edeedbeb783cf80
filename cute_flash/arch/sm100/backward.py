"""The sm100 backward pass: preprocess, main kernel, dQ conversion (see flash_bwd.py for the algorithm).

    1. preprocess:  D = rowsum(dO * O) and lse_log2, (b, h, sq padded to 128) fp32 — the sm80 family's kernel,
                    built for sm_100a (padding and empty rows inert: P = 0 there)
    2. main:        per key tile and KV head: dK, dV in TMEM over every query head of the group (no GQA partial
                    sums), written in the input dtype; each query tile's dQ added by a TMA reduce-add into
                    (b, sq_padded, h, d) fp32
    3. conversion:  dq = softmax_scale * dQ sums in the input dtype (the sm80 family's accumulator conversion)

Packed sequences (`run_backward_varlen`): the same three steps, the statistics and dQ sums in padded rows (sequence b
from row cu_seqlens[b] + b * 128 rounded down to a multiple of 128, common/packed.py), the sm80 family's packed
preprocess and conversion; one CTA row per sequence (grid y: KV heads, z: sequences); keys past seqused_k[b] get
zero gradients.

Head dims below a built kernel's (BWD_HEAD_DIMS: 64, 128) run it on zero-padded operands (arch/padded_head_dims.py):
d32 the d64 kernel, d96 the d128 one. A learnable sink changes no kernel (it is in the LSE; dsink comes from lse and
D on the host, arch/base.sink_grad); soft-capping changes the main kernel (its `features` entry).

No Blackwell GPU has run these kernels: they are verified by cross-compiling (zero spills, the instruction census
of tests/test_sm100_backward.py) and by CPU checks of their shared-memory views; docs/status.md says so.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from typing import Callable, List, Optional

import torch

from ... import compile_cache
from ...kernel_layout import round_up
from ...spec import AttentionSpec, ModsSpec
from ...common.packed import PRE_POST_ROWS, padded_rows
from ...validation import PackedSeqs, Problem, VarlenProblem
from ..base import BwdTensors, Grads, KernelArtifact, fold_lse_grad, fold_lse_grad_packed, sink_grad
from ..padded_head_dims import padded_launcher, widened_problem, widened_spec
from . import tile_config as cfgmod

FAMILY = "sm100"
ROW_MULTIPLE = cfgmod.M_BLOCK  # the statistics and dQ sums hold whole query tiles (the preprocess writes 64-row blocks)
PACKED_PAD = 128  # padded rows of the packed statistics and dQ sums: flash_bwd.PACKED_PAD (common/packed.packed_pads)


def backward_unsupported_reason(spec: AttentionSpec) -> Optional[str]:
    """None where the sm100 backward serves `spec` (every mask, soft-capping and learnable sinks included; each has a
    deterministic build)."""
    if isinstance(spec, ModsSpec):
        return "no score_mod / mask_mod kernel in this family yet"
    return cfgmod.bwd_unsupported_reason(spec)


def kernel_spec(spec: AttentionSpec) -> AttentionSpec:
    """The spec the main kernel serving `spec` is built for: at its kernel head dim, without what it does not read
    (the sink, in the LSE, and the cap's range)."""
    width = cfgmod.bwd_kernel_dim(spec)
    spec = widened_spec(spec, (width, width))
    return dataclasses.replace(spec, sink=False, softcap_wide=False) if spec.sink or spec.softcap_wide else spec


@functools.lru_cache(maxsize=None)
def _sm80_backward():
    """The sm80 backward module, whose preprocess and accumulator conversion this backward runs."""
    from ..sm80 import backward

    return backward


def _build_main(
    spec: AttentionSpec, cfg: cfgmod.BwdTileConfig, target: str, deterministic: bool, seqused: bool = False,
    extra: str = "",
):  # fmt: skip
    """Compiles the main kernel with fake tensors: batch, sequence lengths and head counts symbolic; deterministic:
    the build that adds dQ in key-tile order behind semaphores; seqused (packed builds): the one reading
    seqused_k."""
    import cutlass
    import cutlass.cute as cute

    from ...common.dsl_types import dsl_dtype
    from ...common.fake_tensors import fake_cu_seqlens, fake_f32, fake_operand, fake_tensor
    from .flash_bwd import Sm100FlashBackward

    dt, d = dsl_dtype(spec.dtype), spec.head_dim
    b, sq, sk, h, hk = (cute.sym_int() for _ in range(5))
    if spec.varlen:  # packed: one batch entry, total rows; the statistics and dQ sums in padded rows
        b = 1
    sq_pad = cute.sym_int(divisibility=ROW_MULTIPLE)
    q, dout = fake_operand(dt, (b, sq, h, d)), fake_operand(dt, (b, sq, h, d))
    k, v, dk, dv = (fake_operand(dt, (b, sk, hk, d)) for _ in range(4))
    # Rows of whole tiles (torch.empty of (b, h, sq_pad)): 16-byte aligned, strides of whole tiles (the TMA needs it).
    lse_log2, dpsum = fake_f32((b, h, sq_pad), ROW_MULTIPLE, 16), fake_f32((b, h, sq_pad), ROW_MULTIPLE, 16)
    dq_accum = fake_tensor(cutlass.Float32, (b, sq_pad, h, d), 4, 16)
    semaphores = fake_tensor(cutlass.Int32, (b, h, cute.sym_int()), 1, 4) if deterministic else None
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = compile_cache.compile_options(target, extra=f"--opt-level {cfg.opt_level} {extra}".strip())
    kernel = Sm100FlashBackward(spec, cfg, deterministic)
    scalars = (cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0))
    args = (q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, semaphores, *scalars)
    softcap = (cutlass.Float32(1.0),) if spec.softcap else ()
    if spec.varlen:
        n = cute.sym_int()
        seqs = (fake_cu_seqlens(n), fake_cu_seqlens(n), fake_cu_seqlens(cute.sym_int()) if seqused else None)
        entry = kernel.packed_features if spec.softcap else kernel.packed
        return cute.compile(entry, *args, *softcap, *seqs, cutlass.Int32(1), stream, options=options), kernel
    entry = kernel.features if spec.softcap else kernel
    return cute.compile(entry, *args, *softcap, stream, options=options), kernel


def main_role(deterministic: bool, seqused: bool = False) -> str:
    """The main kernel's role name: deterministic, reading seqused_k (packed specs only)."""
    return "bwd" + ("_seqused" if seqused else "") + ("_det" if deterministic else "")


def _main_kernel(spec: AttentionSpec, target: str, deterministic: bool, seqused: bool = False) -> Callable:
    """The compiled main kernel of `spec` (a kernel_spec) for `target`."""
    assert spec.varlen or not seqused, "seqused_k is a packed-sequence argument"
    cfg = cfgmod.bwd_config(spec)
    key = (FAMILY, target, main_role(deterministic, seqused), spec, cfg)
    compile_cache.ensure_cute_dsl_arch(target)
    return compile_cache.get_or_compile(key, lambda: _build_main(spec, cfg, target, deterministic, seqused)[0])


def _plain(spec: AttentionSpec) -> AttentionSpec:
    """`spec` for the sm80 family's preprocess and conversion, which no mask or feature changes."""
    spec = _sm80_backward().plain_spec(spec)
    return dataclasses.replace(spec, softcap=False, softcap_wide=False, sink=False)


def backward_launcher(
    problem: Problem, device, deterministic: bool = False, checked: bool = True
) -> Callable[[BwdTensors, Grads], None]:
    """The backward of one dense `problem` on `device` as launch(t, grads), with the kernels, the buffers' shapes and
    the scalars settled once. deterministic: dQ summed in key-tile order (bitwise-reproducible gradients; dK and dV
    always are). checked: every tensor goes through kernel_view's check (the eager plan's tensors are in the kernels'
    layout by construction)."""
    spec = problem.spec
    reason = backward_unsupported_reason(spec)
    if reason is not None:
        raise NotImplementedError(reason)
    width = cfgmod.bwd_kernel_dim(spec)
    if (problem.head_dim, problem.head_dim_v) != (width, width):
        dims = (width, width)
        return padded_launcher(dims, backward_launcher(widened_problem(problem, dims), device, deterministic, checked))
    target = compile_cache.runtime_target(device)
    sm80 = _sm80_backward()
    main = _main_kernel(kernel_spec(spec), target, deterministic)
    preprocess = sm80.preprocess_kernel(_plain(spec), target)
    convert = sm80.accum_convert_kernel(_plain(spec), target)
    p, mask = problem, problem.mask
    seqlen_q_pad = round_up(p.seqlen_q, ROW_MULTIPLE)
    stats_shape = (p.batch, p.nheads, seqlen_q_pad)
    dq_accum_shape = (p.batch, seqlen_q_pad, p.nheads, p.head_dim)
    semaphores_shape = (p.batch, p.nheads, seqlen_q_pad // cfgmod.M_BLOCK)
    scalars = (p.softmax_scale, mask.left, mask.right) + ((float(p.softcap),) if spec.softcap else ())
    f32 = dict(dtype=torch.float32, device=device)

    def launch(t: BwdTensors, grads: Grads) -> None:
        dout, q, k, v, out, lse, dlse = t[:7]
        dq, dk, dv = grads[:3]
        if checked:
            assert q.shape == (p.batch, p.seqlen_q, p.nheads, p.head_dim) and k.shape[1:3] == (p.seqlen_k, p.nheads_kv)
            q, k, v, dout, out, dq, dk, dv = sm80.grad_views(q, k, v, dout, out, dq, dk, dv)
        lse_log2 = torch.empty(stats_shape, **f32)
        dpsum = torch.empty(stats_shape, **f32)
        dq_accum = torch.zeros(dq_accum_shape, **f32)
        semaphores = torch.zeros(semaphores_shape, dtype=torch.int32, device=device) if deterministic else None
        preprocess(out, dout, lse, dpsum, lse_log2)
        fold_lse_grad(dpsum, dlse, lse)
        main(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, semaphores, *scalars)
        convert(dq_accum, dq, p.softmax_scale)
        if spec.sink:
            sink_grad(grads.dsink, t.sink, lse, dpsum[..., : p.seqlen_q])

    return launch


def warm_backward(spec: AttentionSpec, target: str, deterministic: bool = False) -> None:
    """Gets every kernel `backward_launcher` launches for `spec` under the same cache keys."""
    _main_kernel(kernel_spec(spec), target, deterministic)
    _sm80_backward().preprocess_kernel(_plain(spec), target)
    _sm80_backward().accum_convert_kernel(_plain(spec), target)


def compile_backward_artifacts(spec: AttentionSpec, target: str) -> List[KernelArtifact]:
    """Compiles the main kernel serving `spec` for `target` with fake tensors (no GPU needed), with the sm80 family's
    preprocess and conversion it launches (reported with an `sm80_` prefix)."""
    reason = backward_unsupported_reason(spec)
    if reason is not None:
        raise NotImplementedError(reason)
    kspec = kernel_spec(spec)
    cfg = cfgmod.bwd_config(kspec)
    compile_cache.ensure_cute_dsl_arch(target)
    artifacts = []
    with tempfile.TemporaryDirectory(prefix="cute_flash_sm100_bwd_") as dump:
        for role, deterministic in (("bwd", False), ("bwd_det", True)):
            extra = compile_cache.keep_artifacts_options(os.path.join(dump, role))
            compiled, kernel = _build_main(kspec, cfg, target, deterministic, extra=extra)
            config = {
                **dataclasses.asdict(cfg),
                "tile_n": cfgmod.N_BLOCK,
                "tile_m": cfgmod.M_BLOCK,
                "threads": 512,
                "shared_bytes": kernel.smem_bytes,
            }
            artifacts.append(KernelArtifact(role, compiled.artifacts.PTX, compiled.artifacts.CUBIN, config))
    roles = ["bwd_preprocess", "bwd_postprocess"]
    for art in _sm80_backward().compile_backward_artifacts(_plain(kspec), target, roles=roles):
        artifacts.append(KernelArtifact(f"sm80_{art.kernel}", art.ptx, art.cubin, {**art.config, "family": "sm80"}))
    return artifacts


def run_backward(t: BwdTensors, grads: Grads, problem: Problem, deterministic: bool = False) -> None:
    """Fills `grads` (shaped and typed like q, k, v) on torch's current stream (tests and studies: the front end
    keeps `backward_launcher`'s bound form)."""
    backward_launcher(problem, t.q.device, deterministic)(t, grads)


def run_backward_varlen(
    t: BwdTensors, grads: Grads, seqs: PackedSeqs, problem: VarlenProblem, deterministic: bool = False
) -> None:
    """The packed backward: q / dout / out / dq (total_q, h, d), k / v / dk / dv (total_k, h_kv, d), lse (h, total_q).
    Keys past seqused_k[b] get zero gradients. deterministic: as `backward_launcher`'s, one semaphore per (head,
    padded query tile)."""
    spec = problem.spec
    reason = backward_unsupported_reason(spec)
    if reason is not None:
        raise NotImplementedError(reason)
    width = cfgmod.bwd_kernel_dim(spec)
    if (problem.head_dim, problem.head_dim_v) != (width, width):
        wide = widened_problem(problem, (width, width))
        inner = lambda tw, gw: run_backward_varlen(tw, gw, seqs, wide, deterministic)  # noqa: E731
        padded_launcher((width, width), inner)(t, grads)
        return
    dout, q, k, v, out, lse, dlse = t[:7]
    dq, dk, dv = grads[:3]
    cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k = seqs
    mask = problem.mask
    sm80 = _sm80_backward()
    target = compile_cache.runtime_target(q.device)
    pad = PACKED_PAD
    batch = cu_seqlens_q.shape[0] - 1
    total_q, nheads, head_dim = q.shape
    q, k, v, dout, out, dq, dk, dv = sm80.grad_views(q, k, v, dout, out, dq, dk, dv)
    dk, dv = sm80.packed_dkv_destinations(dk, dv, False, seqused_k is not None, 0)  # (zeroed with seqused_k)
    if batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:  # no query sees a key: zero gradients, no launch
        for g in (dq, dk, dv):
            g.zero_()
        if spec.sink:
            grads.dsink.zero_()
        return
    rows_q = round_up(padded_rows(total_q, batch, pad), pad)  # whole query tiles
    f32 = dict(dtype=torch.float32, device=q.device)
    lse_log2 = torch.empty(1, nheads, rows_q, **f32)
    dpsum = torch.empty(1, nheads, rows_q, **f32)
    dq_accum = torch.zeros(rows_q, nheads, head_dim, **f32)  # (the sm80 packed conversion's layout)
    semaphores = None
    if deterministic:
        semaphores = torch.zeros(1, nheads, rows_q // cfgmod.M_BLOCK, dtype=torch.int32, device=q.device)
    plain = _plain(spec)
    pre_blocks = -(-max_seqlen_q // pad) * pad // PRE_POST_ROWS  # whole padded tiles per sequence
    sm80.preprocess_kernel(plain, target)(out, dout, lse, dpsum[0], lse_log2[0], cu_seqlens_q, pad, pre_blocks)
    fold_lse_grad_packed(dpsum[0], dlse, lse, cu_seqlens_q, pad)
    main = _main_kernel(kernel_spec(spec), target, deterministic, seqused_k is not None)
    softcap = (float(problem.softcap),) if spec.softcap else ()
    one = lambda x: x.unsqueeze(0)  # noqa: E731  (the kernel's one batch entry)
    main(
        one(q), one(k), one(v), one(dout), lse_log2, dpsum, one(dq_accum), one(dk), one(dv), semaphores,
        problem.softmax_scale, mask.left, mask.right, *softcap, cu_seqlens_q, cu_seqlens_k, seqused_k,
        int(max_seqlen_k),
    )  # fmt: skip
    sm80.accum_convert_kernel(plain, target)(dq_accum, dq, problem.softmax_scale, cu_seqlens_q, pad, max_seqlen_q)
    if spec.sink:
        sink_grad(grads.dsink, t.sink, lse, sm80.packed_rows(dpsum[0], cu_seqlens_q, pad, total_q))

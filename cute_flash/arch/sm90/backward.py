"""The sm90 backward pass: preprocess, main kernel, postprocess (see flash_bwd.py for the algorithm).

    1. preprocess:  D = rowsum(dO * O) and lse_log2 (both (b, h, sq_padded) fp32; padding and empty rows inert) —
                    the sm80 family's kernel (memory-bound, a few percent of the backward), compiled for sm_90a; it
                    also zeroes the dQ accumulator (no torch.zeros before it)
    2. main:        per key tile: dK, dV in registers; each query tile's dQ added by a bulk reduce-add (through
                    shared memory) to (b, h, sq_padded * d) fp32 in the dQ MMA's register order
    3. postprocess: dq = scale * dQ accumulator in the input dtype (DqConvertSm90); under GQA/MQA the main kernel's
                    dK/dV partial sums go to (b, sk_padded, h_kv, d) fp32 buffers converted by the sm80 family's
                    accumulator conversion

The three launch back to back by programmatic dependent launch (preprocess -> main -> dQ postprocess): each may start
while the one before it runs and waits (griddepcontrol.wait) before it reads what that one writes.

Soft-capping (spec.softcap) changes the main kernel only (its feature entries take the cap; flash_bwd.py). A learnable
sink (spec.sink) changes no kernel: the LSE the forward wrote includes it, so P and D are already right; its gradient,
dsink_h = sum over rows of exp(sink_h - lse) * (dlse - D), comes from lse and the preprocess's D on the host side
(arch/base.sink_grad), after the kernels (so that nothing sits between the programmatically launched ones).

Packed sequences (`run_backward_varlen`): the same three steps on buffers whose sequence b starts at row
cu_seqlens[b] + b * pad rounded down to a multiple of pad (common/packed.packed_pads): the sm80 family's packed
preprocess (built as above: it zeroes each sequence's rows of the dQ sums and signals PDL), the main kernel's and the
dQ conversion's `packed` builds, the sm80 packed accumulator conversion under GQA.

Kernels are compiled once per (target, role, spec, tile config) with symbolic batch, sequence and head extents and
launched through TVM-FFI on torch's current stream.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import tempfile
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from ... import compile_cache
from ...spec import AttentionSpec, ModsSpec
from ...kernel_layout import round_up
from ...mods.graph import MAX_TABLES
from ...validation import PackedSeqs, Problem, VarlenProblem
from ...common.packed import PRE_POST_ROWS, packed_pads, padded_rows
from ..base import BwdTensors, Grads, KernelArtifact, fold_lse_grad, fold_lse_grad_packed, sink_grad
from ..padded_head_dims import padded_launcher, widened_problem, widened_spec
from .tile_config import (
    ROWS_PER_CONSUMER,
    WARPGROUP_THREADS,
    BwdTileConfig,
    bwd_config_problem,
    bwd_head_dim_pairs,
    bwd_head_dims,
    bwd_smem_bytes,
    bwd_tile_config,
    long_queries,
    score_heavy,
)

FAMILY = "sm90"
STATS_ROW_MULTIPLE = PRE_POST_ROWS  # the preprocess writes whole 64-row blocks


@functools.lru_cache(maxsize=None)  # (on every packed backward call; the tile tables do not change once calls start)
def kernel_dims(spec: AttentionSpec) -> Optional[Tuple[int, int]]:
    """(head_dim, head_dim_v) of the kernels serving `spec`, or None: the call's own where they have a tile
    configuration (d == dv in bwd_head_dims, or a pair of bwd_head_dim_pairs such as (192, 128)), else both the
    narrowest d == dv tile's that is at least as wide as either. A narrower call runs them on zero-padded operands
    (arch/padded_head_dims.py): e.g. d160 the d192 kernels, d224 the d256 ones, (128, 64) the d128 ones, d72 the d96
    ones, d32 the d64 ones. Those routes measured up to 2.5x the sm80 backward's own tiles for d32 / d160 / d224, and
    no slower but at one point within noise (H100, 2026-11-27)."""
    own = (spec.head_dim, spec.head_dim_v)
    if own in bwd_head_dim_pairs():
        return own
    width = next((w for w in bwd_head_dims(score_heavy(spec)) if w >= max(own)), None)  # (softcap: d96 on d128's)
    return None if width is None else (width, width)


def kernel_spec(spec: AttentionSpec) -> AttentionSpec:
    """The spec the kernels serving `spec` are built for."""
    return widened_spec(spec, _checked_dims(spec))


def backward_unsupported_reason(spec: AttentionSpec) -> Optional[str]:
    """None where the sm90 backward serves `spec` (every mask, soft-capping and learnable sinks included)."""
    if spec.dtype not in ("fp16", "bf16"):
        return f"the sm90 backward computes in fp16 or bf16, not {spec.dtype}"
    if spec.out_dtype != spec.dtype:
        return f"the sm90 backward needs out_dtype equal to the input dtype ({spec.dtype}), got {spec.out_dtype}"
    if isinstance(spec, ModsSpec) and (
        spec.kvcache or spec.softcap or spec.sink or (spec.varlen and spec.block_sparse)
    ):
        return (
            "the score_mod / mask_mod backward takes no softcap or sinks (write softcap as a score_mod) and no block "
            "mask with packed sequences"
        )
    if kernel_dims(spec) is None:
        return (
            f"the sm90 backward has tile configurations for head dims {bwd_head_dims()} and (head_dim, head_dim_v) "
            f"{bwd_head_dim_pairs()} (narrower ones and other head_dim != head_dim_v run on zero-padded operands), "
            f"not ({spec.head_dim}, {spec.head_dim_v})"
        )
    return None


def _checked_dims(spec: AttentionSpec) -> Tuple[int, int]:
    dims = kernel_dims(spec)
    if dims is None:
        raise NotImplementedError(backward_unsupported_reason(spec))
    return dims


@functools.lru_cache(maxsize=None)
def _sm80_backward():
    """The sm80 backward module (imported on first use: it is only needed once a backward runs)."""
    from ..sm80 import backward

    return backward


def main_role(gqa: bool, seqused: bool, deterministic: bool) -> str:
    """The main kernel's role name: with GQA (dK, dV partial sums), reading seqused_k (packed specs only), in a
    deterministic build."""
    return ("bwd_gqa" if gqa else "bwd") + ("_seqused" if seqused else "") + ("_det" if deterministic else "")


# Main-kernel roles by name: (GQA, seqused_k, deterministic). Dense specs build those without seqused_k.
MAIN_ROLES = {main_role(g, s, d): (g, s, d) for d in (False, True) for s in (False, True) for g in (False, True)}


def _build(role: str, spec: AttentionSpec, cfg: BwdTileConfig, target: str, extra: str = ""):
    from . import build

    if role == "bwd_preprocess":
        return build.compile_preprocess(spec, cfg, target, extra)
    extra = f"--opt-level {cfg.opt_level} {extra}".strip()
    if role == "bwd_dq_postprocess":
        return build.compile_dq_postprocess(spec, cfg, target, extra)
    gqa, seqused, deterministic = MAIN_ROLES[role]
    assert spec.varlen or not seqused, "seqused_k is a packed-sequence argument"
    return build.compile_backward(spec, cfg, target, gqa, deterministic, extra, seqused)


def kernel_key(role: str, spec: AttentionSpec, cfg: BwdTileConfig) -> Tuple[AttentionSpec, BwdTileConfig]:
    """The (spec, configuration) that `role`'s kernel is built from: only what its code depends on, so builds that
    generate the same code share one cache entry. Calls (`_kernel`) and the compile command
    (`compile_backward_artifacts`) both build from it, so what the CPU compile tests check is what calls run. No
    kernel reads spec.sink (the sink is in the LSE), and only the main kernel spec.softcap and a ModsSpec's graphs
    and block lists."""
    spec = _without_sink(spec)
    if isinstance(spec, ModsSpec) and role not in MAIN_ROLES:
        spec = _sm80_backward().plain_spec(spec)  # (the pre- and postprocess do not read the callables)
    if role == "bwd_dq_postprocess":
        # The dQ conversion depends on the dtype, the head dim, the dQ MMA's shape and the output tile's swizzle atom
        # (operand_atom_cols: keys_on_rows) only, not on the mask, head_dim_v, stages, registers or ptxas level of
        # the main kernel.
        key_spec = dataclasses.replace(spec, mask="none", head_dim_v=spec.head_dim, softcap=False, softcap_wide=False)
        return key_spec, BwdTileConfig(
            tile_m=cfg.tile_m,
            dq_split=cfg.dq_split,
            keys_on_rows=cfg.keys_on_rows,
            num_consumer_wgs=cfg.num_consumer_wgs,
            dq_swap_ab=cfg.dq_swap_ab,
        )
    if role == "bwd_preprocess":
        # The dtype and head dims only (the sm80 family's preprocess, built to zero the dQ accumulator and signal PDL).
        key_spec = dataclasses.replace(spec, mask="none", softcap=False, softcap_wide=False)
        return key_spec, BwdTileConfig(tile_m=ROWS_PER_CONSUMER, dq_split="m")
    return spec, cfg


def _without_sink(spec: AttentionSpec) -> AttentionSpec:
    """`spec` without what the backward's kernels do not read: the sink (it is in the LSE) and the cap's range."""
    return dataclasses.replace(spec, sink=False, softcap_wide=False) if spec.sink or spec.softcap_wide else spec


def _plain(spec: AttentionSpec) -> AttentionSpec:
    """`spec` for the sm80 family's accumulator conversions, which no feature changes."""
    spec = _sm80_backward().plain_spec(spec)
    if spec.softcap or spec.sink:
        return dataclasses.replace(spec, softcap=False, softcap_wide=False, sink=False)
    return spec


def _kernel(role: str, spec: AttentionSpec, cfg: BwdTileConfig, target: str):
    key_spec, cfg = kernel_key(role, spec, cfg)
    key = (FAMILY, target, role, key_spec, cfg)
    compile_cache.ensure_cute_dsl_arch(target)
    return compile_cache.get_or_compile(key, lambda: _build(role, key_spec, cfg, target))


def _semaphores(deterministic: bool, gqa: bool, dq_shape: tuple, dkv_shape: tuple, device) -> tuple:
    """The main kernel's (dQ, dK / dV) semaphore arguments: zeroed int32 where a deterministic (GQA) build reads
    them, else None."""
    zeros = lambda shape: torch.zeros(shape, dtype=torch.int32, device=device)  # noqa: E731
    return (zeros(dq_shape) if deterministic else None), (zeros(dkv_shape) if deterministic and gqa else None)


class _Kernels(NamedTuple):
    """What one backward call launches, looked up once per (spec, config, target, GQA, deterministic, seqused_k);
    packed specs (spec.varlen) have their own."""

    cfg: BwdTileConfig
    preprocess: Callable
    main: Callable
    postprocess: Callable
    convert: Optional[Callable]  # GQA's fp32 dK sums to the input dtype
    convert_v: Optional[Callable]  # ... and dV's (the same kernel where head_dim_v == head_dim)


_launch_sets: Dict[tuple, _Kernels] = compile_cache.memo()


def _kernels(
    spec: AttentionSpec,
    cfg: Optional[BwdTileConfig],
    target: str,
    gqa: bool,
    deterministic: bool,
    seqused=False,
    long: bool = False,
) -> _Kernels:
    """The kernel set of a call, dense or packed (spec.varlen; `seqused`: seqused_k given; `long`: the default
    configuration for long query sequences, tile_config.long_queries), compiled, loaded from disk or taken from
    memory on first use; a warm call does one dict lookup here instead of re-checking the configuration and
    rebuilding five cache keys."""
    key = (spec, cfg, target, gqa, deterministic, seqused, long)
    kernels = _launch_sets.get(key)
    if kernels is None:
        reason = backward_unsupported_reason(spec)
        if reason is not None:
            raise NotImplementedError(reason)
        chosen = cfg or bwd_tile_config(spec, deterministic, long)
        problem = bwd_config_problem(chosen, spec.head_dim, spec.head_dim_v)
        if problem is None and deterministic and chosen.dq_red:
            problem = "dq_red adds dQ with plain atomics in no fixed order: no deterministic build"
        if problem is None and isinstance(spec, ModsSpec) and deterministic:
            problem = "the score_mod / mask_mod backward has no deterministic build"
        if problem is not None:
            raise ValueError(problem)
        sm80 = _sm80_backward()
        role = main_role(gqa, seqused, deterministic)
        convert = convert_v = None
        if gqa:
            convert = sm80.accum_convert_kernel(_plain(spec), target)
            convert_v = convert
            if spec.head_dim_v != spec.head_dim:
                dv = spec.head_dim_v
                spec_v = dataclasses.replace(_plain(spec), head_dim=dv, head_dim_v=dv)
                convert_v = sm80.accum_convert_kernel(spec_v, target)
        kernels = _launch_sets[key] = _Kernels(
            chosen,
            _kernel("bwd_preprocess", spec, chosen, target),
            _kernel(role, spec, chosen, target),
            _kernel("bwd_dq_postprocess", spec, chosen, target),
            convert,
            convert_v,
        )
    return kernels


def run_backward(
    t: BwdTensors, grads: Grads, problem: Problem, deterministic: bool = False, cfg: Optional[BwdTileConfig] = None
) -> None:
    """Fills `grads` (shaped and typed like q, k, v) on torch's current stream.

    deterministic: dQ (and under GQA dK, dV) are summed in a fixed order, so repeated runs give bitwise-equal
    gradients. cfg: a tile configuration other than the default (tests and studies)."""
    backward_launcher(problem, t.q.device, deterministic, cfg)(t, grads)


def backward_launcher(
    problem: Problem,
    device,
    deterministic: bool = False,
    cfg: Optional[BwdTileConfig] = None,
    checked: bool = True,
    tables: tuple = (),
    blocks: Optional[tuple] = None,
) -> Callable[[BwdTensors, Grads], None]:
    """`run_backward` of one dense `problem` on `device` as launch(t, grads), with what depends only on them (the
    kernel set, the buffers' shapes, the scalars) settled once. checked: every tensor goes through kernel_view's
    check (grad_views: raises for a layout the kernels cannot take); the eager plan, whose tensors are in the
    kernels' layout by construction, keeps an unchecked launcher. tables: a ModsSpec's captured tensors as the
    kernel stores them (cute_flash/mods/call.py); blocks: a block-sparse ModsSpec's lists by key tile at the
    kernels' tiles (`mods_query_tiles`)."""
    dims = _checked_dims(problem.spec)
    if (problem.head_dim, problem.head_dim_v) != dims:
        inner = backward_launcher(widened_problem(problem, dims), device, deterministic, cfg, checked, tables, blocks)
        return padded_launcher(dims, inner)
    p, mask = problem, problem.mask
    gqa = p.nheads != p.nheads_kv
    target = compile_cache.runtime_target(device)
    kernels = _kernels(p.spec, cfg, target, gqa, deterministic, long=long_queries(p.seqlen_q))
    cfg = kernels.cfg
    if blocks is not None:  # (lists built at mods_query_tiles' tiles must be this kernel's)
        want = (-(-p.seqlen_k // cfg.tile_n), -(-p.seqlen_q // cfg.tile_m))
        if (blocks.count.shape[-1], blocks.index.shape[-1]) != want:
            raise ValueError(f"block lists of {tuple(blocks.index.shape[-2:])} tiles, the kernel has {want}")
    seqlen_q_pad = round_up(p.seqlen_q, math.lcm(cfg.tile_m, STATS_ROW_MULTIPLE))
    stats_shape = (p.batch, p.nheads, seqlen_q_pad)
    # The preprocess zeroes every (padded) row of the accumulator itself.
    dq_accum_shape = (p.batch, p.nheads, seqlen_q_pad * p.head_dim)
    dq_tiles = (p.batch, p.nheads, seqlen_q_pad // cfg.tile_m)
    dkv_tiles = (p.batch, p.nheads_kv, -(-p.seqlen_k // cfg.tile_n))
    scale, left, right = p.softmax_scale, mask.left, mask.right
    features = _features(p, tables, blocks)
    sm80 = _sm80_backward()  # the tensor helpers the two backward families share
    dkv_block = max(cfg.tile_n, STATS_ROW_MULTIPLE)  # whole conversion blocks
    f32 = dict(dtype=torch.float32, device=device)
    no_semaphores = (None, None)
    mods = isinstance(p.spec, ModsSpec)

    def launch(t: BwdTensors, grads: Grads) -> None:
        dout, q, k, v, out, lse, dlse = t[:7]
        dq, dk, dv = grads[:3]
        lse_log2 = torch.empty(stats_shape, **f32)
        dpsum = torch.empty(stats_shape, **f32)
        dq_accum = torch.empty(dq_accum_shape, **f32)
        if checked:
            assert q.shape == (p.batch, p.seqlen_q, p.nheads, p.head_dim) and k.shape[1:3] == (p.seqlen_k, p.nheads_kv)
            q, k, v, dout, out, dq, dk, dv = sm80.grad_views(q, k, v, dout, out, dq, dk, dv)
        # Every buffer (and memset) before the first kernel, so that the main kernel follows the preprocess directly
        # in the stream (its programmatic predecessor).
        dk_out, dv_out = sm80.dkv_destinations(dk, dv, gqa, dkv_block)
        semaphores = _semaphores(True, gqa, dq_tiles, dkv_tiles, device) if deterministic else no_semaphores
        kernels.preprocess(out, dout, lse, dpsum, lse_log2, dq_accum)
        fold_lse_grad(dpsum, dlse, lse)  # (between the two kernels when given: the main kernel then waits for it)
        if mods:  # (no semaphores: no deterministic build)
            kernels.main(q, k, v, dout, lse_log2, dpsum, dq_accum, dk_out, dv_out, scale, left, right, *features)
        else:
            kernels.main(
                q, k, v, dout, lse_log2, dpsum, dq_accum, dk_out, dv_out, *semaphores, scale, left, right, *features
            )
        kernels.postprocess(dq_accum, dq, scale)
        if gqa:
            kernels.convert(dk_out, dk, 1.0)  # the main kernel already applied the softmax scale to dK
            kernels.convert_v(dv_out, dv, 1.0)
        if p.spec.sink:
            sink_grad(grads.dsink, t.sink, lse, dpsum[..., : p.seqlen_q])

    return launch


def run_backward_varlen(
    t: BwdTensors, grads: Grads, seqs: PackedSeqs, problem: VarlenProblem, deterministic: bool = False,
    tables: tuple = (),
) -> None:  # fmt: skip
    """The packed backward: q / dout / out / dq (total_q, h, d), k / v / dk / dv (total_k, h_kv, d), lse (h, total_q).
    Keys past seqused_k[b] get zero gradients. deterministic: as `run_backward`'s, with semaphores per (head, padded
    query tile) and (KV head, padded key tile). tables: a ModsSpec's captured tensors (as `backward_launcher`'s)."""
    dims = _checked_dims(problem.spec)
    if (problem.head_dim, problem.head_dim_v) != dims:
        wide = widened_problem(problem, dims)
        inner = lambda tw, gw: run_backward_varlen(tw, gw, seqs, wide, deterministic, tables)  # noqa: E731
        padded_launcher(dims, inner)(t, grads)
        return
    dout, q, k, v, out, lse, dlse = t[:7]
    dq, dk, dv = grads[:3]
    cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k = seqs
    spec, softmax_scale, mask = problem.spec, problem.softmax_scale, problem.mask
    total_q, nheads, head_dim = q.shape
    total_k, nheads_kv = k.shape[0], k.shape[1]
    gqa = nheads != nheads_kv
    target = compile_cache.runtime_target(q.device)
    kernels = _kernels(spec, None, target, gqa, deterministic, seqused_k is not None, long_queries(max_seqlen_q))
    pad_q, pad_k = packed_pads(kernels.cfg.tile_m, kernels.cfg.tile_n)
    batch = cu_seqlens_q.shape[0] - 1
    # Whole pad_q blocks: TMA boxes of the statistics and the dQ sums' query tiles stay inside the buffers.
    rows_q = round_up(padded_rows(total_q, batch, pad_q), pad_q)
    f32 = dict(dtype=torch.float32, device=q.device)
    # (1, h, rows): the main kernel loads them in the dense layout (one batch entry); the preprocess writes (h, rows).
    lse_log2 = torch.empty(1, nheads, rows_q, **f32)
    dpsum = torch.empty(1, nheads, rows_q, **f32)
    cfg = kernels.cfg
    # The preprocess zeroes every row the main kernel adds to (each sequence's padded rows up to its length rounded up
    # to pad_q); the rows between sequences are never read.
    dq_accum = torch.empty(nheads, rows_q * head_dim, **f32)
    sm80 = _sm80_backward()
    q, k, v, dout, out, dq, dk, dv = sm80.grad_views(q, k, v, dout, out, dq, dk, dv)
    # Every buffer (and memset) before the first kernel, so that the main kernel follows the preprocess directly in
    # the stream (its programmatic predecessor).
    rows_k = padded_rows(total_k, batch, pad_k)
    dk_out, dv_out = sm80.packed_dkv_destinations(dk, dv, gqa, seqused_k is not None, rows_k)
    # One semaphore per tile of the padded buffers (whole pads): sequence b's tiles start at its padded offset / tile.
    rows_k = round_up(rows_k, pad_k)
    semaphores = _semaphores(
        deterministic, gqa, (1, nheads, rows_q // cfg.tile_m), (1, nheads_kv, rows_k // cfg.tile_n), q.device
    )

    pre_blocks = -(-max_seqlen_q // pad_q) * pad_q // STATS_ROW_MULTIPLE  # whole pad_q rows per sequence
    kernels.preprocess(out, dout, lse, dpsum[0], lse_log2[0], cu_seqlens_q, pad_q, pre_blocks, dq_accum)
    fold_lse_grad_packed(dpsum[0], dlse, lse, cu_seqlens_q, pad_q)
    if isinstance(spec, ModsSpec):  # (the `packed_mods` entry: no semaphores, the tables without block lists)
        semaphores, features = (), _features(problem, tables)[:MAX_TABLES]
    else:
        features = _features(problem)
    kernels.main(
        q, k, v, dout, lse_log2, dpsum, dq_accum, dk_out, dv_out, *semaphores, softmax_scale, mask.left, mask.right,
        *features, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_k,
    )  # fmt: skip
    kernels.postprocess(dq_accum, dq, softmax_scale, cu_seqlens_q, pad_q, max_seqlen_q)
    if gqa:
        # Every key row of each sequence (cu_seqlens_k, not seqused_k): rows past seqused_k convert their zeros.
        kernels.convert(dk_out, dk, 1.0, cu_seqlens_k, pad_k, max_seqlen_k)
        kernels.convert_v(dv_out, dv, 1.0, cu_seqlens_k, pad_k, max_seqlen_k)
    if spec.sink:
        sink_grad(grads.dsink, t.sink, lse, packed_rows(dpsum[0], cu_seqlens_q, pad_q, total_q))


def _features(problem, tables: tuple = (), blocks: Optional[tuple] = None) -> tuple:
    """The main kernel's arguments after the window bounds: in a spec.softcap build (its feature entry) the cap, in a
    ModsSpec's (the `mods` entry) the tables a0 .. a3 (None past the graphs') and the block lists (None without)."""
    if isinstance(problem.spec, ModsSpec):
        assert (blocks is not None) == problem.spec.block_sparse, "block-sparse builds take the lists, others none"
        return (*tables, *([None] * (MAX_TABLES - len(tables))), *(blocks or (None,) * 4))
    return (float(problem.softcap),) if problem.spec.softcap else ()


def packed_rows(buf: torch.Tensor, cu_seqlens_q: torch.Tensor, pad: int, total_q: int) -> torch.Tensor:
    """The (h, total_q) rows of a padded (h, rows) buffer in which sequence b starts at its padded offset
    (common/packed.py: cu_seqlens[b] + b * pad rounded down to a multiple of pad): a gather on the device, without
    reading cu_seqlens on the host (CUDA-graph capturable)."""
    cu = cu_seqlens_q.long()
    batch = cu.shape[0] - 1
    starts = torch.div(cu[:-1] + torch.arange(batch, device=cu.device) * pad, pad, rounding_mode="floor") * pad
    rows = torch.arange(total_q, device=cu.device)
    # The sequence of each packed row (cu_seqlens ends at total_q; the clamp only keeps a malformed one in bounds).
    seq = torch.searchsorted(cu[1:], rows, right=True).clamp_(max=max(batch - 1, 0))
    return buf[:, starts[seq] + rows - cu[seq]]


def mods_query_tiles(spec: AttentionSpec) -> Tuple[int, int]:
    """(tile_m, tile_n) of the main kernel serving a score_mod / mask_mod `spec`: the tiles of its block lists."""
    cfg = bwd_tile_config(kernel_spec(spec))
    return cfg.tile_m, cfg.tile_n


def warm_backward(spec: AttentionSpec, target: str, *, gqa: bool, deterministic: bool) -> None:
    """Gets every kernel `run_backward` (packed specs: `run_backward_varlen` without seqused_k) launches for `spec`
    (default tile configs, short and long query sequences) under the same cache keys."""
    spec = kernel_spec(spec)
    for long in (False, True):
        if long and bwd_tile_config(spec, deterministic, True) == bwd_tile_config(spec, deterministic):
            continue  # (no long-sequence configuration: the same kernels)
        _kernels(spec, None, target, gqa, deterministic, long=long)


def compile_backward_artifacts(
    spec: AttentionSpec, target: str, cfg: Optional[BwdTileConfig] = None, roles: Optional[List[str]] = None
) -> List[KernelArtifact]:
    """Compiles the sm90 backward kernels serving `spec` for `target` with fake tensors (no GPU needed); the shared
    sm80 accumulator conversion is reported with an `sm80_` prefix (the preprocess, the sm80 family's kernel built
    for this backward, as role `bwd_preprocess`). cfg: another configuration than the default; roles: only these
    sm90 roles (then no sm80 kernels). The default configuration's long-query form (tile_config.long_queries),
    where it differs, adds its main kernels and dQ conversion as `<role>_long`."""
    reason = backward_unsupported_reason(spec)
    if reason is not None:
        raise NotImplementedError(reason)
    spec = kernel_spec(spec)
    default = cfg is None
    cfg = cfg or bwd_tile_config(spec)
    compile_cache.ensure_cute_dsl_arch(target)
    artifacts = []
    with tempfile.TemporaryDirectory(prefix="cute_flash_sm90_bwd_") as dump:
        # dq_red has no deterministic build; the default configuration's deterministic roles take their own one.
        mains = [r for r, (_, s, d) in MAIN_ROLES.items() if not s and (default or not (cfg.dq_red and d))]
        if isinstance(spec, ModsSpec):  # (no deterministic score_mod / mask_mod build)
            mains = [r for r in mains if not MAIN_ROLES[r][2]]
        default_roles = (*mains, "bwd_dq_postprocess", "bwd_preprocess")
        jobs = []  # (artifact name, role, configuration)
        for role in default_roles if roles is None else roles:
            deterministic = default and role in MAIN_ROLES and MAIN_ROLES[role][2]
            jobs.append((role, role, bwd_tile_config(spec, True) if deterministic else cfg))
        long = bwd_tile_config(spec, long=True)
        if default and roles is None and long != cfg:
            jobs += [(f"{role}_long", role, long) for role in ("bwd", "bwd_gqa", "bwd_dq_postprocess")]
        for name, role, role_cfg in jobs:
            sub = os.path.join(dump, name)
            compiled = _build(
                role, *kernel_key(role, spec, role_cfg), target, compile_cache.keep_artifacts_options(sub)
            )
            role_config = {
                **role_cfg.as_dict(),
                "shared_bytes": bwd_smem_bytes(role_cfg, spec.head_dim, spec.head_dim_v),
                "threads": role_cfg.num_threads,
            }
            if role == "bwd_dq_postprocess":
                role_config = {"tile_m": role_cfg.tile_m, "threads": role_cfg.num_dq_wgs * WARPGROUP_THREADS}
            elif role == "bwd_preprocess":
                role_config = {"block_m": STATS_ROW_MULTIPLE, "threads": 128, "shared_bytes": 0}
            artifacts.append(KernelArtifact(name, compiled.artifacts.PTX, compiled.artifacts.CUBIN, role_config))
    if roles is not None:
        return artifacts
    sm80 = _sm80_backward()
    for art in sm80.compile_backward_artifacts(_plain(spec), target, roles=["bwd_postprocess"]):
        artifacts.append(KernelArtifact(f"sm80_{art.kernel}", art.ptx, art.cubin, {**art.config, "family": "sm80"}))
    if spec.head_dim_v != spec.head_dim:  # GQA's dV conversion at head_dim_v (_kernels' convert_v)
        dv = spec.head_dim_v
        spec_v = dataclasses.replace(_plain(spec), head_dim=dv, head_dim_v=dv)
        for art in sm80.compile_backward_artifacts(spec_v, target, roles=["bwd_postprocess"]):
            config = {**art.config, "family": "sm80", "head_dim": dv}
            artifacts.append(KernelArtifact(f"sm80_{art.kernel}_v", art.ptx, art.cubin, config))
    return artifacts

"""Compiling the sm80 forward: fake tensors for every entry (dense, packed, split-key, feature entries), and the
first tile candidate that ptxas fits in registers without spilling (the sm80 family's tile search)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from ... import compile_cache
from ...census import cubin_resources
from ...common.dsl_types import dsl_dtype
from ...common.fake_tensors import fake_f32, fake_feature_args, fake_mods_tables, fake_operand, fake_packed_forward_args
from ...spec import AttentionSpec, ModsSpec
from .tile_config import FwdTileConfig, fwd_tile_candidates


def feature_args(spec: AttentionSpec, split: bool) -> tuple:
    """The feature entries' extra arguments (softcap, sink view) for a spec.softcap / spec.sink build, else (): the
    split build takes no sink (its combine adds it)."""
    if not (spec.softcap or spec.sink):
        return ()
    return fake_feature_args(spec.sink and not split)


def build_forward(spec: AttentionSpec, tile: FwdTileConfig, options: str, seqused: bool = False, split=False):
    """Compiles the forward kernel with fake tensors: batch, seqlens and head counts are symbolic; split: the
    split-key build, whose out / lse are the fp32 partials (splits * b, sq, h, dv) / (splits * b, h, sq). Specs with
    softcap or sinks compile the feature entries (common/entries.py)."""
    import cutlass
    import cutlass.cute as cute

    from .flash_fwd import Sm80FlashForward

    dtype = dsl_dtype(spec.dtype)
    if isinstance(spec, ModsSpec):
        return build_forward_mods(spec, tile, options, seqused)
    if spec.varlen:
        return build_forward_packed(spec, tile, options, seqused)
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
    features = feature_args(spec, split)
    entry = kernel.features if features else kernel
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    scalars = (cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0))
    return cute.compile(entry, q, k, v, out, lse, *scalars, *features, stream, options=options)


def build_forward_mods(spec, tile: FwdTileConfig, options: str, seqused: bool = False):
    """The forward with a score_mod / mask_mod (flash_fwd_mods.py): the `mods` entry, whose tables a0 .. a3 are fake
    tensors of the graphs' read types and ranks (None past them); packed (spec.varlen) the `packed_mods` entry, the
    tables between the window bounds and the packed arguments (as `build_forward_packed`'s, seqused_k with
    `seqused`)."""
    import cutlass
    import cutlass.cute as cute

    from .flash_fwd_mods import Sm80ModsForward

    dtype = dsl_dtype(spec.dtype)
    kernel = Sm80ModsForward(spec, tile)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    tables = fake_mods_tables(spec)  # (then no block lists: the sm80 kernel visits every tile)
    if spec.varlen:
        args = fake_packed_forward_args(dtype, spec.head_dim, spec.head_dim_v, seqused)
        return cute.compile(kernel.packed_mods, *args[:8], *tables, *args[8:], stream, options=options)
    batch, seqlen_q, seqlen_k, heads, heads_kv = (cute.sym_int() for _ in range(5))
    q = fake_operand(dtype, (batch, seqlen_q, heads, spec.head_dim))
    k = fake_operand(dtype, (batch, seqlen_k, heads_kv, spec.head_dim))
    v = fake_operand(dtype, (batch, seqlen_k, heads_kv, spec.head_dim_v))
    out = fake_operand(dtype, (batch, seqlen_q, heads, spec.head_dim_v))
    lse = fake_f32((batch, heads, seqlen_q))
    scalars = (cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0))
    return cute.compile(kernel.mods, q, k, v, out, lse, *scalars, *tables, *(None,) * 4, stream, options=options)


def build_forward_packed(spec: AttentionSpec, tile: FwdTileConfig, options: str, seqused: bool):
    """The packed (varlen) forward: q (total_q, h, d), ..., lse (h, total_q); batch = cu_seqlens_q's length - 1."""
    import cutlass.cute as cute

    from .flash_fwd import Sm80FlashForward

    dtype = dsl_dtype(spec.dtype)
    args = fake_packed_forward_args(dtype, spec.head_dim, spec.head_dim_v, seqused)
    kernel = Sm80FlashForward(spec, tile)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    features = feature_args(spec, split=False)
    if features:  # the packed_features entry: (softcap, sink view) after the window bounds
        return cute.compile(kernel.packed_features, *args[:8], *features, *args[8:], stream, options=options)
    return cute.compile(kernel.packed, *args, stream, options=options)


SPILL_FREE_MAX_HEAD_DIM = 128  # the contract: no register spills up to this head dim
dump_root: Optional[str] = None


def dump_dir() -> str:
    """A fresh directory for one compile's .ptx/.cubin, under a per-process root removed at exit."""
    global dump_root
    if dump_root is None:
        dump_root = tempfile.mkdtemp(prefix="cute_flash_sm80_")
        atexit.register(shutil.rmtree, dump_root, ignore_errors=True)
    return tempfile.mkdtemp(dir=dump_root)


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
        return build_forward(spec, tile, options, seqused, split)

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
        keep = compile_cache.keep_artifacts_options(dump_dir(), ptxas_report=False)
        compiled = build(tile, tile_options(target, tile, f"{keep} {extra_options}"))
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


def compile_runnable_forward(spec: AttentionSpec, target: str, seqused: bool = False, split: bool = False):
    check_runnable_target(target)
    return compile_forward(spec, target, seqused=seqused, split=split).kernel


def tile_options(target: str, tile: FwdTileConfig, extra: str = "") -> str:
    return compile_cache.compile_options(target, extra=f"--opt-level {tile.opt_level} {extra}".strip())

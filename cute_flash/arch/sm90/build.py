"""Compiling the sm90 kernels with fake tensors: one compile serves every shape, stride and head count.

Batch, sequence lengths and head counts are symbolic; strides are symbolic multiples of 8 elements (16 bytes, what
TMA needs); the last dimension is contiguous. The stream is torch's current stream, read through TVM-FFI.
"""

from __future__ import annotations

from typing import Optional

from ... import compile_cache
from ...spec import AttentionSpec
from .tile_config import FwdTileConfig

compile_cache.ensure_cute_dsl_arch("sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

from .flash_fwd import Sm90FlashForward  # noqa: E402

DSL_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}


def _strided(dtype, shape, last_dim: int):
    strides = (cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1)
    return cute.runtime.make_fake_tensor(dtype, (*shape, last_dim), strides, assumed_align=16)


def compile_forward(spec: AttentionSpec, cfg: FwdTileConfig, target: str, extra_options: Optional[str] = None):
    """The compiled forward: call it as fn(q, k, v, out, lse, softmax_scale, window_left, window_right)."""
    dtype = DSL_DTYPES[spec.dtype]
    batch, seqlen_q, seqlen_k, heads, heads_kv = (cute.sym_int() for _ in range(5))
    q = _strided(dtype, (batch, seqlen_q, heads), spec.head_dim)
    k = _strided(dtype, (batch, seqlen_k, heads_kv), spec.head_dim)
    v = _strided(dtype, (batch, seqlen_k, heads_kv), spec.head_dim_v)
    out = _strided(dtype, (batch, seqlen_q, heads), spec.head_dim_v)
    lse = cute.runtime.make_fake_tensor(
        cutlass.Float32, (batch, heads, seqlen_q), (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4
    )
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = Sm90FlashForward(dtype, spec.head_dim, spec.head_dim_v, spec.mask, cfg)
    options = compile_cache.compile_options(target, extra=extra_options or "")
    return cute.compile(
        kernel, q, k, v, out, lse, cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0), stream, options=options
    )

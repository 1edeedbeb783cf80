"""An elementwise kernel that applies one traced score_mod / mask_mod to arrays of inputs: the generated code of
codegen.emit on its own, compiled like any kernel (cross-compiled on a CPU for the census) and, on a GPU, compared
with graph.evaluate before the attention kernels rely on it.

    fn = compile_probe(graph, "sm_90a")                         # fn(score, b, h, q_idx, kv_idx, out, *aux, stream)
    out = run_probe(graph, score, b, h, q_idx, kv_idx)          # on the GPU: float32 (score_mod) or bool as uint8
"""

from __future__ import annotations

from typing import Optional

import torch

from .graph import MAX_TABLES, ModGraph

THREADS = 128
_AUX_DTYPES = {torch.float32: "Float32", torch.float16: "Float16", torch.bfloat16: "BFloat16", torch.int32: "Int32",
               torch.int64: "Int64", torch.int8: "Int8", torch.uint8: "Uint8", torch.bool: "Uint8",
               torch.int16: "Int16", torch.float64: "Float64"}  # fmt: skip


def _kernel(graph: ModGraph):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from .codegen import emit

    nodes_use_score = graph.kind == "score"

    @cute.kernel
    def probe_kernel(score, b, h, q, kv, out, a0, a1, a2, a3):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * THREADS + tidx
        if i < out.shape[0]:
            inputs = {"b": Int32(b[i]), "h": Int32(h[i]), "q_idx": Int32(q[i]), "kv_idx": Int32(kv[i])}
            if cutlass.const_expr(nodes_use_score):
                inputs["score"] = Float32(score[i])
            aux = [t for t in (a0, a1, a2, a3) if t is not None][: len(graph.aux_types)]
            value = emit(graph, inputs, aux)
            if cutlass.const_expr(nodes_use_score):
                out[i] = value
            else:
                out[i] = cutlass.Uint8(cutlass.select_(value, 1, 0))

    @cute.jit
    def probe(score, b, h, q, kv, out, a0, a1, a2, a3, stream):
        probe_kernel(score, b, h, q, kv, out, a0, a1, a2, a3).launch(
            grid=[cute.ceil_div(out.shape[0], THREADS), 1, 1], block=[THREADS, 1, 1], stream=stream
        )

    return probe


def _fake_args(graph: ModGraph):
    import cutlass
    import cutlass.cute as cute

    n = cute.sym_int()

    def vec(dtype):
        return cute.runtime.make_fake_tensor(dtype, (n,), (1,), assumed_align=4)

    aux = []
    for t in graph.aux:
        dtype = getattr(cutlass, _AUX_DTYPES[t.dtype])
        shape = tuple(cute.sym_int() for _ in range(max(t.dim(), 1)))
        strides = tuple(cute.sym_int64() for _ in shape[:-1]) + (1,)
        aux.append(cute.runtime.make_fake_tensor(dtype, shape, strides, assumed_align=max(1, dtype.width // 8)))
    aux += [None] * (MAX_TABLES - len(aux))
    out = vec(cutlass.Float32 if graph.kind == "score" else cutlass.Uint8)
    ints = [vec(cutlass.Int32) for _ in range(4)]
    return (vec(cutlass.Float32), *ints, out, *aux, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))


def compile_probe(graph: ModGraph, target: str, extra_options: str = ""):
    """The compiled probe of `graph` for `target` (e.g. "sm_90a", "sm_80"): fn(score, b, h, q_idx, kv_idx, out,
    a0, a1, a2, a3) with (n,) float32 / int32 vectors, out float32 (score_mod) or uint8 (mask_mod), the captured
    tensors as a0.. (None past the graph's), torch's current stream."""
    import cutlass.cute as cute

    from .. import compile_cache

    if len(graph.aux) > MAX_TABLES:
        raise ValueError(f"the probe takes at most {MAX_TABLES} captured tensors, the graph reads {len(graph.aux)}")
    for t in graph.aux:
        if t.dtype not in _AUX_DTYPES:
            raise ValueError(f"a captured tensor of dtype {t.dtype} cannot be passed to a kernel")
    options = compile_cache.compile_options(target, extra=extra_options)
    return cute.compile(_kernel(graph), *_fake_args(graph), options=options)


def run_probe(graph: ModGraph, score: Optional[torch.Tensor], b, h, q_idx, kv_idx) -> torch.Tensor:
    """The probe on a GPU: 1-D CUDA tensors of equal length (score float32, the rest int32); returns out."""
    from .. import compile_cache

    n = b.numel()
    dev = b.device
    vec = [x.to(device=dev, dtype=torch.int32).contiguous() for x in (b, h, q_idx, kv_idx)]
    s = (score if score is not None else torch.zeros(n, device=dev)).to(torch.float32).contiguous()
    out = torch.empty(n, device=dev, dtype=torch.float32 if graph.kind == "score" else torch.uint8)
    # (bool tables travel as their bytes; a captured scalar as a 1-element vector)
    aux = [
        (t.view(torch.uint8) if t.dtype == torch.bool else t).contiguous().reshape(t.shape or (1,)) for t in graph.aux
    ]
    fn = compile_probe(graph, compile_cache.runtime_target(dev))
    fn(s, *vec, out, *aux, *([None] * (MAX_TABLES - len(aux))))
    return out

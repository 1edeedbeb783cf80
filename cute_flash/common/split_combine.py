"""The combine kernel of split-key decoding (arch/split_kv.py): per query row, the splits' partial results merged.
Arch-neutral (plain loads and stores): every family's split build shares it, compiled for the GPU's target.

Split s of a row wrote its normalised partial output O_s and log-sum-exp lse_s over its own keys (fp32; a split
that saw no key of the row: O_s = 0, lse_s = -inf). The whole row's result is the softmax-weighted sum

    lse = log sum_s exp(lse_s),    O = sum_s exp(lse_s - lse) O_s,

computed here in fp32 and rounded once to the output dtype; a row no split saw keeps O = 0, lse = -inf.
With learnable sinks (spec.sink; the `with_sink` entry) the splits' partials leave the sink out and it joins here,
once: lse = log(sum_s exp(lse_s) + exp(sink)), the O weights exp(lse_s - lse); a row no split saw gets O = 0 and
lse = sink. The sink is read from the (rows, h) fp32 view of arch/base.py at [row, head].

Layout: partials (splits * b, sq, h, dv) and (splits * b, h, sq) (split s of batch b at index s * b + b, as the
split forward's grid writes them), out (b, sq, h, dv) and lse (b, h, sq) with any strides (decoding's packed GQA
views included). Each thread owns 4 columns of one row: a CTA covers 128 // (dv / 4) rows of one (batch, head)
(128 threads at dv 64 / 128 / 256, 120 at dv 96, 96 at dv 192). The partials are at most splits x b x h x sq x dv
fp32 with b x h at most half the SMs (decoding: under 1 MiB; a full 128-row tile at d256: ~17 MiB), read once: plain
loads and stores, one pass over the splits whose loads of CHUNK splits at a time overlap (the combine is
latency-bound), merged online as the forward merges key tiles.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .online_softmax import LOG2_E

COLS_PER_THREAD = 4
THREADS = 128
# Splits whose loads are in flight together: a decoding call's combine is a chain of round trips to L2 (on an H200
# one per split cost ~0.4 us each: 13 us of a 20 us step at batch 1 x 4k with 33 splits), so one chunk of CHUNK
# splits costs one (decoding's default counts at batch 1 are 16 or 32 splits).
CHUNK = 16
LN2 = 0.6931471805599453


class SplitCombine:
    """Compiled once per (output dtype, dv); shapes, strides and the split count are runtime."""

    def __init__(self, out_dtype, head_dim_v: int, pdl: bool = True):
        assert head_dim_v % COLS_PER_THREAD == 0 and head_dim_v // COLS_PER_THREAD <= THREADS
        self.out_dtype = out_dtype
        self.pdl = pdl  # programmatic dependent launch (sm_90 and later; sm_8x targets have none)
        self.head_dim_v = head_dim_v
        self.threads_per_row = head_dim_v // COLS_PER_THREAD
        self.rows_per_cta = THREADS // self.threads_per_row

    @cute.jit
    def __call__(self, mOpart: cute.Tensor, mLSEpart: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, stream):
        self._launch(mOpart, mLSEpart, mO, mLSE, stream)

    @cute.jit
    def with_sink(
        self, mOpart: cute.Tensor, mLSEpart: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mSink: cute.Tensor, stream
    ):
        """The entry of spec.sink builds: mSink the (rows, h) fp32 sink view (natural-log logits)."""
        self._launch(mOpart, mLSEpart, mO, mLSE, stream, mSink)

    @cute.jit
    def _launch(self, mOpart, mLSEpart, mO, mLSE, stream, mSink=None):
        grid = [cute.ceil_div(mO.shape[1], self.rows_per_cta), cute.size(mO.shape[2]), cute.size(mO.shape[0])]
        # Programmatic dependent launch: the CTAs are set up while the split forward runs (a family's split build
        # may let them launch from its start; else they launch as it ends) and wait for its results at
        # griddepcontrol.wait. That orders the combine after the kernel launched just before it on the same stream:
        # both launch sites (arch/base.SplitForward and the C++ call path) launch the pair back to back on the
        # current stream. Without it (sm_80 targets) stream order alone orders the pair.
        self.kernel(mOpart, mLSEpart, mO, mLSE, mSink).launch(
            grid=grid, block=[self.rows_per_cta * self.threads_per_row, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(
        self,
        mOpart: cute.Tensor,
        mLSEpart: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSink: Optional[cute.Tensor] = None,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, head, batch = cute.arch.block_idx()
        row = bidx * self.rows_per_cta + tidx // self.threads_per_row
        col = (tidx % self.threads_per_row) * COLS_PER_THREAD
        nbatch = mO.shape[0]
        splits = mOpart.shape[0] // nbatch
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # the split forward's partials are complete and visible past this
        if row < mO.shape[1]:
            # One pass over the splits in chunks of CHUNK, merged online (the running max and sums rescaled per
            # chunk): every load of a chunk is issued before any is used, so a chunk costs one round trip to L2
            # (its indices clamped to the last split instead of predicated, the extra entries weighted 0).
            run_max = -Float32.inf
            total = Float32(0.0)
            if cutlass.const_expr(mSink is not None):
                run_max = mSink[row, head]
                # The sink's weight relative to itself (no value); a -inf sink weighs 0.
                total = Float32(0.0) if run_max == -Float32.inf else Float32(1.0)
            acc = cute.make_rmem_tensor((COLS_PER_THREAD,), Float32)
            acc.fill(0.0)
            lse_c = cute.make_rmem_tensor((CHUNK,), Float32)
            o_c = cute.make_rmem_tensor((CHUNK, COLS_PER_THREAD), Float32)
            for c in cutlass.range(cute.ceil_div(splits, CHUNK), unroll=1):
                for j in cutlass.range_constexpr(CHUNK):
                    z = cutlass.min(c * CHUNK + j, splits - 1) * nbatch + batch
                    lse_c[j] = mLSEpart[z, head, row]
                    for i in cutlass.range_constexpr(COLS_PER_THREAD):
                        o_c[j, i] = mOpart[z, row, head, col + i]
                new_max = run_max
                for j in cutlass.range_constexpr(CHUNK):
                    if c * CHUNK + j >= splits:
                        lse_c[j] = -Float32.inf
                    new_max = cutlass.max(new_max, lse_c[j])
                # Weights exp(lse - shift); while no split saw the row shift 0, so every weight is exp(-inf) = 0.
                shift = Float32(0.0) if new_max == -Float32.inf else new_max
                rescale = cute.math.exp2((run_max - shift) * LOG2_E, fastmath=True)  # 0 while run_max = -inf
                total *= rescale
                for i in cutlass.range_constexpr(COLS_PER_THREAD):
                    acc[i] *= rescale
                for j in cutlass.range_constexpr(CHUNK):
                    w = cute.math.exp2((lse_c[j] - shift) * LOG2_E, fastmath=True)
                    total += w
                    for i in cutlass.range_constexpr(COLS_PER_THREAD):
                        acc[i] += w * o_c[j, i]
                run_max = new_max
            shift = Float32(0.0) if run_max == -Float32.inf else run_max
            # A row no split saw (and no finite sink): total 0, so O = 0 and lse = -inf.
            empty = total == 0.0
            inv = Float32(0.0) if empty else cute.arch.rcp_approx(total)
            for i in cutlass.range_constexpr(COLS_PER_THREAD):
                mO[batch, row, head, col + i] = (acc[i] * inv).to(self.out_dtype)
            if col == Int32(0):
                log_total = cute.math.log2(Float32(1.0) if empty else total, fastmath=True) * LN2
                mLSE[batch, head, row] = -Float32.inf if empty else shift + log_total


def compile_split_combine(out_dtype: str, head_dim_v: int, target: str, extra_options: str = "", sink: bool = False):
    """The compiled combine: fn(o_part, lse_part, out, lse) with o_part (splits * b, sq, h, dv) and lse_part
    (splits * b, h, sq) fp32, out (b, sq, h, dv) of `out_dtype` ("fp16" / "bf16") and lse (b, h, sq) fp32, any
    strides (last dimension contiguous); with `sink`, fn(o_part, lse_part, out, lse, sink) (the `with_sink` entry)."""
    from .. import compile_cache
    from .dsl_types import dsl_dtype
    from .fake_tensors import fake_f32, fake_operand, fake_sink

    dtype = dsl_dtype(out_dtype)
    batch, seqlen_q, heads, parts = (cute.sym_int() for _ in range(4))
    o_part = fake_f32((parts, seqlen_q, heads, head_dim_v))
    lse_part = fake_f32((parts, heads, seqlen_q))
    out = fake_operand(dtype, (batch, seqlen_q, heads, head_dim_v))
    lse = fake_f32((batch, heads, seqlen_q))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = compile_cache.compile_options(target, extra=extra_options)
    kernel = SplitCombine(dtype, head_dim_v, pdl=not target.startswith("sm_8"))
    if sink:
        return cute.compile(kernel.with_sink, o_part, lse_part, out, lse, fake_sink(), stream, options=options)
    return cute.compile(kernel, o_part, lse_part, out, lse, stream, options=options)

"""The FP8 pre-pass on the GPU: one read of a bf16/fp16 operand, one write of its e4m3 copy and block scales.

One CTA quantises one block of `block` rows x head_dim of one (batch, head) (grid: blocks, heads, batch):
  1. load: each thread owns 8 consecutive rows x 8 consecutive columns (eight 16-byte loads; for V 16 rows x 4
     columns, sixteen 8-byte loads); `lanes_per_row` neighbouring lanes share a row group, so a warp reads whole
     rows, coalesced; all of a thread's loads are issued before any is used;
  2. rotate (Q and K, optional): sign flips, then the Walsh–Hadamard butterflies of `hadamard.walsh_hadamard`, in the
     same order and with the same float32 additions: index bits 0-2 inside a thread, higher bits across lanes by
     butterfly shuffles (lanes differ in exactly the index bit being paired);
  3. block max of |x|: thread, warp (shuffles), CTA (one float per warp in shared memory);
  4. quantise x * (448 / amax) with `cvt.rn.satfinite.e4m3x2.f32`, store 8 bytes per row (or, for V, 16 bytes per
     column: the thread's 16 rows are one group of 16 keys, i.e. 16 contiguous bytes of the transposed (dv, sk_pad)
     row, in the permuted key order `quantize.V_KEY_PERM16`), and the descale amax / 448 (1 for an all-zero block).
Rows past seqlen load as zeros; they are not stored (the transposed V writes its zero padding up to sk_pad).
The torch reference of every step is `cute_flash.fp8.quantize` / `hadamard`.
"""

from __future__ import annotations

import tempfile
from typing import List, Type

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass.memory import SmemAllocator

from ..common.dsl_types import dsl_dtype
from ..common.fake_tensors import fake_f32, fake_operand, fake_tensor
from .e4m3 import e4m3x4
from .hadamard import hadamard_block_size
from .quantize import E4M3_MAX, V_KEY_PERM16, V_SEQ_ALIGN

VEC = 8  # elements per thread per row (one 16-byte load of 16-bit data)
ROWS_PER_THREAD = 8
V_VEC = 4  # transposed V: 4 columns x 16 keys per thread (one permutation group per column)
V_ROWS_PER_THREAD = V_SEQ_ALIGN
WARP = 32


class Fp8Prepass:
    """Compiled once per (input dtype, head_dim, block, rotate, transposed output); shapes are runtime."""

    def __init__(self, dtype: Type[cutlass.Numeric], head_dim: int, block: int, rotate: bool, transpose_out: bool):
        assert dtype in (cutlass.BFloat16, cutlass.Float16)
        assert not (rotate and transpose_out), "V is quantised without rotation"
        self.vec = V_VEC if transpose_out else VEC
        self.rows = V_ROWS_PER_THREAD if transpose_out else ROWS_PER_THREAD
        assert head_dim % self.vec == 0 and block % self.rows == 0
        self.dtype = dtype
        self.head_dim = head_dim
        self.block = block
        self.rotate = rotate
        self.transpose_out = transpose_out
        self.lanes_per_row = head_dim // self.vec
        self.row_groups = block // self.rows
        self.num_threads = self.lanes_per_row * self.row_groups
        assert (
            self.num_threads % WARP == 0 and self.num_threads <= 1024
        ), f"block {block} x head_dim {head_dim} gives {self.num_threads} threads"
        # Hadamard blocks span `hadamard_lanes` lanes; they start at multiples of that lane count because every row
        # group starts at a multiple of lanes_per_row, which hadamard_lanes divides.
        self.hadamard_lanes = hadamard_block_size(head_dim) // VEC if rotate else 1
        self.hadamard_norm = 1.0 / float(hadamard_block_size(head_dim)) ** 0.5

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # (b, s, h, d) fp16/bf16
        mSigns: cute.Tensor,  # (d,) fp32, +-1 (read only when rotating)
        mOut: cute.Tensor,  # (b, s, h, d) e4m3, or (b, h, d, s_pad) e4m3 for the transposed V
        mDescale: cute.Tensor,  # (b, h, nblocks) fp32
        stream,
    ):
        grid = (cute.ceil_div(mX.shape[1], self.block), mX.shape[2], mX.shape[0])
        self.kernel(mX, mSigns, mOut, mDescale).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mSigns: cute.Tensor, mOut: cute.Tensor, mDescale: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        blk, head, batch = cute.arch.block_idx()
        seqlen = mX.shape[1]
        lane_col = tidx % self.lanes_per_row  # which column chunk
        row0 = blk * self.block + (tidx // self.lanes_per_row) * self.rows
        col0 = lane_col * self.vec

        load = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=self.vec * self.dtype.width
        )
        # Every row's load first, from a row clamped into the sequence (no branch), so that all of them are in
        # flight together; rows past seqlen become zeros afterwards. (A branch per row made each load wait for the
        # previous one's conversion: eight DRAM latencies in a row, ~30% of the bandwidth.)
        chunks = [cute.make_rmem_tensor((self.vec,), self.dtype) for _ in range(self.rows)]
        for j in cutlass.range_constexpr(self.rows):
            src = cute.local_tile(mX[batch, cutlass.min(row0 + j, seqlen - 1), head, None], (self.vec,), (lane_col,))
            cute.copy(load, src, chunks[j])
        for j in cutlass.range_constexpr(self.rows):
            if row0 + j >= seqlen:
                chunks[j].fill(0.0)
        x = cute.make_rmem_tensor((self.vec, self.rows), Float32)
        for j in cutlass.range_constexpr(self.rows):
            vals = chunks[j].load().to(Float32)
            for i in cutlass.range_constexpr(self.vec):
                x[i, j] = vals[i]

        if cutlass.const_expr(self.rotate):
            self._hadamard(x, mSigns, col0, lane_col)

        amax = Float32(0.0)
        for k in cutlass.range_constexpr(self.vec * self.rows):
            amax = cute.arch.fmax(amax, cute.arch.fmax(x[k], -x[k]))
        amax = self._block_max(amax, tidx)
        mult = Float32(1.0)
        descale = Float32(1.0)
        if amax > Float32(0.0):
            mult = Float32(E4M3_MAX) / amax
            descale = amax / Float32(E4M3_MAX)
        if tidx == 0:
            mDescale[batch, head, blk] = descale

        if cutlass.const_expr(not self.transpose_out):
            self._store_rows(x, mult, mOut, batch, head, row0, lane_col, seqlen)
        else:
            self._store_columns(x, mult, mOut, batch, head, row0, col0)

    @cute.jit
    def _hadamard(self, x: cute.Tensor, mSigns: cute.Tensor, col0: Int32, lane_col: Int32):
        for i in cutlass.range_constexpr(VEC):
            sign = Float32(mSigns[col0 + i])
            for j in cutlass.range_constexpr(ROWS_PER_THREAD):
                x[i, j] = x[i, j] * sign
        # Index bits inside the thread: (a, b) -> (a + b, a - b) for the pair differing in bit log2(h).
        for stage in cutlass.range_constexpr(VEC.bit_length() - 1):
            h = 1 << stage
            for j in cutlass.range_constexpr(ROWS_PER_THREAD):
                for i in cutlass.range_constexpr(VEC):
                    if cutlass.const_expr((i & h) == 0):
                        a = x[i, j]
                        b = x[i + h, j]
                        x[i, j] = a + b
                        x[i + h, j] = a - b
        # Index bits across lanes: the partner lane holds the other element of each pair.
        for stage in cutlass.range_constexpr(self.hadamard_lanes.bit_length() - 1):
            lanes = 1 << stage
            upper = (lane_col & lanes) != 0
            for k in cutlass.range_constexpr(VEC * ROWS_PER_THREAD):
                other = cute.arch.shuffle_sync_bfly(x[k], offset=lanes)
                x[k] = (other - x[k]) if upper else (x[k] + other)
        for k in cutlass.range_constexpr(VEC * ROWS_PER_THREAD):
            x[k] = x[k] * Float32(self.hadamard_norm)

    @cute.jit
    def _block_max(self, value: Float32, tidx: Int32) -> Float32:
        num_warps = self.num_threads // WARP
        value = cute.arch.warp_reduction(value, cute.arch.fmax)
        smem = SmemAllocator()
        warp_max = smem.allocate_tensor(Float32, cute.make_layout(num_warps), byte_alignment=16)
        if tidx % WARP == 0:
            warp_max[tidx // WARP] = value
        cute.arch.sync_threads()
        total = warp_max[0]
        for w in cutlass.range_constexpr(1, num_warps):
            total = cute.arch.fmax(total, warp_max[w])
        return total

    @cute.jit
    def _store_rows(self, x, mult, mOut, batch, head, row0, lane_col, seqlen):
        store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float8E4M3FN, num_bits_per_copy=64)
        packed = cute.make_rmem_tensor((VEC,), cutlass.Float8E4M3FN)
        words = cute.recast_tensor(packed, Uint32)
        for j in cutlass.range_constexpr(ROWS_PER_THREAD):
            for w in cutlass.range_constexpr(VEC // 4):
                words[w] = e4m3x4(
                    x[4 * w, j] * mult, x[4 * w + 1, j] * mult, x[4 * w + 2, j] * mult, x[4 * w + 3, j] * mult
                )
            if row0 + j < seqlen:
                dst = cute.local_tile(mOut[batch, row0 + j, head, None], (VEC,), (lane_col,))
                cute.copy(store, packed, dst)

    @cute.jit
    def _store_columns(self, x, mult, mOut, batch, head, row0, col0):
        # mOut is (b, h, d, s_pad): the thread's 16 rows (keys row0..row0+15, one permutation group) are 16 contiguous
        # bytes of each column; byte p holds key row0 + V_KEY_PERM16[p]. Keys past seqlen are zeros (zero loads).
        store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float8E4M3FN, num_bits_per_copy=128)
        packed = cute.make_rmem_tensor((self.rows,), cutlass.Float8E4M3FN)
        words = cute.recast_tensor(packed, Uint32)
        seqlen_pad = mOut.shape[3]
        perm = V_KEY_PERM16
        for i in cutlass.range_constexpr(self.vec):
            for w in cutlass.range_constexpr(self.rows // 4):
                words[w] = e4m3x4(
                    x[i, perm[4 * w]] * mult,
                    x[i, perm[4 * w + 1]] * mult,
                    x[i, perm[4 * w + 2]] * mult,
                    x[i, perm[4 * w + 3]] * mult,
                )
            if row0 < seqlen_pad:
                dst = cute.local_tile(mOut[batch, head, col0 + i, None], (self.rows,), (row0 // self.rows,))
                cute.copy(store, packed, dst)


def build_prepass(dtype_name: str, head_dim: int, block: int, rotate: bool, transpose_out: bool, options: str):
    """Compiles the pre-pass with fake tensors (symbolic batch, seqlen, heads; common/fake_tensors' stride rule)."""
    dtype = dsl_dtype(dtype_name)
    b, s, h, nblocks = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    x = fake_operand(dtype, (b, s, h, head_dim))
    signs = fake_tensor(Float32, (head_dim,), align=16)
    out_shape = (b, h, head_dim, cute.sym_int(divisibility=16)) if transpose_out else (b, s, h, head_dim)
    out = fake_operand(cutlass.Float8E4M3FN, out_shape)
    descale = fake_f32((b, h, nblocks))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = Fp8Prepass(dtype, head_dim, block, rotate, transpose_out)
    return cute.compile(kernel, x, signs, out, descale, stream, options=options)


def prepass_artifacts(spec, target: str, q_block: int, kv_block: int) -> List["KernelArtifact"]:  # noqa: F821
    """The front end's fp16/bf16 -> e4m3 pre-pass as the `compile` command reports it, for every FP8 backend: Q and K
    rotated, V transposed; Q scaled per `q_block` rows, K and V per `kv_block` keys (the forward kernel's blocks)."""
    from ..arch.base import KernelArtifact
    from ..census import read_artifacts
    from ..compile_cache import compile_options, keep_artifacts_options

    artifacts = []
    for role, d, block, rotate, transpose in (
        ("fp8_prepass_q", spec.head_dim, q_block, True, False),
        ("fp8_prepass_k", spec.head_dim, kv_block, True, False),
        ("fp8_prepass_v", spec.head_dim_v, kv_block, False, True),
    ):
        with tempfile.TemporaryDirectory(prefix="cute_flash_prepass_") as dump:
            compiled = build_prepass(
                spec.out_dtype, d, block, rotate, transpose, compile_options(target, extra=keep_artifacts_options(dump))
            )
            ptx, cubin = read_artifacts(compiled)
        threads = Fp8Prepass(dsl_dtype(spec.out_dtype), d, block, rotate, transpose).num_threads
        config = {"block": block, "rotate": rotate, "transposed_out": transpose, "threads": threads}
        artifacts.append(KernelArtifact(kernel=role, ptx=ptx, cubin=cubin, config=config))
    return artifacts

"""Host entry points (`@cute.jit` signatures that the host code compiles against) shared by several kernel classes.

Each entry only forwards to the class's `_launch`, so a calling convention that several kernels follow is written
once:

- `DenseFwdEntry`: the forward kernels of the sm80 family and the sm90 bf16/fp16 kernel, on dense tensors;
  `FwdEntries` adds their `packed` entry (packed sequences, `varlen` kernels).
- `BwdEntries`: the backward main kernels of the sm80 and sm90 families: `__call__` on dense tensors and
  `packed` (packed sequences, `varlen` kernels).
- `DenseAccumEntry` / `AccumEntries`: the kernels that convert an fp32 gradient accumulator to the output dtype,
  on dense tensors and (sm80 family) packed ones, where sequence b's output rows start at mCuSeqlens[b] and its
  accumulator rows at mCuSeqlens[b] + b * pad rounded down to a multiple of pad.

Builds for spec.softcap or spec.sink are compiled through the "feature" entries (`features`, `packed_features`):
the same arguments with `softcap` (Float32; 0.0 when unused) and `mSink` (the (rows, h) fp32 sink view of
arch/base.py, or None) after the window bounds; the backward main kernels take `softcap` alone. They forward
`features=(softcap, mSink)` (backward: `features=(softcap,)`) to `_launch`, whose default None is the plain
entries': builds without these features keep their code and calling convention.

Each kernel's docstring gives the layouts of its tensors.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32, Int32


class DenseFwdEntry:
    """`__call__` -> `self._launch(mQ, mK, mV, mO, mLSE, softmax_scale, window_left, window_right, stream)`;
    window_left / window_right are read only by the "local" mask."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # q: batch x seqlen_q x heads x head_dim
        mK: cute.Tensor,  # k: batch x seqlen_k x kv heads x head_dim
        mV: cute.Tensor,  # v: batch x seqlen_k x kv heads x head_dim_v
        mO: cute.Tensor,  # out: batch x seqlen_q x heads x head_dim_v
        mLSE: cute.Tensor,  # lse: batch x heads x seqlen_q, fp32
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        stream: cuda.CUstream,
    ):
        self._launch(mQ, mK, mV, mO, mLSE, softmax_scale, window_left, window_right, stream)

    @cute.jit
    def features(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        softcap: Float32,  # spec.softcap: the cap (> 0)
        mSink: Optional[cute.Tensor],  # spec.sink: (rows, h) fp32 sink logits (arch/base.py), else None
        stream: cuda.CUstream,
    ):
        features = (softcap, mSink)
        self._launch(mQ, mK, mV, mO, mLSE, softmax_scale, window_left, window_right, stream, features=features)


class FwdEntries(DenseFwdEntry):
    """Adds `packed(mQ, mK, mV, mO, mLSE, softmax_scale, window_left, window_right, mCuSeqlensQ, mCuSeqlensK,
    mSeqUsedK, max_seqlen_q, stream)` -> `self._launch(..., stream, (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK,
    max_seqlen_q))` for kernels built with varlen=True: q (total_q, h, d), k / v (total_k, h_kv, d / dv),
    out (total_q, h, dv), lse (h, total_q) fp32, mSeqUsedK (batch,) int32 or None."""

    @cute.jit
    def packed(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mSeqUsedK: Optional[cute.Tensor],
        max_seqlen_q: Int32,
        stream: cuda.CUstream,
    ):
        assert self.varlen
        packed = (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q)
        self._launch(mQ, mK, mV, mO, mLSE, softmax_scale, window_left, window_right, stream, packed)

    @cute.jit
    def packed_features(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        softcap: Float32,
        mSink: Optional[cute.Tensor],  # (total_q, h) fp32 view, or None
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mSeqUsedK: Optional[cute.Tensor],
        max_seqlen_q: Int32,
        stream: cuda.CUstream,
    ):
        assert self.varlen
        packed = (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q)
        features = (softcap, mSink)
        self._launch(mQ, mK, mV, mO, mLSE, softmax_scale, window_left, window_right, stream, packed, features=features)


class BwdEntries:
    """`__call__(mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV, mdQsem, mdKVsem, softmax_scale, window_left,
    window_right, stream)` -> `self._launch((mQ, ..., mdV), softmax_scale, window_left, window_right, stream, None,
    (mdQsem, mdKVsem))` on dense tensors, and `packed(mQ, ..., mdV, mdQsem, mdKVsem, softmax_scale, window_left,
    window_right, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_k, stream)` -> `self._launch(..., stream,
    (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_k), (mdQsem, mdKVsem))` for backward kernels built with
    varlen=True. Buffers "padded" give sequence b the rows from cu_seqlens[b] + b * pad rounded down to a multiple
    of pad (common/packed.py); each kernel's `_launch` gives their exact shapes. The int32 semaphores order the
    deterministic builds' adds (zeroed, one per tile of the dQ sums and of the GQA dK / dV sums); None elsewhere."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, sq, h, d)
        mK: cute.Tensor,  # (b, sk, h_kv, d)
        mV: cute.Tensor,  # (b, sk, h_kv, d)
        mdO: cute.Tensor,  # (b, sq, h, d)
        mLSElog2: cute.Tensor,  # (b, h, sq_padded) fp32, from the preprocess
        mdPsum: cute.Tensor,  # (b, h, sq_padded) fp32, from the preprocess
        mdQaccum: cute.Tensor,  # zeroed fp32 dQ sums over padded query rows, in the kernel's layout
        mdK: cute.Tensor,  # (b, sk, h_kv, d) dtype, or (b, sk_padded, h_kv, d) fp32 zeroed under GQA
        mdV: cute.Tensor,  # like mdK
        mdQsem: Optional[cute.Tensor],  # (b, h, query tiles) int32 of a deterministic build, or None
        mdKVsem: Optional[cute.Tensor],  # (b, h_kv, key tiles) int32 of a deterministic GQA build, or None
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        stream: cuda.CUstream,
    ):
        assert not self.varlen
        tensors = (mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV)
        self._launch(tensors, softmax_scale, window_left, window_right, stream, None, (mdQsem, mdKVsem))

    @cute.jit
    def features(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSElog2: cute.Tensor,
        mdPsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mdQsem: Optional[cute.Tensor],
        mdKVsem: Optional[cute.Tensor],
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        softcap: Float32,  # spec.softcap: the cap (> 0)
        stream: cuda.CUstream,
    ):
        assert not self.varlen
        tensors = (mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV)
        sems = (mdQsem, mdKVsem)
        self._launch(tensors, softmax_scale, window_left, window_right, stream, None, sems, features=(softcap,))

    @cute.jit
    def packed(
        self,
        mQ: cute.Tensor,  # packed queries (total_q, h, d)
        mK: cute.Tensor,  # packed keys (total_k, h_kv, d)
        mV: cute.Tensor,  # packed values, like the keys
        mdO: cute.Tensor,  # the output's gradient, like the queries
        mLSElog2: cute.Tensor,  # the preprocess's log2-domain LSE, padded query rows (fp32)
        mdPsum: cute.Tensor,  # its D = rowsum(dO * O), laid out like mLSElog2
        mdQaccum: cute.Tensor,  # zeroed fp32 dQ sums, padded query rows
        mdK: cute.Tensor,  # dK like the keys, or under GQA zeroed fp32 sums over padded key rows
        mdV: cute.Tensor,  # dV, like mdK
        mdQsem: Optional[cute.Tensor],  # (1, h, padded query rows / tile) int32 of a deterministic build, or None
        mdKVsem: Optional[cute.Tensor],  # (1, h_kv, padded key rows / tile) int32 (deterministic GQA), or None
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        mCuSeqlensQ: cute.Tensor,  # (batch + 1,) int32 query offsets
        mCuSeqlensK: cute.Tensor,  # (batch + 1,) int32 key offsets
        mSeqUsedK: Optional[cute.Tensor],  # (batch,) int32 keys per sequence that get gradients, or None (all)
        max_seqlen_k: Int32,  # the longest sequence's keys (grids that span it per sequence)
        stream: cuda.CUstream,
    ):
        assert self.varlen
        tensors = (mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV)
        packed = (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_k)
        self._launch(tensors, softmax_scale, window_left, window_right, stream, packed, (mdQsem, mdKVsem))

    @cute.jit
    def packed_features(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSElog2: cute.Tensor,
        mdPsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mdQsem: Optional[cute.Tensor],
        mdKVsem: Optional[cute.Tensor],
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        softcap: Float32,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mSeqUsedK: Optional[cute.Tensor],
        max_seqlen_k: Int32,
        stream: cuda.CUstream,
    ):
        assert self.varlen
        tensors = (mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV)
        packed = (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_k)
        sems = (mdQsem, mdKVsem)
        self._launch(tensors, softmax_scale, window_left, window_right, stream, packed, sems, features=(softcap,))


class DenseAccumEntry:
    """`__call__(mAccum, mOut, scale, stream)` -> `self._launch(mAccum, mOut, scale, stream)`."""

    @cute.jit
    def __call__(self, mAccum: cute.Tensor, mOut: cute.Tensor, scale: Float32, stream):
        self._launch(mAccum, mOut, scale, stream)


class AccumEntries(DenseAccumEntry):
    """Adds `packed(mAccum, mOut, scale, mCuSeqlens, pad, max_seqlen, stream)` for kernels built with varlen=True."""

    @cute.jit
    def packed(
        self,
        mAccum: cute.Tensor,
        mOut: cute.Tensor,
        scale: Float32,
        mCuSeqlens: cute.Tensor,
        pad: Int32,
        max_seqlen: Int32,
        stream,
    ):
        assert self.varlen
        self._launch(mAccum, mOut, scale, stream, mCuSeqlens, pad, max_seqlen)


class ModsFwdEntry:
    """`mods(mQ, mK, mV, mO, mLSE, softmax_scale, window_left, window_right, a0, a1, a2, a3, mBlockCount,
    mBlockIndex, mBlockFull, mBlockTiles, stream)` -> `self._launch(..., stream, features=(softmax_scale, a0, a1,
    a2, a3, mBlockCount, mBlockIndex, mBlockFull, mBlockTiles))`: the score_mod / mask_mod forwards (cute_flash/mods)
    on dense tensors; a0 .. a3 the graphs' tables (None past them), the block lists (mods/call.KeyTileLists: counts
    (B, H, M) and key tiles (B, H, M, N) by launch position, full flags (B, H, M, N) by query tile, the query tile of
    each launch position (B, H, M), int32) only in block-sparse builds, else None."""

    @cute.jit
    def mods(
        self,
        mQ: cute.Tensor,  # q: batch x seqlen_q x heads x head_dim
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        a0: Optional[cute.Tensor],
        a1: Optional[cute.Tensor],
        a2: Optional[cute.Tensor],
        a3: Optional[cute.Tensor],
        mBlockCount: Optional[cute.Tensor],
        mBlockIndex: Optional[cute.Tensor],
        mBlockFull: Optional[cute.Tensor],
        mBlockTiles: Optional[cute.Tensor],
        stream: cuda.CUstream,
    ):
        features = (softmax_scale, a0, a1, a2, a3, mBlockCount, mBlockIndex, mBlockFull, mBlockTiles)
        self._launch(mQ, mK, mV, mO, mLSE, softmax_scale, window_left, window_right, stream, features=features)

    @cute.jit
    def packed_mods(
        self,
        mQ: cute.Tensor,  # q: total_q x heads x head_dim
        mK: cute.Tensor,  # k: total_k x kv heads x head_dim
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,  # lse: heads x total_q, fp32
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        a0: Optional[cute.Tensor],
        a1: Optional[cute.Tensor],
        a2: Optional[cute.Tensor],
        a3: Optional[cute.Tensor],
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mSeqUsedK: Optional[cute.Tensor],
        max_seqlen_q: Int32,
        stream: cuda.CUstream,
    ):
        """Packed sequences (kernels built with varlen=True; no block lists): the callables see b = the sequence,
        q_idx / kv_idx = positions within it."""
        assert self.varlen
        packed = (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q)
        features = (softmax_scale, a0, a1, a2, a3, None, None, None, None)
        self._launch(mQ, mK, mV, mO, mLSE, softmax_scale, window_left, window_right, stream, packed, features=features)

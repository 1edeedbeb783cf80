"""The two compile entries of the sm90 KV-cache kernels (flash_fwd.py's wgmma kernel and swapped.py's decoder): one
argument list (build.compile_forward_kvcache's calling convention), each kernel's `_launch_kvcache` behind it.

  kvcache(q, k_cache, v_cache, out, lse, seqlens_k, page_table, cu_seqlens_q, k_descale, v_descale, max_seqlen_q,
          softmax_scale, window_left, window_right, stream)
  kvcache_features(..., window_right, softcap, sink, stream)   builds for spec.softcap / spec.sink
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass.cute as cute
from cutlass import Float32, Int32


class KvCacheEntries:
    """Mixin: the entries; a kernel class defines `_launch_kvcache(..., stream, features=None)` with features
    (softcap, the (h,) fp32 sink logits or None) for the feature builds."""

    @cute.jit
    def kvcache(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSeqlensK: cute.Tensor,
        mPageTable,  # Optional[cute.Tensor]
        mCuSeqlensQ,  # Optional[cute.Tensor]
        mKDescale,  # Optional[cute.Tensor] (b, h_kv) fp32
        mVDescale,  # Optional[cute.Tensor] (b, h_kv) fp32
        max_seqlen_q: Int32,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        stream: cuda.CUstream,
    ):
        self._launch_kvcache(
            mQ, mK, mV, mO, mLSE, mSeqlensK, mPageTable, mCuSeqlensQ, mKDescale, mVDescale, max_seqlen_q,
            softmax_scale, window_left, window_right, stream,
        )  # fmt: skip

    @cute.jit
    def kvcache_features(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSeqlensK: cute.Tensor,
        mPageTable,
        mCuSeqlensQ,
        mKDescale,
        mVDescale,
        max_seqlen_q: Int32,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        softcap: Float32,  # spec.softcap: the cap (> 0; 0.0 when unused)
        mSink,  # Optional[cute.Tensor]: spec.sink, unsplit: the (h,) fp32 sink logits (split builds: None)
        stream: cuda.CUstream,
    ):
        """The entry of builds for spec.softcap / spec.sink (`kvcache`'s arguments, then softcap and the sink)."""
        self._launch_kvcache(
            mQ, mK, mV, mO, mLSE, mSeqlensK, mPageTable, mCuSeqlensQ, mKDescale, mVDescale, max_seqlen_q,
            softmax_scale, window_left, window_right, stream, features=(softcap, mSink),
        )  # fmt: skip

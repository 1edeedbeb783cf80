"""Backward postprocess of the sm90 family: dq = scale * dQ accumulator, from the main kernel's "fragment" layout.

The main kernel (flash_bwd.py) adds each query tile's dQ to a (b, h, sq_padded * d) fp32 buffer in its dQ MMA's
register order (`flash_bwd.dq_fragment_offset`). One CTA with the main kernel's consumer thread count converts one
query tile: thread t reads what consumer thread t added (16-byte loads, all issued before the first store) and finds
each value's (row, column) from the same tiled MMA.
"""

from __future__ import annotations

from typing import Type

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ...common.pin import pin_values
from .flash_bwd import DQ_VEC, dq_fragment_offset, dq_tiled_mma
from .tile_config import WARPGROUP_THREADS, BwdTileConfig


class DqConvertSm90:
    def __init__(self, dtype: Type[cutlass.Numeric], head_dim: int, cfg: BwdTileConfig):
        self.dtype = dtype
        self.head_dim = head_dim
        self.cfg = cfg
        self.num_threads = cfg.num_consumer_wgs * WARPGROUP_THREADS

    @cute.jit
    def __call__(
        self,
        mAccum: cute.Tensor,  # (b, h, sq_padded * d) fp32
        mOut: cute.Tensor,  # (b, sq, h, d) dtype
        scale: Float32,
        stream,
    ):
        grid = (cute.ceil_div(mOut.shape[1], self.cfg.tile_m), mOut.shape[2], mOut.shape[0])
        self.kernel(mAccum, mOut, scale, dq_tiled_mma(self.dtype, self.head_dim, self.cfg)).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mAccum: cute.Tensor, mOut: cute.Tensor, scale: Float32, tiled_mma: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen = mOut.shape[1]
        tile_m = self.cfg.tile_m
        tCcC = tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((tile_m, self.head_dim)))
        n = cute.size(tCcC)
        base = mAccum[batch, head, None].iterator + m_block * (tile_m * self.head_dim)
        values = cute.make_rmem_tensor(n, Float32)
        for i in cutlass.range_constexpr(n // DQ_VEC):  # the tile is padding past seqlen: in bounds
            src = cute.make_tensor(base + dq_fragment_offset(i * DQ_VEC, tidx, self.num_threads), cute.make_layout(DQ_VEC))
            chunk = cute.make_tensor(values.iterator + i * DQ_VEC, cute.make_layout(DQ_VEC))
            cute.autovec_copy(src, chunk)
        pin_values([values[j] for j in range(n)])
        for i in cutlass.range_constexpr(n // 2):
            row = m_block * tile_m + tCcC[2 * i][0]
            if row < seqlen:
                pair = cute.make_rmem_tensor(2, self.dtype)
                pair[0] = (values[2 * i] * scale).to(self.dtype)
                pair[1] = (values[2 * i + 1] * scale).to(self.dtype)
                dst = cute.make_tensor(mOut[batch, row, head, None].iterator + tCcC[2 * i][1], cute.make_layout(2))
                cute.autovec_copy(pair, dst)

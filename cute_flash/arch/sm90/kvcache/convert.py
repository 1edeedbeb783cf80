"""The converter warps of the sm90 KV-cache forward with an fp8 cache (spec.kv_fp8): e4m3 K / V tiles to fp16.

An e4m3 wgmma needs both operands in e4m3 (and V K-major, which a cache in place cannot be), and q is bf16 / fp16,
so the GEMMs stay 16-bit: fp16, whatever q's dtype, since e4m3 -> fp16 is one exact cvt per two values (bf16 would
take three more instructions per two, through fp32), and bf16 queries are rounded to fp16 under a power-of-two
scale by the row loader (loads.load_q_rows_as_fp16). The cache's tiles are converted in shared memory, on the
producer side: TMA fills `fp8_stages` e4m3 stages (their own rings, `Staging`), and warps 2 and 3 of the producer
warpgroup turn each tile into the fp16 stage the consumers wait on, in the consumers' order (K_last, K_{j-1} with
V_j, V_first). The consumers' side does not change: its rings' full barriers complete on the converters' arrivals
(one per converter warp) instead of TMA bytes. A converter warp, per tile: waits for the e4m3 stage and for the
fp16 stage to be free, converts its rows (16 elements per thread and step: one 16-byte load, two 16-byte stores, in
the stages' swizzled layouts; `loads_ahead` loads issued before their conversions), fences its stores for the wgmma
(async proxy), and arrives on the fp16 stage's full barrier and the e4m3 stage's empty one.

Every e4m3 value is an fp16, so the conversion is exact. The integer form the sm80 family uses (common/e4m3.py,
for its bf16 GEMMs) was slower here (H200, 2026-12-02, batch 8 x 32k: 326 us against 278 with cvt into bf16, 215
with cvt into fp16 and four loads ahead; the bf16 cache: 240 us). The descales are per (sequence, KV head) scalars:
k_descale joins the softmax scale and v_descale O's final factor (flash_fwd.py), not the tiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr, pipeline
from cutlass.cutlass_dsl import T, dsl_user_op

from ....common.inline_ptx import ptx_asm
from ..barriers import warpgroup_sync
from ..pipelines import consumer_state, consumer_wait, producer_state
from ..tile_config import WARPGROUP_THREADS

FP8 = cutlass.Float8E4M3FN
FIRST_CONVERTER_WARP = 2  # of the producer warpgroup (warp 0: TMA, warp 1: the query rows)
CONVERTER_WARPS = 2
ELEMS = 16  # per thread and step: one 16-byte e4m3 load


class Staging(NamedTuple):
    """The e4m3 side of an fp8 cache: the TMA -> converter rings of K and V and their stages (tile_n, d, stages)."""

    k: object
    v: object
    sK8: cute.Tensor
    sV8: cute.Tensor
    q_scale: cute.Tensor  # (2,) fp32 in shared memory: [0] the factor bf16 queries were scaled by, inverted


@dsl_user_op
def _e4m3x2_to_f16x2(word: Int32, high: bool, *, loc=None, ip=None) -> Int32:
    """The two e4m3 values in the low (or high) 16 bits of `word` as an f16x2 word (low value low)."""
    half = "h" if high else "l"
    body = f"{{\n.reg .b16 l, h;\nmov.b32 {{l, h}}, $1;\ncvt.rn.f16x2.e4m3x2 $0, {half};\n}}"
    return Int32(ptx_asm(T.i32(), [Int32(word).ir_value(loc=loc, ip=ip)], body, "=r,r", loc=loc, ip=ip))


class _TileCopies(NamedTuple):
    """This thread's steps over one tile: its e4m3 pieces (ELEMS, steps, 1, fp8 stages) and 16-bit pieces."""

    src: cute.Tensor
    dst: cute.Tensor


def _tile_copies(
    s8: cute.Tensor, s16: cute.Tensor, dtype, cols: int, tidx: Int32, threads: int = CONVERTER_WARPS * 32
) -> _TileCopies:
    """Thread `tidx` of `threads` copies rows tidx // (cols / ELEMS) + step * (threads / (cols / ELEMS))."""
    per_row = cols // ELEMS
    threads = cute.make_ordered_layout((threads // per_row, per_row), order=(1, 0))
    values = cute.make_layout((1, ELEMS))
    copy8 = cute.make_tiled_copy_tv(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), FP8, num_bits_per_copy=128),
                                    threads, values)  # fmt: skip
    copy16 = cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128), threads, values
    )
    return _TileCopies(copy8.get_slice(tidx).partition_S(s8), copy16.get_slice(tidx).partition_D(s16))


@cute.jit
def _convert_stage(
    copies: _TileCopies, index8: Int32, index16: Int32, loads_ahead: cutlass.Constexpr[int], zero_from=None
):
    """This thread's steps of one tile, e4m3 stage index8 -> fp16 stage index16; `loads_ahead` loads issued before
    their conversions (the compiler cannot move a shared-memory load above a store it might alias, so one load per
    step would make every step wait out the load's latency). zero_from: (first row to zero, this thread's row in
    step 0, rows per step): rows from there on are written as zeros (a tile's rows past the sequence)."""
    steps = cute.size(copies.src, mode=[1])
    for m0 in cutlass.range_constexpr(0, steps, loads_ahead):
        r8s = []
        for m in cutlass.range_constexpr(m0, min(m0 + loads_ahead, steps)):
            r8 = cute.make_fragment_like(copies.src[None, m, 0, 0])
            cute.autovec_copy(copies.src[None, m, 0, index8], r8)
            r8s.append(r8)
        for i, r8 in enumerate(r8s):
            r16 = cute.make_fragment_like(copies.dst[None, m0 + i, 0, 0])
            w8, w16 = cute.recast_tensor(r8, Int32), cute.recast_tensor(r16, Int32)
            keep = Int32(-1)  # all bits: the row is kept
            if const_expr(zero_from is not None):
                first, row0, rows_per_step = zero_from
                keep = Int32(0) - Int32(row0 + (m0 + i) * rows_per_step < first)
            for w in cutlass.range_constexpr(cute.size(w8)):
                w16[2 * w] = _e4m3x2_to_f16x2(w8[w], False) & keep
                w16[2 * w + 1] = _e4m3x2_to_f16x2(w8[w], True) & keep
            cute.autovec_copy(r16, copies.dst[None, m0 + i, 0, index16])


@cute.jit
def _convert_tile(
    ring8, state8, ring16, state16, copies: _TileCopies, dtype: cutlass.Constexpr, lane: Int32,
    loads_ahead: cutlass.Constexpr[int],
):  # fmt: skip
    consumer_wait(ring8, state8)
    ring16.sync_object_empty.wait(state16.index, state16.phase)
    assert dtype is cutlass.Float16, "the fp8 cache's GEMMs are fp16 (module docstring)"
    _convert_stage(copies, state8.index, state16.index, loads_ahead)
    cute.arch.fence_view_async_shared()  # the 16-bit stores -> the consumers' wgmma (async proxy)
    cute.arch.sync_warp()
    if lane == 0:
        cute.arch.mbarrier_arrive(ring16.producer_get_barrier(state16))
    ring8.consumer_release(state8)  # (lane 0 of each warp arrives)
    state8.advance()
    state16.advance()
    return state8, state16


@cute.jit
def convert_cache_tiles(
    staging: Staging,
    pipes,  # the consumers' LoadPipelines (their k / v rings, full barriers counting CONVERTER_WARPS arrivals)
    sK: cute.Tensor,  # (tile_n, d, stages) 16-bit
    sV: cute.Tensor,
    n_min: Int32,
    n_max: Int32,
    tidx: Int32,  # 0 .. 32 * CONVERTER_WARPS - 1
    dtype: cutlass.Constexpr,
    head_dim: cutlass.Constexpr[int],
    num_stages: cutlass.Constexpr[int],
    fp8_stages: cutlass.Constexpr[int],
    loads_ahead: cutlass.Constexpr[int],
    k_only: cutlass.Constexpr[bool] = False,
):
    lane = cute.arch.lane_idx()
    k_copies = _tile_copies(staging.sK8, sK, dtype, head_dim, tidx)
    v_copies = _tile_copies(staging.sV8, sV, dtype, head_dim, tidx)
    if n_max > n_min:
        k8, v8 = consumer_state(fp8_stages), consumer_state(fp8_stages)
        k16, v16 = producer_state(num_stages), producer_state(num_stages)
        k8, k16 = _convert_tile(staging.k, k8, pipes.k, k16, k_copies, dtype, lane, loads_ahead)
        for _ in cutlass.range(n_max - 1 - n_min, unroll=1):
            k8, k16 = _convert_tile(staging.k, k8, pipes.k, k16, k_copies, dtype, lane, loads_ahead)
            if const_expr(not k_only):
                v8, v16 = _convert_tile(staging.v, v8, pipes.v, v16, v_copies, dtype, lane, loads_ahead)
        if const_expr(not k_only):
            _convert_tile(staging.v, v8, pipes.v, v16, v_copies, dtype, lane, loads_ahead)


@dataclass(frozen=True)
class ConvertingRing:
    """The consumers' V ring when they convert V themselves (KvCacheTileConfig.fp8_v_by_consumers): a wait on it
    waits for the e4m3 stage, converts it into the fp16 stage of the same index (the consumer warpgroup's 128
    threads, 4 steps each at d128), fences the stores for the wgmma, syncs the warpgroup and releases the e4m3
    stage at once; a release is then a no-op (the fp16 stage is this warpgroup's own: its next write, two tiles on,
    follows the P·V that read it, which the walk waits for). The e4m3 and fp16 rings have the same stages, so the
    walk's state indexes both. The walk's first V tile (state.count 0, the right-most: the one that may extend past
    the sequence) has its rows from `tail` on written as zeros, in place of Sm90FlashForward.zero_v_tail. (A frozen
    dataclass: the DSL's loops carry its fields.)"""

    ring8: pipeline.PipelineTmaAsync
    copies: _TileCopies
    tail: Int32  # rows of the first V tile inside the sequence
    row0: Int32  # this thread's row in step 0
    rows_per_step: int
    consumer: int
    loads_ahead: int

    def consumer_try_wait(self, state: pipeline.PipelineState):
        return self.ring8.consumer_try_wait(state)

    def consumer_wait(self, state: pipeline.PipelineState, token=None) -> None:
        self.ring8.consumer_wait(state, token)
        _consumer_convert(self, state)
        self.ring8.consumer_release(state)

    def consumer_release(self, state: pipeline.PipelineState) -> None:
        pass


@cute.jit
def _consumer_convert(ring: ConvertingRing, state: pipeline.PipelineState):
    first = Int32(1 << 30)
    if state.count == 0:
        first = ring.tail
    _convert_stage(ring.copies, state.index, state.index, ring.loads_ahead, (first, ring.row0, ring.rows_per_step))
    cute.arch.fence_view_async_shared()  # the fp16 stores -> this warpgroup's wgmma (async proxy)
    warpgroup_sync(ring.consumer)


def converting_ring(
    ring8, sV8: cute.Tensor, sV: cute.Tensor, head_dim: int, tail: Int32, tidx: Int32, consumer: int, loads_ahead: int
) -> ConvertingRing:
    """The V ring of a consumer warpgroup converting its own V tiles (tidx: 0..127 within the warpgroup)."""
    per_row = head_dim // ELEMS
    copies = _tile_copies(sV8, sV, cutlass.Float16, head_dim, tidx, WARPGROUP_THREADS)
    return ConvertingRing(ring8, copies, tail, tidx // per_row, WARPGROUP_THREADS // per_row, consumer, loads_ahead)

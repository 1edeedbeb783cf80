"""Tile shapes of the sm80 forward kernel, per head dim and target.

Warps split the query rows and each spans the full head dim, so a thread holds tile_m * head_dim_v / threads fp32
output accumulators plus tile_m * tile_n / threads fp32 scores. The preferred tiles are FlashAttention-2's sm80 ones:

  head dim    tile (m x n)   warps   O + S registers / thread   why
  <= 64       128 x 128      4       64 + 128                   a wide score tile halves the softmax passes
  <= 128      128 x 64       4       128 + 64 (d128)            32 rows per warp: each K/V fragment read from shared
                                                                memory feeds two m16 MMAs
  <= 256      128 x 64       8       128 + 32 (d256)            O alone is 128 registers: 16 rows per warp

These sit at the 255-register limit, and whether ptxas spills there depends on the exact head dim, mask and target.
The contract is no spills up to head dim 128, so `fwd_tile_candidates` lists fall-backs (a more conservative ptxas
level, then a narrower score tile) and the backend keeps the first candidate that compiles without spilling.

K/V stages: with 2 stages the next block's K and V are both in flight while this block computes; with 1 stage K and
V still overlap each other (V loads during Q K^T, the next K during P V). Two stages are used where two CTAs of that
size still fit in the target's shared memory (2 CTAs/SM hide each other's softmax), otherwise one.

Head dims are padded to the MMA k (16), and further where the 16-byte global-load tiling would otherwise cover more
rows per pass than a tile has (8 warps with 16-element rows): the padding is zero-filled in shared memory.

Measured on an NVIDIA H200 (sm_90a target, bf16, batch * seqlen = 16k tokens, heads * head_dim = 2048, forward
TFLOP/s = 4 b h s^2 d / time (halved when causal), triton.testing.do_bench medians, by the sm80-forward session's
tuning script; the project benchmark reproduces the comparison with `CUTE_FLASH_ARCH=sm80 python -m cute_flash bench
--impls cute-flash,sdpa-flash --dtypes bf16 --head-dims 64,128,256 --seqlens 4096 --directions fwd --no-memory`):
  d128 s4096: 128x64 O2 376 (O1 363, O3 381 but spills, 128x48 358, 1 stage 362); SDPA flash 350
  d128 s8192: 378 vs 347; d128 s4096 causal: 322 (O1 324) vs 304
  d64 s4096: 128x128 339, 128x64 300; SDPA flash 306.   d256 s4096: 128x64 x 8 warps 317, 64x64 x 4 warps 324; 318
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

# Shared memory one CTA may use, by CuTe DSL target (bytes): A100 / H100 opt-in maxima, and sm86/sm89 for others.
SMEM_CAPACITY = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024, "sm_90a": 227 * 1024}
DEFAULT_SMEM_CAPACITY = 99 * 1024  # the smallest of the sm8x parts: safe for an unknown target
VECTOR_ELEMS = 8  # one 16-byte global load of 16-bit elements

# Compiler optimisation level (CuTe DSL --opt-level, which reaches ptxas). At 3, ptxas hoists shared-memory loads so
# far ahead of the MMAs that it spills loop invariants at these register-bound tiles; 2 spills less and measured
# fastest among the spill-free choices; 1 schedules more conservatively and is the fallback when 2 still spills.
OPT_LEVEL = 2


def round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def row_chunk_elems(row_elems: int) -> int:
    """Width of the swizzled shared-memory atom (and of one global-load pass) for rows of `row_elems` elements."""
    for chunk in (64, 32, 16):
        if row_elems % chunk == 0:
            return chunk
    raise ValueError(f"row of {row_elems} elements is not a multiple of 16")


def rows_per_load_pass(row_elems: int, num_threads: int) -> int:
    return num_threads // (row_chunk_elems(row_elems) // VECTOR_ELEMS)


def pad_head_dim(head_dim: int, num_threads: int, tile_rows: int) -> int:
    """head_dim rounded up to 16, or further until one load pass covers at most (and divides) tile_rows rows."""
    for multiple in (16, 32, 64):
        padded = round_up(head_dim, multiple)
        if tile_rows % rows_per_load_pass(padded, num_threads) == 0:
            return padded
    raise ValueError(f"no padding of head dim {head_dim} fits a {tile_rows}-row tile with {num_threads} threads")


@dataclass(frozen=True)
class FwdTile:
    tile_m: int  # query rows per CTA
    tile_n: int  # key rows per main-loop step
    num_warps: int
    num_stages: int  # K/V shared-memory stages
    head_dim_pad: int  # head_dim padded for the MMA k and the load tiling
    head_dim_v_pad: int
    opt_level: int = OPT_LEVEL

    @property
    def num_threads(self) -> int:
        return self.num_warps * 32

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        q = self.tile_m * self.head_dim_pad
        kv = self.tile_n * (self.head_dim_pad + self.head_dim_v_pad) * self.num_stages
        o = self.tile_m * self.head_dim_v_pad  # O is staged through Q's buffer; it may be the larger of the two
        return (max(q, o) + kv) * elem_bytes

    def as_dict(self) -> dict:
        return {
            "tile_m": self.tile_m,
            "tile_n": self.tile_n,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "head_dim_pad": self.head_dim_pad,
            "head_dim_v_pad": self.head_dim_v_pad,
            "opt_level": self.opt_level,
        }


def _with_stages(tile_m: int, tile_n: int, warps: int, head_dim: int, head_dim_v: int, target: str, opt_level: int):
    rows = min(tile_m, tile_n)
    d_pad = pad_head_dim(head_dim, warps * 32, rows)
    dv_pad = pad_head_dim(head_dim_v, warps * 32, rows)
    capacity = SMEM_CAPACITY.get(target, DEFAULT_SMEM_CAPACITY)
    two = FwdTile(tile_m, tile_n, warps, 2, d_pad, dv_pad, opt_level)
    if 2 * two.smem_bytes() <= capacity:
        return two
    return FwdTile(tile_m, tile_n, warps, 1, d_pad, dv_pad, opt_level)


def fwd_tile_candidates(head_dim: int, head_dim_v: int, target: str) -> List[FwdTile]:
    """Tiles to compile in order, fastest first; the backend keeps the first one ptxas compiles without spills.

    At these register-bound tiles whether ptxas spills depends on the head dim, the mask code and the target, so the
    choice is made by compiling rather than by a table. The list is a pure function of its arguments, so one spec
    always gets the same kernel. Beyond head dim 128 spills are tolerated and only the first tile is used.
    """
    d_max = max(head_dim, head_dim_v)

    def tile(tile_m, tile_n, warps, opt_level=OPT_LEVEL):
        return _with_stages(tile_m, tile_n, warps, head_dim, head_dim_v, target, opt_level)

    if d_max <= 64:
        return [tile(128, 128, 4), tile(128, 128, 4, 1), tile(128, 64, 4, 1)]
    if d_max <= 128:
        return [tile(128, 64, 4), tile(128, 64, 4, 1), tile(128, 32, 4, 1)]
    return [tile(128, 64, 8)]

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
TFLOP/s = 4 b h s^2 d / time (halved when causal), triton.testing.do_bench medians, by a tuning script no longer
kept; the project benchmark reproduces the comparison with `CUTE_FLASH_ARCH=sm80 python -m cute_flash bench
--impls cute-flash,sdpa-flash --dtypes bf16 --head-dims 64,128,256 --seqlens 4096 --directions fwd --no-memory`):
  d128 s4096: 128x64 O2 376 (O1 363, O3 381 but spills, 128x48 358, 1 stage 362); SDPA flash 350
  d128 s8192: 378 vs 347; d128 s4096 causal: 322 (O1 324) vs 304
  d64 s4096: 128x128 339, 128x64 300; SDPA flash 306.   d256 s4096: 128x64 x 8 warps 317, 64x64 x 4 warps 324; 318
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import List, Optional

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
class FwdTileConfig:
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
    two = FwdTileConfig(tile_m, tile_n, warps, 2, d_pad, dv_pad, opt_level)
    if 2 * two.smem_bytes() <= capacity:
        return two
    return FwdTileConfig(tile_m, tile_n, warps, 1, d_pad, dv_pad, opt_level)


def fwd_tile_candidates(head_dim: int, head_dim_v: int, target: str) -> List[FwdTileConfig]:
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


def kvcache_tile_candidates(head_dim: int, head_dim_v: int, target: str) -> List[FwdTileConfig]:
    """The KV-cache forward's tiles (flash_fwd_kvcache.py), fastest expected first, as fwd_tile_candidates'.

    Its rows are a KV head's query heads times the new tokens: a handful when decoding, so the tiles are
    FlashAttention-2's split-KV ones, 64 rows (4 warps of 16), and keys per step by head dim (256 up to d64, 128 up
    to d128, 64 beyond): long key steps amortise each block's softmax over the few rows and keep a whole K or V tile
    in flight per CTA, which is what a memory-bound decoding step needs."""
    d_max = max(head_dim, head_dim_v)
    tile_n = 256 if d_max <= 64 else 128 if d_max <= 128 else 64

    def tile(n, opt_level=OPT_LEVEL):
        return _with_stages(64, n, 4, head_dim, head_dim_v, target, opt_level)

    return [tile(tile_n), tile(tile_n, 1), tile(tile_n // 2, 1)]


# ---------------------------------------------------------------------------------------------------- backward
# Tile shapes of the sm80 backward main kernel (kept free of cutlass imports: the front end asks for them early).

# Largest dynamic shared memory per CTA on an A100; the same tiles serve sm_90a, where the sm80 kernels also run.
SM80_SMEM_CAPACITY = 163 * 1024


@dataclass(frozen=True)
class BwdTileConfig:
    """Tile shape and warp arrangement of the main backward kernel (part of its compile key)."""

    block_m: int  # query rows per inner step
    block_n: int  # keys owned by one CTA
    num_stages: int  # shared-memory buffers for the Q / dO tiles (1 or 2)
    warps_m_sdp: int  # warps along the query dim of S and dP (the rest go along keys)
    warps_n_dkv: int  # warps along the key dim of dK and dV (the rest go along the head dim)
    warps_m_dq: int  # warps along the query dim of dQ (the rest go along the head dim)
    num_warps: int = 8
    dq_chunk: int = 0  # head-dim columns of dQ per pass (0: all at once); smaller bounds the dQ accumulator
    # How dQ leaves the CTA. "rows": fp32 atomics into a (b, sq_padded, h, d) buffer, one per element: a warp's 32
    # atomics land on 8 rows, 8 cache lines. "fragment": the buffer is (b, h, sq_padded * d) and each m-block's
    # block_m * d floats are stored in the dQ mma's register order, thread-interleaved, so a warp's atomic covers
    # 32 * dq_vec consecutive floats (FlashAttention-2's scheme); the postprocess undoes the permutation.
    dq_layout: str = "rows"
    dq_vec: int = 1  # floats per dQ atomic: 1 (red.f32, any target) or 2 / 4 (red.v2/v4.f32, sm_90 and newer)
    dq_before_dk: bool = False  # dQ product and its atomics before the dK product (atomics overlap the dK mmas)
    opt_level: int = 3  # CuTe DSL --opt-level (reaches ptxas) for the kernels that depend on this config

    @property
    def num_threads(self) -> int:
        return self.num_warps * 32

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        qdo = 2 * self.num_stages * self.block_m * head_dim
        kv = 2 * self.block_n * head_dim
        pds = 2 * self.block_m * self.block_n
        return (qdo + kv + pds) * elem_bytes

    def as_dict(self, head_dim: int) -> dict:
        return {
            "block_m": self.block_m,
            "block_n": self.block_n,
            "num_stages": self.num_stages,
            "num_warps": self.num_warps,
            "warps_mn_sdp": (self.warps_m_sdp, self.num_warps // self.warps_m_sdp),
            "warps_nd_dkv": (self.warps_n_dkv, self.num_warps // self.warps_n_dkv),
            "warps_md_dq": (self.warps_m_dq, self.num_warps // self.warps_m_dq),
            "dq_chunk": self.dq_chunk or head_dim,
            "dq_layout": self.dq_layout,
            "dq_vec": self.dq_vec,
            "dq_before_dk": self.dq_before_dk,
            "opt_level": self.opt_level,
            "threads": self.num_threads,
            "shared_bytes": self.smem_bytes(head_dim),
        }


def bwd_tile_config(head_dim: int, target: Optional[str] = None) -> BwdTileConfig:
    """The backward tile config for `head_dim` on `target` ("sm_80", "sm_90a", ...). Studies pass other configs to
    `backward.run_backward(cfg=...)`."""
    return _tile_config(head_dim, _target_major(target))


@functools.lru_cache(maxsize=None)
def _tile_config(head_dim: int, major: int) -> BwdTileConfig:
    # Memoised: every backward call asks for its config, and building one takes ~20 us of host time.
    base = replace(_fa2_tile_config(head_dim), opt_level=default_opt_level(head_dim, major))
    if major == 9 and head_dim in _FRAGMENT_HEAD_DIMS:
        return fragment_dq(base, vec=4, major=major, dq_first=True)
    return base


def _target_major(target: Optional[str]) -> int:
    if target is None:
        return 8
    return int(target.removeprefix("sm_").rstrip("a")) // 10


def fragment_dq(cfg: BwdTileConfig, vec: int, major: int, dq_first: bool = False) -> BwdTileConfig:
    """cfg with dQ in the "fragment" layout, `vec` floats per reduction, optionally dQ before dK (two stages only).
    Vector reductions (red.global.add.v2/v4.f32) exist from sm_90 on; older targets get the scalar form of the same
    layout."""
    return replace(
        cfg, dq_layout="fragment", dq_vec=vec if major >= 9 else 1, dq_before_dk=dq_first and cfg.num_stages == 2
    )


# The "fragment" dQ layout with 4-float reductions and dQ before dK where it was measured faster and passed the GPU
# test matrix (H200, sm_90a target, 2026-11-21: 1.07-1.12x SDPA flash at d128 seqlen 4k/16k, 0.98-1.03x at d64,
# 1.05-1.09x at d256, where with one Q/dO stage dQ stays after dK; the "rows" layout 0.59-0.79x). Other head dims,
# sm_80 targets (where the same layout takes scalar atomics) and
# sm_100a keep the previously tested "rows" until a GPU run covers them.
_FRAGMENT_HEAD_DIMS = (64, 128, 256)


def default_opt_level(head_dim: int, target_major: int) -> int:
    """ptxas level of the tiled backward kernels. At 3 the d96-d128 kernels spill (sm_80, d128: 16 B, 68 B with GQA;
    sm_90a, d128: 32-100 B); at 1 none does. On sm_90a, where it can be timed, 3 is 8-10% faster at d128 despite the
    spills (H200, 2026-11-21: 1.08-1.12x FlashAttention-2 against 0.98-1.02x at 1) and stays. sm_8x targets cannot be
    timed here; they take the spill-free build."""
    return 1 if target_major < 9 and 96 <= head_dim <= 128 else 3


def _fa2_tile_config(head_dim: int) -> BwdTileConfig:
    """FlashAttention-2's arrangement, 8 warps, head_dim a multiple of 32 up to 256:

    head dim   tile (m x n)   Q/dO stages   why
    <= 128     64 x 128       2             dK + dV accumulators (128 regs/thread at d128) leave room for S and dP
    <= 224     64 x 64        2             a 128-key tile would need 192+ accumulator registers per thread
    256        64 x 64        1             two stages of 64 x 256 Q and dO exceed the A100's 163 KiB

    Each warp arrangement must tile its product: a warp covers 16 rows and 16 columns per mma step, so along the head
    dim the warps need head_dim % (16 * warps) == 0 (96, 160, 224 take 2 warps there instead of 4).
    """
    warps = 8
    block_m = 64
    block_n = 128 if head_dim <= 128 else 64

    def fits(rows: int, warps_rows: int) -> bool:
        return rows % (16 * warps_rows) == 0 and head_dim % (16 * (warps // warps_rows)) == 0

    warps_n_dkv = next(w for w in (block_n // 32, 4, 8) if fits(block_n, w))
    warps_m_dq = next(w for w in (2, 4) if fits(block_m, w))
    warps_m_sdp = 2 if block_n == 128 else 4
    # From d128 up, dQ in 64-column passes: its accumulator then takes 16 registers instead of d / 4, which is what
    # keeps these kernels free of spills next to the dK/dV accumulators (measured with ptxas for sm_80).
    dq_chunk = 64 if head_dim >= 128 and head_dim % 64 == 0 else 0
    for stages in (2, 1):
        cfg = BwdTileConfig(block_m, block_n, stages, warps_m_sdp, warps_n_dkv, warps_m_dq, warps, dq_chunk)
        if cfg.smem_bytes(head_dim) <= SM80_SMEM_CAPACITY:
            return cfg
    raise AssertionError(f"no backward tile fits head_dim {head_dim}")

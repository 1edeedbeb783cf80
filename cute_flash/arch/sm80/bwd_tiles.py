"""Tile shapes of the sm80 backward main kernel (kept free of cutlass imports: the front end asks for them early)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional

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
    `backward.run_backward(cfg=...)` (profiling/sm80_bwd_variants.py)."""
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
# 1.05-1.09x at d256, where with one Q/dO stage dQ stays after dK; the "rows" layout 0.59-0.79x;
# profiling/sm80_bwd_variants.py). Other head dims, sm_80 targets (where the same layout takes scalar atomics) and
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

"""Tile configurations of the sm90 FP8 forward kernel and the shared-memory budget behind them.

The FP8 kernel keeps the bf16 kernel's CTA shape (`tile_config.FwdTileConfig`: one producer warpgroup, 64 query rows
per consumer warpgroup, ping-pong) with these differences:
  - Q, K and Vᵀ tiles are e4m3 (1 byte), O is staged in shared memory in the 16-bit output dtype (so it cannot
    reuse the Q slice as the bf16 kernel does);
  - the key tile must divide the K/V scale block (`kv_scale_block`: 384 keys up to d = 128, 128 above) and be a
    multiple of 32 (the k of an e4m3 wgmma), so that each tile has one K and one V descale;
  - `promote_pv`: P·V of every key block goes into a fresh wgmma accumulator that is then added to O with fp32 FFMAs
    (folded into O's per-block rescale, so it costs registers, not instructions). FP8 wgmma accumulates with less
    than fp32 precision; without promotion O is carried through every P·V wgmma of the row and its rounding grows
    with seqlen. It needs one more O-sized register tile: at d = 128 it fits beside 128-key tiles, not 192-key ones.
  - `exp2_poly_per_row`: of the tile_n / 4 probabilities each thread computes per row and tile, this many (the last
    ones) come from a degree-3 polynomial on the FMA pipe instead of MUFU.EX2. At d = 128 the e4m3 wgmma is fast
    enough that the exponentials (16 per clock per SM) take as long as both GEMMs; moving some to the 128-wide FMA
    pipe trades issue slots for MUFU time (FlashAttention-4's idea on Blackwell). P is rounded to e4m3 afterwards,
    so the polynomial's 1e-4 relative error is invisible. Measured (H200, docs/fp8.md): accurate (the GPU tests pass)
    but 7-11% slower, because the loop is bound by instruction issue, not by MUFU; so the default keeps 0.
  - `row_sum_mma`: the softmax row sums come out of the P·V wgmma instead of 64 FADDs per thread and tile: V's shared
    tile gets 8 more rows of ones (written once), so P·[V | 1] has N = dv + 8 and its last columns hold Σ P — of the
    e4m3-rounded P that multiplies V, which is also what normalises it (the accuracy study measured the same RMSE
    either way). Needs promotion (the sums land in the fresh P·V accumulator), tile_n <= 128 and dv + 8 <= 256.
    Measured 2-3% faster causal with 128-key tiles (the causal default then), 1-3% slower without a mask.

The alternatives measured against these defaults stay out of the library (the numbers: docs/fp8.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ....fp8.prepare import BLOCK_M, BLOCK_N
from ..tile_config import ROWS_PER_CONSUMER, SMEM_CAPACITY_BYTES, SMEM_RESERVED_BYTES, FwdTileConfig, register_problem

WIDE_KV_SCALE_BLOCK = 384  # keys per K/V descale at head dims <= 128: two 192-key tiles, three 128-key ones


def kv_scale_block(head_dim: int, head_dim_v: int) -> int:
    """Keys per K/V descale this kernel reads (SM90Backend.fp8_kv_scale_block): 384 up to d = 128, where the default
    key tile is 192; BLOCK_N (128) above, where a 384-row pre-pass block would need more than 1024 threads."""
    return WIDE_KV_SCALE_BLOCK if max(head_dim, head_dim_v) <= 128 else BLOCK_N


FP8_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Fp8FwdConfig:
    tile: FwdTileConfig
    promote_pv: bool
    exp2_poly_per_row: int = 0
    row_sum_mma: bool = False

    def as_dict(self) -> dict:
        return {
            **self.tile.as_dict(),
            "promote_pv": self.promote_pv,
            "exp2_poly_per_row": self.exp2_poly_per_row,
            "row_sum_mma": self.row_sum_mma,
        }

    def pv_width(self, head_dim_v: int) -> int:
        """N of the P·V wgmma: dv, plus the 8 columns of ones whose products are the row sums."""
        return head_dim_v + (ROW_SUM_COLUMNS if self.row_sum_mma else 0)


ROW_SUM_COLUMNS = 8  # the narrowest wgmma N step


def smem_bytes(cfg: Fp8FwdConfig, head_dim: int, head_dim_v: int, out_bytes: int = 2) -> int:
    t = cfg.tile
    q = t.tile_m * head_dim
    kv = t.num_stages * t.tile_n * (head_dim + cfg.pv_width(head_dim_v))
    o = t.tile_m * head_dim_v * out_bytes
    return q + kv + o + SMEM_RESERVED_BYTES


def budget_problem(cfg: Fp8FwdConfig, head_dim: int, head_dim_v: int) -> Optional[str]:
    t = cfg.tile
    block = kv_scale_block(head_dim, head_dim_v)
    if t.tile_n % 32 != 0 or block % t.tile_n != 0:
        return f"tile_n={t.tile_n} must be a multiple of 32 dividing the K/V scale block {block}"
    if ROWS_PER_CONSUMER % BLOCK_M != 0 and BLOCK_M % ROWS_PER_CONSUMER != 0:
        return f"the Q scale block {BLOCK_M} must align with the {ROWS_PER_CONSUMER} rows of a consumer"
    if (problem := register_problem(t)) is not None:
        return problem
    if cfg.row_sum_mma and not cfg.promote_pv:
        return "row_sum_mma needs promote_pv (the row sums are taken from each tile's fresh P·V accumulator)"
    if cfg.row_sum_mma and t.tile_n > 128:
        return f"row_sum_mma writes its ones rows as one 128-byte swizzle atom: tile_n <= 128, got {t.tile_n}"
    if cfg.pv_width(head_dim_v) > 256:
        return f"row_sum_mma needs head_dim_v + {ROW_SUM_COLUMNS} <= 256 (the widest wgmma), got {head_dim_v}"
    if not 0 <= cfg.exp2_poly_per_row <= t.tile_n // 4:
        return f"exp2_poly_per_row={cfg.exp2_poly_per_row} must lie in [0, tile_n / 4 = {t.tile_n // 4}]"
    need = smem_bytes(cfg, head_dim, head_dim_v)
    if need > SMEM_CAPACITY_BYTES:
        return f"FP8 tile {t.tile_m}x{t.tile_n} x {t.num_stages} stages needs {need} B of shared memory"
    return None


_BY_HEAD_DIM = (
    (64, Fp8FwdConfig(FwdTileConfig(3, 128, 2, consumer_regs=160, producer_regs=32), promote_pv=False)),
    (128, Fp8FwdConfig(FwdTileConfig(2, 192, 2), promote_pv=False)),
    (256, Fp8FwdConfig(FwdTileConfig(2, 128, 2, ping_pong=False), promote_pv=False)),
)
# Measured on the H200 (docs/fp8.md), against the defaults until 2026-11-22 in the same process:
# d <= 128: 192-key tiles, P·V accumulated in the wgmma: +7.6-8.4% at seqlen 16k without a mask, +4.8-5.6% causal,
#   against 128-key tiles with promotion (and, causal, the wgmma row sums). Promotion does not fit beside a 192-key
#   tile (S 96 + P 24 + O 64 + the promoted P·V 64 registers per thread); without it the RMSE at 32k keys is 0.45%
#   above the exact-accumulation model, the promoted 128-key build's 0.14%.
# d <= 256: 128-key tiles instead of 64: +17-18% at 4k and 16k, both masks. O alone is 128 registers, so no
#   promotion; 2 stages use 225 of the 227 KiB of shared memory.


def fp8_fwd_config(head_dim: int, head_dim_v: int, mask_kind: str = "none") -> Fp8FwdConfig:
    """The measured default for these head dims (the reasons are above _BY_HEAD_DIM)."""
    # mask_kind: no default depends on it since the 192-key tile (the causal one took row_sum_mma before); callers
    # keep passing it so that a mask-specific default needs no new plumbing.
    width = max(head_dim, head_dim_v)
    for limit, cfg in _BY_HEAD_DIM:
        if width <= limit:
            return cfg
    raise ValueError(f"no sm90 FP8 tile configuration for head dim {width} (at most {FP8_MAX_HEAD_DIM})")

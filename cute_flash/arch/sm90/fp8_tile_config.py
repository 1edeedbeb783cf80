"""Tile configurations of the sm90 FP8 forward kernel and the shared-memory budget behind them.

The FP8 kernel keeps the bf16 kernel's CTA shape (`tile_config.FwdTileConfig`: one producer warpgroup, 64 query rows
per consumer warpgroup, ping-pong) with three differences:
  - Q, K and Vᵀ tiles are e4m3 (1 byte), O is staged in shared memory in the 16-bit output dtype (so it cannot
    reuse the Q slice as the bf16 kernel does);
  - the key tile must divide the K/V scale block (`cute_flash.fp8.prepare.BLOCK_N` = 128) and be a multiple of 32
    (the k of an e4m3 wgmma), so that each tile has one K and one V descale;
  - `promote_pv`: P·V of every key block goes into a fresh wgmma accumulator that is then added to O with fp32 FFMAs
    (folded into O's per-block rescale, so it costs registers, not instructions). FP8 wgmma accumulates with less
    than fp32 precision; without promotion O is carried through every P·V wgmma of the row and its rounding grows
    with seqlen. It needs one more O-sized register tile, so it is on for d <= 128 only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...fp8.prepare import BLOCK_M, BLOCK_N
from .tile_config import REGISTERS_PER_SM, ROWS_PER_CONSUMER, SMEM_CAPACITY_BYTES, SMEM_RESERVED_BYTES, FwdTileConfig
from .tile_config import WARPGROUP_THREADS

FP8_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Fp8FwdConfig:
    tile: FwdTileConfig
    promote_pv: bool

    def as_dict(self) -> dict:
        return {**self.tile.as_dict(), "promote_pv": self.promote_pv}


def smem_bytes(cfg: Fp8FwdConfig, head_dim: int, head_dim_v: int, out_bytes: int = 2) -> int:
    t = cfg.tile
    q = t.tile_m * head_dim
    kv = t.num_stages * t.tile_n * (head_dim + head_dim_v)
    o = t.tile_m * head_dim_v * out_bytes
    return q + kv + o + SMEM_RESERVED_BYTES


def budget_problem(cfg: Fp8FwdConfig, head_dim: int, head_dim_v: int) -> Optional[str]:
    t = cfg.tile
    if t.tile_n % 32 != 0 or BLOCK_N % t.tile_n != 0:
        return f"tile_n={t.tile_n} must be a multiple of 32 dividing the K/V scale block {BLOCK_N}"
    if ROWS_PER_CONSUMER % BLOCK_M != 0 and BLOCK_M % ROWS_PER_CONSUMER != 0:
        return f"the Q scale block {BLOCK_M} must align with the {ROWS_PER_CONSUMER} rows of a consumer"
    regs = t.consumer_regs * WARPGROUP_THREADS * t.num_consumer_wgs + t.producer_regs * WARPGROUP_THREADS
    if regs > REGISTERS_PER_SM:
        return f"register split {t.consumer_regs}/{t.producer_regs} needs {regs} > {REGISTERS_PER_SM} registers"
    need = smem_bytes(cfg, head_dim, head_dim_v)
    if need > SMEM_CAPACITY_BYTES:
        return f"FP8 tile {t.tile_m}x{t.tile_n} x {t.num_stages} stages needs {need} B of shared memory"
    return None


_BY_HEAD_DIM = (
    (64, Fp8FwdConfig(FwdTileConfig(3, 128, 2, consumer_regs=160, producer_regs=32), promote_pv=False)),
    (128, Fp8FwdConfig(FwdTileConfig(2, 128, 2), promote_pv=True)),
    (256, Fp8FwdConfig(FwdTileConfig(2, 64, 2, ping_pong=False), promote_pv=False)),
)


def fp8_fwd_config(head_dim: int, head_dim_v: int) -> Fp8FwdConfig:
    width = max(head_dim, head_dim_v)
    for limit, cfg in _BY_HEAD_DIM:
        if width <= limit:
            return cfg
    raise ValueError(f"no sm90 FP8 tile configuration for head dim {width} (at most {FP8_MAX_HEAD_DIM})")

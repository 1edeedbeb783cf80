"""Tile configurations of the sm90 KV-cache forward, what it refuses, and how many CTAs split each query tile's keys.

The CTA is the bf16 forward's (`..tile_config.FwdTileConfig`: a producer warpgroup, 64 rows per consumer warpgroup);
its rows are (query token, query head) pairs of one KV head, `group = h / h_kv` rows per token. Decoding has few of
them (group x sq, e.g. 4..32): one consumer warpgroup of 64 rows, and the tile is chosen for the bytes it keeps in
flight, since the loop is bound by the cache's bytes, not by the tensor cores.

The numbers (H200: 132 SMs, 4.8 TB/s, ~1.8-2.0 GHz under load):
  bandwidth per SM   4.8 TB/s / 132 = 36 GB/s, about 18-20 bytes per cycle.
  bytes in flight    Little's law with ~1 us of DRAM latency (unloaded; 1.5-2 us under a full load): 36 KiB per
                     SM at least, 55-73 KiB under load. Only the K / V ring holds bytes in flight (Q is read once).
  tensor cores       a 64 x tile_n x d Q·Kᵀ and a 64 x d x tile_n P·V per tile: 4 * 64 * tile_n * d FLOP, at
                     ~4096 bf16 FLOP / cycle / SM 30% of the tile's memory time at any tile_n (both scale with
                     tile_n), and the softmax of 64 x tile_n scores as much again: the consumer keeps up.
  two CTAs per SM    a CTA starts with three dependent round trips (seqlens_k, its first page-table entries, its
                     first TMA tile: ~2-3 us) and ends with its stores; split CTAs walk a few dozen tiles and large
                     batches run in several waves, so with one CTA per SM the SM idles through every start (a split
                     of 1k keys at d128 streams 512 KiB in ~14 us). With two, one streams while the other starts.
                     That needs registers for 2 x 256 threads (consumer 232 + producer 24 per thread pair: 64 K) and
                     shared memory for two (228 KiB per SM).
  d128 (decoding)    64 x 64, 2 stages, 2 CTAs / SM: K + V stages 2 x 32 KiB = 64 KiB in flight per CTA, 128 KiB per
                     SM; Q 16 KiB + 64 KiB + 1 KiB = 81 KiB per CTA. (64 x 128 needs 144 KiB: one CTA per SM.)
                     S 32 + P 16 + O 64 + the next S 32 fp32 registers per thread: 232 is ample.
  d64 (decoding)     64 x 128, 2 stages, 2 CTAs / SM: the same 64 KiB in flight per CTA; 73 KiB of shared memory.
  d256 (decoding)    64 x 64, 3 stages, 1 CTA / SM: O alone is 128 registers (240 needed), so one CTA; 3 stages of
                     64 KiB = 192 KiB in flight; 32 + 192 + 1 = 225 KiB of shared memory.
  more rows          (group x sq > 64: chunked prefill, long speculative runs) the forward's own tile for the head
                     dim (fwd_tile_config: 128 x 128 at d128), one CTA per SM: each KV byte is read once per 128 rows.
Measured (H200, 2026-12-02, profiling/decode_benchmark.py --graphs, d128 h32/8): the 16-bit cache at 4.3-4.5 TB/s
(90-93%) from batch 8 x 32k and batch 64 x 8k up, as fast as torch SDPA; paged (16 / 128) within 1% of dense.

Splits (`kvcache_splits`): the grid has b x h_kv x row tiles CTAs per split; the split count is the smallest whose
last wave fills the CTA slots (SMs x CTAs per SM; one per SM for a small grid, SMALL_GRID_DIVISOR) within 5% as
well as any count up to the cap does
(arch/split_kv.splits_to_fill), from host shapes only: a CUDA graph replays it with new lengths and page tables.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Optional, Union

from ....common.block_info import BlockInfo
from ....spec import AttentionSpec
from ....validation import KvCacheProblem
from ... import split_kv
from ..tile_config import (
    REGISTERS_PER_SM,
    ROWS_PER_CONSUMER,
    SMEM_CAPACITY_BYTES,
    WARPGROUP_THREADS,
    FwdTileConfig,
    budget_problem,
    fwd_tile_config,
    smem_bytes,
)

SMEM_PER_SM_BYTES = 228 * 1024  # Hopper: shared memory of one SM, for every resident CTA
SMEM_SYSTEM_BYTES_PER_CTA = 1024  # what the hardware reserves per resident CTA
PAGE_ROW_MULTIPLE = 8  # a TMA box of whole 8-row swizzle atoms (loads.py); other page sizes: the sm80 gather path
KVCACHE_HEAD_DIMS = (64, 128, 256)  # head_dim == head_dim_v: the 128-byte-swizzled K / V tiles the boxes cut


@dataclass(frozen=True)
class KvCacheTileConfig(FwdTileConfig):
    ctas_per_sm: int = 1  # the launch's min_blocks_per_mp: CTAs that share an SM (registers and shared memory)
    # An fp8 cache (spec.kv_fp8): stages of the e4m3 K / V tiles that TMA fills and the producer warpgroup's
    # converter warps turn into the 16-bit stages the consumers read (convert.py); 0: a 16-bit cache.
    fp8_stages: int = 0
    # Steps of a converter thread whose 16-byte e4m3 loads are issued before their conversions (convert.py): 4
    # registers each, out of the producer warpgroup's producer_regs.
    fp8_loads_ahead: int = 1
    # The consumer warpgroup converts the V tiles itself (convert.ConvertingRing), the converter warps only K: no
    # converter -> consumer hand-off for V. Needs fp8_stages == num_stages and one consumer.
    fp8_v_by_consumers: bool = False


def _config(cfg: FwdTileConfig, ctas_per_sm: int, fp8_stages: int = 0, fp8_loads_ahead: int = 1) -> KvCacheTileConfig:
    extra = {"ctas_per_sm": ctas_per_sm, "fp8_stages": fp8_stages, "fp8_loads_ahead": fp8_loads_ahead}
    return KvCacheTileConfig(**{**cfg.__dict__, **extra})


# (head dim, decoding config); reasons in the module docstring.
_DECODE_BY_HEAD_DIM = {
    64: _config(FwdTileConfig(1, 128, 2, ping_pong=False, consumer_regs=232), 2),
    128: _config(FwdTileConfig(1, 64, 2, ping_pong=False, consumer_regs=232), 2),
    256: _config(FwdTileConfig(1, 64, 3, ping_pong=False), 1),
}
# An fp8 cache: the same tiles with two e4m3 stages beside the two 16-bit (fp16) ones, and 56 registers for the
# producer warpgroup, whose two converter warps issue 4 of their 16-byte loads before converting them
# (fp8_loads_ahead). d128: 16 + 64 + 32 + 1 KiB = 113 KiB per CTA, two per SM (228 KiB); (200 + 56) x 128 x 2 =
# 64 K registers; d128's consumers convert V themselves (fp8_v_by_consumers). Measured (H200, 2026-12-03,
# profiling/kvcache_configs.py; docs/performance.md): 1.16-1.19x the bf16 cache's speed from batch 8 x 32k, 1.14-1.15x
# with the converter warps converting V too (one load ahead 1.07-1.09x, eight ahead as four; 2026-12-02: deeper e4m3
# rings in 32- or 48-key tiles and one CTA per SM with 4-8 stages slower): an fp8 cache halves the memory, not yet
# the time.
# d256: one CTA, 32 + 128 + 64 + 1 = 225 KiB, 72 producer registers for its 16 steps per tile. More rows (d128): the
# forward's 128 x 128 tile with two e4m3 stages (225 KiB) and 232 / 40 registers, loads one at a time; d64 and
# d256 keep the 64-row tile for every row count (the forward's tiles leave no room for the e4m3 stages).
_FP8_DECODE_BY_HEAD_DIM = {
    64: _config(FwdTileConfig(1, 128, 2, ping_pong=False, consumer_regs=200, producer_regs=56), 2, 2, 4),
    128: replace(
        _config(FwdTileConfig(1, 64, 2, ping_pong=False, consumer_regs=200, producer_regs=56), 2, 2, 4),
        fp8_v_by_consumers=True,
    ),
    256: _config(FwdTileConfig(1, 64, 2, ping_pong=False, consumer_regs=240, producer_regs=72), 1, 2, 4),
}
_FP8_MORE_ROWS_BY_HEAD_DIM = {128: _config(FwdTileConfig(2, 128, 2, consumer_regs=232, producer_regs=40), 1, 2)}


SWAPPED_ROWS_PER_TILE = 8  # n of the swapped decoder's m16n8k16 tiles: query rows per row tile
SWAPPED_MAX_ROW_TILES = 2  # its O accumulators take 32 registers per row tile


@dataclass(frozen=True)
class SwappedTileConfig:
    """The swapped fp8-cache decoder (swapped.py): one producer warp, `consumer_warps` warps that each take
    tile_n / consumer_warps keys of every stage, 8 x row_tiles query rows.

    d128, the numbers (H200): a stage of 128 keys is 32 KiB of e4m3 K + V; four stages, one CTA per SM: 128 KiB in
    flight per SM (Little's law wants 55-73 KiB under load, this module's docstring) in 129 KiB of shared memory. A
    warp's 32 keys per stage cost 16 mma.sync (2 x 8 for Sᵀ = K·Qᵀ, 2 x 8 for Oᵀ = Vᵀ·Pᵀ), 64 conversions per
    thread and 16 byte permutes: against ~1700 cycles of memory time per stage and SM (32 KiB at ~19 bytes per
    cycle) the four consumer warps are far from busy. Measured (H200, 2026-12-03, profiling/kvcache_configs.py;
    docs/performance.md): 1.8-2.0x the bf16 cache's speed from batch 8 x 8k on; three stages with two CTAs per SM
    1-3% slower there and 1.5x slower at batch 1 (twice the splits), 64-key tiles or eight warps no faster. Grids
    of many short walks take SWAPPED_SHORT_WALKS instead (`problem_tile_config`)."""

    tile_n: int = 128
    num_stages: int = 4
    consumer_warps: int = 4
    row_tiles: int = 1
    ctas_per_sm: int = 1

    @property
    def tile_m(self) -> int:
        return SWAPPED_ROWS_PER_TILE * self.row_tiles

    @property
    def num_threads(self) -> int:
        return 32 * (1 + self.consumer_warps)

    def as_dict(self) -> dict:
        return {"tile_m": self.tile_m, "swapped": True, **asdict(self)}


AnyKvCacheConfig = Union[KvCacheTileConfig, SwappedTileConfig]

# Grids of many short walks (at least one CTA per SM unsplit, a cache capacity of at most 32 key tiles = 4k keys):
# every CTA starts
# with dependent round trips (its length, page-table entries, first tile) that one CTA per SM leaves exposed; two CTAs
# of three stages per SM overlap them. H200, 2026-12-03: 64 x 1k 35.9 against 39.0 µs (page 16: 38.0 / 44.0), 256 x
# 1k page 16 132.6 against 170.7; at 8k keys within 1-2% either way, at batch <= 8 or 32k keys 2-50% slower.
SWAPPED_SHORT_WALKS = SwappedTileConfig(num_stages=3, ctas_per_sm=2)
SWAPPED_SHORT_WALK_TILES = 32


def swapped_serves(spec: AttentionSpec, rows: int) -> bool:
    """Whether the swapped decoder runs calls of `spec` with at most `rows` packed rows: an fp8 cache at d128, 16
    rows at most."""
    return (
        spec.kv_fp8
        and spec.head_dim == spec.head_dim_v == 128
        and rows <= SWAPPED_ROWS_PER_TILE * SWAPPED_MAX_ROW_TILES
    )


def swapped_smem_bytes(cfg: SwappedTileConfig, head_dim: int, head_dim_v: int) -> int:
    """The e4m3 K and V stages and their barriers (the cross-warp combine reuses the K stages)."""
    return cfg.num_stages * cfg.tile_n * (head_dim + head_dim_v) + 1024 + 4 * 8 * cfg.num_stages


def kvcache_tile_config(spec: AttentionSpec, rows: int) -> AnyKvCacheConfig:
    """The configuration for calls of `spec` whose sequences have at most `rows` packed rows (query tokens x group;
    a host-side bound, KvCacheProblem.seqlen_q x group)."""
    if swapped_serves(spec, rows):
        return SwappedTileConfig(row_tiles=max(1, -(-rows // SWAPPED_ROWS_PER_TILE)))
    if spec.kv_fp8:
        if rows > ROWS_PER_CONSUMER and spec.head_dim in _FP8_MORE_ROWS_BY_HEAD_DIM:
            return _FP8_MORE_ROWS_BY_HEAD_DIM[spec.head_dim]
        return _FP8_DECODE_BY_HEAD_DIM[spec.head_dim]
    if rows <= ROWS_PER_CONSUMER:
        return _DECODE_BY_HEAD_DIM[spec.head_dim]
    return _config(replace(fwd_tile_config(replace(spec, kvcache=False, page_size=0)), cluster_m=1), 1)


def problem_tile_config(problem: KvCacheProblem, sm_count: int) -> AnyKvCacheConfig:
    """The configuration a call of `problem` runs on a GPU of `sm_count` SMs (host shapes only): kvcache_tile_config's,
    or for the swapped decoder's grids of many short walks SWAPPED_SHORT_WALKS (with the same row tiles)."""
    p = problem
    rows = problem_rows(p)
    cfg = kvcache_tile_config(p.spec, rows)
    if isinstance(cfg, SwappedTileConfig) and cfg == SwappedTileConfig(row_tiles=cfg.row_tiles):
        ctas = p.batch * p.nheads_kv * -(-rows // cfg.tile_m)
        if sm_count > 0 and ctas >= sm_count and -(-p.max_seqlen_k // cfg.tile_n) <= SWAPPED_SHORT_WALK_TILES:
            return replace(SWAPPED_SHORT_WALKS, row_tiles=cfg.row_tiles)
    return cfg


def kvcache_smem_bytes(cfg: AnyKvCacheConfig, head_dim: int, head_dim_v: int) -> int:
    """The forward's shared memory (Q / O slots, 16-bit K / V stages) and the e4m3 stages of an fp8 cache."""
    if isinstance(cfg, SwappedTileConfig):
        return swapped_smem_bytes(cfg, head_dim, head_dim_v)
    return smem_bytes(cfg, head_dim, head_dim_v) + cfg.fp8_stages * cfg.tile_n * (head_dim + head_dim_v)


def kvcache_configs(spec: AttentionSpec) -> tuple:
    """Every configuration calls of `spec` may run (decoding, more rows: one where they coincide; the swapped
    decoder's short-walk form)."""
    bounds = (1, SWAPPED_ROWS_PER_TILE + 1, SWAPPED_ROWS_PER_TILE * SWAPPED_MAX_ROW_TILES + 1, ROWS_PER_CONSUMER + 1)
    configs = [kvcache_tile_config(spec, rows) for rows in bounds]
    short = [replace(SWAPPED_SHORT_WALKS, row_tiles=c.row_tiles) for c in configs if isinstance(c, SwappedTileConfig)]
    return tuple(dict.fromkeys(configs + short))


def residency_problem(cfg: AnyKvCacheConfig, head_dim: int, head_dim_v: int) -> Optional[str]:
    """Why `cfg.ctas_per_sm` CTAs do not fit one SM's registers and shared memory, or None."""
    if isinstance(cfg, SwappedTileConfig):  # (registers: the compile census checks them, 150-219 per thread)
        smem = (swapped_smem_bytes(cfg, head_dim, head_dim_v) + SMEM_SYSTEM_BYTES_PER_CTA) * cfg.ctas_per_sm
        return None if smem <= SMEM_PER_SM_BYTES else f"{cfg.ctas_per_sm} CTAs need {smem} B of shared memory per SM"
    threads = WARPGROUP_THREADS
    regs = (cfg.consumer_regs * cfg.num_consumer_wgs + cfg.producer_regs) * threads * cfg.ctas_per_sm
    if regs > REGISTERS_PER_SM:
        return f"{cfg.ctas_per_sm} CTAs of {cfg.consumer_regs}/{cfg.producer_regs} registers need {regs} per SM"
    cta = kvcache_smem_bytes(cfg, head_dim, head_dim_v)
    if cta > SMEM_CAPACITY_BYTES:
        return f"tile {cfg.tile_m}x{cfg.tile_n} with {cfg.fp8_stages} e4m3 stages needs {cta} B of shared memory"
    smem = (cta + SMEM_SYSTEM_BYTES_PER_CTA) * cfg.ctas_per_sm
    if smem > SMEM_PER_SM_BYTES:
        return f"{cfg.ctas_per_sm} CTAs need {smem} B of shared memory per SM"
    return None


def kvcache_unsupported_reason(spec: AttentionSpec) -> Optional[str]:
    """None when the sm90 KV-cache forward serves `spec` (spec.kvcache), else what it lacks (the router then tries the
    sm80 family's gather path)."""
    if spec.dtype not in ("fp16", "bf16") or spec.out_dtype != spec.dtype:
        return f"the sm90 KV-cache forward computes in fp16 or bf16 and writes its input dtype, not {spec.dtype}"
    if spec.head_dim != spec.head_dim_v or spec.head_dim not in KVCACHE_HEAD_DIMS:
        return (
            f"the sm90 KV-cache forward needs head_dim == head_dim_v in {KVCACHE_HEAD_DIMS}, got ({spec.head_dim}, "
            f"{spec.head_dim_v})"
        )
    if spec.mask not in ("none", "causal", "local"):
        return f"unknown mask kind {spec.mask!r}"
    if spec.page_size < 0 or spec.page_size % PAGE_ROW_MULTIPLE != 0:
        return (
            f"the sm90 KV-cache forward loads pages by TMA in boxes of whole 8-row swizzle atoms: page_size must be a "
            f"multiple of {PAGE_ROW_MULTIPLE}, got {spec.page_size}"
        )
    for cfg in kvcache_configs(spec):
        problem = residency_problem(cfg, spec.head_dim, spec.head_dim_v)
        if isinstance(cfg, KvCacheTileConfig):
            problem = budget_problem(cfg, spec.head_dim, spec.head_dim_v) or problem
        if problem is not None:
            return problem
    return None


def chunk_rows(page_size: int, tile_n: int) -> int:
    """Rows per TMA box of a K / V tile: gcd(page_size, tile_n), so that every box lies in one page (a dense cache,
    page_size 0: the whole tile)."""
    return tile_n if page_size == 0 else math.gcd(page_size, tile_n)


def problem_rows(problem: KvCacheProblem) -> int:
    """Packed rows of the longest sequence: query tokens x query heads per KV head."""
    return problem.seqlen_q * (problem.nheads // problem.nheads_kv)


# A grid of at most sm_count / SMALL_GRID_DIVISOR CTAs per split (batch 1-2 at 8 KV heads on an H200) is split to
# fill one CTA per SM, not ctas_per_sm: each further split costs the combine a partial and its CTA a start-up, and
# there the second CTA per SM gains nothing. H200, 2026-12-02, batch 1 d128 h32/8, CUDA graphs: 16 splits took
# 10.8 us at 4k keys and 39.7 us at 32k, 33 splits (two CTAs per SM) 14.0 and 41.8. Not for an fp8 cache: the
# wgmma kernel's fp8 CTAs stream more slowly (the converter warps' hand-offs; 32 splits took 19.7 / 41.9 us, 16 20.3 /
# 51.6), and the swapped decoder runs one CTA per SM anyway (2026-12-03, 1 x 8k / 32k: 16 splits 10.9 / 25.5 us,
# 32 splits 16.5 / 30.0).
SMALL_GRID_DIVISOR = 8


def kvcache_splits(problem: KvCacheProblem, sm_count: int) -> int:
    """CTAs per query tile's keys (arch/base.ArchBackend.kvcache_splits), from host shapes only: the row tiles of the
    longest sequence, the cache's capacity max_seqlen_k and the mask bound the key tiles a query tile walks."""
    p = problem
    rows = problem_rows(p)
    cfg = problem_tile_config(p, sm_count)
    row_tiles = -(-rows // cfg.tile_m)
    ctas = p.batch * p.nheads_kv * row_tiles
    if ctas == 0 or sm_count <= 0:
        return 1
    info = BlockInfo(
        cfg.tile_m, cfg.tile_n, p.mask.kind, p.seqlen_q, p.max_seqlen_k, p.mask.left, p.mask.right,
        rows_per_query=p.nheads // p.nheads_kv,
    )  # fmt: skip
    key_tiles = max((hi - lo for lo, hi in map(info.kv_block_range, range(row_tiles))), default=0)
    small = ctas * SMALL_GRID_DIVISOR <= sm_count and not p.spec.kv_fp8
    slots = sm_count if small else sm_count * cfg.ctas_per_sm
    return split_kv.splits_to_fill(ctas, slots, key_tiles, split_kv.KVCACHE_MAX_SPLITS)

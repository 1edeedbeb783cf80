"""Tile configurations of the sm90 kernels, and the budget checks behind them: the forward's (FwdTileConfig, one per
head dim, and per (head_dim, head_dim_v) pair where that differs; below) and the backward's (BwdTileConfig, further
down).

A CTA has one producer warpgroup (one warp issues every TMA load) and `num_consumer_wgs` consumer warpgroups. Each
consumer warpgroup owns 64 query rows: its own Q slice in shared memory, its own S = Q·Kᵀ and O accumulators and its
own slice of the O store. So `tile_m = 64 * num_consumer_wgs`; K and V tiles of `tile_n` keys go through
`num_stages`-deep TMA pipelines shared by all consumers.

Choices (measured on an H200, bf16; the sweep table is in docs/sm90.md):
  d <= 64:  3 consumers, 192 x 128, ping-pong. Short GEMMs: a third warpgroup keeps the tensor cores fed (+4-21%
            over 128-row tiles from 4k on); 160 registers per consumer thread suffice (O 32 + S 64 fp32).
  d <= 128: 2 consumers, 128 x 128, ping-pong. 240 registers hold S (64), P (32) and O (64) with the next block's S
            in flight; Q 32 KiB + 2 stages of K and V (32 KiB each) = 160 KiB of shared memory. tile_n 176 wins
            only at 16k without a mask; a third stage (tile_n 112) never does.
  d <= 256: 2 consumers, 128 x 80, no ping-pong. O alone is 128 registers per thread; tile_n = 80 is the widest
            that fits Q 64 KiB + 2 x (K 40 KiB + V 40 KiB) = 224 KiB; ping-pong costs up to 5% here (the GEMMs
            dominate, the handshake only adds latency) and gains at most 3% with a causal mask.
With head_dim != head_dim_v the widest of the two picks the row above, except for the pairs in _BY_HEAD_DIMS.
Q·Kᵀ reads both operands from shared memory, so head_dim costs shared memory and GEMM time but no registers;
head_dim_v sets the O accumulator (dv / 2 registers per thread) and, with head_dim, the K/V stage size.
Packed d128 and d256 calls without a mask run in 2-CTA clusters that share K / V (cluster_m, multicast_kv).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional

from ...spec import AttentionSpec, ModsSpec

# Hopper: 227 KiB of dynamic shared memory per CTA; mbarriers and alignment padding take the last few hundred bytes.
SMEM_CAPACITY_BYTES = 227 * 1024
SMEM_RESERVED_BYTES = 1024
REGISTERS_PER_SM = 64 * 1024
WARPGROUP_THREADS = 128
ROWS_PER_CONSUMER = 64  # wgmma's M per warpgroup


@dataclass(frozen=True)
class FwdTileConfig:
    num_consumer_wgs: int  # consumer warpgroups; each owns 64 query rows
    tile_n: int  # keys per K/V tile
    num_stages: int  # depth of the K and the V TMA pipelines
    ping_pong: bool = True  # named barriers make the consumers take turns issuing their GEMMs
    consumer_regs: int = 240  # setmaxnreg.inc for consumer threads
    producer_regs: int = 24  # setmaxnreg.dec for the producer warpgroup
    # CTAs per cluster along the query tiles (1 or 2). With 2, the CTAs of a cluster share the rows of two query tiles
    # of one (sequence, head), 64-row slices dealt out in turn (cta.py), and each loads half of every K / V tile for
    # both by TMA multicast: half the L2 reads of K and V. Only without a mask (the cluster's CTAs must walk the same
    # key tiles), not with split keys, not in the FP8 kernel.
    cluster_m: int = 1

    @property
    def tile_m(self) -> int:
        return ROWS_PER_CONSUMER * self.num_consumer_wgs

    @property
    def num_threads(self) -> int:
        return WARPGROUP_THREADS * (self.num_consumer_wgs + 1)

    def as_dict(self) -> dict:
        return {"tile_m": self.tile_m, **asdict(self)}


def smem_bytes(cfg: FwdTileConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2) -> int:
    """Shared memory the kernel allocates: one Q slot per consumer, max(d, dv) wide (O reuses it), K and V stages."""
    q_and_o = cfg.tile_m * max(head_dim, head_dim_v) * elem_bytes
    kv = cfg.num_stages * cfg.tile_n * (head_dim + head_dim_v) * elem_bytes
    return q_and_o + kv + SMEM_RESERVED_BYTES


def register_problem(cfg) -> Optional[str]:
    """Why the setmaxnreg split of `cfg` (a forward or backward tile configuration) does not fit the register file, or
    None."""
    regs = cfg.consumer_regs * WARPGROUP_THREADS * cfg.num_consumer_wgs + cfg.producer_regs * WARPGROUP_THREADS
    if regs > REGISTERS_PER_SM:
        return f"register split {cfg.consumer_regs}/{cfg.producer_regs} needs {regs} > {REGISTERS_PER_SM} registers"
    return None


def budget_problem(cfg: FwdTileConfig, head_dim: int, head_dim_v: int) -> Optional[str]:
    """A sentence saying why `cfg` cannot run, or None."""
    if cfg.tile_n % 16 != 0 or not 16 <= cfg.tile_n <= 256:
        return f"tile_n={cfg.tile_n} must be a multiple of 16 in [16, 256] (wgmma N for S, K for P·V)"
    if head_dim_v > 256:
        return f"head_dim_v={head_dim_v} exceeds wgmma's N limit of 256"
    if cfg.cluster_m not in (1, 2):
        return f"cluster_m={cfg.cluster_m} must be 1 or 2"
    if (problem := register_problem(cfg)) is not None:
        return problem
    need = smem_bytes(cfg, head_dim, head_dim_v)
    if need > SMEM_CAPACITY_BYTES:
        return f"tile {cfg.tile_m}x{cfg.tile_n} x {cfg.num_stages} stages needs {need} B of shared memory"
    return None


_BY_HEAD_DIM = (
    # (largest head dim served, config)
    (64, FwdTileConfig(num_consumer_wgs=3, tile_n=128, num_stages=2, consumer_regs=160, producer_regs=32)),
    (128, FwdTileConfig(num_consumer_wgs=2, tile_n=128, num_stages=2)),
    (256, FwdTileConfig(num_consumer_wgs=2, tile_n=80, num_stages=2, ping_pong=False)),
)


# (head_dim, head_dim_v) pairs whose best tile differs from that of their wider head dim.
_BY_HEAD_DIMS = {
    # DeepSeek-style (192, 128): O and S need the registers of d128, so d128's 128 x 128 ping-pong tile; Q 48 KiB +
    # 2 x (K 48 + V 32) KiB = 208 KiB. 1.9-2.4x the sm80 route, 0.89-1.07x FA4 (H100, 2026-11-23); other tiles were
    # not measured for this pair.
    (192, 128): FwdTileConfig(num_consumer_wgs=2, tile_n=128, num_stages=2),
}


def fwd_tile_config(spec: AttentionSpec) -> FwdTileConfig:
    """The measured default for `spec` (the caller checks `unsupported_reason` first)."""
    pair = _BY_HEAD_DIMS.get((spec.head_dim, spec.head_dim_v))
    if pair is not None:
        return pair
    width = max(spec.head_dim, spec.head_dim_v)
    for limit, cfg in _BY_HEAD_DIM:
        if width <= limit:
            return replace(cfg, cluster_m=2) if multicast_kv(spec) else cfg
    raise ValueError(f"no sm90 forward tile configuration for head dim {width} (at most 256)")


def multicast_kv(spec: AttentionSpec) -> bool:
    """Whether `spec`'s forward runs in 2-CTA clusters sharing K / V (FwdTileConfig.cluster_m): packed d128 and d256
    calls without a mask. At d128 they take 2.4-3.5% more cycles but run at a 4-6% higher clock under the power cap
    (half the L2 reads of K and V): sustained 0.5-1.5% (H100) and 2.5-3.3% (H200) faster than one CTA per cluster;
    at d256 1.5-2.9% (H100) and 3.8-3.9% (H200) faster (1.5-second sustained windows, 2026-11-27). Dense calls
    gained nothing at d128 (their clock did not move); d64 did not gain (its extra cycles cancel its higher clock);
    d96 and (192, 128) were not measured."""
    if isinstance(spec, ModsSpec):  # (the score_mod / mask_mod forward has no cluster form)
        return False
    return spec.varlen and spec.mask == "none" and spec.head_dim == spec.head_dim_v and spec.head_dim in (128, 256)


# Up to this many query columns per thread (keys on rows), LSE and D are held in registers; above it (tile_m > 64)
# they come through shuffles (flash_bwd.load_column_stats) or, with BwdTileConfig.stats_at_use, from shared memory
# where they are used.
UNSHUFFLED_STAT_COLS = 16


@dataclass(frozen=True)
class BwdTileConfig:
    """Tile configuration of the sm90 backward kernel (flash_bwd.py).

    A CTA owns tile_n keys and walks the query tiles of tile_m rows; Q, dO (with LSE and D) and the P / dS buffers
    are `num_stages` deep. Two forms of the S and dP products:
      keys_on_rows (FlashAttention-3's "swapped" form): Sᵀ = K·Qᵀ, each consumer warpgroup owns 64 keys (wgmma's M),
          so tile_n = 64 * num_consumer_wgs; Pᵀ and dSᵀ stay in registers as the A operands of dV += Pᵀ·dO and
          dK += dSᵀ·Q, and each consumer accumulates dK / dV for its own keys (all head-dim columns).
      queries on rows (keys_on_rows False): S = Q·Kᵀ with tile_m = 64 query rows and the consumers splitting the
          tile_n = 64 keys; P and dS go through shared memory and every consumer computes dK / dV for all 64 keys and
          head_dim / num_consumer_wgs columns: half the accumulator registers per thread, what d256 needs.
    dq_split says how the consumers share dQ = dS·K: "m" (64 query rows each; tile_m = 64 * num_consumer_wgs),
    "n" (head_dim / num_consumer_wgs columns each, which must start on a swizzle atom: multiples of 64, or of 32 with
    queries on rows, whose tiles then take 64-byte atoms), or "single"
    (consumer 0 alone computes the whole 64-row dQ: head dims such as 96 that split neither way).
    dq_swap_ab computes dQᵀ = Kᵀ·dSᵀ instead (FlashAttention-3's dQ_swapAB): wgmma's M is then the 64 head-dim columns
    of each consumer and the query rows are its N, so tile_m need not be a multiple of 64 (d128's 80-row tile).
    Scheduling choices that some default takes (docs/sm90_bwd_sass_study.md; _BWD_BY_HEAD_DIM_AND_MASK and
    _BWD_LONG_QUERIES say which and why):
      dv_before_dp_wait (keys on rows only): dV += Pᵀ·dO is issued before the dP wait, which becomes wait_group(1):
          P being dV's A operand pins all exponentials before that wait (ptxas hoists it otherwise).
          dv_early_kblocks: only that many of its k-blocks (16 queries each) go before the wait, the rest after dS,
          for builds where the whole product before it spills (d128 causal: 2 of 4 pin all 32 exponentials, no
          spills; the whole product spills 8 bytes).
      stats_at_use: above UNSHUFFLED_STAT_COLS query columns per thread, each pair of columns' LSE / D is one 8-byte
          shared-memory load where it is used instead of a shuffle from the lane that loaded it: no registers held,
          20 loads instead of 40 shuffles per step (459 SASS instructions per step against 507; FA4's 463).
      lse_ahead (with stats_at_use): the LSE of the first this many column pairs goes to registers while the S
          product runs, as FlashAttention-4 loads it, rather than after the S wait, where the first exponentials
          waited for the loads; the other pairs are still loaded where used. D likewise, 4-6 pairs before dV's early
          product: 1-4% more cycles (H100), not kept.
      d_after_dv_issue (with dv_before_dp_wait): D's shared-memory loads go after dV's early product is issued, not
          between the exponentials and P's conversion, where ptxas gave a D load and the exponential that P's first
          conversion waits for one scoreboard (Nsight Compute, H100: that conversion's wait was 4.7% of the
          d128 causal main loop's samples).
      dq_red: each consumer adds its dQ to the fp32 accumulator from registers with red.global.add.v4.f32 (the
          fragment layout's 16-byte groups) instead of staging it in shared memory for the dQ warp's bulk
          reduce-add. Frees the tile_m x d fp32 buffer (64 KiB at d256), room for a second Q / dO stage at d256
          (64 x 64 tiles, 2 stages, 226 KiB), the pipelining FA4 gets there from 64 x 48 tiles. At d128 it measured
          0.91x the dQ warp (H200: the adds from registers cost more than the bulk reduce-add there). The
          adds have no fixed order: deterministic builds take _BWD_DETERMINISTIC's configuration, and an explicit
          dq_red one is refused (backward._kernels).
      dq_buffers: the consumers write query tile m_block's dQ into buffer m_block % dq_buffers, so before their dQ
          stores they wait for the bulk reduce-add of the tile before the previous one to have read its buffer, not
          for that of the previous one (Nsight Compute's stall samples had the consumers waiting there).
          Needs a walk that alternates the parity of m_block (consecutive query tiles).
    Always on (measured and then hard-wired): the preprocess zeroes the dQ accumulator and programmatic dependent
    launch runs from the preprocess to the main kernel and from it to the dQ postprocess (together 1.004-1.026x at
    d128, 1.017-1.022x at d64, H100 pairs); K and V ride on the first Q and dO stages' barriers (neutral within noise,
    one barrier wait fewer per CTA; flash_bwd.py). Not kept: Q / dO multicast in 2-CTA clusters (its halved L2 traffic
    went into extra cycles: 0.6-0.8% on an H200, nothing on an H100).
    """

    tile_m: int
    dq_split: str  # "m" | "n" | "single"
    keys_on_rows: bool = True
    tile_n: int = 128
    num_consumer_wgs: int = 2
    num_stages: int = 2
    consumer_regs: int = 240
    producer_regs: int = 24
    opt_level: int = 3  # CuTe DSL --opt-level
    dq_swap_ab: bool = False
    dv_before_dp_wait: bool = False  # dV's product before the dP wait (docs/sm90_bwd_sass_study.md, variant A)
    dv_early_kblocks: Optional[int] = None  # with it: only dV's first k-blocks before the wait (None: all of them)
    dq_red: bool = False  # consumers add dQ from registers (red.global.add.v4.f32): no shared dQ buffer, no dQ warp
    dq_buffers: int = 1  # shared dQ buffers the consumers alternate between (query tile m_block takes m_block % n)
    d_after_dv_issue: bool = False  # with dv_before_dp_wait: D's shared-memory loads after dV's early product
    stats_at_use: bool = False  # above UNSHUFFLED_STAT_COLS: LSE / D loaded where used, not shuffled
    lse_ahead: int = 0  # with stats_at_use: LSE of this many column pairs into registers once S is issued

    @property
    def num_threads(self) -> int:
        return WARPGROUP_THREADS * (self.num_consumer_wgs + 1)

    @property
    def num_dq_wgs(self) -> int:
        """Consumer warpgroups that compute (and hand over) a share of dQ."""
        return 1 if self.dq_split == "single" else self.num_consumer_wgs

    def as_dict(self) -> dict:
        return asdict(self)


MAX_BWD_CONSUMER_WGS = 2  # barriers.BwdBarrierId reserves named barriers for this many consumers


def operand_atom_cols(head_dim: int, cfg: BwdTileConfig) -> Optional[int]:
    """Columns of the swizzle atom of the backward's `head_dim`-wide Q / K (or dO / V) tiles and of the dQ
    postprocess's output tile, or None for the widest the row allows (128-byte atoms, 64 columns). With queries on
    rows the consumers split dK, dV and dQ by head-dim columns, and a warpgroup's share must start on an atom: shares
    that are not whole 64-column atoms (d192's 96 columns) take 32-column (64-byte) ones."""
    share = head_dim // cfg.num_consumer_wgs
    return 32 if not cfg.keys_on_rows and share % 64 else None


def bwd_config_problem(cfg: BwdTileConfig, head_dim: int, head_dim_v: Optional[int] = None) -> Optional[str]:
    """A sentence saying why the backward kernel cannot be built with `cfg` at `head_dim` (and `head_dim_v`, by
    default the same), or None."""
    w = cfg.num_consumer_wgs
    dv = head_dim if head_dim_v is None else head_dim_v

    def whole_atoms(width: int) -> bool:  # each consumer's share of `width` columns starts on a swizzle atom
        return width % w == 0 and (width // w) % (operand_atom_cols(width, cfg) or 64) == 0

    if dv != head_dim and (cfg.keys_on_rows or not whole_atoms(dv)):
        # (keys on rows: Pᵀ and dSᵀ are one register fragment shape, the A operand of both dV and dK)
        return (
            f"head_dim_v {dv} != head_dim {head_dim} needs queries on rows and head_dim_v / consumers in whole "
            f"32-column swizzle atoms"
        )
    if not 1 <= w <= MAX_BWD_CONSUMER_WGS:
        return f"num_consumer_wgs={w}: the backward has named barriers for 1..{MAX_BWD_CONSUMER_WGS} consumers"
    if cfg.keys_on_rows and cfg.tile_n != ROWS_PER_CONSUMER * w:
        return f"keys on rows need tile_n = 64 x consumers = {ROWS_PER_CONSUMER * w}, got {cfg.tile_n}"
    if not cfg.keys_on_rows and (
        cfg.tile_m != ROWS_PER_CONSUMER
        or cfg.tile_n != ROWS_PER_CONSUMER
        or (ROWS_PER_CONSUMER // w) % 16 != 0
        or cfg.dq_split != "n"
    ):
        return (
            f"queries on rows need 64 x 64 tiles, 16-key multiples per consumer and dq_split 'n', got "
            f"{cfg.tile_m} x {cfg.tile_n}, {w} consumers, dq_split {cfg.dq_split!r}"
        )
    kb = cfg.dv_early_kblocks
    if kb is not None and (
        not isinstance(kb, int) or isinstance(kb, bool) or not cfg.dv_before_dp_wait or not 1 <= kb < cfg.tile_m // 16
    ):
        # (tile_m / 16 k-blocks or more: the whole product, which is None)
        return (
            f"dv_early_kblocks={kb!r} needs dv_before_dp_wait and an int in [1, {cfg.tile_m // 16}) (dV's k-blocks of "
            f"16 queries before the dP wait; None for all of them)"
        )
    if cfg.dv_before_dp_wait and not cfg.keys_on_rows:
        return (
            "dv_before_dp_wait needs keys on rows (P in registers as dV's A operand); with queries on rows P goes "
            "through shared memory after the dP wait"
        )
    if cfg.d_after_dv_issue and not cfg.dv_before_dp_wait:
        return "d_after_dv_issue needs dv_before_dp_wait (D is loaded after dV's early product is issued)"
    if cfg.stats_at_use and not cfg.keys_on_rows:
        return "stats_at_use applies to keys on rows only (queries on rows keep one LSE / D per row)"
    if cfg.stats_at_use and cfg.tile_m // 4 <= UNSHUFFLED_STAT_COLS:
        # (keys on rows: a thread holds tile_m / 4 query columns; up to UNSHUFFLED_STAT_COLS they stay in registers,
        # so the switch would change nothing)
        return (
            f"stats_at_use needs more query columns per thread (tile_m / 4 = {cfg.tile_m // 4}) than "
            f"{UNSHUFFLED_STAT_COLS}; below that LSE / D are held in registers"
        )
    if cfg.lse_ahead and not cfg.stats_at_use:
        return "lse_ahead needs stats_at_use (without it LSE is already loaded into registers once S is issued)"
    if not 0 <= cfg.lse_ahead <= cfg.tile_m // 8:
        # (keys on rows: tile_m / 4 query columns per thread, in adjacent pairs)
        return f"lse_ahead counts a thread's column pairs, 0..{cfg.tile_m // 8}, got {cfg.lse_ahead}"
    if cfg.dq_split == "m" and cfg.tile_m != ROWS_PER_CONSUMER * w:
        return f"dq_split 'm' needs tile_m = 64 x consumers = {ROWS_PER_CONSUMER * w}, got {cfg.tile_m}"
    if cfg.dq_swap_ab and (
        not cfg.keys_on_rows or cfg.dq_split != "n" or head_dim != ROWS_PER_CONSUMER * w or cfg.tile_m % 16 != 0
    ):
        return (
            f"dq_swap_ab needs keys on rows, dq_split 'n', head_dim = 64 x consumers and tile_m a multiple of 16, got "
            f"keys_on_rows {cfg.keys_on_rows}, dq_split {cfg.dq_split!r}, head_dim {head_dim}, tile_m {cfg.tile_m}"
        )
    if not cfg.dq_swap_ab and cfg.tile_m % 64 != 0:
        return f"tile_m {cfg.tile_m} must be a multiple of 64 (wgmma's M of dQ) unless dq_swap_ab"
    if cfg.dq_split == "n" and not whole_atoms(head_dim):
        return (
            f"dq_split 'n' needs head_dim / consumers in whole {64 if cfg.keys_on_rows else 32}-column swizzle atoms "
            f"(operand_atom_cols), got head_dim {head_dim}, {w} consumers"
        )
    if cfg.dq_split == "single" and cfg.tile_m != ROWS_PER_CONSUMER:
        return f"dq_split 'single' needs tile_m = 64, got {cfg.tile_m}"
    if cfg.dq_split not in ("m", "n", "single"):
        return f"dq_split must be 'm', 'n' or 'single', got {cfg.dq_split!r}"
    if cfg.dq_buffers not in (1, 2) or (cfg.dq_red and cfg.dq_buffers != 1):
        return f"dq_buffers must be 1 or 2 (and 1 with dq_red, which has no dQ buffer), got {cfg.dq_buffers!r}"
    if (problem := register_problem(cfg)) is not None:
        return problem
    need = bwd_smem_bytes(cfg, head_dim, dv)
    if need > SMEM_CAPACITY_BYTES:
        return f"backward tile {cfg.tile_m}x{cfg.tile_n} x {cfg.num_stages} stages needs {need} B of shared memory"
    return None


def stat_stage_stride(tile_m: int) -> int:
    """Floats between two stages of the backward's LSE / D buffers: each stage is a TMA destination and must start on
    a 128-byte boundary (32 floats), which tile_m 80 alone does not give."""
    return -(-tile_m // 32) * 32


def bwd_smem_bytes(cfg: BwdTileConfig, head_dim: int, head_dim_v: Optional[int] = None, elem_bytes: int = 2) -> int:
    """Q and dO stages, the K and V tiles, dS (and, queries on rows, P) stages, LSE and D stages."""
    dv = head_dim if head_dim_v is None else head_dim_v
    qdo = cfg.num_stages * cfg.tile_m * (head_dim + dv) * elem_bytes
    kv = cfg.tile_n * (head_dim + dv) * elem_bytes
    ds = (1 if cfg.keys_on_rows else 2) * cfg.num_stages * cfg.tile_n * cfg.tile_m * elem_bytes
    dq = 0 if cfg.dq_red else cfg.dq_buffers * cfg.tile_m * head_dim * 4
    stats = 2 * cfg.num_stages * stat_stage_stride(cfg.tile_m) * 4
    return qdo + kv + ds + dq + stats + SMEM_RESERVED_BYTES


# Head dims the sm90 backward serves (d == dv), with the reason and the measurement behind each choice.
#   d64:  128 x 128 tiles, dQ split by query rows (a 32-column split would cut the 64-column swizzle atom):
#         FlashAttention-3's shape for d64. Each thread then holds 32 query columns, so the LSE and D go through
#         shuffles (flash_bwd.load_column_stats); ptxas level 2 (level 3 timed within noise; it spilled 4 B in the
#         GQA build until the epilogue re-read the thread index instead of keeping it live).
#   d96:  64 x 128 tiles like d128, but 48 columns per consumer would cut the swizzle atom: consumer 0 computes the
#         whole dQ (48 registers; FlashAttention-3's d96 shape); dV and dK take 48 each.
#   d128: 64 x 128 tiles, dQ split by head-dim halves: Sᵀ, dPᵀ (32 registers each), dV and dK (64 each) and dQ (32)
#         fit the 240 registers of a consumer thread. FlashAttention-3 takes 80 x 128 tiles without a mask (25% more
#         queries per step for the same per-step costs; dQᵀ = Kᵀ·dSᵀ, since 80 rows are no wgmma M): built here as
#         dq_swap_ab: the default without a mask from 4096 query rows on (_BWD_LONG_QUERIES), not below (shorter
#         walks and the partial last tile cost more).
#   d192: d256's form (64 x 64, queries on rows, dQ from registers, two stages; 178 KiB): each consumer's share of
#         dK, dV and dQ is 96 head-dim columns (48 registers each), which start on a swizzle atom only with 64-byte
#         atoms (operand_atom_cols). 1.3-2.0x the d256 kernels on padded operands and 0.76-0.81x FA4's
#         64 x 96 tile (whose dK / dV products are swapped, dKᵀ = Qᵀ·dS, to make 96 keys a wgmma N); the dQ buffer
#         with the dQ warp instead (which also fits two stages, 226 KiB) measured 1-4% slower (H100, 2026-11-27).
#         Deterministic builds take that buffer.
#   d256: 64 x 64 tiles with queries on rows (FlashAttention-3's d256 shape): dK and dV split by head-dim halves
#         (64 registers each) instead of 128 keys' rows (256 each); P and dS through shared memory. dQ is added from
#         registers (dq_red), which frees the fp32 dQ buffer (64 KiB) for a second Q / dO stage (226 KiB): 1.34x the
#         one-stage kernel with the dQ buffer and 1.14x FA4 over 1k/4k/16k, both masks (H200, 2026-11-26).
#         Deterministic builds keep the dQ buffer and so one stage (_BWD_DETERMINISTIC).
# Other head dims (d160, dv != d, ...) run the narrowest of these at least as wide on zero-padded operands
# (backward.kernel_dims, arch/padded_head_dims.py).
_BWD_BY_HEAD_DIM = {
    64: BwdTileConfig(tile_m=128, dq_split="m", opt_level=2),
    96: BwdTileConfig(tile_m=64, dq_split="single"),
    128: BwdTileConfig(tile_m=64, dq_split="n"),
    192: BwdTileConfig(tile_m=64, dq_split="n", keys_on_rows=False, tile_n=64, num_stages=2, dq_red=True),
    256: BwdTileConfig(tile_m=64, dq_split="n", keys_on_rows=False, tile_n=64, num_stages=2, dq_red=True),
}

# Changes for deterministic builds (dq_red's adds have no fixed order): the dQ buffer and the dQ warp's ordered
# reduce-adds (d256: in the shared memory the second stage had; d192 fits both, 226 KiB).
_BWD_DETERMINISTIC = {
    192: {"dq_red": False},
    256: {"dq_red": False, "num_stages": 1},
}


# (head_dim, head_dim_v) pairs with a configuration of their own: their kernels read dO and V at head_dim_v instead of
# running head_dim's kernels on operands zero-padded to it.
#   (192, 128) (DeepSeek): d192's configuration; dP and dV take 2/3 of d192's products and dO / V 2/3 of its shared
#         memory (154 KiB), and no tensor is padded: 1.13-1.36x d192's kernels on dv padded to 192, 0.75-0.79x FA4;
#         a third Q / dO stage (194 KiB) measured the same (H100, 2026-11-27). Deterministic
#         builds: d192's changes (the dQ buffer, 202 KiB).
_BWD_BY_HEAD_DIMS = {
    (192, 128): _BWD_BY_HEAD_DIM[192],
}


def bwd_head_dims(softcap: bool = False) -> tuple:
    """Head dims (d == dv) with an sm90 backward configuration (of soft-capping builds: _SOFTCAP_PADDED)."""
    return tuple(sorted(d for d in _BWD_BY_HEAD_DIM if not (softcap and d in _SOFTCAP_PADDED)))


def bwd_head_dim_pairs() -> tuple:
    """(head_dim, head_dim_v) pairs, head_dim != head_dim_v, with an sm90 backward configuration of their own."""
    return tuple(sorted(_BWD_BY_HEAD_DIMS))


# Per-mask changes to the head dim's configuration.
#   d128 without a mask: dV's product issued before the dP wait (docs/sm90_bwd_sass_study.md, variant A), which keeps
#         all 32 exponentials ahead of that wait: +1.4% on average over 1k/4k/16k in two H100 runs (-0.8 to +2.5% per
#         point; 2026-11-25), no spills in any build. With a causal mask the whole product there
#         measured neutral and spills 8 bytes (half of it: below). Long query sequences: _BWD_LONG_QUERIES.
#   d128 causal: dV's first 2 of 4 k-blocks before the dP wait (dv_early_kblocks; the whole product there spills 8
#         bytes): all 32 exponentials of the unmasked steps ahead of the wait (4 before), no spills in the dense,
#         GQA and deterministic builds; +3.4% geomean over 1k / 4k / 16k (+1.2 / +2.5 / +6.6%; 3 of 4 k-blocks:
#         -0.6%), H200, 2026-11-26. D loaded after that product is issued (d_after_dv_issue):
#         +1.5% / +2.9% geomean over 1k / 4k (/ 8k) / 16k in two H100 runs, packed drawn mix +1.8 / +2.6%; spill-free
#         dense, GQA, deterministic and packed. Without a mask it spills 16-40 bytes at 64 rows and
#         measured -1.2 to -2.0% packed at 80 rows: off there.
#   d64 causal: two dQ buffers (dq_buffers; 227 KiB, all of it): +2.7 / +0.5 / +1.3% geomean over d64's 1k / 4k /
#         16k x both masks in three H100 runs, all of it from the causal points (4k +8.7 / +1.8 / +5.6%, 16k +4.8 /
#         +0.7 / +2.8%, 1k +0.7 / +1.0 / +1.5%); without a mask 0.99-1.00 (16k +0.3 / -1.3 / -1.6%). d128 (64-row
#         tile) measured 0.994 (causal 4k / 16k -2.3%), d96 1.007: one buffer there (H100, 2026-11-27).
#         Dense only (_DENSE_ONLY): packed GQA builds spill 64-84 bytes with it (none with one buffer), and packed
#         calls were not timed with it. Not deterministic (_NOT_DETERMINISTIC): those builds wait for
#         every reduce, so the second buffer overlapped nothing (and no deterministic call was timed with it).
_BWD_BY_HEAD_DIM_AND_MASK = {
    (64, "causal"): {"dq_buffers": 2},
    (128, "none"): {"dv_before_dp_wait": True},
    (128, "causal"): {"dv_before_dp_wait": True, "dv_early_kblocks": 2, "d_after_dv_issue": True},
}


# Per-mask changes for long query sequences (`long_queries`; not in deterministic builds).
#   d128 without a mask: FlashAttention-3's 80-row tile (dQᵀ = Kᵀ·dSᵀ) with dV's first of 5 k-blocks before the dP
#         wait (no spills; the whole product there spills 128 bytes, 2 k-blocks 8 and measured 0.86x). Against the
#         64-row default, H200, 2026-11-26, two runs: 1k -4.3 / -4.1%, 2k 0.0%, 4k 0.0 / +1.1%,
#         8k +1.7%, 16k +4.0 / +2.0%; the varlen benchmark's drawn mix (max 8037) +0.9% (two runs each). Below
#         LONG_QUERIES the 80-row tile's partial last tile and shorter walks cost more than its 25% longer steps gain.
#         LSE / D loaded where used (stats_at_use) instead of shuffled: +3.2% geomean over 4k / 8k / 16k (+4.1 / +1.4
#         / +4.3%), +3.9% at b11 x 5888, packed drawn mixes +0.5 to +2.4%, H100, 2026-11-27; no spills in the dense,
#         GQA and packed (seqused) builds. LSE of the first 7 of 10 column pairs loaded once S is issued (lse_ahead):
#         loaded at use, the exponentials' FFMAs waited on them right after the S wait (Nsight Compute, H100:
#         7.8% of the kernel's samples); 1.6-1.9% fewer cycles of the whole backward (main kernel 1.8-2.2%), dense
#         and packed (H100, 2026-11-27). 6 pairs helped only the dense build (ptxas's
#         schedule), 8 spill 4-8 bytes.
_DENSE_ONLY = ("dq_buffers",)  # per-mask changes that packed (varlen) builds do not take
# ... and that deterministic builds do not take: their dQ warp waits for each query tile's reduce to finish before
# it hands the next tile's buffer over (flash_bwd.store_dq), so a second buffer never overlaps a reduce with staging.
_NOT_DETERMINISTIC = ("dq_buffers",)

_BWD_LONG_QUERIES = {
    (128, "none"): {"tile_m": 80, "dq_swap_ab": True, "dv_early_kblocks": 1, "stats_at_use": True, "lse_ahead": 7},
}
LONG_QUERIES = 4096

# Soft-capping builds (spec.softcap; flash_bwd.py: the tanh before the mask, T recovered from P for dS, the LSE read
# again) hold a few more live values per score than the defaults above leave room for in two tiles (ptxas -v, CPU
# builds; every other default tile stays spill-free):
#   d64: the 128-row tile spilled 72-132 bytes (GQA builds; every formulation tried: T recovered from P or from the
#         exponent, the LSE from shared memory or from the shuffled registers, one loop or two), so softcap builds take
#         d96's shape: 64-row tiles, consumer 0 computing dQ (spill-free).
#   d96: its 64-row tile spilled 64 bytes at both ptxas levels, and no other d96 shape splits dQ, dK and dV on whole
#         swizzle atoms: softcap builds run the d128 kernels on operands zero-padded to 128 (_SOFTCAP_PADDED).
#   long query sequences (d128 without a mask): the 80-row tile spilled 16 bytes; softcap builds keep the 64-row one.
# Not timed: the capped backward has no measured baseline yet. score_mod / mask_mod builds (a ModsSpec,
# flash_bwd_mods.py) hold the callables' values per score as well: they take the same tiles (`score_heavy`), and at
# d128 without dV's product before the dP wait (_MODS_DROPPED: a derivative of the score kept through the step spilled
# 852 bytes with it without a mask, 16 without; causal 504 / 328, a document mask 160 / 160, ALiBi 0 / 0).
_BWD_SOFTCAP = {64: {"tile_m": 64, "dq_split": "single", "dq_buffers": 1}}
_SOFTCAP_PADDED = (96,)
_MODS_DROPPED = ("dv_before_dp_wait", "dv_early_kblocks", "d_after_dv_issue")


def long_queries(seqlen_q: int) -> bool:
    """Whether a backward over `seqlen_q` query rows (packed: max_seqlen_q) takes the long-sequence configuration."""
    return seqlen_q >= LONG_QUERIES


def score_heavy(spec: AttentionSpec) -> bool:
    """Whether the backward's scores carry more work than the defaults leave registers for: soft-capping and
    score_mod / mask_mod builds (their tiles: _BWD_SOFTCAP, _SOFTCAP_PADDED)."""
    return spec.softcap or isinstance(spec, ModsSpec)


def bwd_tile_config(spec: AttentionSpec, deterministic: bool = False, long: bool = False) -> Optional[BwdTileConfig]:
    """The sm90 backward's configuration for `spec` (its deterministic build's when asked; `long`: for long query
    sequences, `long_queries`), or None where it has none."""
    heavy = score_heavy(spec)
    if spec.head_dim != spec.head_dim_v:
        cfg = _BWD_BY_HEAD_DIMS.get((spec.head_dim, spec.head_dim_v))
    elif spec.head_dim in bwd_head_dims(heavy):
        cfg = _BWD_BY_HEAD_DIM[spec.head_dim]
    else:
        cfg = None
    if cfg is None:
        return None
    key = (spec.head_dim, spec.mask)  # (a pair takes its head_dim's per-mask and deterministic changes)
    dropped = (_DENSE_ONLY if spec.varlen else ()) + (_NOT_DETERMINISTIC if deterministic else ())
    dropped += _MODS_DROPPED if isinstance(spec, ModsSpec) else ()
    per_mask = {k: v for k, v in _BWD_BY_HEAD_DIM_AND_MASK.get(key, {}).items() if k not in dropped}
    changes = {
        **per_mask,
        **(_BWD_DETERMINISTIC.get(spec.head_dim, {}) if deterministic else {}),
        **(_BWD_LONG_QUERIES.get(key, {}) if long and not deterministic and not heavy else {}),
        **(_BWD_SOFTCAP.get(spec.head_dim, {}) if heavy else {}),
    }
    return replace(cfg, **changes) if changes else cfg

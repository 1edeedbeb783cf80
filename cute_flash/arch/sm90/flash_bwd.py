"""The sm90 backward main kernel: FlashAttention-3's Hopper design (TMA producer, wgmma consumers) in CuTe DSL.

One CTA owns one key tile (tile_n keys) of one query head and walks the query tiles that see it
(`BlockInfo.q_block_range`), tile_m query rows at a time. Described here is the "keys on rows" form (d64, d128); with
queries on rows (d192, d256, `BwdTileConfig.keys_on_rows` False) S = Q·Kᵀ and dP = dO·Vᵀ put the 64 queries on the
accumulator rows and split the 64 keys between the consumers, P and dS go to shared memory, and each consumer computes
dV, dK and dQ for its half of the head dim with every operand read from shared memory (d192: halves of 96 columns,
on tiles swizzled in 64-byte atoms, `tile_config.operand_atom_cols`):

  warpgroup 0 (producer, setmaxnreg.dec): warp 0 issues TMA loads of the K and V tiles once, then per query tile
      Q with its log2-domain LSE and dO with its D = rowsum(dO * O) through `num_stages`-deep mbarrier rings.
  warpgroups 1.. (consumers, setmaxnreg.inc): consumer c owns keys [64 c, 64 c + 64) of the tile. Per query tile:
      Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ by SS wgmma (keys on the accumulator rows: the "swapped" form, so that Pᵀ and dSᵀ
      are already the A operands of the dK/dV products), P = exp2(S·scale·log2e − LSE) per query column,
      dS = P ⊙ (dP − D), then dV += Pᵀ·dO and dK += dSᵀ·Q by RS wgmma (A from registers, accumulated over the whole
      walk). dQ needs every key of the tile: each consumer writes its dSᵀ rows to shared memory (stmatrix), a named
      barrier joins the consumers, and each computes its share of dQ = dS·K (SS wgmma, A and B read transposed
      from the K-major tiles) and writes it to its own shared-memory buffer in the accumulator's register order.
  warp 1 of warpgroup 0 (the dQ writer): adds each consumer's dQ buffer to an fp32 accumulator in global memory with
      one bulk reduce-add (cp.reduce.async.bulk) per query tile, in that same "fragment" layout (undone by
      `flash_bwd_postprocess.DqConvertSm90`); two named barriers per consumer hand the buffer back and forth
      (BwdTileConfig.dq_buffers 2: query tiles of alternating parity use two buffers, so a consumer waits only for
      the reduce of the tile two back to have read its buffer). With
      `deterministic`, a semaphore per (batch, head, query tile) makes the key tiles add in a fixed order.
      With BwdTileConfig.dq_red (d192, d256) there is no dQ writer and no shared dQ buffer: each consumer adds
      its dQ share from registers with red.global.add.v4.f32 at the same offsets (after griddepcontrol.wait, since
      the preprocess zeroes the accumulator); no deterministic build.
  epilogue: dK (times the softmax scale) and dV converted to 16 bits and stored with stmatrix + one TMA store per
      tile, reusing the K and V tiles' shared memory. Under GQA/MQA the CTA's dK/dV are partial sums over the
      query heads of one KV head: they are added with red.global.add.v2 to fp32 buffers that a postprocess
      converts (with `deterministic`, in query-head order, behind a semaphore per (batch, KV head, key tile)).

Soft-capping (spec.softcap; the feature entries take the cap): S becomes T = tanh(S · softmax_scale / softcap) before
the mask and the exponent's factor is softcap · log2e, so P is that of the capped scores; dS = P ⊙ (dP − D) ⊙ (1 − T²),
dK and dQ taking the softmax scale as always. T is not kept through the step: `tanh_grad` recovers it from P and the
LSE (tile_config._BWD_SOFTCAP: the tiles it takes). A learnable sink needs nothing here: the LSE read includes it.

Masks: whole query tiles outside the window are never visited; only tiles crossing a window edge, and every tile
when the key tile runs past seqlen_k, pay for element-wise masking. Query rows past seqlen_q (TMA zero-fills them)
and rows that see no key carry lse_log2 = +inf and D = 0 from the preprocess, so their P and dS are exactly 0.
Masking happens on the scaled exponent, after the softmax scale, so a scale of 0 never meets -inf · 0.

Launch overhead: the kernel is launched with programmatic dependent launch and may start while the preprocess still
runs. Q, K, V and dO come from launches that ended before the preprocess began, so the producer loads K, V and the
first Q and dO tiles at once; every access to what the preprocess (or a memset before it) wrote follows a
griddepcontrol.wait: the producer's LSE / D loads, the dQ warp's reduce-adds and semaphores, the consumers' epilogue
(dK / dV stores, GQA adds and semaphores). The kernel lets the dQ postprocess launch early (it waits before its
loads).

K and V ride on the first Q and dO stage's barriers, which expect their bytes on top of the stage's: a CTA's first S
product waits for K and Q only (FA3 / FA4's order).

Global tensors are viewed as (seqlen, head_dim, heads, batch) as in the forward kernel.

Packed sequences (the `packed` entry, common/entries.BwdEntries; instances with `varlen` set): the grid spans
every sequence's key tiles in order (common/packed_tiles.py); a CTA offsets the (total, head_dim, heads) views by its
sequence's first query / key row and the padded buffers (LSE, D, dQ sums, GQA dK / dV sums) by its padded offset
(common/packed.py), zeroes the K / V rows of its tile past seqlen_k in shared memory before the walk (they are the
next sequence's rows or a KV cache's unused slots, and 0 · NaN would reach dP and dQ), and stores dK / dV by
16-byte stores of the sequence's rows (a TMA store would clip only at the end of the packed tensor). Deterministic
builds find a sequence's semaphores at its padded offset / tile (views.tile_semaphores); shortest-first order
reverses the key tiles within the sequence, whose tiles are consecutive in the grid.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple, Tuple, Type

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from ...common.acc_views import rows_cols_view
from ...common.block_info import BlockInfo
from ...common.dsl_types import dsl_dtype
from ...common.entries import BwdEntries
from ...common.mask import apply_mask
from ...common.online_softmax import LOG2_E
from ...common.packed import packed_pads, seq_rows
from ...common.packed_tiles import packed_tile, packed_tiles_bound
from ...common.softcap import apply_softcap, softcap_factors
from ...spec import AttentionSpec
from ..sm80.flash_bwd import red_add_f32_vec
from .barriers import BwdBarrierId
from ...common.bulk_ptx import add_release_gpu, bulk_reduce_add_f32, load_acquire_gpu
from .pipelines import consumer_state, consumer_wait, producer_state
from .epilogue import store_rows_predicated, zero_rows_from
from .views import (
    accum_rows,
    head_tiles,
    packed_seq_major_view,
    padded_stat_rows,
    seq_major_view,
    stats_view,
    tile_semaphores,
)
from .tile_config import (
    ROWS_PER_CONSUMER,
    UNSHUFFLED_STAT_COLS,
    WARPGROUP_THREADS,
    BwdTileConfig,
    bwd_config_problem,
    operand_atom_cols,
    stat_stage_stride,
)
from . import wgmma

SMEM_ALIGN = 1024  # 128-byte swizzle atoms repeat every 1 KiB
WARP_THREADS = 32
DQ_VEC = 4  # consecutive floats of one thread in the dQ "fragment" layout (one 16-byte store)


def one_stage(layout):
    """One stage of a staged shared-memory layout."""
    return cute.select(layout, mode=[0, 1])


def transposed_layout(s: cute.Tensor, rows: int, cols: int, stages: int) -> cute.Tensor:
    """The (cols, rows, stages) view of a (rows, cols, stages) shared-memory tile: a K-major tile read as the
    MN-major operand of another product (the swizzle atom transposes with it)."""
    return cute.composition(s, cute.make_ordered_layout((cols, rows, stages), order=(1, 0, 2)))


def dq_tiled_mma(dtype: Type[cutlass.Numeric], head_dim: int, cfg: BwdTileConfig) -> cute.TiledMma:
    """dQ = dS·K: A = dS (queries x keys: read transposed from the dSᵀ tile with keys on rows, else as stored),
    B = Kᵀ (head_dim x keys, read transposed from the K tile). The consumers split it by query rows ("m") or by
    head-dim columns ("n"). The dQ accumulator's "fragment" layout is this MMA's register order, so the postprocess
    builds the same one (the operands' major modes do not change it)."""
    w = cfg.num_consumer_wgs
    mn = cute.nvgpu.OperandMajorMode.MN
    if cfg.dq_swap_ab:
        # dQᵀ = Kᵀ·dSᵀ: A = Kᵀ (the (d, tile_n) view of K), B = dSᵀ (the (tile_m, tile_n) view of the dSᵀ tiles), both
        # MN-major; each consumer's 64 head-dim columns are wgmma's M.
        return wgmma.tiled_mma_f32(dtype, mn, mn, (w, 1, 1), (ROWS_PER_CONSUMER, cfg.tile_m))
    if cfg.dq_split == "m":
        atoms, tiler = (w, 1, 1), (ROWS_PER_CONSUMER, head_dim)
    elif cfg.dq_split == "single":
        atoms, tiler = (1, 1, 1), (cfg.tile_m, head_dim)
    else:
        atoms, tiler = (1, w, 1), (cfg.tile_m, head_dim // w)
    a_major = mn if cfg.keys_on_rows else cute.nvgpu.OperandMajorMode.K
    return wgmma.tiled_mma_f32(dtype, a_major, mn, atoms, tiler)


def dq_tile(head_dim: int, cfg: BwdTileConfig) -> Tuple[int, int]:
    """The (M, N) tile of the dQ MMA's accumulator: (tile_m, head_dim), or its transpose with dq_swap_ab."""
    return (head_dim, cfg.tile_m) if cfg.dq_swap_ab else (cfg.tile_m, head_dim)


def dq_fragment_offset(i: int, tidx, chunk: int):
    """Offset, within one query tile's block of the dQ accumulator (and within the shared dQ buffer), of dQ
    accumulator element `i` of consumer thread `tidx`. Each consumer warpgroup owns one contiguous chunk of `chunk`
    floats (what one bulk reduce-add moves); inside it, DQ_VEC consecutive elements per thread, thread-interleaved,
    so a warp's 16-byte stores cover 512 contiguous bytes (no bank conflicts)."""
    t = tidx % WARPGROUP_THREADS
    return (tidx // WARPGROUP_THREADS) * chunk + (i // DQ_VEC) * (WARPGROUP_THREADS * DQ_VEC) + t * DQ_VEC + i % DQ_VEC


# Above UNSHUFFLED_STAT_COLS (16) query columns per thread (tile_m > 64), each thread keeps only an eighth of its
# columns' LSE and D and fetches the rest from the 7 lanes that share its columns (shuffles): 32 + 32 registers would
# not fit at d64.


@cute.jit
def load_column_stats(s_stat: cute.Tensor, coords_rc: cute.Tensor, num_cols: cutlass.Constexpr[int]) -> cute.Tensor:
    """This thread's share of a per-query statistic (LSE or D of one stage, `s_stat` (tile_m,)): every column's value,
    or with more than UNSHUFFLED_STAT_COLS columns the columns of 8-column groups lane // 4 (mod 8)."""
    if const_expr(num_cols <= UNSHUFFLED_STAT_COLS):
        regs = cute.make_rmem_tensor(num_cols, Float32)
        for c in cutlass.range_constexpr(num_cols):
            regs[c] = s_stat[coords_rc[0, c][1]]
    else:
        # Column c = v + 2 g of the (rows, cols) view is query 8 g + 2 (lane % 4) + v; the 8 lanes with one
        # lane % 4 share all of them. Lane 4 j + q keeps groups g = j + 8 k.
        # With groups not a multiple of 8 (tile_m 80: 10 groups), the lanes past the last group read a clamped
        # index (never used).
        rounds = (num_cols // 2 + 7) // 8
        regs = cute.make_rmem_tensor(2 * rounds, Float32)
        j = cute.arch.lane_idx() // 4
        for k in cutlass.range_constexpr(rounds):
            for v in cutlass.range_constexpr(2):
                idx = coords_rc[0, v][1] + 8 * (j + 8 * k)
                if const_expr(8 * (8 * k + 7) + 8 > cute.size(s_stat)):
                    idx = cutlass.min(idx, cute.size(s_stat) - 1)
                regs[2 * k + v] = s_stat[idx]
    return regs


@cute.jit
def load_row_stats(s_stat: cute.Tensor, coords_rc: cute.Tensor, num_rows: cutlass.Constexpr[int]) -> cute.Tensor:
    """This thread's share of a per-query statistic when queries are the accumulator rows: one value per row."""
    regs = cute.make_rmem_tensor(num_rows, Float32)
    for r in cutlass.range_constexpr(num_rows):
        regs[r] = s_stat[coords_rc[r, 0][0]]
    return regs


@cute.jit
def column_stat(
    regs: cute.Tensor,
    c: cutlass.Constexpr[int],
    num_cols: cutlass.Constexpr[int],
    s_stat: cute.Tensor = None,
    coords_rc: cute.Tensor = None,
) -> Float32:
    """The statistic of column `c` from `load_column_stats`' registers, or with `s_stat` (the stage's shared-memory
    statistics, given only above UNSHUFFLED_STAT_COLS columns with BwdTileConfig.stats_at_use) loaded here: columns
    2 g and 2 g + 1 are adjacent queries, one 8-byte load (the same load for both, merged by the compiler)."""
    if const_expr(s_stat is not None):
        value = column_pair(s_stat, coords_rc, c - c % 2)[c % 2]
    else:
        value = regs[0]
        if const_expr(num_cols <= UNSHUFFLED_STAT_COLS):
            value = regs[c]
        else:
            v, g = c % 2, c // 2
            value = cute.arch.shuffle_sync(regs[2 * (g // 8) + v], offset=4 * (g % 8) + cute.arch.lane_idx() % 4)
    return value


@cute.jit
def column_pair(s_stat: cute.Tensor, coords_rc: cute.Tensor, c: cutlass.Constexpr[int]) -> cute.Tensor:
    """The statistic of columns c and c + 1 (c even: adjacent queries) as one 8-byte shared-memory load."""
    pair = cute.make_rmem_tensor(2, Float32)
    ptr = (s_stat.iterator + coords_rc[0, c][1]).align(8)
    cute.autovec_copy(cute.make_tensor(ptr, cute.make_layout(2)), pair)
    return pair


@cute.jit
def load_column_pairs(s_stat: cute.Tensor, coords_rc: cute.Tensor, pairs: cutlass.Constexpr[int]) -> cute.Tensor:
    """The statistic of the first 2 `pairs` columns in registers, by 8-byte loads of adjacent pairs
    (BwdTileConfig.lse_ahead)."""
    regs = cute.make_rmem_tensor(2 * pairs, Float32)
    for g in cutlass.range_constexpr(pairs):
        pair = column_pair(s_stat, coords_rc, 2 * g)
        regs[2 * g] = pair[0]
        regs[2 * g + 1] = pair[1]
    return regs


@cute.jit
def tanh_deriv(p: Float32, inv_scale_log2: Float32, lse_scaled: Float32) -> Float32:
    """1 − T², clamped at 0, of the T whose probability p = exp2(T · scale_log2 − lse_log2) is (softcap builds;
    lse_scaled = lse_log2 / scale_log2; Sm90FlashBackward.tanh_grad)."""
    t = cute.math.log2(p, fastmath=True) * inv_scale_log2 + lse_scaled
    return cute.arch.fmax(1.0 - t * t, Float32(0.0))


class PackedRows(NamedTuple):
    """Where one sequence's rows start in packed tensors (all None for dense ones, which index the batch instead):
    its queries and keys in the inputs (cu_seqlens), and its queries in the padded buffers of the query statistics
    and the dQ sums (cu_seqlens + batch * pad rounded down to a multiple of pad, common/packed.py). (The consumers'
    epilogue reads its own.)"""

    offset_q: object
    offset_k: object
    padded_q: object


class BwdGmem(NamedTuple):
    """The kernel's global tensors: TMA coordinate tensors of the six loads (Q, K, V, dO (s, d, h, b) and the
    (sq_padded, h, b) statistics), the fp32 dQ sums, and dK / dV (TMA coordinate tensors of dense builds, the
    packed tensors, or the fp32 sums of GQA builds)."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    do: cute.Tensor
    lse: cute.Tensor  # log2-domain LSE (the preprocess's)
    dpsum: cute.Tensor  # D = rowsum(dO * O), dlse folded in
    dq_accum: cute.Tensor
    dk: cute.Tensor
    dv: cute.Tensor


class BwdAtoms(NamedTuple):
    """The TMA atoms of BwdGmem's loads, and of dK / dV's stores (None where those go otherwise)."""

    q: cute.CopyAtom
    k: cute.CopyAtom
    v: cute.CopyAtom
    do: cute.CopyAtom
    lse: cute.CopyAtom
    dpsum: cute.CopyAtom
    dk: cute.CopyAtom
    dv: cute.CopyAtom


class BwdLayouts(NamedTuple):
    """Shared-memory layouts: the Q / dO stages, the K / V tiles, the dS (and P) stages, the LSE / D stages."""

    q: cute.ComposedLayout
    do: cute.ComposedLayout
    k: cute.ComposedLayout
    v: cute.ComposedLayout
    ds: cute.ComposedLayout
    stat: cute.Layout


class BwdSmem(NamedTuple):
    """The shared-memory tiles (p: P's stages with queries on rows; the dS tiles, unused, with keys on rows)."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    do: cute.Tensor
    ds: cute.Tensor
    p: cute.Tensor
    lse: cute.Tensor
    dpsum: cute.Tensor


class BwdPipes(NamedTuple):
    """The producer's mbarrier rings: Q + LSE, dO + D (K / V ride on their first stages)."""

    q: pipeline.PipelineTmaAsync
    do: pipeline.PipelineTmaAsync


class BwdWork(NamedTuple):
    """One CTA's share: a key tile of one (batch or sequence, query head), the query tiles [m_min, m_max) that see it,
    the tile arithmetic and where the sequence's rows start (packed)."""

    n_block: Int32
    head: Int32
    head_kv: Int32
    group: Int32  # query heads per KV head (GQA / MQA)
    batch: Int32
    m_min: Int32
    m_max: Int32
    info: BlockInfo
    rows: PackedRows
    # Block-sparse builds (refine_work): this key tile's list of query tiles; step i of [m_min, m_max) visits query
    # tile query_tiles[i]. None: step i visits query tile i.
    query_tiles: object = None


class BwdMmas(NamedTuple):
    """The tiled MMAs of a consumer: S and dP, dK, dV, dQ (or, from `get_slice`, one thread's slices of them)."""

    sdp: cute.TiledMma
    dk: cute.TiledMma
    dv: cute.TiledMma
    dq: cute.TiledMma


class BwdFragments(NamedTuple):
    """A consumer's wgmma operands: S / dP (K, Q, V, dO), dV / dK (dOᵀ, Qᵀ, P, dS), dQ (dS, Kᵀ)."""

    tSrK: cute.Tensor
    tSrQ: cute.Tensor
    tdPrV: cute.Tensor
    tdPrdO: cute.Tensor
    tdVrdOt: cute.Tensor
    tdKrQt: cute.Tensor
    tdVrP: cute.Tensor
    tdKrdS: cute.Tensor
    tdQrdS: cute.Tensor
    tdQrKt: cute.Tensor


class DkvTargets(NamedTuple):
    """Where a consumer's dK / dV go: dense tensors by TMA store (their atoms), packed ones by predicated rows, or
    the fp32 sums of GQA builds (deterministic: in head order behind mdKVsem)."""

    mdK: cute.Tensor
    mdV: cute.Tensor
    mdKVsem: cute.Tensor
    atom_dk: cute.CopyAtom
    atom_dv: cute.CopyAtom


class StepLoop(NamedTuple):
    """What every step of a consumer's walk over the query tiles shares."""

    pipes: BwdPipes
    mmas: BwdMmas
    frags: BwdFragments
    acc_dV: cute.Tensor
    acc_dK: cute.Tensor
    smem_copy_ds: object  # this thread's stmatrix copy of dS (and P) in the S accumulator's order
    tdSsdS: cute.Tensor  # its partition of the dS stages
    tPsP: cute.Tensor  # ... and of P's (queries on rows)
    sLSE: cute.Tensor
    sdPsum: cute.Tensor
    coords_rc: cute.Tensor  # (row, column) of this thread's S entries
    coords0_rc: cute.Tensor  # ... and of thread 0's (compile-time), for the mask
    info: BlockInfo
    n_block: Int32
    scale_log2: Float32  # the exponent's factor: softmax_scale * log2(e), or softcap * log2(e)
    pre_tanh: object  # softcap builds: softmax_scale / softcap (scores -> tanh's argument); None otherwise
    inv_scale_log2: object  # softcap builds: 1 / scale_log2 (P -> T, tanh_grad); None otherwise
    thr_dq: object  # this thread's slice of the dQ MMA
    dq_dst: cute.Tensor  # the shared dQ buffer(s), or with dq_red the (sequence, head)'s accumulator
    tidx: Int32  # 0 .. num_consumer_threads - 1
    score_ctx: object = None  # what a subclass's score hooks read (score_mod / mask_mod builds), else None


class Sm90FlashBackward(BwdEntries):
    """Callable compiled once per (dtype, head dims (d, dv), mask kind, varlen, softcap, tile config, GQA,
    deterministic; packed: also seqused_k); shapes and strides are runtime. dv (v, dout, dv) may differ from d (q, k,
    dq, dk) with queries on rows only. Entries (common/entries.py): `__call__` (dense tensors) and `packed` (packed
    sequences, spec.varlen), `features` / `packed_features` for spec.softcap; deterministic builds take their
    semaphores there.

    The kernel's roles: `produce` (the producer warp's TMA loads), `store_dq` (the dQ warp) and `consume` (each
    consumer warpgroup: `walk` over the query tiles, one `step` each, then `store_grads`)."""

    def __init__(self, spec: AttentionSpec, cfg: BwdTileConfig, gqa: bool, deterministic: bool = False):
        """spec.varlen: packed sequences (the `packed` entry), else dense tensors (`__call__`); spec.softcap: the
        feature entries, which take the cap (spec.sink changes nothing here: a sink is in the LSE the kernel reads)."""
        dtype, head_dim, mask_kind = dsl_dtype(spec.dtype), spec.head_dim, spec.mask
        assert dtype in (cutlass.BFloat16, cutlass.Float16)
        assert mask_kind in ("none", "causal", "local")
        problem = bwd_config_problem(cfg, head_dim, spec.head_dim_v)
        assert problem is None, problem
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = spec.head_dim_v  # (dO, V, dV; queries on rows only, where it may differ from head_dim)
        assert spec.head_dim_v == head_dim or not cfg.keys_on_rows, "keys on rows need head_dim_v == head_dim"
        self.mask_kind = mask_kind
        self.softcap = spec.softcap
        self.takes_features = spec.softcap  # (the cap; a subclass with arguments of its own sets it too)
        self.cfg = cfg
        self.gqa = gqa
        self.deterministic = deterministic
        self.varlen = spec.varlen
        self.num_consumers = cfg.num_consumer_wgs
        self.num_consumer_threads = cfg.num_consumer_wgs * WARPGROUP_THREADS
        self.tile_m = cfg.tile_m
        self.tile_n = cfg.tile_n
        self.num_stages = cfg.num_stages
        self.num_dq_wgs = cfg.num_dq_wgs
        self.dq_chunk = cfg.tile_m * head_dim // cfg.num_dq_wgs  # floats per dQ consumer and query tile
        self.keys_on_rows = cfg.keys_on_rows
        # Deterministic dQ order: descending key tiles under a right window edge (causal or local), ascending else.
        self.shortest_first = deterministic and mask_kind != "none"
        self.s_tile = (cfg.tile_n, cfg.tile_m) if cfg.keys_on_rows else (cfg.tile_m, cfg.tile_n)
        # dq_red adds dQ from registers with plain atomics, in no fixed order.
        assert not (deterministic and cfg.dq_red), "dq_red has no deterministic order"
        # Packed sequences: sequence b's rows of the padded buffers (LSE / D, the dQ and GQA dK / dV sums) start at
        # cu_seqlens[b] + b * pad rounded down to a multiple of pad (common/packed.py).
        self.pad_q, self.pad_k = packed_pads(cfg.tile_m, cfg.tile_n)

    # ----------------------------------------------------------------------------------------------------------------
    # Host side: views, layouts, TMA atoms, launch.
    # ----------------------------------------------------------------------------------------------------------------
    @cute.jit
    def _launch(
        self,
        tensors: tuple,  # (mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV) as the entries take them
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        stream: cuda.CUstream,
        packed=None,  # (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_k): packed tensors (common/entries.py)
        semaphores=(None, None),  # (mdQsem, mdKVsem): tensors where a deterministic build reads them
        features=None,  # (softcap,) from the feature entries of a spec.softcap build
    ):
        """Packed tensors: q (total_q, h, d), dout (total_q, h, dv), k / v (total_k, h_kv, d / dv), lse_log2 / dpsum
        (1, h, rows_q) from the packed preprocess (rows_q >= total_q + batch * pad_q), the dQ sums (h, rows_q * d)
        zeroed, dk / dv (total_k, h_kv, d / dv) or fp32 (rows_k, h_kv, d / dv) sums zeroed under GQA."""
        assert (
            features is not None
        ) == self.takes_features, "feature builds take their arguments through their entries"
        gmem = self._kernel_views(BwdGmem(*tensors), packed)
        layouts = self._smem_layouts()
        mmas = self._tiled_mmas()
        atoms, tmas = self._tma_atoms(gmem, layouts, packed)
        SharedStorage = self._shared_storage(layouts)
        if const_expr(packed is None):
            num_n_blocks = cute.ceil_div(gmem.k.shape[0], self.tile_n)
            grid = [num_n_blocks, cute.size(gmem.q.shape[2]), cute.size(gmem.q.shape[3])]
            seqs = None
        else:
            # Every sequence's key tiles in order (common/packed.py: at most batch + 1 per head without work).
            tiles = packed_tiles_bound(gmem.k.shape[0], packed[0].shape[0] - 1, self.tile_n)
            grid = [tiles, cute.size(gmem.q.shape[2]), 1]
            seqs = packed[:3]
        self.kernel(
            tuple(tmas), semaphores, tuple(atoms), tuple(mmas), tuple(layouts), softmax_scale, window_left,
            window_right, features, seqs, SharedStorage,
        ).launch(
            grid=grid, block=[self.cfg.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1, use_pdl=True
        )  # fmt: skip

    def _kernel_views(self, gmem: BwdGmem, packed) -> BwdGmem:
        """The tensors as the kernel indexes them: (seqlen, head_dim, heads, batch), packed (total, head_dim, heads);
        the statistics (rows, heads, batch) (packed: one batch entry, loaded by the same TMA as dense calls); GQA's
        fp32 dK / dV sums as they come."""
        view = seq_major_view if const_expr(packed is None) else packed_seq_major_view
        dk, dv = gmem.dk, gmem.dv
        if const_expr(not self.gqa):
            dk, dv = view(dk), view(dv)
        return gmem._replace(
            q=view(gmem.q), k=view(gmem.k), v=view(gmem.v), do=view(gmem.do), lse=stats_view(gmem.lse),
            dpsum=stats_view(gmem.dpsum), dk=dk, dv=dv,
        )  # fmt: skip

    def _smem_layouts(self) -> BwdLayouts:
        stages = self.num_stages
        d, dv = self.head_dim, self.head_dim_v
        atom, atom_v = operand_atom_cols(d, self.cfg), operand_atom_cols(dv, self.cfg)
        return BwdLayouts(
            q=wgmma.k_major_smem_layout(self.dtype, self.tile_m, d, stages, atom_cols=atom),
            do=wgmma.k_major_smem_layout(self.dtype, self.tile_m, dv, stages, atom_cols=atom_v),
            k=wgmma.k_major_smem_layout(self.dtype, self.tile_n, d, 1, atom_cols=atom),
            v=wgmma.k_major_smem_layout(self.dtype, self.tile_n, dv, 1, atom_cols=atom_v),
            # The S / dP tile as the accumulators hold it (dSᵀ: keys x queries, or dS: queries x keys); P likewise.
            ds=wgmma.k_major_smem_layout(self.dtype, *self.s_tile, stages),
            # Each stage of LSE / D starts on a 128-byte boundary, as a TMA destination must (tile_m 80: 320 bytes).
            stat=cute.make_layout((self.tile_m, stages), stride=(1, stat_stage_stride(self.tile_m))),
        )

    def _tma_atoms(self, gmem: BwdGmem, layouts: BwdLayouts, packed):
        """(BwdAtoms, BwdGmem of TMA coordinate tensors where TMA moves them); sets the stages' byte counts."""
        d, dv = self.head_dim, self.head_dim_v
        load = cpasync.CopyBulkTensorTileG2SOp()
        atom_q, tma_q = cpasync.make_tiled_tma_atom(load, gmem.q, one_stage(layouts.q), (self.tile_m, d))
        atom_do, tma_do = cpasync.make_tiled_tma_atom(load, gmem.do, one_stage(layouts.do), (self.tile_m, dv))
        atom_k, tma_k = cpasync.make_tiled_tma_atom(load, gmem.k, one_stage(layouts.k), (self.tile_n, d))
        atom_v, tma_v = cpasync.make_tiled_tma_atom(load, gmem.v, one_stage(layouts.v), (self.tile_n, dv))
        stat_one = cute.make_layout(self.tile_m)
        atom_lse, tma_lse = cpasync.make_tiled_tma_atom(load, gmem.lse, stat_one, (self.tile_m,))
        atom_dpsum, tma_dpsum = cpasync.make_tiled_tma_atom(load, gmem.dpsum, stat_one, (self.tile_m,))
        atom_dk, tma_dk, atom_dv, tma_dv = None, gmem.dk, None, gmem.dv
        # Packed sequences store dK / dV by predicated rows (a TMA store would clip only at the end of the tensor).
        if const_expr(not self.gqa and packed is None):
            store = cpasync.CopyBulkTensorTileS2GOp()
            atom_dk, tma_dk = cpasync.make_tiled_tma_atom(store, gmem.dk, one_stage(layouts.k), (self.tile_n, d))
            atom_dv, tma_dv = cpasync.make_tiled_tma_atom(store, gmem.dv, one_stage(layouts.v), (self.tile_n, dv))
        stat_bytes = self.tile_m * 4
        self.bytes_q_lse = cute.size_in_bytes(self.dtype, one_stage(layouts.q)) + stat_bytes
        self.bytes_do_dpsum = cute.size_in_bytes(self.dtype, one_stage(layouts.do)) + stat_bytes
        self.bytes_k = cute.size_in_bytes(self.dtype, one_stage(layouts.k))
        self.bytes_v = cute.size_in_bytes(self.dtype, one_stage(layouts.v))
        atoms = BwdAtoms(atom_q, atom_k, atom_v, atom_do, atom_lse, atom_dpsum, atom_dk, atom_dv)
        tmas = gmem._replace(q=tma_q, k=tma_k, v=tma_v, do=tma_do, lse=tma_lse, dpsum=tma_dpsum, dk=tma_dk, dv=tma_dv)
        return atoms, tmas

    def _tiled_mmas(self) -> BwdMmas:
        """The (S / dP, dK, dV, dQ) tiled MMAs (plain Python, called while `_launch` is traced)."""
        d, dv = self.head_dim, self.head_dim_v
        k_major = cute.nvgpu.OperandMajorMode.K
        mn_major = cute.nvgpu.OperandMajorMode.MN
        w = self.num_consumers
        if self.keys_on_rows:
            # Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ: each consumer's 64 keys x all tile_m queries.
            tiled_mma_sdp = wgmma.tiled_mma_f32(
                self.dtype, k_major, k_major, (w, 1, 1), (ROWS_PER_CONSUMER, self.tile_m)
            )
            # dV += Pᵀ·dO, dK += dSᵀ·Q: A from registers (the Sᵀ / dPᵀ accumulators), B = dOᵀ / Qᵀ (MN-major).
            tiled_mma_dk = wgmma.tiled_mma_f32(
                self.dtype, k_major, mn_major, (w, 1, 1), (ROWS_PER_CONSUMER, d), warpgroup.OperandSource.RMEM
            )
            tiled_mma_dv = tiled_mma_dk  # (head_dim_v == head_dim with keys on rows)
        else:
            # S = Q·Kᵀ and dP = dO·Vᵀ: all 64 queries x each consumer's tile_n / w keys.
            tiled_mma_sdp = wgmma.tiled_mma_f32(
                self.dtype, k_major, k_major, (1, w, 1), (ROWS_PER_CONSUMER, self.tile_n // w)
            )
            # dV += Pᵀ·dO, dK += dSᵀ·Q: A = Pᵀ / dSᵀ read transposed from shared memory (every key of the tile),
            # B = dOᵀ / Qᵀ; each consumer owns head_dim / w columns of dK and head_dim_v / w of dV.
            tiled_mma_dk = wgmma.tiled_mma_f32(self.dtype, mn_major, mn_major, (1, w, 1), (self.tile_n, d // w))
            tiled_mma_dv = tiled_mma_dk
            if dv != d:
                tiled_mma_dv = wgmma.tiled_mma_f32(self.dtype, mn_major, mn_major, (1, w, 1), (self.tile_n, dv // w))
        return BwdMmas(tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, dq_tiled_mma(self.dtype, d, self.cfg))

    def _shared_storage(self, layouts: BwdLayouts):
        """The kernel's shared-memory struct (plain Python: the P buffer exists only with queries on rows, and the
        DSL would turn an `if` in a class body under `cute.jit` into device control flow)."""
        stages, aligned, dt = self.num_stages, cute.struct.Align, self.dtype
        fields = {
            "mbar_kv": cute.struct.MemRange[cutlass.Int64, 2],  # (unused: prologue)
            "mbar_q": cute.struct.MemRange[cutlass.Int64, 2 * stages],
            "mbar_do": cute.struct.MemRange[cutlass.Int64, 2 * stages],
            "sLSE": aligned[cute.struct.MemRange[Float32, cute.cosize(layouts.stat)], 128],
            "sdPsum": aligned[cute.struct.MemRange[Float32, cute.cosize(layouts.stat)], 128],
            "sQ": aligned[cute.struct.MemRange[dt, cute.cosize(layouts.q)], SMEM_ALIGN],
            "sdO": aligned[cute.struct.MemRange[dt, cute.cosize(layouts.do)], SMEM_ALIGN],
            "sK": aligned[cute.struct.MemRange[dt, cute.cosize(layouts.k)], SMEM_ALIGN],
            "sV": aligned[cute.struct.MemRange[dt, cute.cosize(layouts.v)], SMEM_ALIGN],
            "sdS": aligned[cute.struct.MemRange[dt, cute.cosize(layouts.ds)], SMEM_ALIGN],
        }
        if not self.cfg.dq_red:  # (with dq_red the consumers add dQ from registers)
            dq_floats = self.cfg.dq_buffers * self.tile_m * self.head_dim
            fields["sdQ"] = aligned[cute.struct.MemRange[Float32, dq_floats], SMEM_ALIGN]
        if not self.keys_on_rows:  # last, so that the other offsets do not move
            fields["sP"] = aligned[cute.struct.MemRange[dt, cute.cosize(layouts.ds)], SMEM_ALIGN]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    # ----------------------------------------------------------------------------------------------------------------
    # The kernel: one CTA's setup, then the roles.
    # ----------------------------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tmas,  # BwdGmem's fields
        semaphores,  # (mdQsem, mdKVsem): int32 tensors of deterministic (GQA) builds, else None
        atoms,  # BwdAtoms' fields
        mmas,  # BwdMmas' fields
        layouts,  # BwdLayouts' fields
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        features,  # the feature entries' arguments ((softcap,) in a spec.softcap build), else None
        seqs,  # packed: (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK or None); dense: None
        SharedStorage: cutlass.Constexpr,
    ):
        gmem, atoms, mmas, layouts = BwdGmem(*tmas), BwdAtoms(*atoms), BwdMmas(*mmas), BwdLayouts(*layouts)
        # The dQ postprocess may be scheduled now; it waits for this grid's end before reading the accumulator.
        cute.arch.griddepcontrol_launch_dependents()
        warp_idx, tidx, storage, pipes = self.prologue(atoms, SharedStorage)
        smem = self.shared_tensors(storage, layouts)
        work = self.refine_work(self.cta_work(gmem, window_left, window_right, seqs), features)
        # Where a consumer puts its dQ: its part of the shared buffer(s) that the dQ warp adds to the accumulator, or
        # with dq_red this (sequence, head)'s accumulator itself.
        if const_expr(self.cfg.dq_red):
            dq_dst = accum_rows(gmem.dq_accum, work.head, work.batch, work.rows.padded_q, self.head_dim)
        else:
            dq_dst = storage.sdQ.get_tensor(cute.make_layout(self.cfg.dq_buffers * self.tile_m * self.head_dim))

        pipeline.pipeline_init_wait(None)

        mdQsem, mdKVsem = semaphores
        warp_group = warp_idx // 4
        if warp_group == 0:
            cute.arch.setmaxregister_decrease(self.cfg.producer_regs)
            if warp_idx == 0:
                self.produce(pipes, atoms, gmem, smem, work)
            if const_expr(not self.cfg.dq_red):
                if warp_idx == 1:
                    self.store_dq(dq_dst, gmem.dq_accum, mdQsem, work)
        else:
            cute.arch.setmaxregister_increase(self.cfg.consumer_regs)
            dkv = DkvTargets(gmem.dk, gmem.dv, mdKVsem, atoms.dk, atoms.dv)
            self.consume(pipes, mmas, smem, dq_dst, dkv, softmax_scale, features, work, tidx, warp_idx, seqs)

    @cute.jit
    def prologue(self, atoms: BwdAtoms, SharedStorage: cutlass.Constexpr):
        """Descriptor prefetch, shared memory, the Q / dO load rings (their init made visible later by
        pipeline_init_wait)."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in atoms[:6]:  # (the loads' atoms)
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads // WARP_THREADS)
        ring = partial(
            pipeline.PipelineTmaAsync.create, producer_group=producer, consumer_group=consumer_warps, defer_sync=True
        )
        # A one-stage ring that nothing waits on (K and V ride on the first Q / dO stages): it served the separate
        # K / V barrier of an earlier study. Without it ptxas allocates differently: the packed d96 local GQA build
        # went from 0 to 24 spill bytes (its plain build from 40 to 56), so it stays until the tight builds are
        # re-tuned.
        ring(barrier_storage=storage.mbar_kv.data_ptr(), num_stages=1, tx_count=self.bytes_k + self.bytes_v)
        pipe_q = ring(barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.num_stages, tx_count=self.bytes_q_lse)
        pipe_do = ring(
            barrier_storage=storage.mbar_do.data_ptr(), num_stages=self.num_stages, tx_count=self.bytes_do_dpsum
        )
        pipeline.pipeline_init_arrive(None, is_relaxed=True)
        return warp_idx, tidx, storage, BwdPipes(pipe_q, pipe_do)

    def shared_tensors(self, storage, layouts: BwdLayouts) -> BwdSmem:
        tile = lambda field, layout: field.get_tensor(layout.outer, swizzle=layout.inner)  # noqa: E731
        sQ = tile(storage.sQ, layouts.q)
        sdO = tile(storage.sdO, layouts.do)
        sK = tile(storage.sK, layouts.k)
        sV = tile(storage.sV, layouts.v)
        sdS = tile(storage.sdS, layouts.ds)
        sLSE = storage.sLSE.get_tensor(layouts.stat)
        sdPsum = storage.sdPsum.get_tensor(layouts.stat)
        sP = sdS  # unused with keys on rows (P stays in registers)
        if const_expr(not self.keys_on_rows):
            sP = tile(storage.sP, layouts.ds)
        return BwdSmem(q=sQ, k=sK, v=sV, do=sdO, ds=sdS, p=sP, lse=sLSE, dpsum=sdPsum)

    @cute.jit
    def cta_work(self, gmem: BwdGmem, window_left: Int32, window_right: Int32, seqs) -> BwdWork:
        """This CTA's key tile, heads, batch (or sequence) and query-tile range. Dense tensors index the batch;
        packed ones offset the inputs by cu_seqlens and the padded buffers by their padded offset (PackedRows)."""
        mQ, mK = gmem.q, gmem.k
        n_block, head, batch = cute.arch.block_idx()
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        rows = PackedRows(None, None, None)
        if const_expr(seqs is not None):
            # This CTA's sequence and key tile (its sequence's keys: seqused_k when given); past the last tile, none.
            num_seqs = seqs[0].shape[0] - 1
            batch, n_block = packed_tile(n_block, self.tile_n, seqs[1], seqs[2])
            idle = batch >= num_seqs
            batch = cutlass.min(batch, num_seqs - 1)
            seq = seq_rows(batch, *seqs)
            seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
            if idle:
                seqlen_k = Int32(0)  # no query tile to walk, nothing to store (below)
            rows = PackedRows(seq.offset_q, seq.offset_k, seq.padded_offset_q(self.pad_q))
        group = mQ.shape[2] // mK.shape[2]  # query heads per KV head (GQA / MQA)
        head_kv = head // group
        info = BlockInfo(self.tile_m, self.tile_n, self.mask_kind, seqlen_q, seqlen_k, window_left, window_right)
        if const_expr(self.shortest_first):
            # Deterministic with a right window edge: the key tiles of a query tile add in descending order (see
            # store_dq), so they are launched in that order too. A CTA may only ever wait for CTAs with a lower
            # block index, which the hardware dispatches first: otherwise a waiting CTA could hold the SM that the
            # CTA it waits for needs. Packed: within the sequence (its tiles are consecutive in the grid); a CTA
            # past the last tile (seqlen_k 0) keeps tile 0, which has nothing to do.
            if const_expr(seqs is None):
                n_block = cute.arch.grid_dim()[0] - 1 - n_block
            else:
                n_block = cutlass.max((seqlen_k + self.tile_n - 1) // self.tile_n - 1 - n_block, 0)
        m_min, m_max = info.q_block_range(n_block)
        if const_expr(seqs is not None):
            # A CTA past the last key tile (seqlen_k 0 above) has nothing to load or compute, and the epilogue writes
            # nothing (its stores are predicated on seqlen_k).
            if n_block * self.tile_n >= seqlen_k:
                m_max = m_min
        return BwdWork(n_block, head, head_kv, group, batch, m_min, m_max, info, rows)

    def refine_work(self, work: BwdWork, features) -> BwdWork:
        """Hook: a subclass's change to the CTA's work from its feature arguments (block-sparse builds: the key tile
        at this launch position and its list of query tiles). The work as it is here."""
        return work

    @staticmethod
    def query_tile(work: BwdWork, i: Int32) -> Int32:
        """The query tile of step i (block-sparse builds: the i-th entry of the key tile's list)."""
        return i if const_expr(work.query_tiles is None) else work.query_tiles[i]

    # ----------------------------------------------------------------------------------------------------------------
    # The producer warp.
    # ----------------------------------------------------------------------------------------------------------------
    @cute.jit
    def produce(self, pipes: BwdPipes, atoms: BwdAtoms, gmem: BwdGmem, smem: BwdSmem, work: BwdWork):
        """K and V once; then Q + LSE and dO + D per query tile, in the consumers' order. Launched while the
        preprocess may still run: K, V and the first Q and dO tiles (written before the preprocess started) are
        loaded first, LSE and D (the preprocess's outputs) only after griddepcontrol.wait."""
        d = self.head_dim
        head, head_kv, batch, rows = work.head, work.head_kv, work.batch, work.rows
        no_cluster = cute.make_layout(1)

        def part(atom, s, g):
            return cpasync.tma_partition(atom, 0, no_cluster, cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2))

        def part1(atom, s, g):
            return cpasync.tma_partition(atom, 0, no_cluster, cute.group_modes(s, 0, 1), cute.group_modes(g, 0, 1))

        gK = cute.local_tile(head_tiles(gmem.k, head_kv, batch, rows.offset_k), (self.tile_n, d), (None, 0))
        gV = cute.local_tile(
            head_tiles(gmem.v, head_kv, batch, rows.offset_k), (self.tile_n, self.head_dim_v), (None, 0)
        )
        gQ = cute.local_tile(head_tiles(gmem.q, head, batch, rows.offset_q), (self.tile_m, d), (None, 0))
        gdO = cute.local_tile(
            head_tiles(gmem.do, head, batch, rows.offset_q), (self.tile_m, self.head_dim_v), (None, 0)
        )
        gLSE = cute.local_tile(padded_stat_rows(gmem.lse, head, batch, rows.padded_q), (self.tile_m,), (None,))
        gdPsum = cute.local_tile(padded_stat_rows(gmem.dpsum, head, batch, rows.padded_q), (self.tile_m,), (None,))
        tKsK, tKgK = part(atoms.k, smem.k, gK)
        tVsV, tVgV = part(atoms.v, smem.v, gV)
        tQsQ, tQgQ = part(atoms.q, smem.q, gQ)
        tdOsdO, tdOgdO = part(atoms.do, smem.do, gdO)
        tLsL, tLgL = part1(atoms.lse, smem.lse, gLSE)
        tDsD, tDgD = part1(atoms.dpsum, smem.dpsum, gdPsum)

        if work.m_max > work.m_min:
            src = (tQgQ, tKgK, tVgV, tdOgdO, tLgL, tDgD)
            dst = (tQsQ, tKsK, tVsV, tdOsdO, tLsL, tDsD)
            q = producer_state(self.num_stages)
            do = producer_state(self.num_stages)
            first = self.query_tile(work, work.m_min)
            self.load_query_tile(pipes, q, do, atoms, src, dst, first, work.n_block, True)
            q.advance()
            do.advance()
            for i in cutlass.range(work.m_min + 1, work.m_max, unroll=1):
                m_block = self.query_tile(work, i)
                self.load_query_tile(pipes, q, do, atoms, src, dst, m_block, work.n_block, False)
                q.advance()
                do.advance()

    @cute.jit
    def acquire_stage(self, pipe, state, atom, src, dst, extra_bytes: int, with_extra: cutlass.Constexpr):
        """Acquires `state`'s stage of `pipe` and returns its full barrier; with_extra, the TMA load src -> dst rides
        on the same barrier (which then expects extra_bytes more)."""
        pipe.producer_acquire(state)
        bar = pipe.producer_get_barrier(state)
        if const_expr(with_extra):
            with cute.arch.elect_one():
                cute.arch.mbarrier_expect_tx(bar, extra_bytes)
            cute.copy(atom, src, dst, tma_bar_ptr=bar)
        return bar

    @cute.jit
    def load_query_tile(
        self,
        pipes: BwdPipes,
        q,
        do,
        atoms: BwdAtoms,
        src: tuple,
        dst: tuple,
        m_block: Int32,
        n_block: Int32,
        first: cutlass.Constexpr,
    ):
        """Q + LSE on a Q stage's barrier, dO + D on a dO stage's. src / dst: the TMA partitions of Q, K, V, dO, LSE
        and D in global and shared memory. The first query tile (`first`): K completes Q's first stage and V dO's
        (each barrier expects the extra bytes), so the first S product waits for K + Q only; every load of an input
        comes before griddepcontrol.wait, LSE and D after it."""
        tQgQ, tKgK, tVgV, tdOgdO, tLgL, tDgD = src
        tQsQ, tKsK, tVsV, tdOsdO, tLsL, tDsD = dst
        bar_q = self.acquire_stage(pipes.q, q, atoms.k, tKgK[None, n_block], tKsK[None, 0], self.bytes_k, first)
        cute.copy(atoms.q, tQgQ[None, m_block], tQsQ[None, q.index], tma_bar_ptr=bar_q)
        if const_expr(not first):
            cute.copy(atoms.lse, tLgL[None, m_block], tLsL[None, q.index], tma_bar_ptr=bar_q)
        bar_do = self.acquire_stage(pipes.do, do, atoms.v, tVgV[None, n_block], tVsV[None, 0], self.bytes_v, first)
        cute.copy(atoms.do, tdOgdO[None, m_block], tdOsdO[None, do.index], tma_bar_ptr=bar_do)
        if const_expr(first):
            cute.arch.griddepcontrol_wait()  # the preprocess has ended and its writes are visible
            cute.copy(atoms.lse, tLgL[None, m_block], tLsL[None, q.index], tma_bar_ptr=bar_q)
        cute.copy(atoms.dpsum, tDgD[None, m_block], tDsD[None, do.index], tma_bar_ptr=bar_do)

    # ----------------------------------------------------------------------------------------------------------------
    # The consumer warpgroups.
    # ----------------------------------------------------------------------------------------------------------------
    @cute.jit
    def consume(
        self,
        pipes: BwdPipes,
        mmas: BwdMmas,
        smem: BwdSmem,
        dq_dst: cute.Tensor,
        dkv: DkvTargets,
        softmax_scale: Float32,
        features,  # the feature entries' arguments (spec.softcap: (the cap,)), else None
        work: BwdWork,
        tidx: Int32,  # the thread's index in the CTA
        warp_idx: Int32,
        seqs,  # packed: the cu_seqlens / seqused_k tensors (see kernel); dense: None
    ):
        """This consumer's key rows: its dK / dV over the walk of the query tiles, its share of each tile's dQ."""
        head_in_group = work.head % work.group
        tidx = tidx - WARPGROUP_THREADS  # 0 .. num_consumer_threads - 1
        frags, thr = self.consumer_fragments(mmas, smem, tidx)
        acc_dV = cute.make_rmem_tensor(thr.dv.partition_shape_C((self.tile_n, self.head_dim_v)), Float32)
        acc_dK = cute.make_rmem_tensor(thr.dk.partition_shape_C((self.tile_n, self.head_dim)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)

        # dSᵀ / dS (and P, queries on rows) in 16 bits, accumulator order, to shared memory for the products that
        # read them from there.
        stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        smem_copy_ds = cute.make_tiled_copy_C(stmatrix, mmas.sdp).get_slice(tidx)
        tdSsdS = smem_copy_ds.partition_D(smem.ds)  # (CPY, CPY_M, CPY_N, stage)
        tPsP = smem_copy_ds.partition_D(smem.p)

        # (row, column) of this thread's S accumulator entries, and thread 0's (compile-time) for the mask.
        coords_rc = rows_cols_view(thr.sdp.partition_C(cute.make_identity_tensor(self.s_tile)))
        coords0_rc = rows_cols_view(mmas.sdp.get_slice(0).partition_C(cute.make_identity_tensor(self.s_tile)))

        if work.m_max > work.m_min:
            scale_log2, pre_tanh, inv_scale_log2, score_ctx = self.score_factors(softmax_scale, features, work)
            if const_expr(self.cfg.dq_red):
                cute.arch.griddepcontrol_wait()  # dQ adds from the first step: after the preprocess zeroed the sums
            loop = StepLoop(
                pipes, mmas, frags, acc_dV, acc_dK, smem_copy_ds, tdSsdS, tPsP, smem.lse, smem.dpsum, coords_rc,
                coords0_rc, work.info, work.n_block, scale_log2, pre_tanh, inv_scale_log2, thr.dq, dq_dst, tidx,
                score_ctx,
            )  # fmt: skip
            self.walk(loop, smem, work)

        # Before any global write of the consumers: dK / dV (GQA: sums zeroed by an earlier launch) and the GQA
        # semaphores. (The LSE / D they read came through the producer's loads, issued after its wait.)
        cute.arch.griddepcontrol_wait()
        self.store_grads((acc_dK, acc_dV), mmas, smem, dkv, softmax_scale, work, head_in_group, tidx, warp_idx, seqs)

    def score_factors(self, softmax_scale: Float32, features, work: BwdWork):
        """(the exponent's factor, softcap's pre_tanh and inv_scale_log2 (or None), the score hooks' context): the
        StepLoop fields the feature entries' arguments decide. A subclass with its own score hooks overrides this."""
        if const_expr(features is None):
            return softmax_scale * LOG2_E, None, None, None
        pre_tanh, scale_log2 = softcap_factors(softmax_scale, features[0])
        return scale_log2, pre_tanh, 1.0 / scale_log2, None

    def consumer_fragments(self, mmas: BwdMmas, smem: BwdSmem, tidx: Int32):
        """(BwdFragments, this thread's slices of the four MMAs as a BwdMmas) of consumer thread `tidx`."""
        d, stages = self.head_dim, self.num_stages
        # Warp-uniform, so that the operand descriptors of every wgmma are built in uniform registers (from tidx they
        # would be per-thread values, moved to uniform registers with R2UR before each wgmma).
        consumer = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)
        wg_first = consumer * WARPGROUP_THREADS  # operand partitions are per warpgroup
        wg_sdp = mmas.sdp.get_slice(wg_first)
        wg_dk = mmas.dk.get_slice(wg_first)
        wg_dv = mmas.dv.get_slice(wg_first)
        # The dQ MMA spans one warpgroup with dq_split "single": every consumer slices it as consumer 0 (only consumer
        # 0 issues it).
        wg_dq = mmas.dq.get_slice(wg_first if const_expr(self.num_dq_wgs > 1) else 0)
        thr = BwdMmas(
            mmas.sdp.get_slice(tidx),
            mmas.dk.get_slice(tidx),
            mmas.dv.get_slice(tidx),
            mmas.dq.get_slice(tidx if const_expr(self.num_dq_wgs > 1) else tidx % WARPGROUP_THREADS),
        )
        sQ, sK, sV, sdO, sdS, sP = smem.q, smem.k, smem.v, smem.do, smem.ds, smem.p

        # Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ (keys on rows), or S = Q·Kᵀ, dP = dO·Vᵀ: all K-major tiles as loaded. The Q and dO
        # fragments keep their stage mode: (MMA, 1, k-blocks, stage).
        if const_expr(self.keys_on_rows):
            tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))[None, None, None, 0]
            tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
            tdPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))[None, None, None, 0]
            tdPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        else:
            tSrK = wg_sdp.make_fragment_B(wg_sdp.partition_B(sK))[None, None, None, 0]
            tSrQ = wg_sdp.make_fragment_A(wg_sdp.partition_A(sQ))
            tdPrV = wg_sdp.make_fragment_B(wg_sdp.partition_B(sV))[None, None, None, 0]
            tdPrdO = wg_sdp.make_fragment_A(wg_sdp.partition_A(sdO))
        # dV += Pᵀ·dO, dK += dSᵀ·Q: B = dOᵀ / Qᵀ, the (d, tile_m) views of the same tiles. A = Pᵀ / dSᵀ: register
        # fragments (keys on rows), else the (tile_n, tile_m) views of the P / dS tiles, with their stage mode.
        tdVrdOt = wg_dv.make_fragment_B(wg_dv.partition_B(transposed_layout(sdO, self.tile_m, self.head_dim_v, stages)))
        tdKrQt = wg_dk.make_fragment_B(wg_dk.partition_B(transposed_layout(sQ, self.tile_m, d, stages)))
        if const_expr(self.keys_on_rows):
            tdVrP = wg_dv.make_fragment_A(wg_dv.partition_shape_A((self.tile_n, self.tile_m)))
            tdKrdS = wg_dk.make_fragment_A(wg_dk.partition_shape_A((self.tile_n, self.tile_m)))
            # dQ = dS·K: A = dS, the (tile_m, tile_n) view of the dSᵀ tiles; B = Kᵀ, the (d, tile_n) view of K.
            tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(transposed_layout(sdS, self.tile_n, self.tile_m, stages)))
        else:
            tdVrP = wg_dv.make_fragment_A(wg_dv.partition_A(transposed_layout(sP, self.tile_m, self.tile_n, stages)))
            tdKrdS = wg_dk.make_fragment_A(wg_dk.partition_A(transposed_layout(sdS, self.tile_m, self.tile_n, stages)))
            tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
        sKt = transposed_layout(sK, self.tile_n, d, 1)
        if const_expr(self.cfg.dq_swap_ab):
            # dQᵀ = Kᵀ·dSᵀ: the same two views as A and B.
            tdQrKt = wg_dq.make_fragment_A(wg_dq.partition_A(sKt))[None, None, None, 0]
            tdQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(transposed_layout(sdS, self.tile_n, self.tile_m, stages)))
        else:
            tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(sKt))[None, None, None, 0]
        frags = BwdFragments(tSrK, tSrQ, tdPrV, tdPrdO, tdVrdOt, tdKrQt, tdVrP, tdKrdS, tdQrdS, tdQrKt)
        return frags, thr

    @cute.jit
    def walk(self, loop: StepLoop, smem: BwdSmem, work: BwdWork):
        """The key tile's walk over its query tiles: its list's (block-sparse builds), or the mask's range's."""
        if const_expr(work.query_tiles is not None):
            self.walk_list(loop, work)
        else:
            self.walk_range(loop, smem, work)

    @cute.jit
    def walk_list(self, loop: StepLoop, work: BwdWork):
        """Block-sparse builds (dense tensors): the listed query tiles in order, every one masked element by element
        (the kernel's own mask: exact whatever the list holds beyond the visible tiles)."""
        q = consumer_state(self.num_stages)
        do = consumer_state(self.num_stages)
        for i in cutlass.range(work.m_min, work.m_max, unroll=1):
            q, do = self.step(q, do, self.query_tile(work, i), True, loop)

    @cute.jit
    def walk_range(self, loop: StepLoop, smem: BwdSmem, work: BwdWork):
        """The query tiles [m_min, m_max) in order; only those crossing a window edge (or all of them when this key
        tile runs past seqlen_k) are masked element by element. Packed sequences: a last query tile that reaches past
        the sequence's end is the walk's last step, taken after the loops (zero_q_do_tail; outside them, so that its
        addresses are not held through the loops: inside, the d128 / d64 / d96 builds spilled 20-24 bytes; this step
        costs the d96 causal build 20 bytes, a value reloaded once per step, and none at d64 / d128 / d256 without a
        window)."""
        info, n_block, m_min, m_max, tidx = work.info, work.n_block, work.m_min, work.m_max, loop.tidx
        q = consumer_state(self.num_stages)
        do = consumer_state(self.num_stages)
        step = partial(self.step, loop=loop)
        m_end = m_max
        q_tail = False
        if const_expr(self.varlen):
            q_tail = m_max * self.tile_m > info.seqlen_q
            if q_tail:
                m_end = m_max - 1
        kv_tail = (n_block + 1) * self.tile_n > info.seqlen_k
        masked_end = m_min
        if const_expr(info.has_right_bound):
            masked_end = cutlass.max(cutlass.min(info.q_right_masked_end(n_block), m_end), m_min)
        left_start = m_end
        if const_expr(info.has_left_bound):
            left_start = cutlass.max(cutlass.min(info.q_left_masked_start(n_block), m_end), masked_end)
        if kv_tail:
            masked_end = m_end
            left_start = m_end
            if const_expr(self.varlen):
                self.zero_kv_tail(loop.pipes, smem, info.seqlen_k - n_block * self.tile_n, tidx)
        for m_block in cutlass.range(m_min, masked_end, unroll=1):
            q, do = step(q, do, m_block, True)
        for m_block in cutlass.range(masked_end, left_start, unroll=1):
            q, do = step(q, do, m_block, False)
        if const_expr(info.has_left_bound):
            for m_block in cutlass.range(left_start, m_end, unroll=1):
                q, do = step(q, do, m_block, True)
        if const_expr(self.varlen):
            if q_tail:
                rows = info.seqlen_q - m_end * self.tile_m
                self.zero_q_do_tail(loop.pipes, q, do, smem, rows, tidx)
                q, do = step(q, do, m_end, True)

    @cute.jit
    def zero_kv_tail(self, pipes: BwdPipes, smem: BwdSmem, keys: Int32, tidx: Int32):
        """Packed sequences: the K and V rows of a key tile past seqlen_k (`keys` rows are the sequence's) are the next
        sequence's rows, or a KV cache's unused slots after seqused_k, as TMA loaded them. The mask makes their P
        and dS exactly 0, but 0 · Inf / NaN (dP = V·dOᵀ, dQ = dS·K) would be NaN: every consumer warpgroup zeroes
        them (the same values, no race) once they have landed, before the first product of the walk."""
        consumer_wait(pipes.q, consumer_state(self.num_stages))  # K rides on the first Q stage, V on dO's
        consumer_wait(pipes.do, consumer_state(self.num_stages))
        widths = (self.head_dim, self.head_dim_v)
        self.zero_tails((smem.k[None, None, 0], smem.v[None, None, 0]), widths, keys, self.tile_n, tidx)

    @cute.jit
    def zero_q_do_tail(self, pipes: BwdPipes, q, do, smem: BwdSmem, rows: Int32, tidx: Int32):
        """Packed sequences: the Q and dO rows of a sequence's last query tile past seqlen_q (`rows` rows are the
        sequence's) are the next sequence's rows as TMA loaded them. Their P and dS are exactly 0 (lse_log2 = +inf,
        D = 0 in the padding rows), but 0 · Inf / NaN (S = K·Qᵀ, dP = V·dOᵀ, dV += Pᵀ·dO, dK += dSᵀ·Q) would carry
        non-finite values of that sequence into this one's dK / dV: every consumer warpgroup zeroes them (the same
        values, no race) once they have landed, before this step's first product."""
        pipes.q.consumer_wait(q)
        pipes.do.consumer_wait(do)
        widths = (self.head_dim, self.head_dim_v)
        tiles = (smem.q[None, None, q.index], smem.do[None, None, do.index])
        self.zero_tails(tiles, widths, rows, self.tile_m, tidx)

    @cute.jit
    def zero_tails(
        self,
        tiles: tuple,
        widths: cutlass.Constexpr[tuple],
        first_row: Int32,
        tile_rows: cutlass.Constexpr[int],
        tidx: Int32,
    ):
        """Rows first_row.. of each landed (tile_rows, width) shared-memory tile become 0, written by every consumer
        warpgroup alike; fenced for the async proxy and synchronised across the consumers before a wgmma reads them."""
        for s, width in zip(tiles, widths):
            zero_rows_from(s, first_row, self.dtype, tile_rows, width, tidx % WARPGROUP_THREADS)
        cute.arch.fence_view_async_shared()  # generic-proxy stores, read next by wgmma (async proxy)
        cute.arch.barrier(barrier_id=int(BwdBarrierId.EPILOGUE), number_of_threads=self.num_consumer_threads)

    # ----------------------------------------------------------------------------------------------------------------
    # One step of the walk: one query tile.
    # ----------------------------------------------------------------------------------------------------------------
    @cute.jit
    def step(
        self,
        q: pipeline.PipelineState,
        do: pipeline.PipelineState,
        m_block: Int32,
        masked: cutlass.Constexpr[bool],
        loop: StepLoop,
    ):
        """One query tile: S and dP, P, (dV's early product,) dS, P and dS to their A operands or shared memory, dV,
        dQ, dK (see the module docstring for the order and the overlap)."""
        tile_ctx = self.query_tile_setup(m_block, loop)
        acc_S, acc_dP, lse = self.score_products(q, do, loop)
        factor = self.probabilities(acc_S, lse, q, m_block, masked, loop, tile_ctx)
        dpsum = self.dv_before_dp_wait(acc_S, do, loop)
        self.score_grads(acc_S, acc_dP, dpsum, lse, q, do, loop, m_block, factor)
        self.stage_p_and_ds(acc_S, acc_dP, q, do, loop)
        self.dq_and_dk(q, do, m_block, loop)
        q.advance()
        do.advance()
        return q, do

    def s_shape(self, loop: StepLoop):
        """A thread's S (and dP) accumulator."""
        return loop.mmas.sdp.get_slice(0).partition_shape_C(self.s_tile)

    @cute.jit
    def score_products(self, q, do, loop: StepLoop):
        """Issues S (Sᵀ = K·Qᵀ with keys on rows) once Q has landed and dP once dO has, and loads the LSE while they
        run: (acc_S, acc_dP, this thread's LSE registers or None)."""
        mma, f, kor = loop.mmas.sdp, loop.frags, self.keys_on_rows
        s_shape = self.s_shape(loop)
        consumer_wait(loop.pipes.q, q)
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        if const_expr(kor):
            wgmma.gemm(mma, acc_S, f.tSrK, f.tSrQ[None, None, None, q.index], zero_init=True, wait=-1)
        else:
            wgmma.gemm(mma, acc_S, f.tSrQ[None, None, None, q.index], f.tSrK, zero_init=True, wait=-1)
        # The statistics of this thread's queries go to registers while the products run (a shared-memory load after
        # the wgmma wait would stall the exponentials behind it), except with stats_at_use (columns beyond
        # UNSHUFFLED_STAT_COLS), where each is loaded where it is used instead of shuffled from another lane.
        s_rc = rows_cols_view(acc_S)
        num_rows = cute.size(s_rc, mode=[0])
        num_cols = cute.size(s_rc, mode=[1])
        lse = self.load_stats(loop.sLSE[None, q.index], loop.coords_rc, num_rows, num_cols, ahead=self.cfg.lse_ahead)
        # dO with the library's wait (no test first): the extra branch of `consumer_wait` here made the d64 GQA build
        # spill 72 bytes.
        loop.pipes.do.consumer_wait(do)
        acc_dP = cute.make_rmem_tensor(s_shape, Float32)
        if const_expr(kor):
            wgmma.gemm(mma, acc_dP, f.tdPrV, f.tdPrdO[None, None, None, do.index], zero_init=True, wait=1)
        else:
            wgmma.gemm(mma, acc_dP, f.tdPrdO[None, None, None, do.index], f.tdPrV, zero_init=True, wait=1)
        return acc_S, acc_dP, lse

    @cute.jit
    def probabilities(
        self, acc_S: cute.Tensor, lse, q, m_block: Int32, masked: cutlass.Constexpr[bool], loop, tile_ctx=None
    ):
        """P = exp2(S · scale · log2e − lse_log2[query]) in place (S has landed: dP's issue waited for it); softcap
        builds take S to T = tanh(S · softmax_scale / softcap) first and scale by softcap · log2e. The mask (on the
        scaled exponent) leaves -inf -> P = 0. Returns what `modify_scores` kept for score_grads (None here)."""
        if const_expr(loop.pre_tanh is not None):
            apply_softcap(acc_S, loop.pre_tanh)
        factor = self.modify_scores(acc_S, m_block, loop)
        s_rc = rows_cols_view(acc_S)
        num_rows = cute.size(s_rc, mode=[0])
        num_cols = cute.size(s_rc, mode=[1])
        if const_expr(self.keys_on_rows):
            for c in cutlass.range_constexpr(num_cols):
                lse_c = self.column_value(lse, loop.sLSE[None, q.index], loop.coords_rc, c, num_cols)
                for r in cutlass.range_constexpr(num_rows):
                    s_rc[r, c] = s_rc[r, c] * loop.scale_log2 - lse_c
        else:
            for r in cutlass.range_constexpr(num_rows):
                for c in cutlass.range_constexpr(num_cols):
                    s_rc[r, c] = s_rc[r, c] * loop.scale_log2 - lse[r]
        self.mask_scores(s_rc, m_block, loop, tile_ctx)
        if const_expr(masked):
            kor = self.keys_on_rows
            apply_mask(s_rc, loop.coords_rc, loop.coords0_rc, loop.info, m_block, loop.n_block, True, True, kor)
        acc_S.store(cute.math.exp2(acc_S.load(), fastmath=True))
        return factor

    def modify_scores(self, acc_S: cute.Tensor, m_block: Int32, loop: StepLoop):
        """Hook: changes the raw scores S of a tile before the exponent's scale; returns what score_grads needs of them
        (or None). None here."""
        return None

    def query_tile_setup(self, m_block: Int32, loop: StepLoop):
        """Hook: what a step's score hooks read of its query tile (`mask_scores`' tile_ctx), loaded before the tile's
        products are issued. None here."""
        return None

    def mask_scores(self, s_rc: cute.Tensor, m_block: Int32, loop: StepLoop, tile_ctx=None) -> None:
        """Hook: masks (-inf) entries of a tile's scaled exponent, before the kernel's own mask. Nothing here."""

    def modify_score_grads(self, p_rc: cute.Tensor, ds_rc: cute.Tensor, m_block: Int32, factor, loop: StepLoop):
        """Hook: changes dS (ds_rc, from P in p_rc) where the scores were changed; `factor`: modify_scores' result.
        Nothing here."""

    def dv_kblocks(self, loop: StepLoop):
        """dV's k-blocks before the dP wait (all: None, or the first dv_early_kblocks) and those after dS (None: none
        left), for dv_before_dp_wait."""
        dv_kb = cute.size(loop.frags.tdVrP.shape[2])
        early = None if const_expr(self.cfg.dv_early_kblocks is None) else (0, min(self.cfg.dv_early_kblocks, dv_kb))
        late = None if const_expr(early is None or early[1] == dv_kb) else (early[1], dv_kb)
        return early, late

    def dv_early(self) -> bool:
        return self.keys_on_rows and self.cfg.dv_before_dp_wait

    @cute.jit
    def dv_before_dp_wait(self, acc_S: cute.Tensor, do, loop: StepLoop):
        """D's registers (loaded here rather than with the LSE, and P converted only once dS is formed: that keeps the
        live registers (Sᵀ, dPᵀ, D, dV, dK) under the 240 a consumer thread has at d64 (tile_m 128)); with
        dv_before_dp_wait, dV += Pᵀ·dO issued first, its P the A operand, so that the exponentials it reads are
        issued before the dP wait (ptxas hoists the wait above most of them otherwise; with the first k-blocks only,
        ptxas still keeps the 32 of an unmasked d128 causal step ahead of it); dV stays in flight through the dS math.
        With d_after_dv_issue, D's loads after dV's early product is issued instead: before it, ptxas gave a D load
        and the exponential that P's first conversion (for that product) waits for one scoreboard, so the conversion
        waited for the load. Returns once dP has landed."""
        dv_early = self.dv_early()
        d_late = dv_early and self.cfg.d_after_dv_issue
        s_rc = rows_cols_view(acc_S)
        num_rows = cute.size(s_rc, mode=[0])
        num_cols = cute.size(s_rc, mode=[1])
        dpsum = None
        if const_expr(not d_late):
            dpsum = self.load_stats(loop.sdPsum[None, do.index], loop.coords_rc, num_rows, num_cols)
        early, _ = self.dv_kblocks(loop)
        if const_expr(dv_early):
            wgmma.store_p_operand(acc_S, loop.frags.tdVrP, early)
            dO_t = loop.frags.tdVrdOt[None, None, None, do.index]
            wgmma.gemm(loop.mmas.dv, loop.acc_dV, loop.frags.tdVrP, dO_t, zero_init=False, wait=-1, k_blocks=early)
            if const_expr(d_late):
                dpsum = self.load_stats(loop.sdPsum[None, do.index], loop.coords_rc, num_rows, num_cols)
            warpgroup.wait_group(1)  # dP done
        else:
            warpgroup.wait_group(0)
        return dpsum

    @cute.jit
    def score_grads(
        self, acc_S: cute.Tensor, acc_dP: cute.Tensor, dpsum, lse, q, do, loop: StepLoop, m_block: Int32, factor
    ):
        """dS = P ⊙ (dP − D[query]) in acc_dP; softcap builds times 1 − T² (`tanh_grad`), score hooks' builds as
        `modify_score_grads` says."""
        s_rc = rows_cols_view(acc_S)
        dp_rc = rows_cols_view(acc_dP)
        num_rows = cute.size(s_rc, mode=[0])
        num_cols = cute.size(s_rc, mode=[1])
        if const_expr(self.keys_on_rows):
            for c in cutlass.range_constexpr(num_cols):
                d = self.column_value(dpsum, loop.sdPsum[None, do.index], loop.coords_rc, c, num_cols)
                for r in cutlass.range_constexpr(num_rows):
                    dp_rc[r, c] = s_rc[r, c] * (dp_rc[r, c] - d)
        else:
            for r in cutlass.range_constexpr(num_rows):
                for c in cutlass.range_constexpr(num_cols):
                    dp_rc[r, c] = s_rc[r, c] * (dp_rc[r, c] - dpsum[r])
        if const_expr(loop.pre_tanh is not None):
            self.tanh_grad(s_rc, dp_rc, lse, q, loop)
        self.modify_score_grads(s_rc, dp_rc, m_block, factor, loop)

    @cute.jit
    def tanh_grad(self, p_rc: cute.Tensor, ds_rc: cute.Tensor, lse, q, loop: StepLoop):
        """dS *= 1 − T² (softcap builds), with T recovered from P rather than kept through the step (a tensor of T
        is 32 more live registers per thread at d128, where the defaults leave few): P = exp2(T · scale_log2 −
        lse_log2), so T = (log2 P + lse_log2) / scale_log2, one lg2 per element, with the LSE read again (keys on
        rows: 8-byte pairs from the stage's shared memory, as stats_at_use does; queries on rows: the rows'
        registers). A loop of its own after dS's: fused into it, or with the LSE from registers, the d64 / d96 builds
        spilled more. Where P is 0 (masked, a row without keys: lse_log2 +inf) T is -inf or NaN and max(1 − T², 0)
        is 0 (max returns the non-NaN operand), so dS stays 0."""
        inv = loop.inv_scale_log2
        num_rows = cute.size(p_rc, mode=[0])
        num_cols = cute.size(p_rc, mode=[1])
        if const_expr(self.keys_on_rows):
            for c in cutlass.range_constexpr(num_cols):
                lse_c = column_stat(None, c, num_cols, loop.sLSE[None, q.index], loop.coords_rc) * inv
                for r in cutlass.range_constexpr(num_rows):
                    ds_rc[r, c] = ds_rc[r, c] * tanh_deriv(p_rc[r, c], inv, lse_c)
        else:
            for r in cutlass.range_constexpr(num_rows):
                lse_r = lse[r] * inv
                for c in cutlass.range_constexpr(num_cols):
                    ds_rc[r, c] = ds_rc[r, c] * tanh_deriv(p_rc[r, c], inv, lse_r)

    @cute.jit
    def stage_p_and_ds(self, acc_S: cute.Tensor, acc_dP: cute.Tensor, q, do, loop: StepLoop):
        """Keys on rows: P (what dV's early product left) and dSᵀ into their 16-bit A fragments, dSᵀ to shared memory
        for dQ, and dV's product (or its remaining k-blocks); queries on rows: P and dS to shared memory, then dV's
        product once every consumer's are there."""
        f, kor = loop.frags, self.keys_on_rows
        dv_early = self.dv_early()
        _, late = self.dv_kblocks(loop)
        if const_expr(kor):
            if const_expr(not dv_early):
                wgmma.store_p_operand(acc_S, f.tdVrP)
            elif const_expr(late is not None):
                wgmma.store_p_operand(acc_S, f.tdVrP, late)
            wgmma.store_p_operand(acc_dP, f.tdKrdS)
            # The 16-bit A fragment holds dSᵀ in the accumulator's register order: store it as such for dQ.
            rdS = cute.make_tensor(f.tdKrdS.iterator, cute.make_layout(self.s_shape(loop)))
            copy = loop.smem_copy_ds
            cute.copy(copy, copy.retile(rdS), loop.tdSsdS[None, None, None, q.index])
            cute.arch.fence_view_async_shared()  # generic-proxy stores, read next by wgmma (async proxy)
            if const_expr(not dv_early):
                dO_t = f.tdVrdOt[None, None, None, do.index]
                wgmma.gemm(loop.mmas.dv, loop.acc_dV, f.tdVrP, dO_t, zero_init=False, wait=-1)
            elif const_expr(late is not None):
                dO_t = f.tdVrdOt[None, None, None, do.index]
                wgmma.gemm(loop.mmas.dv, loop.acc_dV, f.tdVrP, dO_t, zero_init=False, wait=-1, k_blocks=late)
        else:
            # P and dS go to shared memory: the dK / dV products of every consumer read all of the tile's keys.
            copy = loop.smem_copy_ds
            for acc, dst in ((acc_S, loop.tPsP), (acc_dP, loop.tdSsdS)):
                r16 = cute.make_rmem_tensor(self.s_shape(loop), self.dtype)
                wgmma.convert_to_16bit(acc, r16)
                cute.copy(copy, copy.retile(r16), dst[None, None, None, q.index])
            cute.arch.fence_view_async_shared()
        # Every consumer's dS (and P) is in shared memory. Nobody still reads this buffer: a consumer that reaches
        # this stage again has passed the barrier of the step in between (two stages), which every consumer reaches
        # only after waiting for its products; with one stage, the Q ring guards it (a consumer releases the stage
        # only after that wait, and the producer reuses it only after every consumer has released it).
        cute.arch.barrier(barrier_id=int(BwdBarrierId.DS_READY), number_of_threads=self.num_consumer_threads)
        if const_expr(not kor):
            P_t, dO_t = f.tdVrP[None, None, None, q.index], f.tdVrdOt[None, None, None, do.index]
            wgmma.gemm(loop.mmas.dv, loop.acc_dV, P_t, dO_t, zero_init=False, wait=-1)

    @cute.jit
    def dq_and_dk(self, q, do, m_block: Int32, loop: StepLoop):
        """dQ = dS·K (this consumer's share) and dK += dSᵀ·Q; dO's stage released once dV's product is done with it,
        Q's once dK's is; dQ handed to the dQ warp (or added from registers) in between."""
        f, mmas, tidx = loop.frags, loop.mmas, loop.tidx
        acc_dQ = cute.make_rmem_tensor(loop.thr_dq.partition_shape_C(dq_tile(self.head_dim, self.cfg)), Float32)
        every_consumer_dq = self.num_dq_wgs == self.num_consumers
        consumer = tidx // WARPGROUP_THREADS
        if const_expr(self.cfg.dq_swap_ab):
            wgmma.gemm(mmas.dq, acc_dQ, f.tdQrKt, f.tdQrdS[None, None, None, q.index], zero_init=True, wait=1)
        elif const_expr(every_consumer_dq):
            wgmma.gemm(mmas.dq, acc_dQ, f.tdQrdS[None, None, None, q.index], f.tdQrKt, zero_init=True, wait=1)
        else:  # dq_split "single": consumer 0 computes dQ; the others only wait for dV
            if cute.arch.make_warp_uniform(consumer) == 0:
                wgmma.gemm(mmas.dq, acc_dQ, f.tdQrdS[None, None, None, q.index], f.tdQrKt, zero_init=True, wait=1)
            else:
                warpgroup.wait_group(0)
        loop.pipes.do.consumer_release(do)  # dV's product is done with dO (the wait above leaves only dQ's in flight)
        dS_t = f.tdKrdS if const_expr(self.keys_on_rows) else f.tdKrdS[None, None, None, q.index]
        wgmma.gemm(mmas.dk, loop.acc_dK, dS_t, f.tdKrQt[None, None, None, q.index], zero_init=False, wait=1)

        # dQ (unscaled) into this consumer's shared buffer, in the fragment layout, for the dQ warp to add; or with
        # dq_red added to the accumulator from registers.
        put_dq = self.red_dq if const_expr(self.cfg.dq_red) else self.stage_dq
        if const_expr(every_consumer_dq):
            put_dq(acc_dQ, loop.dq_dst, m_block, tidx, consumer)
        else:
            if cute.arch.make_warp_uniform(consumer) == 0:
                put_dq(acc_dQ, loop.dq_dst, m_block, tidx, consumer)
        warpgroup.wait_group(0)
        loop.pipes.q.consumer_release(q)

    # ----------------------------------------------------------------------------------------------------------------
    # The query statistics (LSE, D) of a step.
    # ----------------------------------------------------------------------------------------------------------------
    @cute.jit
    def load_stats(
        self,
        s_stat: cute.Tensor,
        coords_rc: cute.Tensor,
        num_rows: cutlass.Constexpr[int],
        num_cols: cutlass.Constexpr[int],
        ahead: cutlass.Constexpr[int] = 0,
    ):
        """This thread's registers of one per-query statistic (LSE or D) of a stage, `s_stat`; None where
        `column_value` reads them from shared memory at their use (stats_at_use), unless `ahead` (lse_ahead):
        then the first `ahead` column pairs now, the rest still at their use."""
        regs = None
        if const_expr(not self.keys_on_rows):
            regs = load_row_stats(s_stat, coords_rc, num_rows)
        elif const_expr(not self.stats_at_use(num_cols)):
            regs = load_column_stats(s_stat, coords_rc, num_cols)
        elif const_expr(ahead > 0):
            regs = load_column_pairs(s_stat, coords_rc, ahead)  # (tile_config: at most num_cols / 2)
        return regs

    def stats_at_use(self, num_cols: int) -> bool:
        return self.cfg.stats_at_use and num_cols > UNSHUFFLED_STAT_COLS

    @cute.jit
    def column_value(
        self,
        regs,
        s_stat: cute.Tensor,
        coords_rc: cute.Tensor,
        c: cutlass.Constexpr[int],
        num_cols: cutlass.Constexpr[int],
    ) -> Float32:
        """Column c's statistic (keys on rows) from `load_stats`' registers or, with stats_at_use, shared memory."""
        at_use = self.stats_at_use(num_cols)
        if const_expr(at_use and regs is not None and c < cute.size(regs)):
            value = regs[c]  # loaded ahead (lse_ahead)
        else:
            value = column_stat(regs, c, num_cols, s_stat if at_use else None, coords_rc)
        return value

    @cute.jit
    def stage_dq(self, acc_dQ: cute.Tensor, sdQ: cute.Tensor, m_block: Int32, tidx: Int32, consumer: Int32):
        """This consumer's dQ (unscaled) into its shared buffer, in the fragment layout, once the dQ warp hands the
        buffer over; then tells the dQ warp it is full."""
        pair = WARPGROUP_THREADS + WARP_THREADS
        cute.arch.barrier(barrier_id=int(BwdBarrierId.DQ_EMPTY_FIRST) + consumer, number_of_threads=pair)
        if const_expr(self.cfg.dq_buffers > 1):
            sdQ = cute.make_tensor(sdQ.iterator + self.dq_buffer_offset(m_block), sdQ.layout)
        for i in cutlass.range_constexpr(cute.size(acc_dQ) // DQ_VEC):
            dst = (sdQ.iterator + dq_fragment_offset(i * DQ_VEC, tidx, self.dq_chunk)).align(DQ_VEC * 4)
            src = cute.make_tensor(acc_dQ.iterator + i * DQ_VEC, cute.make_layout(DQ_VEC))
            cute.autovec_copy(src, cute.make_tensor(dst, cute.make_layout(DQ_VEC)))
        cute.arch.fence_view_async_shared()  # read next by the bulk copy engine (async proxy)
        cute.arch.barrier_arrive(barrier_id=int(BwdBarrierId.DQ_FULL_FIRST) + consumer, number_of_threads=pair)

    def dq_buffer_offset(self, m_block: Int32):
        """Floats from the shared dQ buffers' start to query tile m_block's buffer (dq_buffers)."""
        if const_expr(self.cfg.dq_buffers == 1):
            return 0
        return (m_block & (self.cfg.dq_buffers - 1)) * (self.tile_m * self.head_dim)  # (1 or 2 buffers)

    @cute.jit
    def red_dq(self, acc_dQ: cute.Tensor, gdQ: cute.Tensor, m_block: Int32, tidx: Int32, consumer: Int32):
        """dq_red: this consumer's dQ (unscaled) added to query tile m_block's block of the accumulator `gdQ` ((batch,
        head)'s sq_padded * d floats) with one red.global.add.v4.f32 per DQ_VEC floats, at the offsets the dQ warp's
        bulk reduce-add would reach (the fragment layout)."""
        base = gdQ.iterator + m_block * (self.tile_m * self.head_dim)
        for i in cutlass.range_constexpr(cute.size(acc_dQ) // DQ_VEC):
            dst = (base + dq_fragment_offset(i * DQ_VEC, tidx, self.dq_chunk)).align(DQ_VEC * 4)
            red_add_f32_vec(dst, [acc_dQ[i * DQ_VEC + j] for j in range(DQ_VEC)])

    # ----------------------------------------------------------------------------------------------------------------
    # The dQ warp, and the consumers' epilogue.
    # ----------------------------------------------------------------------------------------------------------------
    @cute.jit
    def store_dq(self, sdQ: cute.Tensor, mdQaccum: cute.Tensor, mdQsem: cute.Tensor, work: BwdWork):
        """The dQ warp: per query tile, hands each consumer its (free) buffer, waits for it to be filled and adds it
        to the global accumulator with one bulk reduce-add. Deterministic: the key tiles that see a query tile add
        to it one after another, in key-tile order, behind its semaphore."""
        info, n_block, head, batch, rows = work.info, work.n_block, work.head, work.batch, work.rows
        chunk = self.dq_chunk
        pair = WARPGROUP_THREADS + WARP_THREADS
        dq_base = accum_rows(mdQaccum, head, batch, rows.padded_q, self.head_dim).iterator
        # The accumulator (zeroed by the preprocess) and the semaphores only after the preprocess's end.
        cute.arch.griddepcontrol_wait()
        for i in cutlass.range(work.m_min, work.m_max, unroll=1):
            m_block = self.query_tile(work, i)
            for c in cutlass.range_constexpr(self.num_dq_wgs):
                if const_expr(not self.deterministic):
                    # Consumer c's part of this tile's buffer, last read by the reduce dq_buffers tiles back, is free
                    # (groups retire in order; the num_dq_wgs * (dq_buffers - 1) groups of the tiles in between and
                    # those of consumers after c may still be reading).
                    cute.arch.cp_async_bulk_wait_group(self.num_dq_wgs * self.cfg.dq_buffers - 1 - c, read=True)
                cute.arch.barrier_arrive(barrier_id=int(BwdBarrierId.DQ_EMPTY_FIRST) + c, number_of_threads=pair)
            if const_expr(self.deterministic):
                sem = tile_semaphores(mdQsem, head, batch, rows.padded_q, self.tile_m).iterator + m_block
                if const_expr(self.shortest_first):
                    # The key tile on this query tile's diagonal reaches it first (at its first step), the one
                    # before it one step later, ...: turns follow arrival (FlashAttention-3's shortest-first order).
                    turn = info.kv_block_range(m_block)[1] - 1 - n_block
                else:
                    turn = n_block - info.kv_block_range(m_block)[0]  # every key tile reaches it at the same step
                while load_acquire_gpu(sem) != turn:
                    pass
                cute.arch.fence_proxy("async.global")  # the adds below are async-proxy accesses
            for c in cutlass.range_constexpr(self.num_dq_wgs):
                cute.arch.barrier(barrier_id=int(BwdBarrierId.DQ_FULL_FIRST) + c, number_of_threads=pair)
                with cute.arch.elect_one():
                    bulk_reduce_add_f32(
                        dq_base + (m_block * (self.tile_m * self.head_dim) + c * chunk),
                        sdQ.iterator + (self.dq_buffer_offset(m_block) + c * chunk),
                        chunk * 4,
                    )
                cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.deterministic):
                cute.arch.cp_async_bulk_wait_group(0, read=False)  # the adds are done, not only their reads
                cute.arch.fence_proxy("async.global")  # ... and visible to the generic-proxy release below
                with cute.arch.elect_one():
                    add_release_gpu(sem, Int32(1))
        cute.arch.cp_async_bulk_wait_group(0, read=True)  # shared memory must outlive the last reads

    @cute.jit
    def store_grads(
        self,
        accs: tuple,  # (acc_dK, acc_dV)
        mmas: BwdMmas,
        smem: BwdSmem,
        dkv: DkvTargets,
        softmax_scale: Float32,
        work: BwdWork,
        head_in_group: Int32,
        tidx: Int32,
        warp_idx: Int32,
        seqs,
    ):
        """The consumers' dK (times the softmax scale) and dV: stored (`store_dkv`; a key tile no query sees still
        writes its zeros), or under GQA added to the KV head's fp32 sums (`add_dkv_partials`)."""
        offset_k, padded_k = None, None
        if const_expr(seqs is not None):
            # Read again here rather than kept in registers through the walk (they are tight at d64).
            seq = seq_rows(work.batch, *seqs)
            offset_k, padded_k = seq.offset_k, seq.padded_offset_k(self.pad_k)
        if const_expr(self.gqa):
            add = partial(self.add_dkv_partials, accs, mmas, dkv, softmax_scale, work, head_in_group, tidx, padded_k)
            if const_expr(self.varlen):
                if work.n_block * self.tile_n < work.info.seqlen_k:  # (past it: not even padding rows of this sequence)
                    add()
            else:
                add()
        else:
            self.store_dkv(accs, mmas, smem, dkv, softmax_scale, work, tidx, warp_idx, offset_k)

    @cute.jit
    def store_dkv(
        self, accs, mmas, smem: BwdSmem, dkv: DkvTargets, softmax_scale, work: BwdWork, tidx, warp_idx, offset_k
    ):
        """dK·scale and dV (accs) in 16 bits through the K / V tiles' shared memory (every consumer is done reading
        them once all have passed the barrier) and one TMA store each, clipped at seqlen_k; packed sequences
        (offset_k: the sequence's first key row; None: dense) by 16-byte stores of the sequence's rows (a TMA store
        would clip only at the end of the tensor)."""
        acc_dK, acc_dV = accs
        sK, sV, n_block, head_kv, batch = smem.k, smem.v, work.n_block, work.head_kv, work.batch
        seqlen_k = work.info.seqlen_k
        dk_dv = ((sK, dkv.mdK, dkv.atom_dk, self.head_dim), (sV, dkv.mdV, dkv.atom_dv, self.head_dim_v))
        cute.arch.barrier(barrier_id=int(BwdBarrierId.EPILOGUE), number_of_threads=self.num_consumer_threads)
        acc_dK.store(acc_dK.load() * softmax_scale)
        stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        for acc, s, mma in ((acc_dK, sK, mmas.dk), (acc_dV, sV, mmas.dv)):
            smem_copy = cute.make_tiled_copy_C(stmatrix, mma).get_slice(tidx)
            r16 = cute.make_rmem_tensor(acc.shape, self.dtype)
            wgmma.convert_to_16bit(acc, r16)
            cute.copy(smem_copy, smem_copy.retile(r16), smem_copy.partition_D(s[None, None, 0]))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(BwdBarrierId.EPILOGUE), number_of_threads=self.num_consumer_threads)
        if const_expr(offset_k is not None):
            for s, m, _, d in dk_dv:
                g = cute.local_tile(head_tiles(m, head_kv, batch, offset_k), (self.tile_n, d), (n_block, 0))
                store_rows_predicated(
                    s[None, None, 0], g, seqlen_k - n_block * self.tile_n, self.dtype, d, tidx, self.tile_n,
                    self.num_consumer_threads,
                )  # fmt: skip
        else:
            if warp_idx == 4:
                no_cluster = cute.make_layout(1)
                for s, m, atom, d in dk_dv:
                    g = cute.local_tile(m[None, None, head_kv, batch], (self.tile_n, d), (None, 0))
                    t_s, t_g = cpasync.tma_partition(
                        atom, 0, no_cluster, cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
                    )
                    cute.copy(atom, t_s[None, 0], t_g[None, n_block])
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def add_dkv_partials(
        self,
        accs: tuple,  # (acc_dK, acc_dV)
        mmas: BwdMmas,
        dkv: DkvTargets,
        softmax_scale: Float32,
        work: BwdWork,
        head_in_group: Int32,
        tidx: Int32,
        padded_k,  # packed: the sequence's first row of the (rows_k, h_kv, d) sums (None: dense)
    ):
        """GQA: this query head's dK·scale and dV added to the fp32 (b, sk_padded, h_kv, d) sums, two adjacent
        columns per red (the buffers are padded to whole key tiles, so no row needs a predicate). Deterministic: the
        query heads of a KV head add in head order, behind the (batch, KV head, key tile) semaphore."""
        acc_dK, acc_dV = accs
        n_block, head_kv, batch = work.n_block, work.head_kv, work.batch
        sem = None
        if const_expr(self.deterministic):
            sem = tile_semaphores(dkv.mdKVsem, head_kv, batch, padded_k, self.tile_n).iterator + n_block
            if tidx == 0:
                while load_acquire_gpu(sem) != head_in_group:
                    pass
            cute.arch.barrier(barrier_id=int(BwdBarrierId.EPILOGUE), number_of_threads=self.num_consumer_threads)
        # Each thread holds two rows of its warp's 16 and, per 8-column group, two adjacent columns: one row pointer
        # per row, and column offsets that are thread 0's (compile-time) plus this thread's shift.
        # The thread's coordinates from a fresh thread-index read: values derived from the index at the kernel's
        # start would stay live (or spill) across the whole walk just for this epilogue.
        fresh_tidx = cute.arch.make_warp_uniform(cute.arch.warp_idx()) * WARP_THREADS + cute.arch.lane_idx()

        def coords(mma, d):  # (this thread's coordinates, thread 0's, their column shift) in dK's / dV's tile
            tile = cute.make_identity_tensor((self.tile_n, d))
            coords_rc = rows_cols_view(mma.get_slice(fresh_tidx - WARPGROUP_THREADS).partition_C(tile))
            coords0_rc = rows_cols_view(mma.get_slice(0).partition_C(tile))
            return coords_rc, coords0_rc, coords_rc[0, 0][1] - coords0_rc[0, 0][1]

        coords_rc, coords0_rc, col_shift = coords(mmas.dk, self.head_dim)
        row0 = n_block * self.tile_n
        acc_dK.store(acc_dK.load() * softmax_scale)
        for acc, m, d in ((acc_dK, dkv.mdK, self.head_dim), (acc_dV, dkv.mdV, self.head_dim_v)):
            if const_expr(d != self.head_dim):  # dV's own tile (head_dim_v wide); else dK's coordinates serve
                coords_rc, coords0_rc, col_shift = coords(mmas.dv, d)
            acc_rc = rows_cols_view(acc)
            for r in cutlass.range_constexpr(cute.size(acc_rc, mode=[0])):
                if const_expr(padded_k is None):
                    row_ptr = m[batch, row0 + coords_rc[r, 0][0], head_kv, None].iterator + col_shift
                else:
                    row_ptr = m[padded_k + row0 + coords_rc[r, 0][0], head_kv, None].iterator + col_shift
                for c in cutlass.range_constexpr(cute.size(acc_rc, mode=[1]) // 2):
                    red_add_f32_vec(row_ptr + coords0_rc[0, 2 * c][1], [acc_rc[r, 2 * c], acc_rc[r, 2 * c + 1]])
        if const_expr(self.deterministic):
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier(barrier_id=int(BwdBarrierId.EPILOGUE), number_of_threads=self.num_consumer_threads)
            if tidx == 0:
                add_release_gpu(sem, Int32(1))

"""Tile shapes, 2-CTA choice, pipeline depths and register split of the sm100 forward kernel: the one place they live.

Kernel anatomy (see `flash_fwd.py`): a CTA owns two query tiles of 128 rows ("q stages"), each handled by its own
softmax warpgroup, and walks the KV blocks of 128 keys. TMEM (512 columns of 128 lanes x 32 bit) holds
S0 | S1 | O0 | O1 side by side; P (16 or 8 bit) overwrites the upper half of its S tile.

2-CTA mode (`use_2cta`): a cluster of two CTAs shares one `tcgen05.mma.cta_group::2` of M = 256, so each MMA issue
covers both CTAs' 128-row tiles while each CTA stages only half of every K and V tile in shared memory. It halves
the K/V bytes each SM loads per query row (memory and smem bandwidth are what limit d=128 attention on B200), at the
price of a 512-row cluster tile. The rule, applied at launch because it depends on seqlen_q:

  * head_dim == head_dim_v == 128, fp16/bf16, mask "none" or "causal", and seqlen_q > 256 (at least two 1-CTA tiles,
    so the 512-row cluster is not mostly padding)  ->  2-CTA;
  * everything else (d=64/96, fp8, local windows, short queries)  ->  1-CTA.

Local windows stay 1-CTA because the shared KV range of a 512-row cluster widens a narrow window's work by up to
384 keys per row; fp8 stays 1-CTA to keep the number of built variants small (its smem already fits 8 KV stages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...spec import AttentionSpec

SUPPORTED_HEAD_DIMS = (64, 96, 128)  # S0|S1|O0|O1 must fit 512 TMEM columns: 256 + 2 * d
M_BLOCK = 128  # query rows per softmax warpgroup = TMEM lanes
N_BLOCK = 128  # keys per KV block = S columns in TMEM
Q_STAGES = 2  # query tiles per CTA (two softmax warpgroups ping-pong on the tensor core)
TMEM_COLUMNS = 512
# FP8 dequantisation granularity this family asks the front end for (SM100Backend.fp8_kv_scale_block): one Q factor
# per 64 query rows, one K and one V factor per block of N_BLOCK = 128 keys (sm90 uses 384-key blocks).
FP8_Q_SCALE_ROWS = 64
FP8_KV_SCALE_KEYS = N_BLOCK
# Shared memory one CTA may use on sm100 (227 KiB), minus room for mbarriers and alignment.
SMEM_BUDGET_BYTES = 227 * 1024 - 3 * 1024
MAX_KV_STAGES = 8
# 2-CTA only when the query sequence fills at least two 1-CTA tiles.
TWO_CTA_MIN_SEQLEN_Q = Q_STAGES * M_BLOCK + 1


@dataclass(frozen=True)
class FwdTileConfig:
    """Everything besides the AttentionSpec that changes the generated forward kernel (part of the compile key)."""

    use_2cta: bool
    kv_stages: int
    # setmaxnreg per role; 2 softmax WGs + 1 correction WG + 4 single warps must fit 64K registers (512 threads).
    regs_softmax: int = 192
    regs_correction: int = 80
    regs_other: int = 48
    # Compiler optimisation level. This kernel is spill-free at O2 and O3 today; O2 is kept for its margin: the
    # softmax warpgroups sit at their register budget, and the closest relative (the CUTLASS Blackwell FMHA) spills
    # 104 B in them at O3 and none at O2. docs/sm100.md has the measurements.
    opt_level: int = 2

    @property
    def cta_group(self) -> int:
        return 2 if self.use_2cta else 1

    @property
    def rows_per_cta(self) -> int:
        return Q_STAGES * M_BLOCK

    @property
    def rows_per_cluster(self) -> int:
        return Q_STAGES * M_BLOCK * self.cta_group

    def __post_init__(self):
        total = 8 * 32 * self.regs_softmax + 4 * 32 * self.regs_correction + 4 * 32 * self.regs_other
        if total > 64 * 1024:
            raise ValueError(f"register split {self} needs {total} registers, more than the 65536 of an SM")


def unsupported_reason(spec: AttentionSpec) -> Optional[str]:
    if spec.kvcache:  # (routing sends these to the sm80 family; a direct build must not pass it)
        return "the sm100 forward has no KV-cache build"
    if spec.varlen and spec.dtype == "fp8":
        return "the sm100 fp8 forward has no varlen (packed sequences) build"
    if spec.head_dim != spec.head_dim_v:
        return f"head_dim {spec.head_dim} != head_dim_v {spec.head_dim_v}: the sm100 forward needs equal head dims"
    if spec.head_dim not in SUPPORTED_HEAD_DIMS:
        return (
            f"head_dim {spec.head_dim} is not built for sm100 (supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))})"
        )
    if spec.dtype == "fp8" and spec.out_dtype not in ("bf16", "fp16"):
        return f"fp8 needs a bf16 or fp16 output, got {spec.out_dtype}"
    if spec.dtype == "fp8" and (spec.softcap or spec.sink):
        missing = " or ".join(n for n, on in (("soft-capping", spec.softcap), ("learnable sinks", spec.sink)) if on)
        return f"the sm100 fp8 forward has no {missing} (its fp16 / bf16 builds have them)"
    return None


def _element_bytes(dtype: str) -> int:
    return 1 if dtype == "fp8" else 2


def _kv_stages(spec: AttentionSpec, use_2cta: bool) -> int:
    """As many K/V ring slots as shared memory holds after Q (2 tiles) and the O staging buffer (2 tiles)."""
    in_bytes = _element_bytes(spec.dtype)
    q_bytes = Q_STAGES * M_BLOCK * spec.head_dim * in_bytes
    o_bytes = Q_STAGES * M_BLOCK * spec.head_dim_v * 2
    # K and V tiles share the ring; in 2-CTA mode each CTA holds half of every tile.
    slot_bytes = N_BLOCK * max(spec.head_dim, spec.head_dim_v) * in_bytes // (2 if use_2cta else 1)
    return max(2, min(MAX_KV_STAGES, (SMEM_BUDGET_BYTES - q_bytes - o_bytes) // slot_bytes))


def two_cta_eligible(spec: AttentionSpec) -> bool:
    """Packed sequences stay 1-CTA: a 512-row cluster tile would mostly be padding of short sequences."""
    dims = spec.head_dim == 128 and spec.head_dim_v == 128
    return spec.dtype in ("bf16", "fp16") and dims and spec.mask != "local" and not spec.varlen


def make_config(spec: AttentionSpec, use_2cta: bool) -> FwdTileConfig:
    if use_2cta and not two_cta_eligible(spec):
        raise ValueError(f"2-CTA mode is not built for {spec}")
    return FwdTileConfig(use_2cta=use_2cta, kv_stages=_kv_stages(spec, use_2cta))


def choose_config(spec: AttentionSpec, seqlen_q: int) -> FwdTileConfig:
    """The launch-time choice between the 1-CTA and the 2-CTA kernel (see the module docstring)."""
    return make_config(spec, use_2cta=two_cta_eligible(spec) and seqlen_q >= TWO_CTA_MIN_SEQLEN_Q)


def configs_for(spec: AttentionSpec):
    """Every config `choose_config` can return for `spec` (what `compile_artifacts` builds)."""
    configs = [make_config(spec, use_2cta=False)]
    if two_cta_eligible(spec):
        configs.append(make_config(spec, use_2cta=True))
    return configs


# ----------------------------------------------------------------------------------------------------------------
# Backward (flash_bwd.py): one CTA per 128-key tile, 128-query steps, dK / dV in TMEM.
# ----------------------------------------------------------------------------------------------------------------
BWD_HEAD_DIMS = (64, 128)  # dK | dV | S^T | dP^T (dQ over dP^T) in 512 TMEM columns: 2 d + 256


@dataclass(frozen=True)
class BwdTileConfig:
    """Everything besides the AttentionSpec that changes the generated backward kernel (part of the compile key)."""

    do_stages: int  # dO slots in shared memory (Q always has two)
    # setmaxnreg per warpgroup: 2 compute WGs, the dQ WG, and the WG of the MMA / load / idle warps.
    regs_compute: int = 192
    regs_dq: int = 96
    regs_other: int = 32
    opt_level: int = 2

    def __post_init__(self):
        total = 8 * 32 * self.regs_compute + 4 * 32 * self.regs_dq + 4 * 32 * self.regs_other
        if total > 64 * 1024:
            raise ValueError(f"register split {self} needs {total} registers, more than the 65536 of an SM")


def bwd_unsupported_reason(spec: AttentionSpec) -> Optional[str]:
    """None where the sm100 backward kernel serves `spec` (after padded_head_dims' widening of narrower dims)."""
    if spec.kvcache:
        return "the KV-cache forward (attention_with_kvcache) has no backward"
    if spec.dtype not in ("fp16", "bf16") or spec.out_dtype != spec.dtype:
        return f"the sm100 backward computes in fp16 or bf16 with out_dtype equal to it, not {spec.dtype}"
    if max(spec.head_dim, spec.head_dim_v) > max(BWD_HEAD_DIMS):
        return f"the sm100 backward has head dims up to {max(BWD_HEAD_DIMS)}, not ({spec.head_dim}, {spec.head_dim_v})"
    return None


def bwd_kernel_dim(spec: AttentionSpec) -> int:
    """The head dim of the kernel serving `spec`: the narrowest built one at least as wide as d and dv (narrower calls
    run on zero-padded operands, arch/padded_head_dims.py)."""
    return next(w for w in BWD_HEAD_DIMS if w >= max(spec.head_dim, spec.head_dim_v))


def bwd_config(spec: AttentionSpec) -> BwdTileConfig:
    # Shared memory at d128: K, V, dS 32 KiB each, Q 2 x 32, dO 1 x 32, dQ staging 2 x 16 (224 KiB): one dO slot.
    return BwdTileConfig(do_stages=2 if spec.head_dim <= 64 else 1)

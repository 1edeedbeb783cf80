"""Alternatives to the sm90 FP8 forward's default tile configurations (`arch/sm90/fp8/tile_config.py`), for the
speed and accuracy studies: `python -m profiling.fp8_benchmark --variants NAMES` and `python -m profiling.fp8_accuracy`
time / check them beside the default by passing the configuration to `fp8.launch.run_forward_fp8(cfg=...)`.
The outcomes are in docs/fp8.md; the library itself only knows its defaults.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, Tuple

from cute_flash.arch.sm90.fp8.tile_config import Fp8FwdConfig, fp8_fwd_config
from cute_flash.arch.sm90.tile_config import FwdTileConfig

_D128 = fp8_fwd_config(128, 128)  # the d <= 128 default
_TILE128 = Fp8FwdConfig(FwdTileConfig(2, 128, 2), promote_pv=True)  # the previous default, and its variants below

# Alternatives to the d <= 128 default, timed by `python -m profiling.fp8_benchmark --variants`.
VARIANTS: Dict[str, Fp8FwdConfig] = {
    "tile192_stages3": replace(_D128, tile=FwdTileConfig(2, 192, 3)),
    "tile128_promote": _TILE128,
    "tile128": replace(_TILE128, promote_pv=False),
    "tile128_promote_row_sum_mma": replace(_TILE128, row_sum_mma=True),
    "stages3": replace(_TILE128, tile=FwdTileConfig(2, 128, 3)),
    "stages3_no_promote": Fp8FwdConfig(FwdTileConfig(2, 128, 3), promote_pv=False),
    "poly4": replace(_TILE128, exp2_poly_per_row=4),
    "poly8": replace(_TILE128, exp2_poly_per_row=8),
    "poly12": replace(_TILE128, exp2_poly_per_row=12),
    "poly8_stages3": Fp8FwdConfig(FwdTileConfig(2, 128, 3), promote_pv=True, exp2_poly_per_row=8),
    "poly8_no_promote": Fp8FwdConfig(FwdTileConfig(2, 128, 2), promote_pv=False, exp2_poly_per_row=8),
    "row_sum_mma_stages3": replace(_TILE128, tile=FwdTileConfig(2, 128, 3), row_sum_mma=True),
    "no_ping_pong": replace(_D128, tile=FwdTileConfig(2, 192, 2, ping_pong=False)),
    # d <= 64 (the "d64_" prefix): 2 consumers x 64 rows with 240 registers instead of 3 with 160
    "d64_tile192": Fp8FwdConfig(FwdTileConfig(2, 192, 2), promote_pv=False),
    "d64_tile192_stages3": Fp8FwdConfig(FwdTileConfig(2, 192, 3), promote_pv=False),
    "d64_tile128_2wg": Fp8FwdConfig(FwdTileConfig(2, 128, 2), promote_pv=False),
    # 128 < d <= 256 (the "d256_" prefix)
    "d256_tile128_ping_pong": Fp8FwdConfig(FwdTileConfig(2, 128, 2), promote_pv=False),
    "d256_tile64": Fp8FwdConfig(FwdTileConfig(2, 64, 2, ping_pong=False), promote_pv=False),  # the previous default
    "d256_tile64_stages3": Fp8FwdConfig(FwdTileConfig(2, 64, 3, ping_pong=False), promote_pv=False),
}
# Tried and dropped on the CPU compile: 3 consumers x 64 rows at d = 128 without promotion (160 registers per consumer
# thread) spills (96-byte stack frame); a 256-key tile with the intra-warpgroup overlap spills even without promotion.
VARIANT_HEAD_DIMS = (65, 128)  # the width range the variants are built for (they replace the d <= 128 default)
D64_VARIANT_HEAD_DIMS = (1, 64)  # ... except "d64_" variants, which replace the d <= 64 default,
D256_VARIANT_HEAD_DIMS = (129, 256)  # and "d256_" variants, which replace the d <= 256 one


def variant_head_dims(name: str) -> Tuple[int, int]:
    if name.startswith("d64_"):
        return D64_VARIANT_HEAD_DIMS
    return D256_VARIANT_HEAD_DIMS if name.startswith("d256_") else VARIANT_HEAD_DIMS

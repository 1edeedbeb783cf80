"""Study helper (GPU): makes a study variant of profiling/sm90_bwd_variants.py the sm90 backward's default for one
head dim and mask, dense and packed, so that code which calls the public API (the varlen benchmark, the test suites)
runs it. Also a pytest plugin:

    CUTE_FLASH_BWD_VARIANT=m80_kb1 python -m pytest -p profiling.bwd_variant_patch tests/test_varlen_gpu.py -m sm90

(head dim 128 and no mask unless CUTE_FLASH_BWD_VARIANT_AT="d,mask" says otherwise). profiling/target.py (and so
profiling.ncu_profile) reads the same variables.
"""

from __future__ import annotations

import dataclasses
import json
import os


_DEFAULT = []  # backward.bwd_tile_config as the library defines it, once patched


def apply(name, head_dim: int = 128, mask: str = "none") -> None:
    """From now on in this process, (head_dim, mask) backwards take VARIANTS[name], or `name`'s BwdTileConfig fields
    when it is JSON ('{"lse_ahead": 6}'), on top of their default; None restores the defaults. Kernel sets built
    before are dropped (the compiled kernels stay cached), so calls can switch between variants. Packed-only fields
    (cluster_n) apply to packed calls only."""
    from cute_flash.arch.sm90 import backward

    from .sm90_bwd_variants import VARIANTS

    if not _DEFAULT:
        _DEFAULT.append(backward.bwd_tile_config)
    default = _DEFAULT[0]
    backward._launch_sets.clear()
    if name is None:
        backward.bwd_tile_config = default
        return
    changes = json.loads(name) if name.startswith("{") else VARIANTS[name]

    def patched(spec, deterministic=False, long=False):
        cfg = default(spec, deterministic, long)
        if cfg is not None and (spec.head_dim, spec.mask) == (head_dim, mask) and not deterministic:
            packed_only = () if spec.varlen else ("cluster_n",)
            cfg = dataclasses.replace(cfg, **{k: v for k, v in changes.items() if k not in packed_only})
        return cfg

    backward.bwd_tile_config = patched  # _kernels reads the module attribute


def apply_from_env() -> None:
    """apply(CUTE_FLASH_BWD_VARIANT) at CUTE_FLASH_BWD_VARIANT_AT ("d,mask"; 128 without a mask by default), if set."""
    name = os.environ.get("CUTE_FLASH_BWD_VARIANT")
    if name:
        d, mask = os.environ.get("CUTE_FLASH_BWD_VARIANT_AT", "128,none").split(",")
        apply(name, int(d), mask)


def pytest_configure(config) -> None:  # noqa: ARG001 - pytest hook signature
    apply_from_env()

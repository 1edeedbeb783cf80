"""Registry of kernel families, one package per GPU architecture.

Each arch package (`cute_flash.arch.sm80`, ...) exposes a module-level object `BACKEND` implementing
`cute_flash.arch.base.ArchBackend`. The packages are imported lazily, so importing cute_flash never imports cutlass.
Adding an architecture means adding its package and one line to `ARCH_PACKAGES` and `CUTE_DSL_ARCH` (and a case in
`arch_for_capability` when it serves a compute capability of its own).
"""

from __future__ import annotations

import importlib
import os
from typing import Dict, Optional, Tuple

from .base import ArchBackend

# Kernel family name -> package that implements it.
ARCH_PACKAGES: Dict[str, str] = {
    "sm80": "cute_flash.arch.sm80",
    "sm90": "cute_flash.arch.sm90",
    "sm100": "cute_flash.arch.sm100",
}

# CuTe DSL target for each family (the `a` suffix unlocks wgmma / tcgen05).
CUTE_DSL_ARCH: Dict[str, str] = {"sm80": "sm_80", "sm90": "sm_90a", "sm100": "sm_100a"}

ARCH_ENV_VAR = "CUTE_FLASH_ARCH"


def arch_for_capability(capability: Tuple[int, int]) -> str:
    """Maps a compute capability to the kernel family that serves it."""
    major, minor = capability
    if major == 10:
        return "sm100"
    if major == 9 and minor == 0:
        return "sm90"
    if major == 8:
        return "sm80"
    raise NotImplementedError(
        f"cute_flash has no kernels for compute capability {major}.{minor}; "
        f"kernel families: sm80 (compute capability 8.x), sm90 (9.0), sm100 (10.x)"
    )


def resolve_arch(capability: Optional[Tuple[int, int]]) -> str:
    """The family that serves a GPU of `capability`, unless CUTE_FLASH_ARCH overrides it."""
    forced = os.environ.get(ARCH_ENV_VAR)
    if forced:
        if forced not in ARCH_PACKAGES:
            raise ValueError(
                f"{ARCH_ENV_VAR}={forced!r} is not a kernel family; expected one of {sorted(ARCH_PACKAGES)}"
            )
        return forced
    if capability is None:
        raise RuntimeError(
            "no CUDA GPU is visible: name a family with CUTE_FLASH_ARCH, or cross-compile for a GPU with "
            "python -m cute_flash compile --arch ... / warmup --arch ..."
        )
    return arch_for_capability(capability)


def get_backend(arch: str) -> ArchBackend:
    if arch not in ARCH_PACKAGES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCH_PACKAGES)}")
    return importlib.import_module(ARCH_PACKAGES[arch]).BACKEND

"""Which kernel family serves a call: per device, per spec, and separately for forward and backward.

A GPU can run more than one family: a Hopper GPU runs the sm90 kernels and also the sm80 ones (mma.sync, cp.async
and ldmatrix exist on sm_90a; the sm80 backend compiles them for the device's own target). Each family states what
it has kernels for (`ArchBackend.unsupported_reason`), so a call goes to the first family of the device's list that
has one:

    compute capability 9.0   sm90, then sm80
    compute capability 8.x   sm80
    compute capability 10.x  sm100, then sm80 (mma.sync, cp.async and ldmatrix exist on sm_100a; neither family
                             has run on a Blackwell GPU here: both are verified by cross-compiling, docs/status.md)

The forward and the backward are routed on their own: a backward goes to the first family whose backward serves
the spec (`unsupported_reason(spec, backward=True)` is None; with `deterministic`, a backward that sums in a fixed
order), which may differ from the family that ran the forward;
the saved out and lse follow one convention for every family (see arch/base.py). CUTE_FLASH_ARCH=<family> replaces
the list by that one family (no fallback), e.g. to run the sm80 kernels on an H100.

Decisions are cached per (spec, capability, CUTE_FLASH_ARCH, direction): a warm call costs a dict lookup.
`explain` in cute_flash.interface shows a decision and why the families before it were skipped.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

from .arch import ARCH_ENV_VAR, ARCH_PACKAGES, arch_for_capability, get_backend
from .arch.base import ArchBackend
from .spec import AttentionSpec

Capability = Tuple[int, int]


def candidate_families(capability: Optional[Capability], forced: Optional[str] = None) -> Tuple[str, ...]:
    """The families that may serve a GPU of `capability`, in order of preference; `forced` (the value of
    CUTE_FLASH_ARCH, read by the caller) replaces them by that one family."""
    if forced:
        if forced not in ARCH_PACKAGES:
            raise ValueError(
                f"{ARCH_ENV_VAR}={forced!r} is not a kernel family; expected one of {sorted(ARCH_PACKAGES)}"
            )
        return (forced,)
    if capability is None:
        raise RuntimeError("no CUDA GPU is visible; set CUTE_FLASH_ARCH to pick a kernel family for cross-compiling")
    primary = arch_for_capability(capability)  # raises for a capability no family serves
    if primary in ("sm90", "sm100"):
        return (primary, "sm80")
    return (primary,)


@dataclass(frozen=True)
class Route:
    """The family serving one direction of a spec on one device (None: no family has a kernel), and the reason each
    family before it (or every family, when none serves) was skipped."""

    direction: str  # "forward" | "backward"
    family: Optional[str]
    skipped: Tuple[Tuple[str, str], ...]  # (family, reason)
    _backend: Any = field(default=None, compare=False, repr=False)  # the family's backend, looked up once

    @property
    def backend(self) -> ArchBackend:
        if self.family is None:
            raise NotImplementedError(self.error())
        return self._backend

    def error(self) -> str:
        why = "; ".join(f"{family}: {reason}" for family, reason in self.skipped)
        return f"cute_flash has no {self.direction} kernel for this call ({why})"

    def describe(self) -> str:
        head = f"{self.direction}: {self.family}" if self.family else f"{self.direction}: none"
        if not self.skipped:
            return head
        return head + " (skipped " + "; ".join(f"{f}: {r}" for f, r in self.skipped) + ")"


@functools.lru_cache(maxsize=4096)
def _route(
    spec: AttentionSpec, capability: Optional[Capability], forced: Optional[str], backward: bool, deterministic: bool
) -> Route:
    skipped = []
    for family in candidate_families(capability, forced):
        backend = get_backend(family)
        reason = _variant_reason(family, backend, spec, backward)
        reason = reason or backend.unsupported_reason(spec, backward, deterministic)
        if reason is None:
            return Route("backward" if backward else "forward", family, tuple(skipped), backend)
        skipped.append((family, reason))
    return Route("backward" if backward else "forward", None, tuple(skipped))


def _variant_reason(family: str, backend: ArchBackend, spec: AttentionSpec, backward: bool) -> Optional[str]:
    """Packed-sequence calls (`attention_varlen`) go only to families that declare a varlen kernel (`varlen` true on
    the backend), KV-cache calls (`attention_with_kvcache`) only to those that declare a KV-cache forward
    (`kvcache`); each family's `unsupported_reason` then says what else its variant lacks."""
    if spec.varlen and not getattr(backend, "varlen", False):
        return f"the {family} kernels have no varlen variant yet"
    if spec.kvcache and not getattr(backend, "kvcache", False):
        return f"the {family} kernels have no KV-cache forward yet"
    if spec.kvcache and backward:
        return "the KV-cache forward has no backward (attention_with_kvcache is forward-only)"
    return None


def route(
    spec: AttentionSpec, capability: Optional[Capability], backward: bool = False, deterministic: bool = False
) -> Route:
    """The route of `spec` on a GPU of `capability` (forward, or backward when asked, a deterministic backward when
    `deterministic`); CUTE_FLASH_ARCH applies."""
    return _route(spec, capability, os.environ.get(ARCH_ENV_VAR) or None, backward, backward and deterministic)


def clear_cache() -> None:
    """Forget cached decisions (tests that change what a family supports)."""
    _route.cache_clear()

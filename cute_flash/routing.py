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
`cute_flash.explain` shows a decision and why the families before it were skipped (`Explanation`), for the GPU
holding the inputs or for a compute capability given as (9, 0), "9.0" or "sm90" (`parse_capability`).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Tuple, Union

from .arch import ARCH_ENV_VAR, ARCH_PACKAGES, arch_for_capability, get_backend
from .arch.base import ArchBackend
from .problem import Problem, VarlenProblem
from .spec import UNBOUNDED_WINDOW, AttentionSpec

Capability = Tuple[int, int]
CapabilityLike = Union[Capability, str]  # what `parse_capability` takes: (9, 0), "9.0", "sm90", "sm_90a"


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
        raise RuntimeError(
            "no CUDA GPU is visible: name a family with CUTE_FLASH_ARCH, or cross-compile for a GPU with "
            "python -m cute_flash compile --arch ... / warmup --arch ..."
        )
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
    the backend, arch/base.ArchBackend), KV-cache calls (`attention_with_kvcache`) only to those that declare a
    KV-cache forward (`kvcache`); each family's `unsupported_reason` then says what else its variant lacks."""
    if spec.varlen and not backend.varlen:
        return f"the {family} kernels have no varlen variant yet"
    if spec.kvcache and not backend.kvcache:
        return f"the {family} kernels have no KV-cache forward yet"
    if spec.kvcache and backward:
        return "the KV-cache forward has no backward (attention_with_kvcache is forward-only)"
    return None


def forced_family() -> Optional[str]:
    """The family CUTE_FLASH_ARCH forces now (None: none)."""
    return os.environ.get(ARCH_ENV_VAR) or None


def route(
    spec: AttentionSpec, capability: Optional[Capability], backward: bool = False, deterministic: bool = False
) -> Route:
    """The route of `spec` on a GPU of `capability` (forward, or backward when asked, a deterministic backward when
    `deterministic`); CUTE_FLASH_ARCH applies."""
    return route_forced(forced_family(), spec, capability, backward, deterministic)


def route_forced(
    forced: Optional[str], spec: AttentionSpec, capability: Optional[Capability], backward: bool = False,
    deterministic: bool = False,
) -> Route:  # fmt: skip
    """`route` with the family `forced` (None: none) in place of CUTE_FLASH_ARCH's: a cached plan routes its
    backward as the variable was when its forward was planned."""
    return _route(spec, capability, forced, backward, backward and deterministic)


def clear_cache() -> None:
    """Forget cached decisions (tests that change what a family supports)."""
    _route.cache_clear()


_CAPABILITY_TEXT = re.compile(r"(?:(\d+)\.(\d+)|sm_?(\d+?)(\d)a?)")


def parse_capability(capability: object) -> Capability:
    """A compute capability as (major, minor), from (9, 0) / [9, 0], "9.0", or a target or family name ("sm90",
    "sm_90a", "sm86"; "sm100" is 10.0); ValueError naming these forms for anything else."""
    if isinstance(capability, str):
        m = _CAPABILITY_TEXT.fullmatch(capability.strip().lower())
        if m is not None:
            major, minor = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            return int(major), int(minor)
    elif isinstance(capability, (tuple, list)) and len(capability) == 2:
        if all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in capability):
            return int(capability[0]), int(capability[1])
    raise ValueError(
        f"capability must be a compute capability as (major, minor), e.g. (9, 0), 'major.minor' such as '9.0', or a "
        f"target such as 'sm90' / 'sm_90a'; got {capability!r}"
    )


Window = Tuple[Optional[int], Optional[int]]


@dataclass(frozen=True)
class Explanation:
    """Which kernel family serves a call, forward and backward, why the families before it were skipped, and what
    the call asks of the kernels besides its shapes: the mask kind and window (None: unbounded on that side; a
    negative bound moves that edge past the diagonal), the soft-capping value (0: none) and whether learnable sinks
    take part."""

    capability: Capability
    forward: Route
    backward: Route
    # The head dim the backward's kernels run at where it is wider than the call's head dims (operands zero-padded
    # to it, arch/padded_head_dims.py), else None.
    backward_padded_to: Optional[int] = None
    mask: str = "none"
    window: Window = (None, None)
    softcap: float = 0.0
    sink: bool = False

    @property
    def forward_family(self) -> Optional[str]:
        return self.forward.family

    @property
    def backward_family(self) -> Optional[str]:
        return self.backward.family

    def __str__(self) -> str:
        cap = f"compute capability {self.capability[0]}.{self.capability[1]}"
        backward = self.backward.describe()
        if self.backward_padded_to is not None:
            backward += f" (its head dim {self.backward_padded_to} kernels, on operands zero-padded to it)"
        call = f"mask {self.mask}"
        if self.window != (None, None):
            call += f", window {self.window}"
        if self.softcap:
            call += f", softcap {self.softcap:g}"
        if self.sink:
            call += ", learnable sinks"
        return f"{cap}, {call}: {self.forward.describe()}; {backward}"

    @classmethod
    def of(cls, problem: Union[Problem, VarlenProblem], capability: Capability, deterministic: bool) -> "Explanation":
        spec = problem.spec
        forward = route(spec, capability, backward=False)
        backward = route(spec, capability, backward=True, deterministic=deterministic)
        padded_to = None
        if backward.family is not None:
            dims = backward.backend.backward_head_dims(spec)
            padded_to = max(dims) if dims != (spec.head_dim, spec.head_dim_v) else None
        m = problem.mask
        window = tuple(None if b >= UNBOUNDED_WINDOW else b for b in (m.left, m.right))
        return cls(capability, forward, backward, padded_to, m.kind, window, problem.softcap, spec.sink)


def explaining(call: Callable) -> Callable:
    """Makes `explain(q, k, v, ..., capability, **keywords)` take exactly the arguments of `call` (an attention
    function), return_lse aside, and `capability`: its signature (what help() and inspect show) and the check of the
    arguments it is given (TypeError for unknown ones) come from `call`'s, so the two lists cannot drift apart. The
    decorated function gets every argument by name, defaults filled in."""
    sig = inspect.signature(call)
    params = [p for name, p in sig.parameters.items() if name != "return_lse"]
    kind = inspect.Parameter.KEYWORD_ONLY
    params.append(inspect.Parameter("capability", kind, default=None, annotation=Optional[CapabilityLike]))
    sig = sig.replace(parameters=params, return_annotation=Explanation)

    def wrap(explainer: Callable) -> Callable:
        @functools.wraps(explainer)
        def explain(*args, **kwargs) -> Explanation:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            return explainer(**bound.arguments)

        explain.__signature__ = sig
        return explain

    return wrap

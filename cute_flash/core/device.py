"""The GPU a call runs on: its compute capability (read once per device), the device guard around a launch, and the
route (the family serving a spec there). Tests and profiling/host_overhead_cpu.py replace these functions to run
the host path on CPU or meta tensors; every caller reads them from this module at call time."""

from __future__ import annotations

import functools
from typing import Tuple

import torch

from .. import routing
from ..arch.base import ArchBackend
from ..spec import AttentionSpec


@functools.lru_cache(maxsize=None)
def _capability_of(device_index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def capability(t: torch.Tensor) -> Tuple[int, int]:
    """The compute capability of the GPU holding `t`."""
    return _capability_of(t.device.index if t.device.index is not None else torch.cuda.current_device())


def guard(t: torch.Tensor):
    """Makes `t`'s GPU current while a kernel launches."""
    return torch.cuda.device(t.device)


def route(spec: AttentionSpec, t: torch.Tensor, backward: bool, deterministic: bool = False) -> ArchBackend:
    """The backend serving `spec` on `t`'s GPU in one direction (a deterministic backward if asked);
    NotImplementedError naming every family's reason when none has a kernel. Looked up on every plan made
    (CUTE_FLASH_ARCH may change); routing caches the decisions."""
    return routing.route(spec, capability(t), backward, deterministic).backend


def capturing(t: torch.Tensor) -> bool:
    """Whether torch's current CUDA stream is capturing a graph (a tensor filled now exists only in the graph: a
    plan must not keep it for eager calls)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()

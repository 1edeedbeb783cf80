"""Multi-process checks of ring attention against the single-device float64 reference (used by the CPU tests with
gloo and ReferenceBlocks, the GPU tests with NCCL and KernelBlocks), and a launcher that needs no torchrun.

Every rank draws the same full-sequence inputs (one seed per case), computes the reference on the whole sequence,
runs the ring on its shard and compares its rows. Failures are collected, not raised at once, so that every rank
goes through the same collective calls; each rank raises at the end with its list.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..reference import attention_reference
from .layout import gather_sequence, shard_sequence


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, backend: str, args: tuple) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    kwargs = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=int(os.environ.get("CUTE_FLASH_DIST_TIMEOUT", "120"))),
        **kwargs,
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args, backend: str = "gloo") -> None:
    """Runs fn(rank, world_size, *args) in `world_size` fresh processes, each in an initialised process group
    (`backend`: "gloo", or "nccl" with rank r on GPU r). fn must be importable (a module-level function). Raises when
    any process fails (the others are then stopped)."""
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(fn, world_size, free_port(), backend, args), nprocs=world_size, join=True)


@dataclass(frozen=True)
class Case:
    name: str
    layout: str = "zigzag"
    causal: bool = False
    window_size: Tuple[Optional[int], Optional[int]] = (None, None)
    nheads: int = 4
    nheads_kv: int = 4
    head_dim: int = 8
    seqlen_local: int = 6
    batch: int = 2
    softmax_scale: Optional[float] = None

    def kwargs(self) -> Dict[str, object]:
        return dict(causal=self.causal, window_size=self.window_size, softmax_scale=self.softmax_scale)


def standard_cases(seqlen_local: int, head_dim: int, nheads: int = 4, window: int = 5) -> List[Case]:
    """Both layouts, causal and not, GQA, windows that reach across chunk borders (left `window`)."""
    cases = []
    for layout in ("zigzag", "contiguous"):
        common = dict(layout=layout, seqlen_local=seqlen_local, head_dim=head_dim, nheads=nheads, nheads_kv=nheads)
        gqa = dict(common, nheads_kv=max(1, nheads // 2))
        cases += [
            Case(f"{layout}-full", **common),
            Case(f"{layout}-causal", causal=True, **common),
            Case(f"{layout}-full-gqa", **gqa),
            Case(f"{layout}-causal-gqa", causal=True, **gqa),
            Case(f"{layout}-window{window}_2", window_size=(window, 2), **common),
            Case(f"{layout}-causal-window{window}", causal=True, window_size=(window, None), **gqa),
            Case(f"{layout}-window0_{window}-scale0.3", window_size=(0, window), softmax_scale=0.3, **common),
        ]
    return cases


@dataclass
class Tolerance:
    """exact: |ring - ref| <= atol (float64 against float64). Otherwise FlashAttention's rule: <= 2 · |torch in the
    input dtype - ref| + atol."""

    exact: bool = True
    atol: float = 1e-10


@dataclass
class Results:
    failures: List[str] = field(default_factory=list)
    lines: List[str] = field(default_factory=list)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def _inputs(case: Case, world_size: int, dtype: torch.dtype, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    n = case.seqlen_local * world_size
    shapes = [
        (case.batch, n, case.nheads, case.head_dim),
        (case.batch, n, case.nheads_kv, case.head_dim),
        (case.batch, n, case.nheads_kv, case.head_dim),
        (case.batch, n, case.nheads, case.head_dim),
    ]
    return [torch.randn(*s, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype) for s in shapes]


def _reference(q, k, v, dout, case: Case, compute_dtype: torch.dtype):
    leaves = [t.detach().to(compute_dtype).requires_grad_(True) for t in (q, k, v)]
    out, lse = attention_reference(*leaves, compute_dtype=compute_dtype, return_lse=True, **case.kwargs())
    grads = torch.autograd.grad(out, leaves, dout.to(compute_dtype))
    return out.detach(), lse, grads


def check_case(
    rank: int,
    world_size: int,
    case: Case,
    *,
    dtype: torch.dtype,
    device: torch.device,
    tol: Tolerance,
    results: Results,
    blocks=None,
    seed: int = 0,
) -> None:
    """Ring forward (out, lse) and gradients (torch.autograd.grad) on this rank's shard against the reference."""
    from .ring import ring_attention

    q, k, v, dout = _inputs(case, world_size, dtype, device, seed)
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, case, torch.float64)
    if not tol.exact:
        low_out, low_lse, low_grads = _reference(q, k, v, dout, case, dtype)

    def mine(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return shard_sequence(t, rank, world_size, case.layout, dim=dim)

    ql, kl, vl = (mine(t).requires_grad_(True) for t in (q, k, v))
    out, lse = ring_attention(ql, kl, vl, layout=case.layout, return_lse=True, blocks=blocks, **case.kwargs())
    grads = torch.autograd.grad(out, (ql, kl, vl), mine(dout))

    checks = [("out", out, mine(ref_out), None if tol.exact else mine(low_out))]
    for name, g, r, i in zip(("dq", "dk", "dv"), grads, ref_grads, range(3)):
        checks.append((name, g, mine(r), None if tol.exact else mine(low_grads[i])))
    for name, got, ref, low in checks:
        bound = tol.atol if low is None else 2 * _err(low, ref) + tol.atol
        err = _err(got, ref)
        ok = err <= bound and bool(torch.isfinite(got).all())
        line = f"rank {rank}/{world_size} {case.name} {name}: err {err:.3e} bound {bound:.3e}"
        results.lines.append(line)
        if not ok:
            results.failures.append(line)
    # lse: -inf exactly where the reference has no key, else the same rule (float32 floor on the baseline).
    ref_l = mine(ref_lse, dim=2)
    if not torch.equal(torch.isneginf(lse), torch.isneginf(ref_l)):
        results.failures.append(f"rank {rank}/{world_size} {case.name} lse: -inf rows differ")
    keep = ~torch.isneginf(ref_l)
    lse_bound = 1e-5 if tol.exact else 2 * max(_err(mine(low_lse, dim=2)[keep], ref_l[keep]), 1e-4) + tol.atol
    lse_err = _err(lse[keep], ref_l[keep])
    if lse.dtype != torch.float32 or lse_err > lse_bound:
        results.failures.append(f"rank {rank}/{world_size} {case.name} lse: err {lse_err:.3e} bound {lse_bound:.3e}")
    # The gathered full output equals the reference as well (unshard of every rank's rows).
    full = gather_sequence(out.detach().contiguous(), layout=case.layout)
    if tol.exact and _err(full, ref_out) > tol.atol:
        results.failures.append(f"rank {rank}/{world_size} {case.name}: gathered out differs from the reference")


def check_rejections(rank: int, world_size: int, device: torch.device, dtype: torch.dtype, results: Results) -> None:
    """Uneven shapes across ranks, an odd zigzag shard and mismatched options raise ValueError on every rank."""
    from .ring import ring_attention

    def expect(what: str, needle: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except ValueError as e:
            if needle not in str(e):
                results.failures.append(f"rank {rank}: {what}: unexpected message {e}")
            return
        results.failures.append(f"rank {rank}: {what}: no ValueError")

    def qkv(seqlen: int):
        return [torch.randn(1, seqlen, 2, 8, dtype=dtype, device=device) for _ in range(3)]

    uneven = qkv(4 if rank == 0 else 6)
    expect("uneven seqlen", "same shape on every rank", lambda: ring_attention(*uneven, layout="contiguous"))
    expect("odd zigzag shard", "even seqlen_local", lambda: ring_attention(*qkv(5), layout="zigzag"))
    expect("layout name", "layout must be one of", lambda: ring_attention(*qkv(4), layout="striped"))
    expect("options differ", "same on every rank", lambda: ring_attention(*qkv(4), causal=(rank == world_size - 1)))
    expect("q/k lengths", "same number of positions", lambda: ring_attention(*qkv(4)[:1], *qkv(6)[1:]))
    # A check that fails on one rank only: that rank raises its own error, the others a ValueError naming it (none
    # waits in a transfer); dtypes and an explicit softmax_scale that differ between ranks.
    odd = 5 if rank == 0 else 6
    expect("one rank's odd zigzag shard", "even seqlen_local" if rank == 0 else "refused there",
           lambda: ring_attention(*qkv(odd), layout="zigzag"))  # fmt: skip
    other = [t.float() for t in qkv(4)] if rank == world_size - 1 else qkv(4)
    expect("dtypes differ", "same dtypes on every rank", lambda: ring_attention(*other))
    expect("scale differs", "same on every rank", lambda: ring_attention(*qkv(4), softmax_scale=0.1 * (rank + 1)))

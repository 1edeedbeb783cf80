"""Ring attention on 2+ GPUs: NCCL between one process per GPU, the blocks on cute-flash's kernels (KernelBlocks,
bf16), against the float64 reference of the unsharded sequence with FlashAttention's rule (each of out, lse, dq, dk,
dv within 2x the error of plain torch in bf16, plus 1e-5). The same cases as the CPU test (tests/test_ring_attention.py)
at GPU sizes, and once more with float64 ReferenceBlocks on the GPUs, where the result must match the reference
exactly: that isolates the ring itself (NCCL, the side stream, buffer lifetimes) from the kernels' rounding.

Run on a machine with two or more Hopper GPUs (each test spawns its own processes, so no pytest-xdist):
  python3 -m pytest -q tests/test_ring_attention_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.sm90,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA GPUs"),
]


def _world_sizes():
    n = torch.cuda.device_count()
    return [w for w in (2, 4) if w <= n] or [2]


def _job(rank: int, world_size: int, mode: str) -> None:
    from cute_flash.distributed import ReferenceBlocks
    from cute_flash.distributed.testing import (
        Case,
        Results,
        Tolerance,
        check_case,
        check_rejections,
        standard_cases,
    )

    device = torch.device("cuda", rank)
    results = Results()
    if mode == "kernels":
        cases = standard_cases(seqlen_local=512, head_dim=128, nheads=4, window=300)
        # A longer sequence, where the transfers overlap real compute.
        cases += [Case("zigzag-causal-long", causal=True, seqlen_local=2048, head_dim=128, nheads=8, batch=1)]
        for i, case in enumerate(cases):
            check_case(
                rank,
                world_size,
                case,
                dtype=torch.bfloat16,
                device=device,
                tol=Tolerance(exact=False, atol=1e-5),
                results=results,
                seed=1000 * world_size + i,
            )
        check_rejections(rank, world_size, device, torch.bfloat16, results)
    else:
        for i, case in enumerate(standard_cases(seqlen_local=64, head_dim=32)):
            check_case(
                rank,
                world_size,
                case,
                dtype=torch.float64,
                device=device,
                tol=Tolerance(),
                results=results,
                blocks=ReferenceBlocks(),
                seed=2000 * world_size + i,
            )
    if rank == 0:
        print("\n".join(results.lines))
    if results.failures:
        raise AssertionError("\n".join(results.failures))


@pytest.mark.parametrize("world_size", _world_sizes())
def test_ring_attention_nccl_kernels(world_size):
    from cute_flash.distributed.testing import spawn

    spawn(_job, world_size, "kernels", backend="nccl")


@pytest.mark.parametrize("world_size", _world_sizes())
def test_ring_attention_nccl_reference_blocks(world_size):
    from cute_flash.distributed.testing import spawn

    spawn(_job, world_size, "reference", backend="nccl")

"""Ring attention on CPUs: the ring logic (layouts, per-pair masks, LSE merge, dK/dV accumulators travelling around
the ring) in several gloo processes with float64 ReferenceBlocks, against the single-process float64 reference on
the unsharded sequence; plus unit tests of the pieces without processes.

The same checks run on GPUs with NCCL and the kernels in tests/test_ring_attention_gpu.py.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from cute_flash.distributed import plan as plan_mod
from cute_flash.distributed.layout import (
    chunks,
    global_positions,
    shard_sequence,
    unshard_sequence,
)
from cute_flash.distributed.merge import merge, merge_into
from cute_flash.distributed.plan import global_bounds, pair_task, ring_plan
from cute_flash.reference import attention_reference, visible_keys
from cute_flash.spec import UNBOUNDED_WINDOW, MaskBounds, normalize_mask


# ---------------------------------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_unshard_round_trip(layout, world):
    n = 2 * world * 3
    x = torch.arange(2 * n * 5).reshape(2, n, 5)
    shards = [shard_sequence(x, r, world, layout) for r in range(world)]
    assert torch.equal(unshard_sequence(shards, layout), x)
    # Each shard holds exactly the positions global_positions names, in that order.
    for r, s in enumerate(shards):
        assert torch.equal(s, x[:, global_positions(r, world, n // world, layout)])
    # lse-like tensors shard along dim 2.
    y = x.transpose(1, 2).contiguous()
    assert torch.equal(
        unshard_sequence([shard_sequence(y, r, world, layout, dim=2) for r in range(world)], layout, 2), y
    )


def test_zigzag_chunks():
    # World 4: 8 chunks; rank 1 holds chunks 1 and 6.
    assert [(c.global_start, c.local_start, c.length) for c in chunks(1, 4, 6, "zigzag")] == [(3, 0, 3), (18, 3, 3)]
    assert torch.equal(global_positions(1, 4, 6, "zigzag"), torch.tensor([3, 4, 5, 18, 19, 20]))


def test_shard_rejects_uneven_and_unknown():
    x = torch.zeros(1, 10, 1)
    with pytest.raises(ValueError, match="multiple of 8"):
        shard_sequence(x, 0, 4, "zigzag")
    with pytest.raises(ValueError, match="multiple of 4"):
        shard_sequence(x, 0, 4, "contiguous")
    with pytest.raises(ValueError, match="layout must be one of"):
        shard_sequence(x, 0, 2, "striped")
    with pytest.raises(ValueError, match="even seqlen_local"):
        chunks(0, 2, 5, "zigzag")


# ---------------------------------------------------------------------------------------------------------------------
# LSE merge
# ---------------------------------------------------------------------------------------------------------------------
def test_merge_is_exact_with_masked_rows():
    torch.manual_seed(0)
    b, s, h, d, n = 2, 7, 3, 8, 12
    q, k, v = torch.randn(b, s, h, d, dtype=torch.float64), torch.randn(b, n, h, d, dtype=torch.float64), None
    v = torch.randn(b, n, h, d, dtype=torch.float64)
    # Row 0 sees no key at all, row 1 only keys of the first half, row 2 only the second half, the rest some of both.
    vis = torch.rand(s, n) < 0.6
    vis[0] = False
    vis[1, n // 2 :] = False
    vis[2, : n // 2] = False
    vis[3:, 0] = True
    vis[3:, -1] = True

    def attend(keys):
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k[:, keys]).masked_fill(~vis[:, keys], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        p = torch.nan_to_num(torch.exp(scores - lse.unsqueeze(-1)), nan=0.0)
        return torch.einsum("bhqk,bkhd->bqhd", p, v[:, keys]), lse

    full_out, full_lse = attend(slice(0, n))
    a_out, a_lse = attend(slice(0, n // 2))
    b_out, b_lse = attend(slice(n // 2, n))
    out, lse = merge(a_out, a_lse, b_out, b_lse)
    assert torch.isfinite(out).all()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(full_lse))
    assert torch.isneginf(lse[:, :, 0]).all() and (out[:, 0] == 0).all()
    torch.testing.assert_close(out, full_out, rtol=0, atol=1e-9)
    keep = ~torch.isneginf(full_lse)
    torch.testing.assert_close(lse[keep], full_lse[keep], rtol=0, atol=1e-9)
    # Merging with an empty partial (all rows -inf, out 0) changes nothing; float32 lse is promoted.
    empty_out, empty_lse = torch.zeros_like(out), torch.full_like(lse, float("-inf")).float()
    out2, lse2 = merge(out, lse, empty_out, empty_lse)
    assert out2.dtype == torch.float64 and torch.equal(out2, out) and torch.equal(lse2, lse)
    # In place into views of an accumulator (what the ring does), with a lower-precision partial.
    acc, acc_lse = a_out.clone(), a_lse.clone()
    merge_into(acc[:, 2:], acc_lse[:, :, 2:], b_out[:, 2:].float(), b_lse[:, :, 2:].float())
    torch.testing.assert_close(acc[:, 2:], full_out[:, 2:], rtol=0, atol=1e-6)
    assert torch.equal(acc[:, :2], a_out[:, :2]) and torch.isfinite(acc).all()


# ---------------------------------------------------------------------------------------------------------------------
# Per-pair masks
# ---------------------------------------------------------------------------------------------------------------------
def _global_truth(n: int, left, right) -> torch.Tensor:
    # Self-attention over the whole sequence: the reference's own rule with seqlen_q == seqlen_k.
    return visible_keys(
        n,
        n,
        MaskBounds("local", UNBOUNDED_WINDOW if left is None else left, UNBOUNDED_WINDOW if right is None else right),
    )


def _task_visibility(task, m_total: int, n_total: int) -> torch.Tensor:
    """(m_total, n_total) local visibility of one launch: its kernel rule on its rectangle, False elsewhere."""
    out = torch.zeros(m_total, n_total, dtype=torch.bool)
    m, n = task.q_end - task.q_start, task.k_end - task.k_start
    out[task.q_start : task.q_end, task.k_start : task.k_end] = visible_keys(m, n, task.mask)
    return out


def test_pair_task_matches_global_rule_on_random_chunks():
    rng = random.Random(17)
    for _ in range(3000):
        n = rng.randint(1, 40)
        qs, ks = rng.randrange(n), rng.randrange(n)
        qc = plan_mod.Chunk(qs, 0, rng.randint(1, n - qs))
        kc = plan_mod.Chunk(ks, 0, rng.randint(1, n - ks))
        left = rng.choice([None, 0, 1, 3, rng.randint(0, n), -rng.randint(1, n)])  # negative: past the diagonal
        right = rng.choice([None, 0, 2, rng.randint(0, n), -rng.randint(1, n)])
        truth = _global_truth(n, left, right)[qs : qs + qc.length, ks : ks + kc.length]
        task = pair_task(qc, kc, left, right)
        if task is None:
            assert not truth.any(), (qc, kc, left, right)
            continue
        assert task.mask.left >= 0 and task.mask.right >= 0
        assert task.mask.kind in ("none", "causal", "local")
        if task.mask.kind == "causal":
            assert (task.mask.left, task.mask.right) == (UNBOUNDED_WINDOW, 0)
        got = _task_visibility(task, qc.length, kc.length)
        assert torch.equal(got, truth), (qc, kc, left, right, task)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_plan_covers_global_rule(layout):
    """Over all steps of all ranks, the launches see exactly the pairs of the global rule, each pair once."""
    cases = [(None, None), (None, 0), (3, 0), (5, 2), (0, 4), (0, 0), (1, None), (7, 7)]
    cases += [(None, -2), (-3, None), (5, -2), (-1, 4), (-3, 2)]  # negative bounds (the last: no key at all)
    for world, (left, right) in itertools.product([1, 2, 3, 4], cases):
        seqlen_local = 6
        n = seqlen_local * world
        truth = _global_truth(n, left, right)
        seen = torch.zeros(n, n, dtype=torch.int64)
        for rank in range(world):
            qpos = global_positions(rank, world, seqlen_local, layout)
            for step, tasks in enumerate(ring_plan(rank, world, seqlen_local, layout, left, right)):
                kpos = global_positions((rank - step) % world, world, seqlen_local, layout)
                for t in tasks:
                    assert t.mask.left >= 0 and t.mask.right >= 0
                    vis = _task_visibility(t, seqlen_local, seqlen_local).long()
                    seen[qpos.unsqueeze(1), kpos.unsqueeze(0)] += vis
        assert torch.equal(seen, truth.long()), (world, left, right)


def test_zigzag_causal_plan_is_balanced_and_fused():
    """Causal zigzag: one causal launch over the whole shard at step 0, one dense launch over half of it after."""
    world, s = 4, 8
    for rank in range(world):
        plan = ring_plan(rank, world, s, "zigzag", None, 0)
        assert len(plan[0]) == 1 and plan[0][0].mask.kind == "causal"
        assert (plan[0][0].q_end - plan[0][0].q_start, plan[0][0].k_end - plan[0][0].k_start) == (s, s)
        for tasks in plan[1:]:
            assert len(tasks) == 1 and tasks[0].mask.kind == "none"
            area = (tasks[0].q_end - tasks[0].q_start) * (tasks[0].k_end - tasks[0].k_start)
            assert area == s * s // 2


def test_global_bounds_treats_long_windows_as_unbounded():
    assert global_bounds(normalize_mask(True, (None, None)), 16) == (None, 0)
    assert global_bounds(normalize_mask(False, (16, 3)), 16) == (None, 3)
    assert global_bounds(normalize_mask(False, (15, 3)), 16) == (15, 3)


# ---------------------------------------------------------------------------------------------------------------------
# One process: the ring degenerates to plain attention
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{}, {"causal": True}, {"window_size": (3, 1)}], ids=["full", "causal", "window"])
def test_single_rank_is_plain_attention(kwargs):
    from cute_flash.distributed import ring_attention

    torch.manual_seed(1)
    q = torch.randn(2, 10, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 10, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 10, 2, 16, dtype=torch.float64, requires_grad=True)
    out, lse = ring_attention(q, k, v, return_lse=True, **kwargs)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **kwargs)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-9)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-6)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for g, r in zip(grads, torch.autograd.grad(ref, (q, k, v), dout, retain_graph=True)):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-9)
    # A loss of lse too: each block's backward takes its rows of lse's gradient (D - dlse).
    dlse = torch.randn_like(lse)
    got = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    want = torch.autograd.grad((ref, ref_lse), (q, k, v), (dout, dlse.to(ref_lse.dtype)))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-6)


def test_cute_flash_import_stays_light():
    import subprocess
    import sys

    code = "import sys, cute_flash; print('cute_flash.distributed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False"]


# ---------------------------------------------------------------------------------------------------------------------
# Several processes (gloo): one spawned job per world size runs every case
# ---------------------------------------------------------------------------------------------------------------------
def _gloo_job(rank: int, world_size: int) -> None:
    from cute_flash.distributed.testing import Results, Tolerance, check_case, check_rejections, standard_cases

    torch.set_num_threads(1)  # several processes share two cores
    results = Results()
    for i, case in enumerate(standard_cases(seqlen_local=6, head_dim=8)):
        check_case(
            rank,
            world_size,
            case,
            dtype=torch.float64,
            device=torch.device("cpu"),
            tol=Tolerance(),
            results=results,
            seed=100 * world_size + i,
        )
    check_rejections(rank, world_size, torch.device("cpu"), torch.float64, results)
    # Without the cross-rank check (no all-gather) the result is the same.
    from cute_flash.distributed import ring_attention

    torch.manual_seed(rank)
    q, k, v = (torch.randn(1, 6, 2, 8, dtype=torch.float64) for _ in range(3))
    if not torch.equal(ring_attention(q, k, v, causal=True), ring_attention(q, k, v, causal=True, check_shapes=False)):
        results.failures.append(f"rank {rank}: check_shapes=False changed the result")
    if world_size < 4:  # (four processes on the CI's two cores: the smaller groups cover the merge and the dsink sum)
        _featured_checks(rank, world_size, results.failures)  # soft-capping, learnable sinks, negative windows
    if results.failures:
        raise AssertionError("\n".join(results.failures))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_attention_gloo(world_size):
    from cute_flash.distributed.testing import spawn

    spawn(_gloo_job, world_size, backend="gloo")


def test_kernel_blocks_reject_cpu_tensors_before_any_work():
    from cute_flash.distributed import KernelBlocks, ring_attention

    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA GPUs only"):
        ring_attention(q, q, q, causal=True, blocks=KernelBlocks())


# ---------------------------------------------------------------------------------------------------------------------
# Soft-capping, learnable sinks and negative window bounds through the ring
# ---------------------------------------------------------------------------------------------------------------------
FEATURED = [
    dict(softcap=2.0),
    dict(causal=True, learnable_sink=True),
    dict(window_size=(4, -1), softcap=1.5, learnable_sink=True),  # keys at least one before the diagonal
    dict(window_size=(-2, 3)),  # keys 2..3 after the diagonal: the last rows see none
]


def _featured_inputs(n: int, seed: int, sink: bool):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(2, n, 4, 8, generator=g, dtype=torch.float64) for _ in range(4))
    s = torch.randn(4, generator=g, dtype=torch.float64).requires_grad_(True) if sink else None
    return q, k, v, dout, s


def _featured_ref(q, k, v, dout, s, kw):
    from cute_flash.validation import validate_reference

    from .feature_reference import featured_reference

    sem = validate_reference(q, k, v, causal=kw.get("causal", False), softmax_scale=None,
                             window_size=kw.get("window_size", (None, None)))  # fmt: skip
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)] + ([s] if s is not None else [])
    rows = None if s is None else s.expand(q.shape[1], 4)
    out, lse = featured_reference(*leaves[:3], sem.softmax_scale, sem.mask, kw.get("softcap", 0.0), rows)
    return out, lse, torch.autograd.grad(out, leaves, dout)


def _ring_kwargs(kw, s):
    return {**kw, "learnable_sink": s} if kw.get("learnable_sink") else kw


@pytest.mark.parametrize("kw", FEATURED, ids=["softcap", "causal_sink", "window_softcap_sink", "negative_left"])
def test_single_rank_softcap_sinks_and_negative_windows(kw):
    from cute_flash.distributed import ring_attention

    q, k, v, dout, s = _featured_inputs(10, 3, kw.get("learnable_sink", False))
    ref, ref_lse, ref_grads = _featured_ref(q, k, v, dout, s, kw)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)] + ([s] if s is not None else [])
    out, lse = ring_attention(*leaves[:3], layout="contiguous", return_lse=True, **_ring_kwargs(kw, s))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-9)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=0, atol=1e-6)  # (lse is returned in float32)
    for g, r in zip(torch.autograd.grad(out, leaves, dout), ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-9)


def _featured_checks(rank: int, world_size: int, failures: list) -> None:
    """Every featured case over the group (in `_gloo_job`'s processes): each rank's rows of out, lse, dq, dk, dv
    against the unsharded reference, and the sinks' gradient summed over the ranks (each returns its rows' share)
    against the reference's."""
    import torch.distributed as dist

    from cute_flash.distributed import ring_attention, shard_sequence

    for layout in ("zigzag", "contiguous"):
        for i, kw in enumerate(FEATURED):
            q, k, v, dout, s = _featured_inputs(6 * world_size, 10 * world_size + i, kw.get("learnable_sink", False))
            ref, ref_lse, ref_grads = _featured_ref(q, k, v, dout, s, kw)

            def mine(t, dim=1):
                return shard_sequence(t, rank, world_size, layout, dim=dim)

            local = [mine(t).requires_grad_(True) for t in (q, k, v)]
            out, lse = ring_attention(*local, layout=layout, return_lse=True, **_ring_kwargs(kw, s))
            grads = torch.autograd.grad(out, local + ([s] if s is not None else []), mine(dout))
            checks = [("out", out, mine(ref)), ("lse", lse, mine(ref_lse, dim=2))]
            checks += [(n, g, mine(r)) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)]
            if s is not None:
                dsink = grads[3].clone()
                dist.all_reduce(dsink)
                checks.append(("dsink", dsink, ref_grads[3]))
            for name, got, want in checks:
                try:  # (lse in float32; -inf rows, those without keys or sinks, must match exactly)
                    torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=1e-6 if name == "lse" else 1e-8)
                except AssertionError as e:
                    failures.append(f"rank {rank}/{world_size} {layout} {kw} {name}: {e}")

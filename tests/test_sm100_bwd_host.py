"""CPU: the sm100 backward's host path on a faked compute capability 10.0 GPU with recording no-op kernels
(profiling/host_overhead_cpu.fake_gpu): which kernels a dense and a packed backward launch, under which cache keys,
with which buffers (shapes, padded rows, semaphores) in the order the compiled entries take them
(arch/sm100/backward.py builds them with fake tensors of the same ranks)."""

import pytest
import torch

import cute_flash


def _record():
    from cute_flash import compile_cache
    from cute_flash.arch.sm80 import backward as sm80_backward

    launches = []
    compile_cache.get_or_compile = lambda key, build: lambda *args: launches.append((key, args))
    compile_cache.clear()
    sm80_backward._cache_key.cache_clear()
    return launches


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_dense_backward_launches_preprocess_main_and_conversion(monkeypatch, deterministic):
    from profiling.host_overhead_cpu import fake_gpu

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))  # (the sm100 forward's check)

    q = torch.randn(2, 200, 8, 96, dtype=torch.bfloat16, requires_grad=True)  # d96: the d128 kernel, zero-padded
    k, v = (torch.randn(2, 300, 2, 96, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    with fake_gpu((10, 0)):
        launches = _record()
        assert cute_flash.explain(q, k, v, causal=True).backward_family == "sm100"
        out = cute_flash.attention(q, k, v, causal=True, deterministic=deterministic)
        out.sum().backward()
    mains = [(key, args) for key, args in launches if key[0] == "sm100" and key[2].startswith("bwd")]
    assert len(mains) == 1
    key, args = mains[0]
    assert key[2] == ("bwd_det" if deterministic else "bwd") and key[3].head_dim == 128 and not key[3].varlen
    q_, k_, v_, dout, lse_log2, dpsum, dq_accum, dk, dv, semaphores, scale, left, right = args
    assert q_.shape == (2, 200, 8, 128) and k_.shape == dk.shape == (2, 300, 2, 128)
    assert lse_log2.shape == dpsum.shape == (2, 8, 256) and dq_accum.shape == (2, 256, 8, 128)  # whole 128-row tiles
    assert (semaphores is not None) == deterministic
    if deterministic:
        assert semaphores.shape == (2, 8, 2) and semaphores.dtype == torch.int32
    assert scale == pytest.approx(96**-0.5) and right == 0
    roles = [key[2] for key, _ in launches if key[0] == "sm80"]
    assert "bwd_preprocess" in roles and "bwd_postprocess" in roles  # the sm80 family's, built for this GPU
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("seqused", [False, True])
def test_a_packed_backward_runs_the_sm100_kernel_on_padded_rows(monkeypatch, seqused, deterministic):
    from profiling.host_overhead_cpu import fake_gpu

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))  # (the sm100 kernels' check)

    q = torch.randn(100, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(120, 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    cu_q = torch.tensor([0, 40, 100], dtype=torch.int32)
    cu_k = torch.tensor([0, 50, 120], dtype=torch.int32)
    used = torch.tensor([33, 70], dtype=torch.int32) if seqused else None
    with fake_gpu((10, 0)):
        launches = _record()
        e = cute_flash.explain_varlen(q, k, v, cu_q, cu_k, 60, 70, causal=True, seqused_k=used)
        assert (e.forward.family, e.backward.family) == ("sm100", "sm100"), e
        kw = dict(causal=True, seqused_k=used, deterministic=deterministic)
        out = cute_flash.attention_varlen(q, k, v, cu_q, cu_k, 60, 70, **kw)
        out.sum().backward()
    forwards = [(key, args) for key, args in launches if key[0] == "sm100" and key[2] == "fwd"]
    assert len(forwards) == 1  # the packed forward: 1-CTA, keyed on seqused_k
    ((fkey, fargs),) = forwards
    assert fkey[3].varlen and not fkey[4].use_2cta and (fkey[5:] == ("seqused_k",)) == seqused
    assert fargs[0].shape == (100, 4, 64) and fargs[4].shape == (4, 100) and fargs[-1] == 60  # max_seqlen_q
    mains = [(key, args) for key, args in launches if key[0] == "sm100" and key[2].startswith("bwd")]
    assert len(mains) == 1
    key, args = mains[0]
    assert key[2] == ("bwd_seqused" if seqused else "bwd") + ("_det" if deterministic else "") and key[3].varlen
    q_, k_, v_, dout, lse_log2, dpsum, dq_accum, dk, dv, semaphores, scale, left, right, *seqs = args
    rows = 384  # 100 rows + 2 sequences x 128 of padding (common/packed.py), rounded up to whole 128-row tiles
    assert q_.shape == (1, 100, 4, 64) and k_.shape == dk.shape == (1, 120, 2, 64)
    assert lse_log2.shape == dpsum.shape == (1, 4, rows) and dq_accum.shape == (1, rows, 4, 64)
    if deterministic:  # one per (query head, 128-row tile of the padded rows): dQ adds in key-tile order
        assert semaphores.shape == (1, 4, rows // 128) and semaphores.dtype == torch.int32
    else:
        assert semaphores is None
    cu_q_, cu_k_, used_, max_k = seqs
    assert torch.equal(cu_q_, cu_q) and torch.equal(cu_k_, cu_k) and used_ is used and max_k == 70
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape

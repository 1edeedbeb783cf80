"""CPU checks of `cute_flash.attention_varlen`: validation errors, routing (which families have a varlen kernel), and
the autograd plumbing with a fake sm80 backend that computes with the float64 reference."""

from __future__ import annotations

import concurrent.futures
import contextlib

import pytest
import torch

import cute_flash
from cute_flash import routing, validation
from cute_flash.arch.base import BackendBase
from cute_flash.core import device
from cute_flash.reference import attention_varlen_reference

HOPPER, AMPERE, BLACKWELL = (9, 0), (8, 0), (10, 0)


def _packed(lens_q, lens_k, h=4, hkv=2, d=64, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), h, d, generator=g).to(dtype).to(device)
    k = torch.randn(sum(lens_k), hkv, d, generator=g).to(dtype).to(device)
    v = torch.randn(sum(lens_k), hkv, d, generator=g).to(dtype).to(device)

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)

    return q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k)


@pytest.fixture(autouse=True)
def _fresh_routes():
    routing.clear_cache()  # routes cache their backend: fakes below must not leak into other tests, nor the reverse
    yield
    routing.clear_cache()


# --- validation ------------------------------------------------------------------------------------------------------
def test_cpu_inputs_are_refused_with_a_pointer_to_the_reference():
    with pytest.raises(ValueError, match=r"q is on cpu.*cute_flash\.reference"):
        cute_flash.attention_varlen(*_packed([3, 5], [4, 4]))


@pytest.fixture
def meta(monkeypatch):
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "meta"))
    monkeypatch.setattr(device, "capability", lambda t: AMPERE)
    return _packed([3, 5], [4, 4], device="meta")


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), ValueError, "cu_seqlens_q must be an int32"),
        (lambda a: a.update(cu_seqlens_k=a["cu_seqlens_k"][:2]), ValueError, "one batch"),
        (lambda a: a.update(cu_seqlens_k=torch.zeros(3, dtype=torch.int32)), ValueError, "cu_seqlens_k is on cpu"),
        (lambda a: a.update(max_seqlen_q=torch.tensor(5)), ValueError, "host int"),
        (lambda a: a.update(max_seqlen_k=-1), ValueError, "host int"),
        (lambda a: a.update(q=a["q"][None]), ValueError, "packed"),
        (lambda a: a.update(q=a["q"].float(), k=a["k"].float(), v=a["v"].float()), TypeError, "float16"),
        (lambda a: a.update(k=a["k"].half()), ValueError, "same dtype|share one dtype"),
        (lambda a: a.update(q=a["q"][..., :12], k=a["k"][..., :12]), NotImplementedError, "head_dim of q/k is 12"),
        (lambda a: a.update(window_size=(1.5, 0)), ValueError, "window_size"),
        (lambda a: a.update(softcap=-2.0), ValueError, "softcap"),
        (lambda a: a.update(learnable_sink=torch.zeros(3, device="meta")), ValueError, "learnable_sink"),
        (lambda a: a.update(deterministic=1), TypeError, "deterministic"),
        (lambda a: a.update(seqused_k=torch.zeros(3, dtype=torch.int32, device="meta")), ValueError, "seqused_k"),
        (
            lambda a: a.update(q=torch.empty(64, 4, 8, dtype=torch.bfloat16, device="meta").permute(2, 1, 0)),
            ValueError,
            "contiguous in its last dimension",
        ),
    ],
)
def test_validation_errors(meta, change, error, match):
    q, k, v, cq, ck, mq, mk = meta
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk)
    change(args)
    with pytest.raises(error, match=match):
        cute_flash.attention_varlen(**args)


def test_the_spec_is_a_separate_varlen_variant(meta):
    q, k, v, cq, ck, mq, mk = meta
    seqs = validation.PackedSeqs(cq, ck, None, mq, mk)
    p = validation.validate_varlen(q, k, v, seqs, causal=True, softmax_scale=None, window_size=(None, None))
    assert p.spec.varlen and p.spec.mask == "causal" and (p.batch, p.total_q, p.total_k) == (2, 8, 8)
    dense = validation.validate(q[None], k[None], v[None], causal=True, softmax_scale=None,
                                window_size=(None, None), dtype=None)  # fmt: skip
    assert not dense.spec.varlen and dense.spec != p.spec


# --- routing ---------------------------------------------------------------------------------------------------------
def test_explain_varlen_routes_to_families_with_a_varlen_kernel():
    q, k, v, cq, ck, mq, mk = _packed([3, 5], [4, 4])
    e = cute_flash.explain_varlen(q, k, v, cq, ck, mq, mk, causal=True, capability=HOPPER)
    assert (e.forward_family, e.backward_family) == ("sm90", "sm90")
    # The sm90 packed backward has a deterministic build; the sm80 family has none (below).
    e = cute_flash.explain_varlen(q, k, v, cq, ck, mq, mk, causal=True, capability=HOPPER, deterministic=True)
    assert (e.forward_family, e.backward_family) == ("sm90", "sm90")
    # sm100 serves packed fp16/bf16 forwards and backwards at d <= 128 (deterministic included).
    e = cute_flash.explain_varlen(q, k, v, cq, ck, mq, mk, causal=True, capability=BLACKWELL, deterministic=True)
    assert (e.forward_family, e.backward_family) == ("sm100", "sm100")
    e = cute_flash.explain_varlen(q, k, v, cq, ck, mq, mk, capability=AMPERE, deterministic=True)
    assert (e.forward_family, e.backward_family) == ("sm80", None)
    # Dense calls keep their routes: the sm90 kernels still serve them on Hopper.
    assert cute_flash.explain(q[None], k[None], v[None], capability=HOPPER).forward_family == "sm90"


# --- autograd plumbing with a fake backend ---------------------------------------------------------------------------
class _RefBackend(BackendBase):
    """An sm80 stand-in whose varlen kernels are the float64 reference (gradients by torch autograd)."""

    name, varlen = "sm80", True

    def __init__(self):
        self.calls = []

    def unsupported_reason(self, spec, backward, deterministic=False):
        return "no deterministic backward" if backward and deterministic else None

    def forward_varlen(self, q, k, v, out, lse, seqs, problem):
        self.calls.append("forward")
        cu_q, cu_k, seqused_k, max_seqlen_q, _ = seqs
        softmax_scale, mask = problem.softmax_scale, problem.mask
        o, l_ = attention_varlen_reference(
            q, k, v, cu_q, cu_k, max_seqlen_q, k.shape[0], softmax_scale=softmax_scale, seqused_k=seqused_k,
            causal=mask.kind == "causal", return_lse=True,
        )  # fmt: skip
        out.copy_(o)
        lse.copy_(l_)

    def backward_varlen(self, t, grads, seqs, problem, deterministic=False):
        self.calls.append("backward")
        dout, q, k, v, out, lse, dlse = t[:7]
        dq, dk, dv = grads[:3]
        cu_q, cu_k, seqused_k, max_q, max_k = seqs
        softmax_scale, mask = problem.softmax_scale, problem.mask

        def reference_grads():
            leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
            kw = dict(softmax_scale=softmax_scale, seqused_k=seqused_k, causal=mask.kind == "causal")
            o, l_ = attention_varlen_reference(*leaves, cu_q, cu_k, max_q, max_k, return_lse=True, **kw)
            if dlse is None:
                return torch.autograd.grad(o, leaves, dout.double())
            return torch.autograd.grad((o, l_), leaves, (dout.double(), dlse.to(l_.dtype)))

        # In a thread of its own: a backward runs with grad mode off, and inside a custom op (torch.compile's path)
        # below autograd's dispatch keys, both thread-local; a fresh thread records the reference's graph.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            grads = pool.submit(reference_grads).result()
        for g, t in zip(grads, (dq, dk, dv)):
            t.copy_(g)


@pytest.fixture
def ref_backend(monkeypatch):
    fake = _RefBackend()
    monkeypatch.setattr(routing, "get_backend", lambda name: fake)
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(device, "capability", lambda t: AMPERE)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    return fake


def test_autograd_plumbing(ref_backend):
    q, k, v, cq, ck, mq, mk = _packed([0, 1, 7, 3], [2, 0, 9, 3], dtype=torch.float16)
    used = torch.tensor([2, 0, 5, 3], dtype=torch.int32)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = cute_flash.attention_varlen(*leaves, cq, ck, mq, mk, causal=True, seqused_k=used, return_lse=True)
    assert out.shape == (11, 4, 64) and out.dtype == torch.float16 and lse.shape == (4, 11)
    dout = torch.randn_like(out)
    (out * dout).sum().backward()
    assert ref_backend.calls == ["forward", "backward"]

    ref_leaves = [t.clone().double().requires_grad_(True) for t in (q, k, v)]
    ref = attention_varlen_reference(*ref_leaves, cq, ck, mq, mk, causal=True, seqused_k=used)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=0)
    for got, want in zip(leaves, torch.autograd.grad(ref, ref_leaves, dout.double())):
        assert got.grad.shape == got.shape and got.grad.dtype == got.dtype
        torch.testing.assert_close(got.grad.double(), want, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("with_seqused_k", [False, True])
def test_seqused_q_runs_only_the_used_rows(ref_backend, with_seqused_k):
    # seqused_q becomes packed sequences the kernels take (PackedSeqs.with_used_queries): checked against the
    # reference's own reading of seqused_q, outputs, lse and the three gradients; unused rows 0 / -inf / 0.
    lens_q, lens_k = [0, 5, 7, 3, 4], [2, 0, 9, 3, 6]
    q, k, v, cq, ck, mq, mk = _packed(lens_q, lens_k, dtype=torch.float16, seed=3)
    used_q = torch.tensor([0, 2, 7, 9, 0], dtype=torch.int32)  # 9 > 3: counts as the sequence's length
    used_k = torch.tensor([1, 0, 6, 3, 6], dtype=torch.int32) if with_seqused_k else None
    kw = dict(causal=True, seqused_k=used_k)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = cute_flash.attention_varlen(*leaves, cq, ck, mq, mk, seqused_q=used_q, return_lse=True, **kw)
    dout = torch.randn_like(out)
    (out * dout).sum().backward()
    ref_leaves = [t.clone().double().requires_grad_(True) for t in (q, k, v)]
    ref, ref_lse = attention_varlen_reference(*ref_leaves, cq, ck, mq, mk, seqused_q=used_q, return_lse=True, **kw)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=0)
    for got, want in zip(leaves, torch.autograd.grad(ref, ref_leaves, dout.double())):
        torch.testing.assert_close(got.grad.double(), want, atol=2e-2, rtol=1e-2)
    unused = torch.cat([torch.arange(a + min(u, b - a), b) for a, b, u in
                        zip(cq[:-1].tolist(), cq[1:].tolist(), used_q.tolist())])  # fmt: skip
    assert torch.all(out[unused] == 0) and torch.all(lse[:, unused] == float("-inf"))
    assert torch.all(leaves[0].grad[unused] == 0)
    with pytest.raises(ValueError, match="seqused_q must be an int32"):
        cute_flash.attention_varlen(q, k, v, cq, ck, mq, mk, seqused_q=used_q.long())


def test_explain_varlen_takes_seqused_q():
    q, k, v, cq, ck, mq, mk = _packed([3, 4], [3, 4])
    used = torch.tensor([1, 4], dtype=torch.int32)
    assert cute_flash.explain_varlen(q, k, v, cq, ck, mq, mk, seqused_q=used, capability=(9, 0)).forward_family
    with pytest.raises(ValueError, match="seqused_q must be an int32 tensor of shape"):
        cute_flash.explain_varlen(q, k, v, cq, ck, mq, mk, seqused_q=used[:1], capability=(9, 0))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
@pytest.mark.parametrize("uses", ["lse", "out_and_lse"])
def test_lse_gradient_reaches_the_backward(ref_backend, uses, compiled):
    """lse (h, total_q) is differentiable, eager and through the custom ops under torch.compile: its gradient reaches
    the backend (BwdTensors.dlse); rows without keys (lse -inf) are skipped by the loss."""
    q, k, v, cq, ck, mq, mk = _packed([0, 1, 7, 3], [2, 0, 9, 3], dtype=torch.float16)
    w = torch.randn(4, 11, dtype=torch.float64)

    def loss(out, lse):
        value = (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).double() * w).sum()
        return value + (out.double().square().sum() if uses == "out_and_lse" else 0)

    def run(q, k, v):
        return loss(*cute_flash.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True, return_lse=True))

    if compiled:
        torch._dynamo.reset()
        run = torch.compile(run, fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    run(*leaves).backward()
    ref_leaves = [t.clone().double().requires_grad_(True) for t in (q, k, v)]
    loss(*attention_varlen_reference(*ref_leaves, cq, ck, mq, mk, causal=True, return_lse=True)).backward()
    for got, ref in zip(leaves, ref_leaves):
        want = torch.zeros_like(ref) if ref.grad is None else ref.grad  # (lse alone does not depend on v)
        torch.testing.assert_close(got.grad.double(), want, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("round_rows", [False, True], ids=["sm80_rows", "sm90_rows"])
def test_fold_lse_grad_packed_matches_a_loop_over_sequences(round_rows):
    """D -= dlse into the padded per-sequence layout, by device ops alone (no host read of cu_seqlens): both families'
    buffer sizes, a strided dlse, rows past cu_seqlens[-1] ignored, rows without keys (lse -inf) left at D even where
    dlse is not finite there."""
    from cute_flash.arch.base import fold_lse_grad_packed

    lens, pad, h = [5, 0, 130, 64, 1], 64, 3
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1]) + 7  # 7 rows past the last sequence
    rows = total + len(lens) * pad
    rows = -(-rows // pad) * pad if round_rows else rows
    dpsum = torch.randn(h, rows, dtype=torch.float32)
    dlse = torch.randn(total, h, dtype=torch.float32).t()  # (h, total), not contiguous
    lse = torch.randn(h, total, dtype=torch.float32)
    lse[1, 3], dlse[1, 3] = float("-inf"), float("nan")  # a row without keys, a NaN gradient there
    want = dpsum.clone()
    for b, n in enumerate(lens):
        start = int(cu[b])
        padded = (start + b * pad) // pad * pad
        want[:, padded : padded + n] -= torch.where(torch.isneginf(lse), 0.0, dlse)[:, start : start + n]
    fold_lse_grad_packed(dpsum, dlse, lse, cu, pad)
    assert torch.equal(dpsum, want)


def test_fold_lse_grad_dense_keeps_rows_without_keys():
    from cute_flash.arch.base import fold_lse_grad

    dpsum = torch.randn(2, 3, 64)
    lse, dlse = torch.randn(2, 3, 50), torch.randn(2, 3, 50).expand(2, 3, 50)
    lse[0, 1, 7], dlse = float("-inf"), dlse.clone()
    dlse[0, 1, 7] = float("inf")
    want = dpsum.clone()
    want[..., :50] -= torch.where(torch.isneginf(lse), 0.0, dlse)
    fold_lse_grad(dpsum, dlse, lse)
    assert torch.equal(dpsum, want)
    fold_lse_grad(dpsum, None, lse)  # no gradient of lse: nothing changes
    assert torch.equal(dpsum, want)


def test_no_grad_and_empty_batches_launch_nothing(ref_backend):
    q, k, v, cq, ck, _, _ = _packed([2, 3], [4, 1])
    with torch.no_grad():
        cute_flash.attention_varlen(q, k, v, cq, ck, 3, 4)
    assert ref_backend.calls == ["forward"]
    out, lse = cute_flash.attention_varlen(q, k[:0], v[:0], cq, torch.zeros_like(ck), 3, 0, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == float("-inf")) and ref_backend.calls == ["forward"]


def test_deterministic_fails_before_the_forward(ref_backend):
    q, k, v, cq, ck, mq, mk = _packed([2, 3], [4, 1])
    with pytest.raises(NotImplementedError, match="deterministic"):
        cute_flash.attention_varlen(q.requires_grad_(True), k, v, cq, ck, mq, mk, deterministic=True)
    assert ref_backend.calls == []


# --- torch.compile: the custom ops cute_flash::fwd / bwd with packed-sequence arguments ------------------------------
def test_varlen_ops_fake_shapes_and_opcheck(meta):
    # the dense ops with their packed-sequence arguments (cu_seqlens, seqused_k, max_seqlen)
    q, k, v, cq, ck, mq, mk = meta
    q, k, v = (t.to(torch.float16) for t in (q, k, v))
    v = torch.empty(k.shape[0], k.shape[1], 32, dtype=k.dtype, device="meta")
    used = torch.empty(2, dtype=torch.int32, device="meta")
    fields = (True, 0.125, None, None, False, 0.0, None)  # core/fields.py's CALL, then PACKED
    args = (q, k, v, *fields, cq, ck, used, mq, mk, False)
    out, lse = torch.ops.cute_flash.fwd(*args)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((8, 4, 32), torch.float16, (4, 8), torch.float32)
    torch.library.opcheck(torch.ops.cute_flash.fwd.default, args, test_utils=("test_schema", "test_faketensor"))
    bargs = (torch.empty_like(out), q, k, v, out, lse, None, *fields, cq, ck, None, mq, mk)
    torch.library.opcheck(torch.ops.cute_flash.bwd.default, bargs, test_utils=("test_schema", "test_faketensor"))
    grads = torch.ops.cute_flash.bwd(*bargs)
    assert [g.shape for g in grads[:3]] == [t.shape for t in (q, k, v)] and grads[3].shape == (0,)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("with_seqused_q", [False, True])
def test_torch_compile_traces_attention_varlen_without_a_graph_break(ref_backend, backend, with_seqused_q):
    torch._dynamo.reset()
    q, k, v, cq, ck, mq, mk = _packed([0, 1, 7, 3], [2, 0, 9, 3], dtype=torch.float16)
    used = torch.tensor([2, 0, 5, 3], dtype=torch.int32)
    used_q = torch.tensor([0, 1, 4, 3], dtype=torch.int32) if with_seqused_q else None

    def loss(q, k, v, dout):
        out, lse = cute_flash.attention_varlen(
            q, k, v, cq, ck, mq, mk, causal=True, seqused_k=used, seqused_q=used_q, softmax_scale=0.2,
            return_lse=True,
        )  # fmt: skip
        return (out.float() * dout).sum(), lse

    compiled = torch.compile(loss, fullgraph=True, backend=backend)  # fullgraph: a graph break would raise
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    dout = torch.randn(q.shape[0], q.shape[1], v.shape[2])
    value, lse = compiled(*leaves, dout)
    grads = torch.autograd.grad(value, leaves)
    assert ref_backend.calls == ["forward", "backward"] and lse.shape == (4, 11)

    ref_leaves = [t.clone().double().requires_grad_(True) for t in (q, k, v)]
    ref = attention_varlen_reference(
        *ref_leaves, cq, ck, mq, mk, causal=True, seqused_k=used, seqused_q=used_q, softmax_scale=0.2
    )
    torch.testing.assert_close(value.double(), (ref * dout.double()).sum(), atol=2e-2, rtol=1e-3)
    for got, want in zip(grads, torch.autograd.grad(ref, ref_leaves, dout.double())):
        assert got.shape == want.shape and got.dtype == torch.float16
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=1e-2)


def test_varlen_validation_still_runs_under_torch_compile(meta):
    torch._dynamo.reset()
    q, k, v, cq, ck, mq, mk = meta
    with pytest.raises(Exception, match="window_size"):
        torch.compile(
            lambda q, k, v: cute_flash.attention_varlen(q, k, v, cq, ck, mq, mk, window_size=(1.5, 0)), fullgraph=True
        )(q, k, v)


def test_torch_compile_varlen_recompiles_dynamic_lengths(ref_backend):
    # A second batch of other lengths makes dynamo trace totals and max_seqlen as symbols (automatic dynamic):
    # validation must take a traced host int as a host int.
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda *a: cute_flash.attention_varlen(*a, causal=True), fullgraph=True, backend="aot_eager", dynamic=None
    )
    for lens_q, lens_k in (([3, 5], [4, 4]), ([6, 2, 9], [7, 1, 9]), ([1, 4], [2, 8])):
        args = _packed(lens_q, lens_k)
        out = compiled(*args)
        ref = attention_varlen_reference(*(t.double() for t in args[:3]), *args[3:], causal=True)
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=0)

"""The one layout normalisation (validation.kernel_view): which layouts pass untouched, which become a view, which
are copied; and that every tensor the front end hands a backend, gradients included, meets the kernels' contract.

CPU only: a fake backend computes with the reference and checks the contract on everything it receives.
"""

import contextlib

import pytest
import torch

import cute_flash
from cute_flash.arch.base import BackendBase, launcher_through_backward, launcher_through_forward
from cute_flash import validation
from cute_flash.core import device
from cute_flash.reference import attention_reference, visible_keys
from cute_flash.validation import kernel_view


def _contract_ok(t: torch.Tensor) -> bool:
    align = max(1, 16 // t.element_size())
    return (
        t.data_ptr() % 16 == 0
        and (t.shape[-1] == 1 or t.stride(-1) == 1)
        and all(s % align == 0 and (s > 0 or n == 1) for n, s in zip(t.shape[:-1], t.stride()[:-1]))
    )


def bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


# --- layouts that are already usable: the tensor itself, no copy ------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda: bf16(2, 16, 4, 64),
        lambda: bf16(2, 4, 16, 64).transpose(1, 2),  # (b, h, s, d) storage
        lambda: bf16(2, 16, 3, 4, 64)[:, :, 1],  # q, k or v of a packed qkv tensor
        lambda: bf16(2, 16, 4, 128)[..., :64],  # a head-dim slice: row stride 128
        lambda: bf16(4, 16, 4, 64)[1:3],  # a batch slice (offset of a whole batch entry)
    ],
    ids=["contiguous", "bhsd", "packed_qkv", "dim_slice", "batch_slice"],
)
def test_usable_layouts_are_not_touched(make):
    t = make()
    assert kernel_view(t) is t
    assert kernel_view(t, copy=False) is t


# --- a size-1 dimension with a stride that breaks the contract: a view of the same memory ------------------------
def test_size_one_dimension_gets_a_usable_stride_without_a_copy():
    base = bf16(2, 16, 3 * 64 + 1)
    t = base[:, :, 1:65].unsqueeze(2)  # (2, 16, 1, 64): offset 1 element (misaligned) -> that one is a copy
    assert kernel_view(t).data_ptr() != t.data_ptr()
    t = torch.as_strided(bf16(2 * 16 * 64), (2, 16, 1, 64), (1024, 64, 3, 1))  # head stride 3: never used
    v = kernel_view(t)
    assert v.data_ptr() == t.data_ptr() and torch.equal(v, t) and _contract_ok(v)
    assert v.stride(2) % 8 == 0
    assert kernel_view(t, copy=False).data_ptr() == t.data_ptr()


# --- layouts that need a copy ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones((), dtype=torch.bfloat16).expand(2, 16, 4, 64),  # d(out.sum())/d(out)
        lambda: bf16(2, 16, 1, 64).expand(2, 16, 4, 64),  # broadcast over heads
        lambda: bf16(2, 1, 4, 64).expand(2, 16, 4, 64),  # broadcast over the sequence
        lambda: bf16(2, 16, 64, 4).transpose(2, 3),  # head_dim not unit-stride
        lambda: bf16(2 * 16 * 4 * 64 + 3)[3:].view(2, 16, 4, 64),  # offset view: base misaligned
        lambda: torch.as_strided(bf16(2 * 16 * 4 * 68), (2, 16, 4, 64), (16 * 4 * 68, 4 * 68, 68, 1)),  # stride 68
    ],
    ids=["expanded_scalar", "broadcast_heads", "broadcast_seq", "transposed", "offset", "odd_stride"],
)
def test_unusable_layouts_are_copied_once(make):
    t = make()
    v = kernel_view(t)
    assert v is not t and _contract_ok(v) and torch.equal(v, t)
    assert v.is_contiguous()
    with pytest.raises(ValueError, match="without a copy"):
        kernel_view(t, copy=False)


def test_alignment_is_in_bytes():
    # fp32: 4 elements are 16 bytes; fp8: 16 elements.
    t = torch.as_strided(torch.randn(2 * 16 * 4 * 68), (2, 16, 4, 64), (16 * 4 * 68, 4 * 68, 68, 1))
    assert kernel_view(t) is t
    t8 = torch.zeros(2, 16, 4, 72, dtype=torch.float8_e4m3fn)[..., :64]  # row stride 72: not 16 elements
    v8 = kernel_view(t8)
    assert v8 is not t8 and _contract_ok(v8)


def test_empty_tensors_pass():
    t = bf16(0, 16, 4, 64)
    assert kernel_view(t) is t


# --- the front end: whatever layout q, k, v and the gradient have, a backend only sees the contract --------------
class _CheckingBackend(BackendBase):
    """Computes with the float64 reference, after asserting the layout contract of every tensor it is handed."""

    name = "fake"
    cute_arch = "sm_80"

    def __init__(self):
        self.seen = []

    def unsupported_reason(self, spec, backward, deterministic=False):
        return None

    def _check(self, **tensors):
        for name, t in tensors.items():
            assert _contract_ok(t), (name, tuple(t.shape), t.stride(), t.data_ptr() % 16)
            self.seen.append(name)

    def forward_launcher(self, problem, device):
        return launcher_through_forward(self, problem)

    def backward_launcher(self, problem, device, deterministic=False):
        return launcher_through_backward(self, problem, deterministic)

    def forward(self, t, problem, descale=None):
        q, k, v, out, lse = t[:5]
        softmax_scale, mask = problem.softmax_scale, problem.mask
        self._check(q=q, k=k, v=v, out=out)
        o, l = attention_reference(
            q, k, v, softmax_scale=softmax_scale, window_size=(mask.left, mask.right), return_lse=True
        )
        out.copy_(o)
        lse.copy_(l)

    def backward(self, t, grads, problem, deterministic=False):
        dout, q, k, v, out, lse, dlse = t[:7]
        dq, dk, dv = grads[:3]
        softmax_scale, mask = problem.softmax_scale, problem.mask
        self._check(dout=dout, q=q, k=k, v=v, out=out, dq=dq, dk=dk, dv=dv)
        # The attention gradients written out (a kernel call runs below autograd, inside torch.ops.cute_flash.bwd).
        qd, kd, vd, do = (t.double() for t in (q, k, v, dout))
        s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * softmax_scale
        s = s.masked_fill(~visible_keys(q.shape[1], k.shape[1], mask), float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # (a row without keys: 0, as the kernels)
        dp = torch.einsum("bqhd,bkhd->bhqk", do, vd)
        d = (dp * p).sum(-1, keepdim=True)
        if dlse is not None:  # lse's gradient folds into D (arch/base.fold_lse_grad)
            d = d - dlse.double().unsqueeze(-1)
        ds = p * (dp - d)
        dq.copy_(torch.einsum("bhqk,bkhd->bqhd", ds, kd) * softmax_scale)
        dk.copy_(torch.einsum("bhqk,bqhd->bkhd", ds, qd) * softmax_scale)
        dv.copy_(torch.einsum("bhqk,bqhd->bkhd", p, do))


@pytest.fixture
def fake_gpu(monkeypatch):
    backend = _CheckingBackend()
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(device, "route", lambda spec, t, backward, deterministic=False: backend)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    return backend


def _weights(shape, layout=lambda w: w):
    return layout(torch.randn(*shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64))


GRADIENTS = {
    "sum": lambda out: out.sum(),  # an expanded (all strides 0) gradient
    "mean_of_head_0": lambda out: out[:, :, 0].float().mean(),  # zeros elsewhere, a broadcast inside
    # A gradient whose head_dim is not unit-stride: the weights are stored (b, s, d, h).
    "transposed": lambda out: (out * _weights((2, 8, 64, 4), lambda w: w.transpose(2, 3)).to(out.dtype)).sum(),
    "weighted": lambda out: (out * _weights(out.shape).to(out.dtype)).sum(),
}


@pytest.mark.parametrize("grad", list(GRADIENTS), ids=list(GRADIENTS))
def test_any_gradient_reaches_the_backend_in_a_usable_layout(fake_gpu, grad):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 4, 64).to(torch.bfloat16).requires_grad_(True) for _ in range(3))
    out = cute_flash.attention(q, k, v)
    GRADIENTS[grad](out).backward()
    assert "dout" in fake_gpu.seen
    # Same gradients as autograd through the reference (in float64, from the same dout).
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    GRADIENTS[grad](attention_reference(*leaves)).backward()
    for got, ref in zip((q.grad, k.grad, v.grad), leaves):
        torch.testing.assert_close(got.double(), ref.grad, atol=2e-2, rtol=2e-2)


def test_strided_and_offset_inputs_reach_the_backend_in_a_usable_layout(fake_gpu):
    torch.manual_seed(1)
    packed = torch.randn(2, 8, 3, 4, 64).to(torch.bfloat16)
    q, k, v = packed.unbind(2)  # row stride 3 * 4 * 64: usable as is
    flat = torch.randn(2 * 8 * 4 * 64 + 1).to(torch.bfloat16)
    q_off = flat[1:].view(2, 8, 4, 64)  # misaligned base: copied
    for inputs in (
        (q, k, v),
        (q_off, k, v),
        (q, k.expand(2, 8, 4, 64).transpose(0, 0), v[:, :, :1].expand(2, 8, 4, 64)),
    ):
        inputs = tuple(t.detach().requires_grad_(True) for t in inputs)
        out = cute_flash.attention(*inputs)
        torch.testing.assert_close(out.double(), attention_reference(*inputs), atol=2e-2, rtol=2e-2)
        out.sum().backward()
        assert all(t.grad is not None and t.grad.shape == t.shape for t in inputs)


def _finite(lse):
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


@pytest.mark.parametrize("uses", ["lse", "out_and_lse"])
def test_lse_gradient_reaches_the_backend(fake_gpu, uses):
    """lse is differentiable: its gradient reaches the backend as BwdTensors.dlse (folded into D there), with a zero
    out gradient when the loss uses lse alone; the gradients match autograd through the float64 reference. A causal
    mask with seqlen_q > seqlen_k leaves rows without keys (lse -inf), which the loss skips."""
    torch.manual_seed(2)
    q = torch.randn(2, 8, 4, 64).to(torch.bfloat16).requires_grad_(True)
    k, v = (torch.randn(2, 5, 4, 64).to(torch.bfloat16).requires_grad_(True) for _ in range(2))
    w = torch.randn(2, 4, 8, dtype=torch.float64)

    def loss(out, lse):
        value = (_finite(lse).double() * w).sum()
        return value + (out.double().square().sum() if uses == "out_and_lse" else 0)

    out, lse = cute_flash.attention(q, k, v, causal=True, return_lse=True)
    assert lse.requires_grad and torch.isneginf(lse).any()
    loss(out, lse).backward()
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    loss(*attention_reference(*leaves, causal=True, return_lse=True)).backward()
    for got, ref in zip((q.grad, k.grad, v.grad), leaves):
        want = torch.zeros_like(ref) if ref.grad is None else ref.grad  # (lse alone does not depend on v)
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)


def test_double_backward_raises_instead_of_dropping_terms(fake_gpu):
    """create_graph=True works where no second backward reaches attention's gradients (a penalty on a downstream
    weight's gradient); a second backward through dq raises instead of treating it as a constant."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 8, 2, 64).to(torch.bfloat16).requires_grad_(True) for _ in range(3))
    w = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
    loss = (cute_flash.attention(q, k, v).double() @ w).square().sum()
    dq, dw = torch.autograd.grad(loss, (q, w), create_graph=True)
    dw.square().sum().backward(retain_graph=True)  # reaches attention's forward only: fine
    assert w.grad is not None and q.grad is not None
    with pytest.raises(NotImplementedError, match="double"):
        dq.float().square().sum().backward()


def test_backward_op_returns_the_strides_its_fake_promises(fake_gpu):
    """Inputs the kernels need copied (a non-unit last stride, a misaligned base) still get gradients with the strides
    of `empty_like(input)`: the fake's, which inductor asserts on under torch.compile."""
    from cute_flash import ops

    torch.manual_seed(3)
    flat = torch.randn(2 * 8 * 4 * 64 + 1).to(torch.bfloat16)
    unit = torch.randn(8, 4, 64).to(torch.bfloat16)
    cases = (
        flat[1:].view(2, 4, 8, 64).transpose(1, 2),  # misaligned (b, h, s, d) view: copied
        unit.expand(2, 8, 4, 64),  # broadcast batch: copied
        unit.as_strided((1, 8, 4, 64), (3, 256, 64, 1)),  # a size-1 dimension's odd stride: restrided view
    )
    for q in cases:
        b = q.shape[0]
        k, v = torch.randn(b, 8, 4, 64).to(torch.bfloat16), torch.randn(b, 8, 4, 64).to(torch.bfloat16)
        args = (False, None, None, None, False, 0.0, None, None, None, None, 0, 0)
        out, lse = torch.ops.cute_flash.fwd(q, k, v, *args, False)
        dout = torch.randn_like(out)
        got = torch.ops.cute_flash.bwd(dout, q, k, v, out, lse, None, *args)
        fake = ops._bwd_fake(dout, q, k, v, out, lse, None, *args)
        assert [g.stride() for g in got[:3]] == [f.stride() for f in fake[:3]]
        ref = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
        (attention_reference(*ref).double() * dout.double()).sum().backward()
        for g, r in zip(got[:3], ref):
            torch.testing.assert_close(g.double(), r.grad, atol=3e-2, rtol=3e-2)

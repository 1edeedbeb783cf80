"""attention(..., score_mod=, mask_mod=) on the CPU: the experimental gate, what it refuses, the spec and tables the
sm80 backend receives (a recording backend on meta tensors), explain's route (sm80 on every GPU)."""

from __future__ import annotations

import pytest
import torch

import cute_flash
from cute_flash import validation
from cute_flash.core import device
from cute_flash.spec import ModsSpec

from . import test_mods as examples


class _Recorder:
    name = "sm80"

    def __init__(self):
        self.calls = []

    def forward_mods(self, q, k, v, out, lse, problem, tables):
        self.calls.append((problem, tables))

    def backward_mods(self, t, grads, problem, tables):
        self.calls.append(("backward", problem, tables))


@pytest.fixture
def backend(monkeypatch):
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "meta"))
    rec = _Recorder()
    monkeypatch.setattr(device, "route", lambda spec, t, backward=False, deterministic=False: rec)
    monkeypatch.setattr(device, "guard", lambda t: __import__("contextlib").nullcontext())
    return rec


def _qkv(b=2, s=77, h=4, hk=2, d=64, device="meta"):
    return (torch.empty(b, s, h, d, dtype=torch.bfloat16, device=device),
            torch.empty(b, s, hk, d, dtype=torch.bfloat16, device=device),
            torch.empty(b, s, hk, d, dtype=torch.bfloat16, device=device))  # fmt: skip


def test_a_call_reaches_the_backend_with_its_spec_and_tables(backend, monkeypatch):
    monkeypatch.setattr(examples, "DOC", examples.DOC.to("meta"))
    monkeypatch.setattr(examples, "SLOPES", examples.SLOPES.to("meta"))
    q, k, v = _qkv()
    out, lse = cute_flash.attention(q, k, v, score_mod=examples.alibi, mask_mod=examples.document, return_lse=True)
    assert out.shape == (2, 77, 4, 64) and lse.shape == (2, 4, 77)
    ((problem, tables),) = backend.calls
    spec = problem.spec
    assert isinstance(spec, ModsSpec) and spec.mask == "none" and spec.score_mod[0] == "score"
    assert spec.mask_mod[0] == "mask" and [t.dtype for t in tables] == [torch.float32, torch.int32]
    # Equal callables give the same spec (one kernel); the tables' values are runtime data.
    cute_flash.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s - examples.SLOPES[h] * (qi - ki),
                         mask_mod=examples.document)  # fmt: skip
    assert backend.calls[1][0].spec == spec


def test_boolean_and_scalar_tables_are_stored_as_the_kernel_reads_them(backend):
    q, k, v = _qkv(device="meta")
    blocks = examples.RANDOM_BLOCKS.to("meta")
    bias = torch.tensor(0.5, device="meta")
    cute_flash.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias,
                         mask_mod=lambda b, h, qi, ki: blocks[qi // 16, ki // 16])  # fmt: skip
    ((_, tables),) = backend.calls
    assert [(t.dtype, tuple(t.shape)) for t in tables] == [(torch.float32, (1,)), (torch.uint8, (8, 8))]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(softcap=5.0), "softcap"),
        (dict(deterministic=True), "deterministic"),
        (dict(dtype="fp8"), "dtype"),
    ],
)
def test_what_does_not_combine_is_refused(backend, kwargs, match):
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=match):
        cute_flash.attention(q, k, v, score_mod=examples.alibi, **kwargs)


def test_gradients_go_through_one_node_to_the_backward_with_the_tables(backend, monkeypatch):
    monkeypatch.setattr(examples, "SLOPES", examples.SLOPES.to("meta"))
    q, k, v = (t.requires_grad_() for t in _qkv())
    out, lse = cute_flash.attention(q, k, v, score_mod=examples.alibi, return_lse=True)
    assert out.requires_grad and lse.requires_grad
    dq, dk, dv = torch.autograd.grad((out.sum(), lse.sum()), (q, k, v))
    (problem, tables), (tag, problem_b, tables_b) = backend.calls
    assert tag == "backward" and problem_b is problem and len(tables_b) == len(tables) == 1
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_captured_tensors_that_require_grad_are_refused(backend):
    q, k, v = _qkv()
    bias = torch.zeros(4, device="meta", requires_grad=True)
    with pytest.raises(NotImplementedError, match="requires grad"):
        cute_flash.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h])


def test_foreign_tables_and_unsupported_callables_are_refused(backend):
    q, k, v = _qkv()
    with torch.no_grad():
        with pytest.raises(ValueError, match="is on cpu"):
            cute_flash.attention(q, k, v, score_mod=examples.alibi)  # SLOPES lives on the CPU, q on meta
        with pytest.raises(cute_flash.mods.ModError, match="erf"):
            cute_flash.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: torch.erf(s))


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0)])
def test_explain_routes_mods_to_the_sm80_family_everywhere(capability):
    q, k, v = _qkv(device="cpu")
    e = cute_flash.explain(q, k, v, mask_mod=examples.causal, capability=capability)
    assert e.forward.family == "sm80" and e.backward.family == "sm80", e
    # The backward takes head_dim == head_dim_v, a multiple of 32.
    q, k, v = _qkv(d=72, device="cpu")
    e = cute_flash.explain(q, k, v, mask_mod=examples.causal, capability=capability)
    assert e.forward.family == "sm80" and e.backward.family is None, e

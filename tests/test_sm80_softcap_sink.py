"""GPU: the sm80 family's soft-capping, learnable sinks and negative window bounds, forward (dense, packed, split-key)
and backward (dense, packed, GQA; dsink), called through the backend (arch/base.py's contract) against the float64
oracle of tests/feature_oracle.py with FlashAttention's rule.

Run: pytest -m sm80 tests/test_sm80_softcap_sink.py  (on Hopper the sm80 kernels run for target sm_90a).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from cute_flash.arch.base import BwdTensors, FwdTensors, Grads, PackedSeqs
from cute_flash.spec import UNBOUNDED_WINDOW, AttentionSpec, normalize_mask
from cute_flash.testing import ErrorReport, random_qkv
from cute_flash.validation import Problem, VarlenProblem

from .feature_oracle import assert_reports, attention_oracle, lse_report, max_abs

pytestmark = pytest.mark.sm80

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _backend():
    from cute_flash.arch.sm80 import BACKEND

    return BACKEND


def _bounds(mask):
    """The oracle's (left, right) of a MaskBounds (UNBOUNDED_WINDOW: None)."""
    left = None if mask.left >= UNBOUNDED_WINDOW else mask.left
    right = None if mask.right >= UNBOUNDED_WINDOW else mask.right
    return left, right


def _problem(q, k, v, dtype, *, causal=False, window=(None, None), softcap=0.0, sink=False):
    mask = normalize_mask(causal, window)
    b, sq, h, d = q.shape
    spec = AttentionSpec(dtype, d, v.shape[-1], mask.kind, dtype, softcap=softcap > 0, sink=sink)
    scale = 1.0 / math.sqrt(d)
    return Problem(b, sq, k.shape[1], h, k.shape[2], d, v.shape[-1], mask, scale, spec, softcap)


def _sinks(h, seed):
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    return (torch.randn(h, generator=gen, device="cuda") * 2).float()


def _combine_takes_sink() -> bool:
    from cute_flash.common.split_combine import SplitCombine

    return len(inspect.signature(inspect.unwrap(SplitCombine.__call__)).parameters) > 6  # self, 4 tensors, stream


def _forward(problem, q, k, v, sink):
    b, sq, h, _ = q.shape
    out = torch.empty(b, sq, h, v.shape[-1], dtype=q.dtype, device="cuda")
    lse = torch.empty(b, h, sq, dtype=torch.float32, device="cuda")
    view = None if sink is None else sink.view(1, h).expand(sq, h)
    _backend().forward(FwdTensors(q, k, v, out, lse, view), problem)
    return out, lse


def _check_forward(problem, q, k, v, out, lse, sink):
    left, right = _bounds(problem.mask)
    kw = dict(scale=problem.softmax_scale, left=left, right=right, softcap=problem.softcap, sink=sink)
    ref, ref_lse = attention_oracle(q, k, v, **kw)
    low, low_lse = attention_oracle(q, k, v, compute_dtype=q.dtype, **kw)
    empty = torch.isneginf(ref_lse).transpose(1, 2)  # (b, sq, h)
    assert torch.count_nonzero(out[empty]) == 0, "rows without keys must give out 0"
    assert_reports(
        [ErrorReport("out", max_abs(out, ref), max_abs(low, ref)), lse_report(lse, ref_lse, low_lse)],
        [("out", out)],
    )


# (dtype, head_dim, heads, seqlens, causal, window, softcap, sink)
FORWARD_CASES = [
    ("bf16", 128, (4, 2), (333, 517), True, (None, None), 30.0, False),
    ("bf16", 128, (4, 4), (517, 333), False, (None, None), 0.0, True),
    ("bf16", 128, (6, 2), (300, 400), False, (64, -5), 10.0, True),  # keys at least 5 before the diagonal
    ("fp16", 64, (4, 1), (257, 700), True, (None, None), 5.0, True),
    ("bf16", 128, (4, 2), (200, 100), True, (None, None), 0.0, True),  # rows 0..99 see no key: out 0, lse = sink
]


@pytest.mark.parametrize("case", FORWARD_CASES, ids=lambda c: f"{c[0]}_d{c[1]}_cap{c[6]:g}_sink{int(c[7])}")
def test_forward_softcap_sink(case):
    dtype, d, (h, h_kv), (sq, sk), causal, window, softcap, with_sink = case
    q, k, v = random_qkv(2, sq, sk, h, h_kv, d, dtype=DTYPES[dtype], seed=sq + d)
    sink = _sinks(h, sq) if with_sink else None
    problem = _problem(q, k, v, dtype, causal=causal, window=window, softcap=softcap, sink=with_sink)
    out, lse = _forward(problem, q, k, v, sink)
    _check_forward(problem, q, k, v, out, lse, sink)


@pytest.mark.parametrize("with_sink", [False, True])
def test_forward_split_keys(with_sink):
    # Decoding shapes (few query tiles): the split-key build and its combine; the partials leave the sink out and the
    # combine adds it (its sink build: common/split_combine.py).
    if with_sink and not _combine_takes_sink():
        pytest.skip("the split combine's sink build (common/split_combine.py) is not on this branch")
    q, k, v = random_qkv(1, 3, 1500, 4, 2, 128, dtype=torch.bfloat16, seed=3)
    sink = _sinks(4, 5) if with_sink else None
    problem = _problem(q, k, v, "bf16", causal=True, softcap=20.0, sink=with_sink)
    out, lse = _forward(problem, q, k, v, sink)
    _check_forward(problem, q, k, v, out, lse, sink)


NEGATIVE_WINDOWS = [(-3, 40), (40, -3), (-20, 5), (None, -50), (-70, None), (0, -1)]


@pytest.mark.parametrize("window", NEGATIVE_WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
def test_negative_windows_forward_backward(window):
    # Windows off the diagonal, some rows (or every row: (-20, 5), (0, -1)) seeing no key: out 0, lse -inf, zero dq.
    for sq, sk in ((333, 517), (517, 333)):
        q, k, v, dout = _backward_inputs(torch.bfloat16, 128, sq, sk, 4, 2, seed=sq)
        problem = _problem(q, k, v, "bf16", window=window)
        out, lse = _forward(problem, q, k, v, None)
        _check_forward(problem, q, k, v, out, lse, None)
        _check_backward(problem, q, k, v, dout, out, lse, None, None)


def _backward_inputs(dtype, d, sq, sk, h, h_kv, seed, batch=2):
    q, k, v = random_qkv(batch, sq, sk, h, h_kv, d, dtype=dtype, seed=seed)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed + 1)
    dout = torch.randn(batch, sq, h, d, generator=gen, device="cuda").to(dtype)
    return q, k, v, dout


def _reference_grads(problem, q, k, v, dout, sink, dlse, compute_dtype):
    left, right = _bounds(problem.mask)
    leaves = [t.detach().to(compute_dtype).requires_grad_(True) for t in (q, k, v)]
    sink_leaf = None if sink is None else sink.detach().to(compute_dtype).requires_grad_(True)
    out, lse = attention_oracle(
        *leaves, scale=problem.softmax_scale, left=left, right=right, softcap=problem.softcap, sink=sink_leaf,
        compute_dtype=compute_dtype,
    )  # fmt: skip
    outs, grads_in = [out], [dout.to(compute_dtype)]
    if dlse is not None:
        finite = torch.isfinite(lse)
        outs.append(torch.where(finite, lse, torch.zeros_like(lse)))
        grads_in.append(torch.where(finite, dlse.to(lse.dtype), torch.zeros_like(lse)))
    inputs = leaves + ([sink_leaf] if sink_leaf is not None else [])
    got = torch.autograd.grad(outs, inputs, grads_in, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, got)]


def _check_backward(problem, q, k, v, dout, out, lse, sink, dlse):
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    dsink = None if sink is None else torch.full_like(sink, float("nan"))
    t = BwdTensors(dout, q, k, v, out, lse, dlse, sink)
    _backend().backward(t, Grads(dq, dk, dv, dsink), problem)
    ref = _reference_grads(problem, q, k, v, dout, sink, dlse, torch.float64)
    low = _reference_grads(problem, q, k, v, dout, sink, dlse, q.dtype)
    names = ("dq", "dk", "dv", "dsink")
    got = [dq, dk, dv] + ([dsink] if dsink is not None else [])
    reports = [ErrorReport(n, max_abs(g, r), max_abs(lo, r)) for n, g, r, lo in zip(names, got, ref, low)]
    assert_reports(reports, list(zip(names, got)))


# (dtype, head_dim, head_dim_v, heads, seqlens, causal, window, softcap, sink, dlse)
BACKWARD_CASES = [
    ("bf16", 128, 128, (4, 2), (333, 517), True, (None, None), 30.0, False, False),
    ("bf16", 128, 128, (4, 4), (517, 333), False, (None, None), 0.0, True, True),
    ("bf16", 128, 128, (6, 2), (300, 400), False, (64, -5), 10.0, True, False),
    ("fp16", 64, 64, (4, 1), (257, 700), True, (None, None), 5.0, True, True),
    ("bf16", 128, 64, (4, 2), (200, 100), True, (None, None), 0.0, True, False),  # padded (d, dv); empty rows
]


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=lambda c: f"{c[0]}_d{c[1]}x{c[2]}_cap{c[7]:g}_sink{int(c[8])}")
def test_backward_softcap_sink(case):
    dtype, d, dv, (h, h_kv), (sq, sk), causal, window, softcap, with_sink, with_dlse = case
    q, k, v = random_qkv(2, sq, sk, h, h_kv, d, dv, dtype=DTYPES[dtype], seed=sq + d)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(sk)
    dout = torch.randn(2, sq, h, dv, generator=gen, device="cuda").to(q.dtype)
    dlse = torch.randn(2, h, sq, generator=gen, device="cuda") if with_dlse else None
    sink = _sinks(h, sq) if with_sink else None
    problem = _problem(q, k, v, dtype, causal=causal, window=window, softcap=softcap, sink=with_sink)
    out, lse = _forward(problem, q, k, v, sink)
    _check_backward(problem, q, k, v, dout, out, lse, sink, dlse)


def _packed(lengths_q, lengths_k, h, h_kv, d, seed):
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)

    def cu(lengths):
        return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")

    tq, tk = sum(lengths_q), sum(lengths_k)
    q = torch.randn(tq, h, d, generator=gen, device="cuda").to(torch.bfloat16)
    k = torch.randn(tk, h_kv, d, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(tk, h_kv, d, generator=gen, device="cuda").to(torch.bfloat16)
    dout = torch.randn(tq, h, d, generator=gen, device="cuda").to(torch.bfloat16)
    seqs = PackedSeqs(cu(lengths_q), cu(lengths_k), None, max(lengths_q), max(lengths_k))
    return q, k, v, dout, seqs


def test_packed_softcap_sink_forward_backward():
    # Packed sequences (lengths 0, 1, odd, several tiles), GQA, a local window with a negative right bound.
    lengths_q, lengths_k = [0, 1, 200, 77, 300], [5, 0, 333, 77, 129]
    h, h_kv, d = 4, 2, 128
    q, k, v, dout, seqs = _packed(lengths_q, lengths_k, h, h_kv, d, seed=11)
    sink = _sinks(h, 12)
    mask = normalize_mask(False, (96, -2))
    spec = AttentionSpec("bf16", d, d, mask.kind, "bf16", varlen=True, softcap=True, sink=True)
    problem = VarlenProblem(
        len(lengths_q), q.shape[0], k.shape[0], h, h_kv, d, d, seqs.max_seqlen_q, seqs.max_seqlen_k, spec, mask,
        1.0 / math.sqrt(d), 15.0,
    )  # fmt: skip
    out = torch.empty_like(q)
    lse = torch.empty(h, q.shape[0], dtype=torch.float32, device="cuda")
    backend = _backend()
    backend.forward_varlen(q, k, v, out, lse, seqs, problem, sink=sink.view(1, h).expand(q.shape[0], h))
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    dsink = torch.full_like(sink, float("nan"))
    backend.backward_varlen(BwdTensors(dout, q, k, v, out, lse, None, sink), Grads(dq, dk, dv, dsink), seqs, problem)

    # Per sequence against the dense oracle; dsink sums over the sequences.
    left, right = _bounds(mask)
    dsink_ref = torch.zeros(h, dtype=torch.float64, device="cuda")
    dsink_low = torch.zeros(h, dtype=torch.float32, device="cuda")
    cq, ck = seqs.cu_seqlens_q.tolist(), seqs.cu_seqlens_k.tolist()
    reports = []
    for i in range(len(lengths_q)):
        rq, rk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        one = Problem(1, lengths_q[i], lengths_k[i], h, h_kv, d, d, mask, problem.softmax_scale, spec, 15.0)
        qs, ks, vs, dos = (t[r].unsqueeze(0) for t, r in ((q, rq), (k, rk), (v, rk), (dout, rq)))
        kw = dict(scale=one.softmax_scale, left=left, right=right, softcap=15.0, sink=sink)
        ref, ref_lse = attention_oracle(qs, ks, vs, **kw)
        low, low_lse = attention_oracle(qs, ks, vs, compute_dtype=torch.bfloat16, **kw)
        reports += [
            ErrorReport(f"out[{i}]", max_abs(out[rq], ref[0]), max_abs(low[0], ref[0])),
            lse_report(lse[:, rq], ref_lse[0], low_lse[0]),
        ]
        g_ref = _reference_grads(one, qs, ks, vs, dos, sink, None, torch.float64)
        g_low = _reference_grads(one, qs, ks, vs, dos, sink, None, torch.bfloat16)
        for name, got, r, lo in zip(("dq", "dk", "dv"), (dq[rq], dk[rk], dv[rk]), g_ref, g_low):
            reports.append(ErrorReport(f"{name}[{i}]", max_abs(got, r[0]), max_abs(lo[0], r[0])))
        dsink_ref += g_ref[3]
        dsink_low += g_low[3].float()
    reports.append(ErrorReport("dsink", max_abs(dsink, dsink_ref), max_abs(dsink_low, dsink_ref)))
    assert_reports(reports, [("out", out), ("dq", dq), ("dk", dk), ("dv", dv), ("dsink", dsink)])

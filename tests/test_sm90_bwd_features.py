"""GPU (Hopper): the sm90 backward with soft-capping, learnable sinks and negative window bounds, against float64
autograd with FlashAttention's rule.

The front end takes neither softcap= nor learnable_sink= yet, and cute_flash.reference neither: the backward runs
through the backend (`arch/sm90/backward.run_backward` / `run_backward_varlen`, as tests/test_sm90_bwd.py's kernel
tests do), fed out / lse from a float64 forward written here from FlashAttention-4's `attention_ref` (capped score =
softcap * tanh(score * scale / softcap); the sink a natural-log logit per query head in the softmax denominator,
attending to no value; lse includes it). Every loss also uses lse (dlse random), so D - dlse and dsink =
sum P_sink * (dlse - D) are exercised. Rows that see no key must get dq = 0 exactly, keys no query sees dk = dv = 0.

Run on an H100/H200 (one pytest worker per group, so that each compiles only its kernels; about 2-3 minutes):
  python3 -m pytest -q -n 8 --dist loadgroup tests/test_sm90_bwd_features.py
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

pytestmark = pytest.mark.sm90

INF = math.inf


def _dims(d):
    return d if isinstance(d, tuple) else (d, d)


def _dims_id(d) -> str:
    d, dv = _dims(d)
    return f"d{d}" if d == dv else f"d{d}x{dv}"


def _visible(sq: int, sk: int, window, device) -> torch.Tensor:
    """(sq, sk): query i sees key j iff i + off - left <= j <= i + off + right (off = sk - sq; None: unbounded)."""
    left, right = (INF if w is None else w for w in window)
    i = torch.arange(sq, device=device).view(-1, 1).double()
    j = torch.arange(sk, device=device).view(1, -1).double()
    off = sk - sq
    return (j >= i + off - left) & (j <= i + off + right)


def _attention_ref(q, k, v, sink, *, window, softcap: float, scale: float, compute_dtype):
    """One sequence batch (b, s, h, d) in compute_dtype: (out (b, sq, h, dv), lse (b, h, sq), natural log; rows that
    see no key and have no sink: out 0, lse -inf), differentiable in q, k, v and sink."""
    b, sq, h, _ = q.shape
    sk, h_kv = k.shape[1], k.shape[2]
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    k, v = (t.repeat_interleave(h // h_kv, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    visible = _visible(sq, sk, window, q.device)
    s = s.masked_fill(~visible, -INF)
    empty = ~visible.any(dim=-1)  # (sq,)
    if sink is not None:
        column = sink.to(compute_dtype).view(1, h, 1, 1).expand(b, h, sq, 1)
        s = torch.cat([s, column], dim=-1)
        empty = torch.zeros_like(empty)
    # Rows without any term: a constant row in place of all -inf (finite gradients), their results set after.
    s = torch.where(empty.view(sq, 1), 0.0, s)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))[..., :sk].masked_fill(~visible, 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, torch.where(empty.view(1, 1, sq), -INF, lse)


def _packed_ref(q, k, v, sink, cu_q, cu_k, **kw):
    """The packed form: q (total_q, h, d), ... ; out (total_q, h, dv), lse (h, total_q)."""
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        sl_q, sl_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, lse = _attention_ref(q[None, sl_q], k[None, sl_k], v[None, sl_k], sink, **kw)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


def _reference_grads(ref, leaves, sink, dout, dlse, compute_dtype, **kw):
    """(out, lse, dq, dk, dv, dsink) of `ref` in compute_dtype; the loss's gradients dout and dlse (rows whose lse is
    -inf take none)."""
    xs = [t.detach().to(compute_dtype).requires_grad_(True) for t in leaves]
    s = None if sink is None else sink.detach().to(compute_dtype).requires_grad_(True)
    out, lse = ref(*xs, s, compute_dtype=compute_dtype, **kw)
    inputs = xs + ([] if s is None else [s])
    got = torch.autograd.grad((out, lse), inputs, (dout.to(compute_dtype), dlse.to(compute_dtype)), allow_unused=True)
    got = [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, got)]
    return out, lse, (*got, None) if s is None else tuple(got)


def _check(got, ref_grads, low_grads):
    """FlashAttention's rule for each gradient (and dsink), everything finite."""
    from cute_flash.testing import ErrorReport

    bad = []
    for name, g, r, lo in zip(("dq", "dk", "dv", "dsink"), got, ref_grads, low_grads):
        if g is None:
            continue
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
        err = lambda a: (a.double() - r.double()).abs().max().item()  # noqa: E731
        rep = ErrorReport(name, err(g), err(lo))
        if not rep.ok:
            bad.append(str(rep))
    assert not bad, "; ".join(bad)


def _problem(q, k, v, window, softcap: float, sink, seqs=None):
    from cute_flash.spec import normalize_mask
    from cute_flash.validation import problem_of

    causal = window == (None, 0)
    mask = normalize_mask(causal, (None, None) if causal else window)
    problem = problem_of(q, k, v, mask, q.shape[-1] ** -0.5, seqs)
    spec = dataclasses.replace(problem.spec, softcap=softcap > 0, sink=sink is not None)
    return dataclasses.replace(problem, spec=spec, softcap=float(softcap))


def _inputs(dtype, d, sq, sk, h, h_kv, seed, batch=1, q_scale=1.0, packed=False):
    """q, k, v, dout, dlse, sink (N(0, 1); q times q_scale, so that the cap bends the scores); packed: the batch's
    rows flattened."""
    d, dv = _dims(d)
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (sq,) if packed else (batch, sq)
    kshape = (sk,) if packed else (batch, sk)
    q = (torch.randn(*shape, h, d, generator=g, device="cuda") * q_scale).to(dtype)
    k = torch.randn(*kshape, h_kv, d, generator=g, device="cuda").to(dtype)
    v = torch.randn(*kshape, h_kv, dv, generator=g, device="cuda").to(dtype)
    dout = torch.randn(*shape, h, dv, generator=g, device="cuda").to(dtype)
    dlse = torch.randn((h, sq) if packed else (batch, h, sq), generator=g, device="cuda")
    sink = torch.randn(h, generator=g, device="cuda") * 2.0
    return q, k, v, dout, dlse, sink


def _run_dense(q, k, v, dout, dlse, sink, window, softcap, deterministic=False):
    """The sm90 backward kernels on out / lse of the float64 forward; (grads, float64 grads, low-precision grads)."""
    from cute_flash.arch.base import BwdTensors, Grads
    from cute_flash.arch.sm90.backward import run_backward

    kw = dict(window=window, softcap=softcap, scale=q.shape[-1] ** -0.5)
    out, lse, ref = _reference_grads(_attention_ref, (q, k, v), sink, dout, dlse, torch.float64, **kw)
    *_, low = _reference_grads(_attention_ref, (q, k, v), sink, dout, dlse, q.dtype, **kw)
    problem = _problem(q, k, v, window, softcap, sink)
    grads = Grads(*(torch.full_like(t, float("nan")) for t in (q, k, v)), None if sink is None else sink * float("nan"))
    t = BwdTensors(dout, q, k, v, out.to(q.dtype), lse.float(), dlse, sink)
    run_backward(t, grads, problem, deterministic=deterministic)
    return grads, ref, low


# (head dim, (sq, sk), (h, h_kv), window, softcap, sink) per head dim: causal with both features under GQA; a left
# bound below 0 (keys at least 7 past the diagonal; the first keys nobody sees); a right bound below 0 with seqlen_q >
# seqlen_k (the first 63 rows see no key, the last 20 keys nobody sees) under MQA; a sink alone (plain kernels).
FEATURE_CASES = [
    ((113, 203), (4, 2), (None, 0), 3.0, True),
    ((239, 300), (4, 4), (-7, 50), 5.0, False),
    ((300, 257), (4, 1), (100, -20), 3.0, True),
    ((1023, 1024), (4, 1), (None, None), 0.0, True),
]
HEAD_DIMS = (64, 128, 256, (192, 128))


@pytest.mark.parametrize(
    "d, lens, heads, window, softcap, sink",
    [
        pytest.param(d, *c, id=f"{_dims_id(d)}-{c[0][0]}x{c[0][1]}-h{c[1][0]}_{c[1][1]}-w{c[2]}-cap{c[3]}-sink{c[4]}",
                     marks=pytest.mark.xdist_group(f"features-{_dims_id(d)}"))
        for d in HEAD_DIMS
        for c in FEATURE_CASES
    ],
)  # fmt: skip
def test_sm90_backward_softcap_sink_windows(d, lens, heads, window, softcap, sink):
    from cute_flash.testing import stable_seed

    (sq, sk), (h, h_kv) = lens, heads
    q, k, v, dout, dlse, s = _inputs(torch.bfloat16, d, sq, sk, h, h_kv, stable_seed(d, lens, window), q_scale=2.0)
    grads, ref, low = _run_dense(q, k, v, dout, dlse, s if sink else None, window, softcap)
    _check(grads, ref, low)
    visible = _visible(sq, sk, window, q.device)
    assert torch.count_nonzero(grads.dq[:, ~visible.any(dim=1)]) == 0, "rows that see no key: dq 0"
    unseen = ~visible.any(dim=0)
    assert torch.count_nonzero(grads.dk[:, unseen]) == 0 and torch.count_nonzero(grads.dv[:, unseen]) == 0


@pytest.mark.xdist_group("features-padded")
def test_sm90_backward_softcap_fp16_and_padded_head_dims():
    """fp16, and head dims whose softcap builds have no tile of their own (d96 and d72 run the d128 kernels,
    tile_config._SOFTCAP_PADDED; (128, 64) the d128 ones too): arch/padded_head_dims.py carries the cap, the sink and
    dsink through."""
    from cute_flash.testing import stable_seed

    for dtype, d in ((torch.float16, 128), (torch.bfloat16, 96), (torch.bfloat16, 72), (torch.bfloat16, (128, 64))):
        q, k, v, dout, dlse, s = _inputs(dtype, d, 300, 300, 4, 2, stable_seed(d, "pad"), q_scale=2.0)
        grads, ref, low = _run_dense(q, k, v, dout, dlse, s, (None, 0), 4.0)
        _check(grads, ref, low)


@pytest.mark.xdist_group("features-det")
def test_sm90_backward_softcap_deterministic():
    """deterministic=True with both features: bitwise-equal dq, dk, dv, dsink over repeats, within the rule."""
    from cute_flash.testing import stable_seed

    q, k, v, dout, dlse, s = _inputs(torch.bfloat16, 128, 517, 300, 4, 2, stable_seed("det-softcap"), q_scale=2.0)
    runs = [_run_dense(q, k, v, dout, dlse, s, (None, 0), 3.0, deterministic=True) for _ in range(3)]
    for grads, _, _ in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0][0], grads))
    _check(*runs[0])


@pytest.mark.xdist_group("features-det")
@pytest.mark.parametrize(
    "sq, sk, window",
    [
        (1, 1, (None, -3)),
        (300, 100, (None, -3)),
        (100, 300, (None, -70)),
        (200, 333, (-5, None)),
        (257, 129, (-40, 30)),
    ],
)
def test_sm90_backward_negative_windows_deterministic(sq, sk, window):
    """Negative bounds in deterministic builds: a key tile whose first reaching row lies in the last query tile's
    padding must not visit it (block_info.q_block_range; it would wait for a turn that never comes), and the
    gradients stay bitwise reproducible and within the rule; no softcap, no sink (the plain kernels)."""
    from cute_flash.testing import stable_seed

    q, k, v, dout, dlse, _ = _inputs(torch.bfloat16, 128, sq, sk, 4, 4, stable_seed(sq, sk, window, "neg"), batch=2)
    runs = [_run_dense(q, k, v, dout, dlse, None, window, 0.0, deterministic=True) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0][:3], runs[1][0][:3]))
    _check(*runs[0])
    visible = _visible(sq, sk, window, q.device)
    assert torch.count_nonzero(runs[0][0].dq[:, ~visible.any(dim=1)]) == 0


def _run_packed(d, lens_q, lens_k, heads, window, softcap, seed, deterministic=False, dtype=torch.bfloat16):
    from cute_flash.arch.base import BwdTensors, Grads
    from cute_flash.arch.sm90.backward import run_backward_varlen
    from cute_flash.validation import PackedSeqs

    h, h_kv = heads
    cu_q = [0] + list(torch.tensor(lens_q).cumsum(0).tolist())
    cu_k = [0] + list(torch.tensor(lens_k).cumsum(0).tolist())
    q, k, v, dout, dlse, sink = _inputs(dtype, d, cu_q[-1], cu_k[-1], h, h_kv, seed, q_scale=2.0, packed=True)
    kw = dict(cu_q=cu_q, cu_k=cu_k, window=window, softcap=softcap, scale=q.shape[-1] ** -0.5)
    out, lse, ref = _reference_grads(_packed_ref, (q, k, v), sink, dout, dlse, torch.float64, **kw)
    *_, low = _reference_grads(_packed_ref, (q, k, v), sink, dout, dlse, q.dtype, **kw)
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")  # noqa: E731
    seqs = PackedSeqs(as_i32(cu_q), as_i32(cu_k), None, max(lens_q), max(lens_k))
    problem = _problem(q, k, v, window, softcap, sink, seqs)
    runs = []
    for _ in range(2 if deterministic else 1):
        grads = Grads(*(torch.full_like(t, float("nan")) for t in (q, k, v)), sink * float("nan"))
        t = BwdTensors(dout, q, k, v, out.to(dtype), lse.float(), dlse, sink)
        run_backward_varlen(t, grads, seqs, problem, deterministic=deterministic)
        runs.append(grads)
    if deterministic:
        assert all(torch.equal(a, b) for a, b in zip(*runs))
    _check(runs[0], ref, low)


# Sequences with no queries or no keys, one-token ones, lengths off the tiles; the last one long enough for d128's
# 80-row tile (max_seqlen_q from 4096).
LENS_Q = [0, 1, 64, 81, 129, 300, 700, 5, 3]
LENS_K = [5, 1, 64, 128, 129, 256, 385, 0, 300]


@pytest.mark.xdist_group("features-packed-d128")
@pytest.mark.parametrize("window", [(None, 0), (30, -10), (None, None)], ids=["causal", "local-30_-10", "full"])
def test_sm90_packed_backward_softcap_sink(window):
    """Packed sequences with both features under GQA (d128), causal, a negative right bound and no mask (the last
    with a 4133-row sequence: the 80-row tile)."""
    lens_q, lens_k = LENS_Q, LENS_K
    if window == (None, None):
        lens_q, lens_k = LENS_Q + [4133], LENS_K + [4000]
    _run_packed(128, lens_q, lens_k, (4, 2), window, 3.0, seed=11)


@pytest.mark.xdist_group("features-packed-det")
def test_sm90_packed_backward_softcap_sink_deterministic():
    """The packed deterministic build with both features (d128, GQA, a negative left bound): bitwise-equal reruns."""
    _run_packed(128, LENS_Q, LENS_K, (4, 2), (-3, 60), 3.0, seed=12, deterministic=True)


@pytest.mark.xdist_group("features-packed-d64")
def test_sm90_packed_backward_softcap_d64_d256():
    """The packed d64 (128-row tiles, shuffled statistics) and d256 (queries on rows) builds with both features."""
    _run_packed(64, LENS_Q, LENS_K, (4, 1), (None, 0), 3.0, seed=13)
    _run_packed(256, LENS_Q, LENS_K, (4, 2), (64, 0), 3.0, seed=14)

"""GPU (Blackwell, compute capability 10.x): the sm100 backward (dq, dk, dv, dsink) against float64 autograd with
FlashAttention's rule (max |grad - ref| <= 2 * max |torch in the input dtype - ref| + 1e-5).

No Blackwell GPU has run these yet (docs/status.md): the kernel is verified by cross-compiling
(tests/test_compile_sm100_bwd.py). On a B200:  pytest -m sm100 -n 4 --dist loadgroup tests/test_sm100_bwd.py

Two entry points over one matrix, as the sm90 suite: the backward kernels alone (`run_backward`, fed out / lse from
the reference forward, so a failure is told apart from one of the forward) and cute_flash.attention(...).backward().
Head dims 64 and 128 have kernels of their own; 32, 80 and 96 run them on zero-padded operands.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytestmark = pytest.mark.sm100

HEAD_DIMS = (64, 128, 32, 96)
SEQLENS = ((1, 1), (113, 203), (128, 128), (239, 1), (1023, 1024), (300, 100))
MASKS = {  # name -> (causal, window_size)
    "full": (False, (None, None)),
    "causal": (True, (None, None)),
    "window100_30": (False, (100, 30)),
    "window_neg": (False, (-20, 60)),  # keys at least 20 after the diagonal, at most 60
    "window_before": (False, (90, -10)),  # keys 10 to 90 before the diagonal
}
HEADS = ((4, 4), (8, 2), (4, 1))
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _case(dt, d, sq, sk, mask, h, h_kv):
    return pytest.param(
        dt, d, sq, sk, mask, h, h_kv, id=f"{dt}-d{d}-{sq}x{sk}-{mask}-h{h}_{h_kv}",
        marks=pytest.mark.xdist_group(f"{dt}-d{d}"),
    )  # fmt: skip


CASES = [
    _case(dt, d, sq, sk, m, h, hk)
    for dt, d, (sq, sk), m, (h, hk) in itertools.product(DTYPES, HEAD_DIMS, SEQLENS, MASKS, HEADS)
]


def _inputs(dt, d, sq, sk, h, h_kv, *seed, batch=None):
    from cute_flash.testing import backward_inputs, stable_seed

    return backward_inputs(DTYPES[dt], d, sq, sk, h, h_kv, stable_seed(dt, d, sq, sk, h, h_kv, *seed), batch)


@pytest.mark.parametrize("dt, d, sq, sk, mask, h, h_kv", CASES)
def test_sm100_backward_kernels(dt, d, sq, sk, mask, h, h_kv):
    from cute_flash.arch.sm100.backward import run_backward
    from cute_flash.testing import backward_kernel_grads, check_backward

    causal, window = MASKS[mask]
    q, k, v, dout = _inputs(dt, d, sq, sk, h, h_kv, mask)
    grads = backward_kernel_grads(run_backward, q, k, v, dout, causal, window)
    check_backward(q, k, v, dout, grads, causal=causal, window_size=window)


@pytest.mark.parametrize("dt, d, sq, sk, mask, h, h_kv", CASES[::3])
def test_sm100_attention_backward(dt, d, sq, sk, mask, h, h_kv):
    import cute_flash
    from cute_flash.testing import check_backward

    causal, window = MASKS[mask]
    q, k, v, dout = _inputs(dt, d, sq, sk, h, h_kv, mask)
    assert cute_flash.explain(q, k, v, causal=causal, window_size=window).backward_family == "sm100"
    out = cute_flash.attention(q, k, v, causal=causal, window_size=window)
    out.backward(dout)
    check_backward(q, k, v, dout, (q.grad, k.grad, v.grad), causal=causal, window_size=window)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm100_backward_softcap_and_sinks(d, causal):
    """Soft-capping (the tanh's derivative in dS) and learnable sinks (dsink from lse and D), with a loss on lse."""
    import cute_flash
    from cute_flash.testing import check_backward

    q, k, v, dout = _inputs("bf16", d, 777, 901, 8, 2, causal)
    sink = torch.randn(8, device=q.device, dtype=torch.float32).requires_grad_()
    for softcap, learnable_sink in ((30.0, None), (0.0, sink), (5.0, sink)):
        for t in (q, k, v, sink):
            t.grad = None
        out, lse = cute_flash.attention(
            q, k, v, causal=causal, softcap=softcap, learnable_sink=learnable_sink, return_lse=True
        )
        dlse = torch.randn_like(lse)
        torch.autograd.backward((out, lse), (dout, dlse))
        kw = dict(causal=causal, softcap=softcap, learnable_sink=learnable_sink)
        dsink = sink.grad if learnable_sink is not None else None
        check_backward(q, k, v, dout, (q.grad, k.grad, v.grad), dlse=dlse, dsink=dsink, **kw)


@pytest.mark.parametrize("d", [64, 128])
def test_sm100_backward_fully_masked_rows_and_unseen_keys(d):
    """Rows that see no key get dq = 0 exactly; key tiles no query sees get dk = dv = 0 (written, not left over)."""
    import cute_flash
    from cute_flash.testing import check_backward

    for sq, sk, causal, window, empty_rows in ((300, 100, True, (None, None), 200), (256, 200, False, (8, 0), 56)):
        q, k, v, dout = _inputs("bf16", d, sq, sk, 4, 2, causal, window)
        out = cute_flash.attention(q, k, v, causal=causal, window_size=window)
        out.backward(dout)
        check_backward(q, k, v, dout, (q.grad, k.grad, v.grad), causal=causal, window_size=window)
        assert torch.count_nonzero(q.grad[:, :empty_rows]) == 0
    q, k, v, dout = _inputs("bf16", d, 128, 512, 2, 2, "tail")
    out = cute_flash.attention(q, k, v, window_size=(4, 0))
    out.backward(dout)
    check_backward(q, k, v, dout, (q.grad, k.grad, v.grad), window_size=(4, 0))
    assert torch.count_nonzero(k.grad[:, :380]) == 0 and torch.count_nonzero(v.grad[:, :380]) == 0


@pytest.mark.parametrize("seqlen, causal, h_kv", [(8192, False, 2), (8192, True, 1), (4099, True, 2)])
def test_sm100_backward_long(seqlen, causal, h_kv):
    from cute_flash.arch.sm100.backward import run_backward
    from cute_flash.testing import backward_kernel_grads, check_backward

    q, k, v, dout = _inputs("bf16", 128, seqlen, seqlen, 4, h_kv, causal, batch=1)
    grads = backward_kernel_grads(run_backward, q, k, v, dout, causal, (None, None))
    check_backward(q, k, v, dout, grads, causal=causal)


def test_sm100_backward_strided_and_expanded_inputs():
    """Heads-major storage (transposed (b, h, s, d) views) and an expanded dO (out.sum().backward()) give the
    gradients of contiguous copies."""
    import cute_flash
    from cute_flash.testing import check_backward

    q, k, v, _ = _inputs("bf16", 128, 333, 444, 4, 2, "strided")
    qs, ks, vs = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v))
    out = cute_flash.attention(qs, ks, vs, causal=True)
    out.sum().backward()
    dout = torch.ones_like(out)
    check_backward(qs, ks, vs, dout, (qs.grad, ks.grad, vs.grad), causal=True)

"""GPU (Blackwell, compute capability 10.x): packed sequences on the sm100 kernels (`attention_varlen`: the sm100
packed forward and backward) against the per-sequence float64 reference with FlashAttention's rule
(cute_flash.testing.check_varlen: out, lse, dq, dk, dv; rows that see no key give out 0 and dq 0 exactly).

Never run: no Blackwell GPU has been available (docs/status.md). On a B200:
  pytest -m sm100 -n 4 --dist loadgroup tests/test_sm100_varlen.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.sm100

MASKS = {"full": (False, (None, None)), "causal": (True, (None, None)), "window": (False, (60, -5))}
LENGTHS = {  # per sequence (queries, keys): lengths 0 and 1, odd, query lengths other than key lengths
    "mixed": ([4, 0, 1, 17, 128, 333, 64, 1, 77], [0, 0, 5, 17, 128, 333, 64, 1, 200]),
    "long": ([3, 1, 1537, 5, 0, 130], [3, 7, 1537, 2, 11, 65]),
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _packed(dt, d, lens_q, lens_k, h, h_kv, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def make(rows, heads):
        return torch.randn(rows, heads, d, generator=g, device="cuda").to(DTYPES[dt]).requires_grad_(True)

    return make(sum(lens_q), h), make(sum(lens_k), h_kv), make(sum(lens_k), h_kv), _cu(lens_q), _cu(lens_k)


CASES = [
    pytest.param(
        dt,
        d,
        m,
        heads,
        lengths,
        id=f"{dt}-d{d}-{m}-h{heads[0]}_{heads[1]}-{lengths}",
        marks=pytest.mark.xdist_group(f"sm100-varlen-{dt}-d{d}"),
    )  # fmt: skip
    for dt, d in (("bf16", 128), ("fp16", 64), ("bf16", 96))
    for m in MASKS
    for heads in ((4, 4), (4, 1))
    for lengths in LENGTHS
]


@pytest.mark.parametrize("dt, d, mask, heads, lengths", CASES)
def test_sm100_varlen_forward_backward(dt, d, mask, heads, lengths):
    import cute_flash
    from cute_flash.testing import check_varlen, stable_seed

    causal, window = MASKS[mask]
    lens_q, lens_k = LENGTHS[lengths]
    q, k, v, cq, ck = _packed(dt, d, lens_q, lens_k, *heads, stable_seed(dt, d, mask, heads, lengths))
    mq, mk = max(lens_q), max(lens_k)
    e = cute_flash.explain_varlen(q, k, v, cq, ck, mq, mk, causal=causal, window_size=window)
    assert e.backward.family == "sm100" and e.forward.family == ("sm100" if d in (64, 96, 128) else "sm80"), e
    out, lse = cute_flash.attention_varlen(q, k, v, cq, ck, mq, mk, causal=causal, window_size=window, return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_varlen(q, k, v, cq, ck, mq, mk, out, lse, dout, grads, causal=causal, window_size=window)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_sm100_varlen_seqused_k_softcap_sinks_deterministic(heads):
    """seqused_k (keys past it: zero gradients), soft-capping and sinks (a loss on lse too), and the deterministic
    backward (bitwise-equal repeats)."""
    import cute_flash
    from cute_flash.testing import check_varlen

    lens_q, lens_k = [5, 0, 40, 200, 1], [9, 4, 40, 300, 3]
    used = torch.tensor([9, 0, 17, 250, 3], dtype=torch.int32, device="cuda")
    q, k, v, cq, ck = _packed("bf16", 128, lens_q, lens_k, *heads, seed=7)
    sink = torch.randn(heads[0], device="cuda", dtype=torch.float32).requires_grad_()
    kw = dict(causal=True, seqused_k=used, softcap=20.0, learnable_sink=sink)
    runs = []
    for _ in range(2):
        out, lse = cute_flash.attention_varlen(q, k, v, cq, ck, 256, 512, return_lse=True, deterministic=True, **kw)
        dout, dlse = torch.ones_like(out), torch.full_like(lse, 0.5)
        runs.append(torch.autograd.grad((out, lse), (q, k, v, sink), (dout, dlse)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    grads, dsink = runs[0][:3], runs[0][3]
    check_varlen(q, k, v, cq, ck, 256, 512, out, lse, dout, grads, dlse, dsink, **kw)
    for b in range(len(lens_k)):
        k0, k1 = ck[b].item() + used[b].item(), ck[b + 1].item()
        assert torch.all(grads[1][k0:k1] == 0) and torch.all(grads[2][k0:k1] == 0)

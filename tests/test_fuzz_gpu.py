"""GPU: randomised forward calls on Hopper's default paths against the float64 reference, as the acceptance run
probes them: shapes from decoding (one row, a few rows, packed GQA, split keys) to a few hundred rows, odd lengths,
GQA / MQA, no mask / causal / windows, fp16 / bf16, and inputs as users hand them over (seq- or head-major, slices of
a wider buffer, a batch expanded from one entry, an odd storage offset). Every call twice: the warm no-grad call
(the C++ call path where it serves) must equal the first bit for bit, and out / lse follow FlashAttention's rule.

Run: python -m pytest -q tests/test_fuzz_gpu.py (FUZZ_CASES=N for more; the cases come from a fixed seed)
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import cute_flash
from cute_flash.testing import check_forward, random_qkv

pytestmark = [pytest.mark.sm90]

_HEADS = [(1, 1), (4, 4), (8, 2), (16, 4), (32, 8), (6, 1)]
_DIMS = [64, 128]  # (the other head dims: tests/test_edge_cases_gpu.py, tests/test_sm90_fwd.py)


def _case(i: int) -> dict:
    r = random.Random(1000 + i)
    sq = r.choice([1, 1, 1, 2, 3, 7, 16, 64, 100, 128, 129, 300])
    sk = r.choice([1, 5, 64, 127, 128, 129, 700, 1000, 2049, 4097, 9000])
    h, hkv = r.choice(_HEADS)
    mask = r.choice(["none", "causal", "window"])
    window = (None, None)
    if mask == "window":
        window = (r.choice([0, 1, 31, 200, 3000]), r.choice([None, 0, 5]))
    return dict(
        b=r.choice([1, 1, 2, 3, 5]),
        sq=sq,
        sk=sk,
        h=h,
        hkv=hkv,
        d=r.choice(_DIMS),
        dtype=r.choice([torch.bfloat16, torch.float16]),
        causal=mask == "causal",
        window=window,
        scale=r.choice([None, None, 0.05, 1.0]),
        layout=r.choice(["bshd", "bhsd", "slice", "expanded", "offset"]),
        seed=i,
    )


def _layout(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "bhsd":  # head-major memory (transformers' KV cache)
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if how == "slice":  # the first d columns of a wider row (a fused qkv buffer)
        wide = torch.randn(*t.shape[:-1], t.shape[-1] + 64, device=t.device, dtype=t.dtype)
        wide[..., : t.shape[-1]] = t
        return wide[..., : t.shape[-1]]
    if how == "expanded":  # one batch entry seen b times (stride 0)
        return t[:1].expand_as(t)
    if how == "offset":  # 2 bytes past a 16-byte boundary
        flat = torch.empty(t.numel() + 1, device=t.device, dtype=t.dtype)
        return flat[1:].view_as(t).copy_(t)
    return t


CASES = int(os.environ.get("FUZZ_CASES", "120"))


@pytest.mark.parametrize("i", range(CASES))
def test_random_forward_calls(i):
    c = _case(i)
    q, k, v = random_qkv(c["b"], c["sq"], c["sk"], c["h"], c["hkv"], c["d"], dtype=c["dtype"], seed=c["seed"])
    q, k, v = (_layout(t, c["layout"]) for t in (q, k, v))
    kw = dict(causal=c["causal"], window_size=c["window"], softmax_scale=c["scale"])
    with torch.no_grad():
        first = cute_flash.attention(q, k, v, **kw)
        second = cute_flash.attention(q, k, v, **kw)
        out, lse = cute_flash.attention(q, k, v, return_lse=True, **kw)
    assert torch.equal(first, second), c
    assert torch.equal(first, out), c
    check_forward(q, k, v, out, lse, **kw)

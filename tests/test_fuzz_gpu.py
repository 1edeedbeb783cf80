"""GPU: randomised calls on Hopper's default paths against the float64 reference, as the acceptance run probes them.

- Forward (`test_random_forward_calls`): shapes from decoding (one row, a few rows, packed GQA, split keys) to a few
  hundred rows, odd lengths, GQA / MQA, no mask / causal / windows, fp16 / bf16, and inputs as users hand them over
  (seq- or head-major, slices of a wider buffer, a batch expanded from one entry, an odd storage offset). Every call
  twice: the warm no-grad call (the C++ call path where it serves) must equal the first bit for bit, and out / lse
  follow FlashAttention's rule.
- Training (`test_random_training_calls`): the same kinds of inputs through autograd at the sm90 backward's own head
  dims (d192 and (192, 128) among them) and ones it runs padded (d72, d160, (128, 64), (160, 128)), losses of out
  alone or of out and lse, output gradients that are strided or expanded, deterministic backwards (run twice, bitwise
  equal); out, lse and dq / dk / dv by the rule.
- Packed sequences (`test_random_varlen_calls`): length mixes with empty sequences, single tokens, partial tiles and
  the long-query tile (>= 4096 rows), keys that differ from queries, seqused_k, GQA, masks, q / k / v as slices of
  a fused buffer or off a 16-byte boundary; out, lse and the three gradients against the per-sequence reference.

Run: python -m pytest -q tests/test_fuzz_gpu.py -n 8 (FUZZ_CASES / FUZZ_TRAIN_CASES / FUZZ_VARLEN_CASES=N for more or
fewer; the cases come from fixed seeds)
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import cute_flash
from cute_flash.testing import check_backward, check_forward, check_varlen, random_qkv

pytestmark = [pytest.mark.sm90]


@pytest.fixture(autouse=True)
def _router_choice(_force_family, monkeypatch):
    """The router's own choice (what users get: e.g. d72 runs the sm80 forward and the sm90 backward), not the family
    the sm90 marker forces."""
    monkeypatch.delenv("CUTE_FLASH_ARCH", raising=False)


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


# Training: (head_dim, head_dim_v) pairs of the sm90 backward's own tiles ((192, 128) and d192 among them), and ones
# it runs padded to a wider tile (d72 and d160 after the sm80 forward, (128, 64), (160, 128)); d128 twice (the common
# case).
_TRAIN_DIMS = [(64, 64), (96, 96), (128, 128), (128, 128), (192, 128), (256, 256), (192, 192), (72, 72), (160, 160),
               (128, 64), (160, 128)]  # fmt: skip
TRAIN_CASES = int(os.environ.get("FUZZ_TRAIN_CASES", "100"))
_REFERENCE_ELEMENTS = 1 << 26  # b * h * sq * sk of the float64 reference's scores (~0.5 GiB), per case


def _train_case(i: int) -> dict:
    r = random.Random(5000 + i)
    c = _case(10_000 + i)  # mask, window, scale, dtype, heads and layout drawn as the forward's
    del c["d"]
    c.update(
        sq=r.choice([1, 2, 17, 64, 113, 128, 255, 511, 1000, 2049]),
        sk=r.choice([1, 7, 64, 128, 129, 383, 1000, 2049]),
        dims=r.choice(_TRAIN_DIMS),
        deterministic=r.random() < 0.2,
        loss=r.choice(["out", "out", "out_and_lse"]),
        dout=r.choice(["randn", "randn", "expanded", "head_major"]),
    )
    while c["b"] * c["h"] * c["sq"] * c["sk"] > _REFERENCE_ELEMENTS:
        c["b"], c["h"], c["hkv"] = (c["b"] // 2, c["h"], c["hkv"]) if c["b"] > 1 else (1, c["h"] // 2, c["hkv"] // 2)
    c["h"], c["hkv"] = max(c["h"], 1), max(c["hkv"], 1)
    return c


def _leaf(t: torch.Tensor, how: str) -> torch.Tensor:
    """`t` in layout `how` as a leaf that requires grad (its gradient then has that tensor's shape)."""
    return _layout(t.detach(), how).requires_grad_(True)


def _output_grad(out: torch.Tensor, how: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device=out.device).manual_seed(seed)
    if how == "expanded":  # what out.sum().backward() hands the backward: a stride-0 tensor
        return torch.randn((), generator=g, device=out.device).to(out.dtype).expand_as(out)
    dout = torch.randn(out.shape, generator=g, device=out.device).to(out.dtype)
    return dout.transpose(1, 2).contiguous().transpose(1, 2) if how == "head_major" else dout


@pytest.mark.parametrize("i", range(TRAIN_CASES))
def test_random_training_calls(i):
    c = _train_case(i)
    d, dv = c["dims"]
    base = random_qkv(c["b"], c["sq"], c["sk"], c["h"], c["hkv"], d, dv, dtype=c["dtype"], seed=c["seed"])
    q, k, v = (_leaf(t, c["layout"]) for t in base)
    kw = dict(causal=c["causal"], window_size=c["window"], softmax_scale=c["scale"])

    def step():
        out, lse = cute_flash.attention(q, k, v, return_lse=True, deterministic=c["deterministic"], **kw)
        dout = _output_grad(out, c["dout"], c["seed"])
        dlse = None
        if c["loss"] == "out_and_lse":
            g = torch.Generator(device=lse.device).manual_seed(c["seed"] + 7)
            dlse = torch.randn(lse.shape, generator=g, device=lse.device)
        outputs, grads_in = ((out, lse), (dout, dlse)) if dlse is not None else ((out,), (dout,))
        return out, lse, dout, dlse, torch.autograd.grad(outputs, (q, k, v), grads_in)

    out, lse, dout, dlse, grads = step()
    assert all(g.shape == t.shape for g, t in zip(grads, (q, k, v))), c
    if c["deterministic"]:
        again = step()[4]
        assert all(torch.equal(a, b) for a, b in zip(grads, again)), c
    check_forward(q, k, v, out, lse.detach(), **kw)
    check_backward(q, k, v, dout, grads, dlse, **kw)


# Packed sequences: lengths that hit empty sequences, one token, partial 64 / 80 / 128-row tiles, and >= 4096 rows
# (the long-query backward tile); at most 4 long ones, so that the per-sequence reference stays small.
_VARLEN_LENGTHS = [0, 1, 2, 7, 63, 64, 80, 81, 128, 129, 300, 777, 1500]
_VARLEN_LONG = [4096, 4133, 5000]
_VARLEN_DIMS = _TRAIN_DIMS
VARLEN_CASES = int(os.environ.get("FUZZ_VARLEN_CASES", "60"))


def _varlen_case(i: int) -> dict:
    r = random.Random(9000 + i)
    n = r.choice([1, 2, 3, 5, 9, 17, 40])
    lens_q = [r.choice(_VARLEN_LENGTHS) for _ in range(n)]
    long = r.random() < 0.25
    if long:
        lens_q[r.randrange(n)] = r.choice(_VARLEN_LONG)
    self_attention = r.random() < 0.6
    lens_k = list(lens_q) if self_attention else [r.choice(_VARLEN_LENGTHS) for _ in range(n)]
    # A long sequence's float64 reference (scores, probabilities and their gradients) takes ~1 GiB per head at 5000
    # rows: at most 4 heads there, so that 12 workers fit one 80 GB GPU.
    h, hkv = r.choice([(4, 4), (4, 1)] if long else [(4, 4), (8, 2), (6, 1), (16, 4)])
    mask = r.choice(["none", "causal", "window"])
    return dict(
        lens_q=lens_q,
        lens_k=lens_k,
        seqused=r.random() < 0.25,
        h=h,
        hkv=hkv,
        dims=r.choice(_VARLEN_DIMS),
        dtype=r.choice([torch.bfloat16, torch.float16]),
        causal=mask == "causal",
        window=(r.choice([0, 17, 300]), r.choice([None, 0, 9])) if mask == "window" else (None, None),
        layout=r.choice(["plain", "plain", "fused", "offset"]),
        slack=r.choice([0, 0, 3]),  # max_seqlen larger than every sequence
        seed=i,
    )


def _packed_leaves(c: dict):
    """q, k, v (total, h, d) in the case's layout, leaves that require grad: "fused" slices one (total, h, d + 64)
    buffer per tensor (a fused projection's output), "offset" starts 2 bytes past a 16-byte boundary."""
    d, dv = c["dims"]
    g = torch.Generator(device="cuda").manual_seed(c["seed"])

    def make(rows, heads, dim):
        t = torch.randn(rows, heads, dim, generator=g, device="cuda").to(c["dtype"])
        if c["layout"] == "fused":
            wide = torch.randn(rows, heads, dim + 64, generator=g, device="cuda").to(c["dtype"])
            wide[..., :dim] = t
            t = wide[..., :dim]
        elif c["layout"] == "offset":
            flat = torch.empty(t.numel() + 1, device="cuda", dtype=t.dtype)
            t = flat[1:].view_as(t).copy_(t)
        return t.requires_grad_(True)

    tq, tk = sum(c["lens_q"]), sum(c["lens_k"])
    return make(tq, c["h"], d), make(tk, c["hkv"], d), make(tk, c["hkv"], dv)


def _cu(lens) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("i", range(VARLEN_CASES))
def test_random_varlen_calls(i):
    c = _varlen_case(i)
    q, k, v = _packed_leaves(c)
    cq, ck = _cu(c["lens_q"]), _cu(c["lens_k"])
    mq, mk = max(c["lens_q"]) + c["slack"], max(c["lens_k"]) + c["slack"]
    kw = dict(causal=c["causal"], window_size=c["window"])
    if c["seqused"]:
        r = random.Random(c["seed"])
        kw["seqused_k"] = torch.tensor([r.randint(0, n) for n in c["lens_k"]], dtype=torch.int32, device="cuda")
    out, lse = cute_flash.attention_varlen(q, k, v, cq, ck, mq, mk, return_lse=True, **kw)
    dout = _output_grad(out[None], "randn", c["seed"])[0]
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_varlen(q, k, v, cq, ck, mq, mk, out, lse.detach(), dout, grads, **kw)

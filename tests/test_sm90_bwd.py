"""GPU (Hopper): the sm90 backward (dq, dk, dv) against float64 autograd, with FlashAttention's rule.

Two entry points over the same matrix:
  - test_sm90_attention_backward: cute_flash.attention(...).backward() (sm90 forward and backward kernels),
  - test_sm90_backward_kernels: the sm90 backward kernels alone, fed out/lse from the reference forward, so that a
    backward failure is told apart from a forward one.
Plus long sequences, fully masked rows, odd strides of the gradient, and the head dims without a tile of their own
(a wider one on zero-padded operands).

Run on an H100/H200 (one pytest worker per (dtype, head dim) group, so that each compiles only its kernels):
  python3 -m pytest -q -n 8 --dist loadgroup tests/test_sm90_bwd.py
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytestmark = pytest.mark.sm90

# Head dims with kernels of their own: d == dv, or a (head_dim, head_dim_v) pair (tile_config.bwd_head_dim_pairs).
HEAD_DIMS = (64, 96, 128, 192, 256, (192, 128))


def _dims_id(d) -> str:
    return f"d{d[0]}x{d[1]}" if isinstance(d, tuple) else f"d{d}"


SEQLENS = ((1, 1), (113, 203), (128, 128), (239, 1), (1023, 1024), (2048, 2048))
MASKS = {  # name -> (causal, window_size)
    "full": (False, (None, None)),
    "causal": (True, (None, None)),
    "window64_0": (False, (64, 0)),
    "window100_30": (False, (100, 30)),
}
HEADS = ((8, 8), (8, 2), (8, 1))
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _case(dt, d, sq, sk, mask, h, h_kv):
    return pytest.param(
        dt,
        d,
        sq,
        sk,
        mask,
        h,
        h_kv,
        id=f"{dt}-{_dims_id(d)}-{sq}x{sk}-{mask}-h{h}_{h_kv}",
        marks=pytest.mark.xdist_group(f"{dt}-{_dims_id(d)}"),
    )


CASES = [
    _case(dt, d, sq, sk, m, h, hk)
    for dt, d, (sq, sk), m, (h, hk) in itertools.product(DTYPES, HEAD_DIMS, SEQLENS, MASKS, HEADS)
]


def _inputs(dt, d, sq, sk, h, h_kv, seed, batch=None):
    """d: a head dim, or a (head_dim, head_dim_v) pair."""
    from cute_flash.testing import backward_inputs

    d, dv = d if isinstance(d, tuple) else (d, d)
    return backward_inputs(DTYPES[dt], d, sq, sk, h, h_kv, seed, batch, head_dim_v=dv)


def _seed(*params) -> int:
    from cute_flash.testing import stable_seed

    return stable_seed(*params)


def _kernel_grads(q, k, v, dout, causal, window_size, **kwargs):
    from cute_flash.arch.sm90.backward import run_backward
    from cute_flash.testing import backward_kernel_grads

    return backward_kernel_grads(run_backward, q, k, v, dout, causal, window_size, **kwargs)


@pytest.mark.parametrize("dt, d, sq, sk, mask, h, h_kv", CASES)
def test_sm90_backward_kernels(dt, d, sq, sk, mask, h, h_kv):
    from cute_flash.testing import check_backward

    causal, window = MASKS[mask]
    q, k, v, dout = _inputs(dt, d, sq, sk, h, h_kv, _seed(dt, d, sq, sk, mask, h, h_kv))
    grads = _kernel_grads(q, k, v, dout, causal, window)
    check_backward(q, k, v, dout, grads, causal=causal, window_size=window)


@pytest.mark.parametrize("dt, d, sq, sk, mask, h, h_kv", CASES)
def test_sm90_attention_backward(dt, d, sq, sk, mask, h, h_kv):
    import cute_flash
    from cute_flash.testing import check_backward

    causal, window = MASKS[mask]
    q, k, v, dout = _inputs(dt, d, sq, sk, h, h_kv, _seed(dt, d, sq, sk, mask, h, h_kv))
    out = cute_flash.attention(q, k, v, causal=causal, window_size=window)
    out.backward(dout)
    check_backward(q, k, v, dout, (q.grad, k.grad, v.grad), causal=causal, window_size=window)


@pytest.mark.parametrize(
    "d, seqlen, causal, h_kv",
    # One xdist worker for every long test (their float64 references take tens of GiB; see test_sm90_fwd.py).
    [
        pytest.param(d, s, c, hk, marks=pytest.mark.xdist_group("long"))
        for d, s, c, hk in (
            (128, 8192, False, 2),  # (from 4096 query rows without a mask: the 80-row tile, tile_config)
            (128, 4099, False, 1),
            (128, 8192, True, 2),
            (64, 8192, True, 1),
            (128, 16384, True, 1),
            (256, 8192, True, 2),
            ((192, 128), 8192, False, 2),
        )
    ],
)
def test_sm90_backward_long(d, seqlen, causal, h_kv):
    from cute_flash.testing import check_backward

    q, k, v, dout = _inputs("bf16", d, seqlen, seqlen, 2, h_kv, _seed(d, seqlen, causal), batch=1)
    grads = _kernel_grads(q, k, v, dout, causal, (None, None))
    check_backward(q, k, v, dout, grads, causal=causal)


@pytest.mark.parametrize(
    "d", [pytest.param(d, marks=pytest.mark.xdist_group(f"bf16-{_dims_id(d)}"), id=_dims_id(d)) for d in HEAD_DIMS]
)
def test_sm90_backward_fully_masked_rows(d):
    """Rows that see no key (seqlen_q > seqlen_k, causal; a window that ends before key 0): their dq must be exactly
    0, everything finite, the rest within the rule; key tiles no query sees get dk = dv = 0."""
    import cute_flash
    from cute_flash.testing import check_backward

    for sq, sk, causal, window, empty_rows in ((300, 100, True, (None, None), 200), (256, 200, False, (8, 0), 56)):
        q, k, v, dout = _inputs("bf16", d, sq, sk, 4, 2, _seed(d, sq, sk, causal))
        out = cute_flash.attention(q, k, v, causal=causal, window_size=window)
        out.backward(dout)
        check_backward(q, k, v, dout, (q.grad, k.grad, v.grad), causal=causal, window_size=window)
        assert torch.count_nonzero(q.grad[:, :empty_rows]) == 0
    # A window that leaves the first keys unseen by every query (query i sees keys i + 380 .. i + 384): whole key
    # tiles no query visits, whose dk, dv must be 0. (A one-key window would give dk = 0 everywhere: P = 1.)
    q, k, v, dout = _inputs("bf16", d, 128, 512, 2, 2, _seed(d, "tail"))
    out = cute_flash.attention(q, k, v, window_size=(4, 0))
    out.backward(dout)
    check_backward(q, k, v, dout, (q.grad, k.grad, v.grad), window_size=(4, 0))
    assert torch.count_nonzero(k.grad[:, 384:]) > 0
    assert torch.count_nonzero(k.grad[:, :380]) == 0 and torch.count_nonzero(v.grad[:, :380]) == 0


@pytest.mark.xdist_group("bf16-d128")
def test_sm90_backward_strided_inputs():
    """Non-contiguous q/k/v/dout views (heads-major storage, a sliced head dim stays contiguous) give the same
    gradients as contiguous copies."""
    import cute_flash
    from cute_flash.testing import check_backward

    b, s, h, d = 2, 333, 4, 128
    gen = torch.Generator(device="cuda").manual_seed(7)
    base = torch.randn(b, h, s, 3 * d, generator=gen, device="cuda").to(torch.bfloat16)
    q, k, v = (base[..., i * d : (i + 1) * d].transpose(1, 2).detach().requires_grad_() for i in range(3))
    dout = torch.randn(b, h, s, d, generator=gen, device="cuda").to(torch.bfloat16).transpose(1, 2)
    out = cute_flash.attention(q, k, v, causal=True)
    out.backward(dout)
    check_backward(q, k, v, dout, (q.grad, k.grad, v.grad), causal=True)


@pytest.mark.parametrize(
    "d, forward_family, backward_family",
    [pytest.param(d, f, b, marks=pytest.mark.xdist_group(f"pad-d{d}")) for d, f, b in (
        (72, "sm80", "sm90"), (160, "sm80", "sm90"), (32, "sm80", "sm90"), (224, "sm80", "sm90"))],
)  # fmt: skip
def test_other_head_dims_train_on_hopper(monkeypatch, d, forward_family, backward_family):
    """Head dims without an sm90 backward tile of their own train on the narrowest wider one with zero-padded
    operands (sm90.backward.kernel_dims: d72 on the d96 kernels, d160 on the d192 ones, d32 on the d64 ones, d224
    on the d256 ones), after the sm80 forward (no sm90 forward tile for them). The marker's CUTE_FLASH_ARCH=sm90
    would forbid the sm80 family, so it is lifted."""
    import cute_flash
    from cute_flash.testing import check_backward

    monkeypatch.delenv("CUTE_FLASH_ARCH", raising=False)
    q, k, v, dout = _inputs("bf16", d, 300, 300, 4, 2, _seed(d, "pad"))
    route = cute_flash.explain(q, k, v, causal=True)
    assert (route.forward_family, route.backward_family) == (forward_family, backward_family), str(route)
    out = cute_flash.attention(q, k, v, causal=True)
    out.backward(dout)
    check_backward(q, k, v, dout, (q.grad, k.grad, v.grad), causal=True)


@pytest.mark.parametrize(
    "d, dv, h_kv, family, deterministic",
    [pytest.param(*c, marks=pytest.mark.xdist_group(f"dv{c[0]}_{c[1]}-{c[3]}")) for c in (
        (192, 128, 2, "default", False), (192, 128, 4, "default", True), (128, 64, 1, "default", False),
        (64, 128, 2, "default", False), (192, 128, 2, "sm80", False), (128, 64, 1, "sm80", False))],
)  # fmt: skip
def test_dv_differs_trains_on_hopper(monkeypatch, d, dv, h_kv, family, deterministic):
    """head_dim != head_dim_v trains on Hopper: the sm90 forward, the sm90 backward on (192, 128)'s own kernels or at
    the narrowest tile at least as wide as both head dims on zero-padded operands ((128, 64), (64, 128); deterministic
    too: bitwise equal over repeats), and with the sm80 family forced, its backward at the wider head dim, padded
    likewise. Gradients by the rule, loss through out and lse, odd lengths and a causal mask."""
    import cute_flash
    from cute_flash.testing import check_backward, random_qkv

    if family == "sm80":
        monkeypatch.setenv("CUTE_FLASH_ARCH", "sm80")
    else:
        monkeypatch.delenv("CUTE_FLASH_ARCH", raising=False)
    q, k, v = random_qkv(2, 301, 517, 4, h_kv, d, dv, seed=d + dv + h_kv, requires_grad=True)
    route = cute_flash.explain(q, k, v, causal=True)
    want = ("sm80", "sm80") if family == "sm80" else ("sm90", "sm90")
    assert (route.forward_family, route.backward_family) == want, str(route)
    g = torch.Generator(device="cuda").manual_seed(5)
    runs = []
    for _ in range(2 if deterministic else 1):
        out, lse = cute_flash.attention(q, k, v, causal=True, return_lse=True, deterministic=deterministic)
        g.manual_seed(5)
        dout = torch.randn(out.shape, generator=g, device="cuda").to(out.dtype)
        dlse = torch.randn(lse.shape, generator=g, device="cuda")
        runs.append(torch.autograd.grad((out, lse), (q, k, v), (dout, dlse)))
    if deterministic:
        assert all(torch.equal(a, b) for a, b in zip(*runs))
    check_backward(q, k, v, dout, runs[0], dlse, causal=True)


@pytest.mark.parametrize(
    "d, mask, h_kv, sq, sk",
    [
        pytest.param(d, m, hk, sq, sk, marks=pytest.mark.xdist_group(f"det-{_dims_id(d)}"))
        for d in HEAD_DIMS
        for m in ("full", "causal", "window64_0", "window100_30")
        for hk in (4, 1)
        for sq, sk in ((1000, 1100), (1100, 300))
    ]
    + [pytest.param(128, "causal", 2, 1, 1, marks=pytest.mark.xdist_group("det-d128"))],
)
def test_sm90_backward_deterministic(d, mask, h_kv, sq, sk):
    """deterministic=True: bitwise-equal gradients over repeats (dQ, and GQA's dK/dV, summed in a fixed order), and
    still within the rule; windows, seqlen_q > seqlen_k (rows that see no key) and one-token sequences included,
    since a wrong turn number there would hang the kernel."""
    import cute_flash
    from cute_flash.testing import check_backward

    causal, window = MASKS[mask]
    q, k, v, dout = _inputs("bf16", d, sq, sk, 4, h_kv, _seed(d, mask, h_kv, sq, sk, "det"))
    runs = []
    for _ in range(3):
        out = cute_flash.attention(q, k, v, causal=causal, window_size=window, deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    for grads in runs[1:]:
        for a, b in zip(runs[0], grads):
            assert torch.equal(a, b)
    check_backward(q, k, v, dout, runs[0], causal=causal, window_size=window)


@pytest.mark.xdist_group("pad-d160")
def test_padded_head_dim_deterministic(monkeypatch):
    """d160 (its wider tile's d192 kernels, zero-padded) in deterministic mode: bitwise-equal gradients over repeats,
    within the rule, GQA and a window. (The sm80 backward, which has no deterministic mode, must not serve it: it
    runs on the sm90 kernels padded to d192.)"""
    import cute_flash
    from cute_flash.testing import check_backward

    monkeypatch.delenv("CUTE_FLASH_ARCH", raising=False)
    q, k, v, dout = _inputs("bf16", 160, 700, 900, 4, 2, _seed(160, "det"))
    assert cute_flash.explain(q, k, v, deterministic=True).backward_padded_to == 192
    runs = []
    for _ in range(2):
        out = cute_flash.attention(q, k, v, window_size=(100, 30), deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    check_backward(q, k, v, dout, runs[0], window_size=(100, 30))


SWAP_AB_CASES = [
    pytest.param(dt, sq, sk, m, h, hk, id=f"{dt}-{sq}x{sk}-{m}-h{h}_{hk}", marks=pytest.mark.xdist_group("swap-d128"))
    for dt in DTYPES
    for sq, sk in ((1, 1), (80, 80), (113, 203), (239, 1), (161, 300), (1023, 1024), (2048, 2048))
    for m in ("full", "causal", "window100_30")
    for h, hk in ((8, 8), (8, 2))
]


@pytest.mark.parametrize("dt, sq, sk, mask, h, h_kv", SWAP_AB_CASES)
def test_sm90_backward_dq_swap_ab(dt, sq, sk, mask, h, h_kv):
    """The 80-row query tile with dQᵀ = Kᵀ·dSᵀ (BwdTileConfig.dq_swap_ab; the default only for long query
    sequences without a mask), d128, every mask: the kernels alone against the reference, and deterministic repeats
    bitwise equal."""
    from cute_flash.arch.sm90.tile_config import BwdTileConfig
    from cute_flash.testing import check_backward

    cfg = BwdTileConfig(tile_m=80, dq_split="n", dq_swap_ab=True)
    causal, window = MASKS[mask]
    q, k, v, dout = _inputs(dt, 128, sq, sk, h, h_kv, _seed(dt, sq, sk, mask, h, h_kv, "swap"))
    grads = _kernel_grads(q, k, v, dout, causal, window, cfg=cfg)
    check_backward(q, k, v, dout, grads, causal=causal, window_size=window)
    det = [_kernel_grads(q, k, v, dout, causal, window, cfg=cfg, deterministic=True) for _ in range(2)]
    for a, b in zip(*det):
        assert torch.equal(a, b)
    check_backward(q, k, v, dout, det[0], causal=causal, window_size=window)

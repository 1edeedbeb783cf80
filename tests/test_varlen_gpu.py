"""GPU: `cute_flash.attention_varlen` (packed sequences) on the sm80 family, forward and the three gradients against the
float64 per-sequence reference with FlashAttention's rule (cute_flash.testing), plus CUDA-graph capture.

On Hopper the `sm80` marker forces the sm80 family (tests/conftest.py); the router's own choice there is the sm90
family's packed kernels, which the `sm90` tests at the end check.
Cases sharing compiled kernels share an xdist group:
    python -m pytest -q tests/test_varlen_gpu.py -n 4 --dist loadgroup
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MASKS = {"full": (False, (None, None)), "causal": (True, (None, None)), "window": (False, (48, 16))}
# (lens_q, lens_k): zero-length sequences (and queries without keys), single tokens, odd lengths, one long sequence
# among short ones, and query lengths that differ from key lengths (bottom-right alignment per sequence).
LENGTHS = {
    "mixed": ([4, 0, 1, 17, 128, 333, 64, 1, 77], [0, 0, 5, 17, 128, 333, 64, 1, 200]),
    "long": ([3, 1, 1537, 5, 0, 130], [3, 7, 1537, 2, 11, 65]),
    "longest": ([37, 4133, 0, 81, 200], [37, 4133, 5, 80, 333]),
    # More sequences than a warp's 32 lanes: the sm90 kernels find a CTA's sequence in more than one step of their
    # warp scan (common/packed_tiles.py); lengths 0..300 and one of 700.
    "many": (
        [(i * 37) % 151 for i in range(19)] + [700] + [(i * 53) % 301 for i in range(20)],
        [(i * 41) % 173 + (i % 2) for i in range(19)] + [650] + [(i * 53) % 301 for i in range(20)],
    ),
}


def _cases():
    cases = []
    for mask in MASKS:
        for heads in ((4, 4), (4, 1)):
            for lengths in ("mixed", "long"):
                cases.append(("bf16", 128, mask, heads, lengths))
    for mask in ("causal", "window"):
        cases.append(("fp16", 64, mask, (6, 2), "mixed"))
        cases.append(("fp16", 64, mask, (6, 6), "long"))
    return _params(cases)


def _params(cases, prefix: str = ""):
    """pytest params of (dtype, d, mask, heads, lengths) cases, one xdist group per compiled kernel."""
    group = f"varlen{prefix.replace('sm', '')}"  # "varlen" / "varlen90"
    return [
        pytest.param(
            *c,
            id=f"{prefix}{'-' if prefix else ''}{c[0]}-d{c[1]}-{c[2]}-h{c[3][0]}_{c[3][1]}-{c[4]}",
            marks=pytest.mark.xdist_group(f"{group}-{c[0]}-d{c[1]}-{c[2]}"),
        )  # fmt: skip
        for c in cases
    ]


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _packed(dt, d, lens_q, lens_k, h, h_kv, seed, dv=None, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def make(rows, heads, dim, s=1.0):
        x = torch.randn(rows, heads, dim, generator=g, device="cuda") * s
        return x.to(DTYPES[dt]).requires_grad_(True)

    q, k = make(sum(lens_q), h, d, scale), make(sum(lens_k), h_kv, d, scale)
    return q, k, make(sum(lens_k), h_kv, dv or d), _cu(lens_q), _cu(lens_k)


def _check(q, k, v, cq, ck, mq, mk, out, lse, dout, grads, dlse=None, **kw):
    from cute_flash.testing import check_varlen

    return check_varlen(q, k, v, cq, ck, mq, mk, out, lse, dout, grads, dlse, **kw)


@pytest.mark.sm80
@pytest.mark.parametrize("dt, d, mask, heads, lengths", _cases())
def test_varlen_forward_backward(dt, d, mask, heads, lengths):
    import cute_flash
    from cute_flash.testing import stable_seed

    causal, window = MASKS[mask]
    lens_q, lens_k = LENGTHS[lengths]
    q, k, v, cq, ck = _packed(dt, d, lens_q, lens_k, *heads, seed=stable_seed(dt, d, mask, *heads, lengths))
    mq, mk = max(lens_q), max(lens_k)
    out, lse = cute_flash.attention_varlen(q, k, v, cq, ck, mq, mk, causal=causal, window_size=window, return_lse=True)
    assert out.shape == (q.shape[0], heads[0], d) and lse.shape == (heads[0], q.shape[0])
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    _check(q, k, v, cq, ck, mq, mk, out, lse, dout, grads, causal=causal, window_size=window)


@pytest.mark.sm80
@pytest.mark.xdist_group("varlen-bf16-d128-causal")
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_varlen_seqused_k(heads):
    """seqused_k keeps only the first keys of each sequence (causal alignment on that count); the others get zero
    gradients. A larger max_seqlen than any sequence is allowed."""
    import cute_flash

    lens_q, lens_k = [5, 0, 40, 200, 1], [9, 4, 40, 300, 3]
    used = torch.tensor([9, 0, 17, 250, 3], dtype=torch.int32, device="cuda")
    q, k, v, cq, ck = _packed("bf16", 128, lens_q, lens_k, *heads, seed=7)
    out, lse = cute_flash.attention_varlen(q, k, v, cq, ck, 256, 512, causal=True, seqused_k=used, return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    _check(q, k, v, cq, ck, 256, 512, out, lse, dout, grads, causal=True, seqused_k=used)
    for b in range(len(lens_k)):  # keys past seqused_k: exactly zero gradients
        k0, k1 = ck[b].item() + used[b].item(), ck[b + 1].item()
        assert torch.all(grads[1][k0:k1] == 0) and torch.all(grads[2][k0:k1] == 0)


@pytest.mark.sm80
@pytest.mark.xdist_group("varlen-bf16-d128-causal")
def test_varlen_equal_lengths_match_dense_attention():
    """Equal lengths: the packed call and the dense sm80 call compute the same thing (to the rule's tolerance)."""
    import cute_flash

    q, k, v, cq, ck = _packed("bf16", 128, [300] * 3, [300] * 3, 4, 4, seed=3)
    out = cute_flash.attention_varlen(q, k, v, cq, ck, 300, 300, causal=True)
    dense = cute_flash.attention(*(t.view(3, 300, 4, 128) for t in (q, k, v)), causal=True)
    torch.testing.assert_close(out, dense.reshape(900, 4, 128), atol=2e-2, rtol=0)


@pytest.mark.sm80
def test_varlen_deterministic_backward_is_refused():
    import cute_flash

    q, k, v, cq, ck = _packed("bf16", 128, [5, 9], [5, 9], 4, 4, seed=1)
    with pytest.raises(NotImplementedError, match="deterministic"):
        cute_flash.attention_varlen(q, k, v, cq, ck, 9, 9, deterministic=True)


@pytest.mark.sm80
@pytest.mark.xdist_group("varlen-bf16-d128-causal")
def test_varlen_cuda_graph_capture():
    """A varlen call is captured in a CUDA graph (no device-to-host copy inside); replaying it after new values are
    written into q and into cu_seqlens (same batch size and totals) gives the eager result for the new values."""
    import cute_flash
    from cute_flash.testing import capture_graph

    lens = [100, 3, 250, 47]
    with torch.no_grad():
        q, k, v, cq, ck = (t.detach() for t in _packed("bf16", 128, lens, lens, 4, 4, seed=5))
        call = lambda: cute_flash.attention_varlen(q, k, v, cq, ck, 256, 256, causal=True)  # noqa: E731
        graph, out = capture_graph(call)  # (compiled and warmed up outside the capture)

        q.copy_(torch.randn_like(q))
        new = _cu([200, 50, 150, 0])  # same total (400), another segmentation
        cq.copy_(new)
        ck.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        expected = call()
        assert torch.equal(out, expected)


@pytest.mark.sm80
@pytest.mark.xdist_group("varlen-bf16-d128-causal")
def test_varlen_torch_compile_training_step_matches_eager():
    """Inductor, fullgraph=True: attention_varlen becomes the custom ops cute_flash::fwd / bwd with packed-sequence
    arguments; the compiled output equals the eager call's bitwise (the same kernel runs), the gradients up to the
    order of the sm80 backward's fp32 atomic adds (inductor also sums the loss in an order of its own)."""
    import cute_flash

    torch._dynamo.reset()
    lens = [100, 3, 250, 47]
    q, k, v, cq, ck = _packed("bf16", 128, lens, lens, 4, 2, seed=11)
    w = torch.randn(q.shape[0], 4, 128, device="cuda")

    def step(q, k, v):
        out = cute_flash.attention_varlen(q, k, v, cq, ck, 250, 250, causal=True)
        return (out.float() * w).sum(), out

    eager_value, eager_out = step(q, k, v)
    eager_grads = torch.autograd.grad(eager_value, (q, k, v))
    value, out = torch.compile(step, fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(value, (q, k, v))
    assert torch.equal(out, eager_out)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def _lse_gradient_case(heads, deterministic=False):
    """A loss of out and lse over the mixed lengths (causal: rows without keys, lse -inf, zero gradient there)."""
    import cute_flash

    lens_q, lens_k = LENGTHS["mixed"]
    q, k, v, cq, ck = _packed("bf16", 128, lens_q, lens_k, *heads, seed=31)
    mq, mk = max(lens_q), max(lens_k)
    out, lse = cute_flash.attention_varlen(
        q, k, v, cq, ck, mq, mk, causal=True, return_lse=True, deterministic=deterministic
    )
    g = torch.Generator(device="cuda").manual_seed(32)
    dlse = torch.randn(lse.shape, generator=g, device="cuda")
    dlse = torch.where(torch.isfinite(lse), dlse, torch.zeros_like(dlse))
    dout = torch.randn(out.shape, generator=g, device="cuda").to(out.dtype)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    _check(q, k, v, cq, ck, mq, mk, out, lse, dout, grads, dlse=dlse, causal=True)


@pytest.mark.sm80
@pytest.mark.xdist_group("varlen-bf16-d128-causal")
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_varlen_backward_through_lse(heads):
    _lse_gradient_case(heads)


# --- the sm90 packed kernels (the router's choice on Hopper; docs/varlen.md) -----------------------------------------
def _sm90_cases():
    cases = [
        ("bf16", 128, mask, heads, lengths)
        for mask in MASKS
        for heads in ((4, 4), (4, 1))
        for lengths in ("mixed", "long")
    ]
    cases += [("fp16", 64, mask, (6, 2), "mixed") for mask in MASKS]
    cases += [("bf16", 256, mask, (2, 1), "long") for mask in MASKS]
    cases += [("bf16", 96, mask, (4, 2), "mixed") for mask in ("full", "causal")]  # 4 threads per O row (gcd)
    cases += [("fp16", 256, mask, (4, 4), "mixed") for mask in ("causal", "window")]
    # max_seqlen_q >= 4096 without a mask: the backward's long-sequence configuration (80-row query tiles).
    cases += [("bf16", 128, "full", heads, "longest") for heads in ((4, 4), (4, 2))]
    cases += [("bf16", 128, mask, (4, 2), "many") for mask in MASKS]
    return _params(cases, "sm90")


@pytest.fixture
def sm90_varlen(monkeypatch):
    """attention_varlen on the router's own choice (the sm90 packed builds), whatever the marker set."""
    monkeypatch.delenv("CUTE_FLASH_ARCH", raising=False)
    yield


@pytest.mark.sm90
@pytest.mark.parametrize("dt, d, mask, heads, lengths", _sm90_cases())
def test_sm90_varlen_forward_backward(sm90_varlen, dt, d, mask, heads, lengths):
    """out, lse and the three gradients of every sequence against the float64 reference: zero-length sequences,
    queries without keys, tiles that end inside a sequence (their loads read the next sequence's rows, which must
    not leak in and must not be overwritten), GQA sums."""
    import cute_flash
    from cute_flash.testing import stable_seed

    causal, window = MASKS[mask]
    lens_q, lens_k = LENGTHS[lengths]
    q, k, v, cq, ck = _packed(dt, d, lens_q, lens_k, *heads, seed=stable_seed(dt, d, mask, *heads, lengths))
    mq, mk = max(lens_q), max(lens_k)
    e = cute_flash.explain_varlen(q, k, v, cq, ck, mq, mk, causal=causal, window_size=window)
    assert (e.forward_family, e.backward_family) == ("sm90", "sm90")
    out, lse = cute_flash.attention_varlen(q, k, v, cq, ck, mq, mk, causal=causal, window_size=window, return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    _check(q, k, v, cq, ck, mq, mk, out, lse, dout, grads, causal=causal, window_size=window)


@pytest.mark.sm90
@pytest.mark.parametrize("mask", ["causal", "full"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
def test_sm90_varlen_seqused_k(sm90_varlen, mask, heads):
    """seqused_k, with NaN in every key / value row a sequence does not use (a KV cache's empty slots): the tail
    tiles read those rows, and 0 * NaN (P·V forward; dP = V·dOᵀ and dQ = dS·K backward) would poison the results
    unless they are zeroed (docs/varlen.md). Keys past seqused_k get exactly zero gradients."""
    import cute_flash

    causal = mask == "causal"
    lens_q, lens_k = [5, 0, 40, 200, 1], [9, 4, 40, 300, 3]
    used = torch.tensor([9, 0, 17, 250, 3], dtype=torch.int32, device="cuda")
    q, k, v, cq, ck = _packed("bf16", 128, lens_q, lens_k, *heads, seed=7)
    with torch.no_grad():
        for b in range(len(lens_k)):
            k[ck[b].item() + used[b].item() : ck[b + 1].item()] = float("nan")
            v[ck[b].item() + used[b].item() : ck[b + 1].item()] = float("nan")
    out, lse = cute_flash.attention_varlen(q, k, v, cq, ck, 256, 512, causal=causal, seqused_k=used, return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    # The reference never reads those rows either; it gives them zero gradients too.
    clean_k, clean_v = k.detach().nan_to_num(0.0), v.detach().nan_to_num(0.0)
    _check(q, clean_k, clean_v, cq, ck, 256, 512, out, lse, dout, grads, causal=causal, seqused_k=used)
    for b in range(len(lens_k)):
        k0, k1 = ck[b].item() + used[b].item(), ck[b + 1].item()
        assert torch.all(grads[1][k0:k1] == 0) and torch.all(grads[2][k0:k1] == 0)


@pytest.mark.sm90
@pytest.mark.xdist_group("varlen90-bf16-d128-full")
@pytest.mark.parametrize("d", [128, 256])
def test_sm90_varlen_multicast_forward_matches_one_cta_per_cluster(sm90_varlen, d):
    """The d128 / d256 packed forward without a mask runs in 2-CTA clusters sharing K / V (tile_config.multicast_kv):
    its out and lse are bitwise those of the same kernel with one CTA per cluster (the same products of the same
    tiles). Sequences whose last cluster holds 1, 2, 3 or 4 slices of 64 rows, empty ones, queries without keys, GQA,
    with and without seqused_k."""
    import dataclasses

    import cute_flash
    from cute_flash.arch.sm90 import backend, build
    from cute_flash.arch.sm90.tile_config import fwd_tile_config

    lens_q, lens_k = [0, 1, 64, 65, 129, 193, 256, 257, 700, 3], [5, 1, 64, 80, 129, 200, 256, 300, 650, 0]
    q, k, v, cq, ck = _packed("bf16", d, lens_q, lens_k, 4, 2, seed=11)
    used = torch.tensor([max(0, n - 37) for n in lens_k], dtype=torch.int32, device="cuda")

    def both():
        with torch.no_grad():
            run = partial(cute_flash.attention_varlen, q, k, v, cq, ck, max(lens_q), max(lens_k), return_lse=True)
            return run(), run(seqused_k=used)

    multicast = both()

    def these_calls(key):  # their two builds: without and with seqused_k
        spec, _, variant = key
        return spec.varlen and (spec.dtype, spec.head_dim, spec.mask) == ("bf16", d, "none") and variant != "split"

    keys = [key for key in backend._forward_kernels if these_calls(key)]
    spec = keys[0][0]
    assert len(keys) == 2 and fwd_tile_config(spec).cluster_m == 2, keys
    saved = {key: backend._forward_kernels[key] for key in keys}
    try:
        cfg = dataclasses.replace(fwd_tile_config(spec), cluster_m=1)
        for key in keys:
            backend._forward_kernels[key] = build.compile_forward_packed(spec, cfg, key[1], None, key[2] == "seqused_k")
        single = both()
    finally:
        backend._forward_kernels.update(saved)
    for (out_m, lse_m), (out_s, lse_s) in zip(multicast, single):
        assert torch.equal(out_m, out_s) and torch.equal(lse_m, lse_s)


@pytest.mark.sm90
@pytest.mark.xdist_group("varlen90-bf16-d128-causal")
def test_sm90_varlen_equal_lengths_match_dense_attention():
    """Equal lengths: the packed calls and the dense sm90 calls compute the same outputs and gradients (to the
    rule's tolerance; the dQ sums add in another order)."""
    import cute_flash

    q, k, v, cq, ck = _packed("bf16", 128, [300] * 3, [300] * 3, 4, 4, seed=3)
    out = cute_flash.attention_varlen(q, k, v, cq, ck, 300, 300, causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    dense_leaves = [t.detach().view(3, 300, 4, 128).requires_grad_(True) for t in (q, k, v)]
    dense = cute_flash.attention(*dense_leaves, causal=True)
    dense_grads = torch.autograd.grad(dense, dense_leaves, dout.view(3, 300, 4, 128))
    torch.testing.assert_close(out, dense.reshape(900, 4, 128), atol=2e-2, rtol=0)
    for got, want in zip(grads, dense_grads):
        torch.testing.assert_close(got, want.reshape(got.shape), atol=2e-2, rtol=0)


@pytest.mark.sm90
@pytest.mark.parametrize(
    "dt, d, mask, heads, lengths, seqused",
    [
        ("bf16", 128, "causal", (4, 4), "mixed", False),
        ("bf16", 128, "causal", (4, 2), "long", False),
        ("bf16", 128, "full", (4, 1), "mixed", False),
        ("bf16", 128, "window", (4, 2), "long", True),
        ("fp16", 64, "causal", (6, 2), "mixed", True),
        ("bf16", 256, "causal", (2, 1), "long", False),
        ("bf16", 96, "window", (4, 2), "mixed", False),
        ("bf16", 128, "window", (4, 2), "many", False),
    ],
    ids=lambda a: str(a),
)
def test_sm90_varlen_deterministic_backward(sm90_varlen, dt, d, mask, heads, lengths, seqused):
    """deterministic=True: the packed backward's dQ (and GQA dK / dV) sums add in a fixed order behind semaphores
    per (head, padded tile), so repeated runs give bitwise-equal gradients, each correct against the float64
    reference (shortest-first order within each sequence under a right window edge; zero-length sequences)."""
    import cute_flash
    from cute_flash.testing import stable_seed

    causal, window = MASKS[mask]
    lens_q, lens_k = LENGTHS[lengths]
    q, k, v, cq, ck = _packed(dt, d, lens_q, lens_k, *heads, seed=stable_seed(dt, d, mask, *heads, lengths, 17))
    used = None
    if seqused:
        used = torch.tensor([max(0, n - (i % 3) * 5) for i, n in enumerate(lens_k)], dtype=torch.int32, device="cuda")
    mq, mk = max(lens_q), max(lens_k)
    kw = dict(causal=causal, window_size=window, seqused_k=used)
    e = cute_flash.explain_varlen(q, k, v, cq, ck, mq, mk, deterministic=True, **kw)
    assert e.backward_family == "sm90"
    out, lse = cute_flash.attention_varlen(q, k, v, cq, ck, mq, mk, deterministic=True, return_lse=True, **kw)
    dout = torch.randn_like(out)
    runs = [torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) for _ in range(4)]
    for other in runs[1:]:
        for got, first in zip(other, runs[0]):
            assert torch.equal(got, first)
    _check(q, k, v, cq, ck, mq, mk, out, lse, dout, runs[0], **kw)


@pytest.mark.sm90
@pytest.mark.xdist_group("varlen90-bf16-d128-causal")
def test_sm90_varlen_forward_cuda_graph(sm90_varlen):
    import cute_flash
    from cute_flash.testing import capture_graph

    lens = [100, 3, 250, 47]
    q, k, v, cq, ck = (t.detach() for t in _packed("bf16", 128, lens, lens, 4, 4, seed=5))
    call = lambda: cute_flash.attention_varlen(q, k, v, cq, ck, 256, 256, causal=True)  # noqa: E731
    graph, out = capture_graph(call)
    new = _cu([200, 50, 150, 0])
    cq.copy_(new)
    ck.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, call())


# --- layouts: strided, offset and expanded tensors (both families) ----------------------------------------------------
def _strided_inputs(kind: str, lens, h: int, h_kv: int, d: int, seed: int):
    """Leaves q, k, v (total, heads, d) bf16 with the layout `kind`: "qkv" slices of one packed (total, 3, h, d) buffer
    (GQA: q from (total, h, d), k and v from one (total, 2, h_kv, d) buffer), or "offset" tensors whose data start
    2 bytes past a 16-byte boundary (copied for the kernels); the gradients come back in the leaves' own shapes."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lens)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)

    if kind == "qkv" and h == h_kv:
        qkv = randn(total, 3, h, d).requires_grad_(True)
        return (qkv,), (qkv[:, 0], qkv[:, 1], qkv[:, 2])
    if kind == "qkv":
        q, kv = randn(total, h, d).requires_grad_(True), randn(total, 2, h_kv, d).requires_grad_(True)
        return (q, kv), (q, kv[:, 0], kv[:, 1])
    flat = [randn(total * n * d + 1).requires_grad_(True) for n in (h, h_kv, h_kv)]
    return tuple(flat), tuple(f[1:].view(total, n, d) for f, n in zip(flat, (h, h_kv, h_kv)))


@pytest.mark.parametrize(
    "family", [pytest.param("sm80", marks=pytest.mark.sm80), pytest.param("sm90", marks=pytest.mark.sm90)]
)
@pytest.mark.parametrize("kind", ["qkv", "offset"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("dout_kind", ["random", "expanded"])
def test_varlen_strided_offset_and_expanded_tensors(family, kind, heads, dout_kind):
    """Packed q / k / v as views of a packed qkv (or kv) buffer, or at a misaligned address; dout as autograd hands it
    after out.sum() (stride 0 everywhere): outputs and the gradients of the leaves against float64 (the marker forces
    the family)."""
    import cute_flash

    lens = [37, 0, 200, 5, 129]
    leaves, (q, k, v) = _strided_inputs(kind, lens, *heads, 128, seed=13)
    cq = ck = _cu(lens)
    e = cute_flash.explain_varlen(q, k, v, cq, ck, 200, 200, causal=True)
    assert (e.forward_family, e.backward_family) == (family, family)
    out, lse = cute_flash.attention_varlen(q, k, v, cq, ck, 200, 200, causal=True, return_lse=True)
    dout = torch.ones_like(out) if dout_kind == "expanded" else torch.randn_like(out)
    if dout_kind == "expanded":
        out.sum().backward()  # autograd hands the backward ones expanded from a scalar (stride 0)
    else:
        out.backward(dout)
    # The gradients of q, k, v themselves, read back from the leaves they are views of.
    if kind == "qkv" and heads[0] == heads[1]:
        grads = tuple(leaves[0].grad[:, i] for i in range(3))
    elif kind == "qkv":
        grads = (leaves[0].grad, leaves[1].grad[:, 0], leaves[1].grad[:, 1])
    else:
        grads = tuple(f.grad[1:].view(t.shape) for f, t in zip(leaves, (q, k, v)))
    _check(q, k, v, cq, ck, 200, 200, out, lse, dout, grads, causal=True)


def _isolation_cases():
    """(family, dtype, d, mask, heads, lengths): d128's 64-row tile on sm80 and sm90; on sm90 also d64's 128-row tile,
    d96 (one dQ warpgroup), d256 (queries on rows, P in shared memory), a window, and the 80-row tile of long query
    sequences without a mask (max_seqlen_q >= 4096); sm100's d128 and d64 kernels."""
    short = [37, 70, 0, 200, 5, 129]
    cases = [
        (family, "bf16", 128, mask, heads, short)
        for family in ("sm80", "sm90")
        for mask in ("causal", "full")
        for heads in ((4, 4), (4, 2))
    ]
    cases += [
        ("sm90", "fp16", 64, "window", (4, 2), short),
        ("sm90", "bf16", 96, "causal", (4, 4), short),
        ("sm90", "bf16", 256, "causal", (2, 1), short),
        ("sm90", "bf16", 128, "full", (4, 2), [37, 70, 0, 4133, 5, 129]),
    ]
    # sm100 (never run: no Blackwell GPU): V zeroed by the forward's correction warps, K / Q / dO by the backward's
    # tail warps (arch/sm100/smem_tails.py); sequences of 3 and 5 query tiles, so that a tail step follows steps
    # without one
    several = [37, 300, 0, 200, 5, 520]
    cases += [("sm100", "bf16", 128, mask, heads, several) for mask in ("causal", "full") for heads in ((4, 4), (4, 2))]
    cases += [("sm100", "fp16", 64, "window", (4, 2), several)]
    return [
        pytest.param(
            *c, id=f"{c[0]}-{c[1]}-d{c[2]}-{c[3]}-h{c[4][0]}_{c[4][1]}-max{max(c[5])}", marks=getattr(pytest.mark, c[0])
        )
        for c in cases
    ]


@pytest.mark.parametrize("family, dt, d, mask, heads, lens", _isolation_cases())
def test_varlen_non_finite_sequence_stays_in_its_rows(family, dt, d, mask, heads, lens):
    """NaN in every q, k, v and dout row of two sequences: the other sequences' outputs and gradients are those of
    the clean batch. The last tile of a sequence reads the next sequence's rows (sm90: TMA over the packed tensor),
    where 0 · NaN in S, dP, dV += Pᵀ·dO or dK += dSᵀ·Q would carry them over unless those rows are zeroed."""
    import cute_flash

    causal, window = MASKS[mask]
    poisoned = (1, 4)
    mx = max(lens)
    q, k, v, cq, ck = _packed(dt, d, lens, lens, *heads, seed=23)
    e = cute_flash.explain_varlen(q, k, v, cq, ck, mx, mx, causal=causal, window_size=window)
    assert (e.forward_family, e.backward_family) == (family, family)
    dout = torch.randn(q.shape[0], heads[0], d, device="cuda", dtype=q.dtype)
    rows = [slice(cq[b].item(), cq[b + 1].item()) for b in poisoned]

    def run(inputs, grad_out):
        out, lse = cute_flash.attention_varlen(
            *inputs, cq, ck, mx, mx, causal=causal, window_size=window, return_lse=True
        )
        return (out, lse, *torch.autograd.grad(out, inputs, grad_out))

    clean = run((q, k, v), dout)
    dirty_inputs = [t.detach().clone() for t in (q, k, v)]
    dirty_dout = dout.clone()
    for r in rows:
        for t in (*dirty_inputs, dirty_dout):
            t[r] = float("nan")
    dirty = run(tuple(t.requires_grad_(True) for t in dirty_inputs), dirty_dout)
    # The poisoned sequences' own rows are NaN; take the clean run's there and check the whole against float64.
    merged = []
    for c, d_ in zip(clean, dirty):
        m = d_.clone()
        for r in rows:
            if m.dim() == 2:  # lse (h, total_q)
                m[:, r] = c[:, r]
            else:
                m[r] = c[r]
        merged.append(m)
    out, lse, *grads = merged
    _check(q, k, v, cq, ck, mx, mx, out, lse, dout, tuple(grads), causal=causal, window_size=window)


@pytest.mark.sm90
@pytest.mark.xdist_group("varlen90-bf16-d128-causal")
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_sm90_varlen_backward_through_lse(sm90_varlen, heads, deterministic):
    _lse_gradient_case(heads, deterministic)


@pytest.mark.sm90
@pytest.mark.xdist_group("varlen90-bf16-d128-causal")
@pytest.mark.parametrize("softmax_scale, input_scale", [(0.0, 1.0), (1e-30, 1.0), (None, 20.0)], ids=str)
def test_sm90_varlen_scales_and_large_inputs(sm90_varlen, softmax_scale, input_scale):
    """softmax_scale 0 (uniform attention over the visible keys) and 1e-30, and inputs 20x N(0, 1) (logits in the
    hundreds): forward and gradients against the float64 reference, per sequence."""
    import cute_flash

    torch.manual_seed(42)
    lens_q, lens_k = LENGTHS["mixed"]
    q, k, v, cq, ck = _packed("bf16", 128, lens_q, lens_k, 4, 2, seed=41, scale=input_scale)
    mq, mk = max(lens_q), max(lens_k)
    kw = dict(causal=True, softmax_scale=softmax_scale)
    out, lse = cute_flash.attention_varlen(q, k, v, cq, ck, mq, mk, return_lse=True, **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    _check(q, k, v, cq, ck, mq, mk, out, lse, dout, grads, **kw)


@pytest.mark.sm90
@pytest.mark.parametrize("d, dv", [(192, 128), (192, 192), (128, 64), (72, 72)], ids=lambda x: str(x))
def test_varlen_other_head_dims_on_hopper(sm90_varlen, d, dv):
    """Head dims beyond the sm90 backward's four and dv != d: whichever families `explain_varlen` names serve the
    forward (and, where one exists, the backward) within the rule; where no family has a backward, asking for
    gradients raises NotImplementedError (at the latest in the backward) and the forward alone still works."""
    import cute_flash

    torch.manual_seed(44)
    lens_q, lens_k = LENGTHS["long"]
    q, k, v, cq, ck = _packed("bf16", d, lens_q, lens_k, 4, 2, seed=43, dv=dv)
    mq, mk = max(lens_q), max(lens_k)
    e = cute_flash.explain_varlen(q, k, v, cq, ck, mq, mk, causal=True)
    assert e.forward_family is not None, str(e)
    if e.backward_family is None:
        with pytest.raises(NotImplementedError):
            out = cute_flash.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True)
            torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        with torch.no_grad():
            out, lse = cute_flash.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True, return_lse=True)
        _check(q, k, v, cq, ck, mq, mk, out, lse, None, None, causal=True)
        return
    out, lse = cute_flash.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True, return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    _check(q, k, v, cq, ck, mq, mk, out, lse, dout, grads, causal=True)


@pytest.mark.parametrize(
    "family", [pytest.param("sm80", marks=pytest.mark.sm80), pytest.param("sm90", marks=pytest.mark.sm90)]
)
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)], ids=["mha", "mqa"])
@pytest.mark.parametrize("window", [None, 37])
def test_varlen_padded_batch_layout(family, heads, window):
    """The transformers plug-in's padded path: a (b, s) batch with left / right / no / full padding run over its own
    rows (integrations/transformers._unpad: each row's padding queries sequences that see no key, its valid keys
    counted by seqused_k; the CPU suite checks that these sequences are the rows' own attention): against float64
    with FlashAttention's rule, and the padding rows' out and q, k, v gradients exactly 0."""
    import cute_flash
    from cute_flash.integrations.transformers import _unpad

    b, s, d = 5, 300, 128
    mask = torch.zeros(b, s, dtype=torch.bool, device="cuda")
    for i, n in enumerate([300, 171, 1, 0, 299]):
        mask[i, s - n :] = i % 2 == 0  # even rows left padded, odd rows right padded
        mask[i, :n] |= i % 2 == 1
    p = _unpad(mask, s, windowed=window is not None, k_width=s)
    assert p.q_rows is None
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(b * s, h, d, generator=g, device="cuda").bfloat16().requires_grad_() for h in
               (heads[0], heads[1], heads[1]))  # fmt: skip
    w = (None, None) if window is None else (window - 1, 0)
    seqs = (p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k)
    out, lse = cute_flash.attention_varlen(q, k, v, *seqs, causal=True, window_size=w, seqused_k=p.seqused_k,
                                           return_lse=True)  # fmt: skip
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    _check(q, k, v, *seqs, out, lse, dout, grads, causal=True, window_size=w, seqused_k=p.seqused_k)
    pad = ~mask.flatten()
    assert torch.all(out[pad] == 0) and all(torch.all(t[pad] == 0) for t in grads)


@pytest.mark.parametrize(
    "family", [pytest.param("sm80", marks=pytest.mark.sm80), pytest.param("sm90", marks=pytest.mark.sm90)]
)
@pytest.mark.parametrize("window", [(None, None), (40, 3)])
def test_varlen_seqused_q(family, window):
    """seqused_q (FlashAttention's): only the first seqused_q[b] rows of each sequence attend, aligned on that
    count; the others give out 0 and zero dq (PackedSeqs.with_used_queries), with and without seqused_k."""
    import cute_flash

    lens_q, lens_k = [5, 0, 40, 200, 1, 77], [9, 4, 40, 300, 3, 0]
    used_q = torch.tensor([3, 0, 40, 150, 0, 77], dtype=torch.int32, device="cuda")
    for used_k in (None, torch.tensor([9, 0, 17, 250, 3, 0], dtype=torch.int32, device="cuda")):
        q, k, v, cq, ck = _packed("bf16", 128, lens_q, lens_k, 4, 2, seed=11)
        kw = dict(causal=True, window_size=window, seqused_k=used_k, seqused_q=used_q)
        out, lse = cute_flash.attention_varlen(q, k, v, cq, ck, 200, 300, return_lse=True, **kw)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        _check(q, k, v, cq, ck, 200, 300, out, lse, dout, grads, **kw)

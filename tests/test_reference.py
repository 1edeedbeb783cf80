"""The tiled online-softmax algorithm equals the materialising float64 reference, and both honour the mask rules."""

import math

import pytest
import torch

from cute_flash.common.block_info import BlockInfo
from cute_flash.reference import attention_reference, attention_tiled, visible_keys
from cute_flash.spec import UNBOUNDED_WINDOW, MaskBounds, normalize_mask


def _inputs(b, sq, sk, h, hkv, d, dv, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, sk, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, sk, hkv, dv, generator=g, dtype=torch.float64)
    return q, k, v


CASES = [
    # b, sq, sk, h, hkv, d, dv
    (1, 1, 1, 1, 1, 8, 8),
    (2, 113, 203, 4, 2, 32, 16),
    (1, 239, 1, 3, 1, 16, 16),
    (1, 128, 128, 2, 2, 64, 64),
    (2, 65, 64, 4, 1, 24, 40),
    (1, 200, 90, 2, 2, 16, 16),
]
MASKS = [
    {},
    {"causal": True},
    {"window_size": (64, 0)},
    {"window_size": (5, 7)},
    {"causal": True, "window_size": (17, None)},
    {"window_size": (None, 3)},
]


@pytest.mark.parametrize("shape", CASES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kwargs", MASKS, ids=lambda k: str(k) or "nomask")
def test_tiled_equals_reference(shape, kwargs):
    q, k, v = _inputs(*shape, seed=hash((shape, str(kwargs))) % 1000)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **kwargs)
    out, lse, _ = attention_tiled(q, k, v, block_m=32, block_n=48, compute_dtype=torch.float64, **kwargs)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("kwargs", MASKS, ids=lambda k: str(k) or "nomask")
def test_reference_blocks_of_query_rows_change_nothing(monkeypatch, kwargs):
    # The reference builds its scores a block of query rows at a time (REFERENCE_BLOCK_ELEMS): blocks of a few rows,
    # with a ragged last one and sq != sk, give the one-block answer, and the same gradients.
    from cute_flash import reference

    q, k, v = (t.requires_grad_(True) for t in _inputs(2, 71, 50, 4, 2, 16, 24, seed=5))
    whole, whole_lse = attention_reference(q, k, v, return_lse=True, **kwargs)
    grads = torch.autograd.grad(whole.square().sum(), (q, k, v))
    monkeypatch.setattr(reference, "REFERENCE_BLOCK_ELEMS", 2 * 4 * 50 * 3)  # 3 rows per block
    blocks, blocks_lse = attention_reference(q, k, v, return_lse=True, **kwargs)
    # Equal up to the order of float64 sums: CI's CPU once gave 3e-10 on a gradient of size 5 here (its BLAS blocks
    # a 3-row product differently from a 71-row one), so 1e-9, still far below any error a wrong block would make.
    torch.testing.assert_close(blocks, whole, atol=1e-9, rtol=1e-9)
    assert torch.equal(torch.isinf(blocks_lse), torch.isinf(whole_lse))
    torch.testing.assert_close(blocks_lse, whole_lse)
    for g, w in zip(torch.autograd.grad(blocks.square().sum(), (q, k, v)), grads):
        torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-9)
    empty = attention_reference(q[:, :0], k, v, **kwargs)
    assert empty.shape == (2, 0, 4, 24)


def test_reference_matches_sdpa_without_mask():
    q, k, v = _inputs(2, 50, 70, 4, 4, 32, 32, seed=1)
    ref = attention_reference(q, k, v)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    torch.testing.assert_close(ref, sdpa.transpose(1, 2))


def test_causal_is_bottom_right_aligned():
    # seqlen_q < seqlen_k: the last query sees every key, the first sees sk - sq + 1 keys.
    allowed = visible_keys(3, 5, normalize_mask(True, (None, None)))
    assert allowed.tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]


def test_fully_masked_rows_give_zero_and_minus_inf():
    # seqlen_q > seqlen_k with causal: the first sq - sk queries see no key.
    q, k, v = _inputs(1, 10, 4, 2, 1, 16, 16, seed=3)
    out, lse = attention_reference(q, k, v, causal=True, return_lse=True)
    assert torch.all(out[:, :6] == 0)
    assert torch.all(torch.isneginf(lse[:, :, :6]))
    assert torch.isfinite(lse[:, :, 6:]).all()
    tiled, tiled_lse, _ = attention_tiled(q, k, v, causal=True, block_m=4, block_n=4, compute_dtype=torch.float64)
    assert torch.all(tiled[:, :6] == 0) and torch.all(torch.isneginf(tiled_lse[:, :, :6]))


def test_gqa_shares_kv_heads_between_consecutive_query_heads():
    q, k, v = _inputs(1, 9, 11, 4, 2, 8, 8, seed=4)
    out = attention_reference(q, k, v)
    for head in range(4):
        single = attention_reference(
            q[:, :, head : head + 1], k[:, :, head // 2 : head // 2 + 1], v[:, :, head // 2 : head // 2 + 1]
        )
        torch.testing.assert_close(out[:, :, head : head + 1], single)


def test_softmax_scale_is_applied():
    q, k, v = _inputs(1, 7, 7, 1, 1, 16, 16, seed=5)
    # scale s on q·k equals the default 1/sqrt(d) applied to q scaled by s·sqrt(d)
    torch.testing.assert_close(
        attention_reference(q, k, v, softmax_scale=0.5), attention_reference(q * (0.5 * math.sqrt(16)), k, v)
    )


def test_tiled_skips_hidden_blocks():
    q, k, v = _inputs(1, 256, 256, 1, 1, 8, 8, seed=6)
    _, _, dense = attention_tiled(q, k, v, block_m=64, block_n=64)
    _, _, causal = attention_tiled(q, k, v, causal=True, block_m=64, block_n=64)
    _, _, window = attention_tiled(q, k, v, window_size=(64, 0), block_m=64, block_n=64)
    assert dense == 16 and causal == 10 and window == 7


@pytest.mark.parametrize(
    "causal, window, expected",
    [
        (False, (None, None), MaskBounds("none", UNBOUNDED_WINDOW, UNBOUNDED_WINDOW)),
        (True, (None, None), MaskBounds("causal", UNBOUNDED_WINDOW, 0)),
        (True, (64, None), MaskBounds("local", 64, 0)),
        (False, (64, 0), MaskBounds("local", 64, 0)),
        (False, (None, 5), MaskBounds("local", UNBOUNDED_WINDOW, 5)),
        (True, (None, 5), MaskBounds("causal", UNBOUNDED_WINDOW, 0)),
    ],
)
def test_normalize_mask(causal, window, expected):
    assert normalize_mask(causal, window) == expected


def test_kv_block_range_empty_when_nothing_visible():
    blocks = BlockInfo(4, 4, "causal", seqlen_q=10, seqlen_k=4)
    lo, hi = blocks.kv_block_range(0)  # rows 0..3 see no key (sq - sk = 6)
    assert hi <= lo
    assert blocks.kv_block_range(2) == (0, 1)  # rows 8..9 see keys 0..3


@pytest.mark.parametrize(
    "kind, left, right",
    [
        ("none", UNBOUNDED_WINDOW, UNBOUNDED_WINDOW),
        ("causal", UNBOUNDED_WINDOW, 0),
        ("local", 64, 0),
        ("local", 5, 17),
        ("local", UNBOUNDED_WINDOW, 3),
    ],
)
def test_backward_block_ranges_match_brute_force(kind, left, right):
    """BlockInfo's backward direction: q_block_range holds exactly the query tiles with a row that sees a key of
    the key tile, and tile_needs_mask is never False for a tile holding a masked (row, key) pair."""
    for sq, sk, bm, bn in [
        (113, 203, 16, 32),
        (239, 1, 64, 128),
        (300, 100, 64, 64),
        (1, 1, 64, 128),
        (97, 97, 16, 16),
    ]:
        blocks = BlockInfo(bm, bn, kind, sq, sk, window_left=left, window_right=right)
        seen = visible_keys(sq, sk, MaskBounds(kind, left, right))
        for n in range((sk + bn - 1) // bn):
            lo, hi = blocks.q_block_range(n)
            expect = [m for m in range((sq + bm - 1) // bm) if seen[m * bm : (m + 1) * bm, n * bn : (n + 1) * bn].any()]
            assert list(range(lo, hi)) == expect, (sq, sk, bm, bn, n)
            for m in expect:
                rows = slice(m * bm, min((m + 1) * bm, sq))
                fully_visible = bool(seen[rows, n * bn : (n + 1) * bn].all()) and (n + 1) * bn <= sk
                if not fully_visible:
                    assert bool(blocks.tile_needs_mask(m, n)), (sq, sk, bm, bn, m, n)


@pytest.mark.parametrize("tile_m, tile_n", [(64, 128), (128, 128), (16, 32)])
def test_block_ranges_are_one_relation(tile_m, tile_n):
    """Key tile n visits query tile m (m in q_block_range(n)) exactly when n is in kv_block_range(m). The sm90
    backward's deterministic mode relies on it: the key tiles that add to a query tile's dQ take turns numbered from
    kv_block_range(m)[0], so one tile too many or too few on either side would deadlock."""
    import random

    rng = random.Random(0)
    for _ in range(60):
        sq, sk = rng.randint(1, 700), rng.randint(1, 700)
        kind = rng.choice(["none", "causal", "local"])
        left = rng.choice([UNBOUNDED_WINDOW, 0, 5, 64, 300]) if kind == "local" else UNBOUNDED_WINDOW
        right = (
            rng.choice([UNBOUNDED_WINDOW, 0, 7, 200])
            if kind == "local"
            else (0 if kind == "causal" else UNBOUNDED_WINDOW)
        )
        info = BlockInfo(tile_m, tile_n, kind, sq, sk, window_left=left, window_right=right)
        num_m, num_n = -(-sq // tile_m), -(-sk // tile_n)
        visits = {(m, n) for n in range(num_n) for m in range(*info.q_block_range(n))}
        for m in range(num_m):
            lo, hi = info.kv_block_range(m)
            assert {n for n in range(num_n) if (m, n) in visits} == set(range(lo, hi)), (sq, sk, kind, left, right, m)


# --- The reference is reachable and validates as cute_flash.attention does --------------------------------------
def test_reference_is_an_attribute_of_the_package():
    import subprocess
    import sys

    code = (
        "import sys, cute_flash; f = cute_flash.reference.attention_reference; "
        "assert cute_flash.attention_reference is f; assert 'cutlass' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _meta(b=2, sq=16, sk=16, h=4, hkv=4, d=64, dv=None, dtype=torch.bfloat16):
    dv = d if dv is None else dv
    return (
        torch.empty(b, sq, h, d, dtype=dtype, device="meta"),
        torch.empty(b, sk, hkv, d, dtype=dtype, device="meta"),
        torch.empty(b, sk, hkv, dv, dtype=dtype, device="meta"),
    )


# (name, inputs, keyword arguments): every one is rejected by cute_flash.attention.
BAD_CALLS = [
    ("scalar window", lambda: _meta(), {"window_size": 64}),
    ("float window", lambda: _meta(), {"window_size": (1.5, None)}),
    ("three-sided window", lambda: _meta(), {"window_size": (1, 2, 3)}),
    ("heads not divisible", lambda: _meta(h=6, hkv=4), {}),
    (
        "k and v heads differ",
        lambda: _meta()[:2] + (torch.empty(2, 16, 2, 64, dtype=torch.bfloat16, device="meta"),),
        {},
    ),
    (
        "k and v seqlens differ",
        lambda: _meta()[:2] + (torch.empty(2, 15, 4, 64, dtype=torch.bfloat16, device="meta"),),
        {},
    ),
    ("batches differ", lambda: _meta()[:2] + (torch.empty(3, 16, 4, 64, dtype=torch.bfloat16, device="meta"),), {}),
    (
        "q/k head dims differ",
        lambda: (_meta()[0], torch.empty(2, 16, 4, 32, dtype=torch.bfloat16, device="meta"), _meta()[2]),
        {},
    ),
    ("head dim not a multiple of 8", lambda: _meta(d=12), {}),
    ("head dim over 256", lambda: _meta(d=264), {}),
    ("head_dim_v not a multiple of 8", lambda: _meta(dv=100), {}),
    ("rank 3", lambda: (_meta()[0].flatten(2),) + _meta()[1:], {}),
    ("nan scale", lambda: _meta(), {"softmax_scale": float("nan")}),
    ("inf scale", lambda: _meta(), {"softmax_scale": float("inf")}),
    ("string scale", lambda: _meta(), {"softmax_scale": "0.1"}),
    ("negative scale", lambda: _meta(), {"softmax_scale": -0.1}),
    ("non-bool causal", lambda: _meta(), {"causal": 1}),
    ("mixed dtypes", lambda: _meta()[:2] + (_meta(dtype=torch.float16)[2],), {}),
]


@pytest.mark.parametrize("name, make, kwargs", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_reference_rejects_what_attention_rejects(monkeypatch, name, make, kwargs):
    import cute_flash
    from cute_flash import validation

    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "meta"))
    with pytest.raises(Exception) as from_attention:
        cute_flash.attention(*make(), **kwargs)
    with pytest.raises(Exception) as from_reference:
        attention_reference(*make(), **kwargs)
    assert type(from_reference.value) is type(from_attention.value)
    assert str(from_reference.value) == str(from_attention.value)
    with pytest.raises(type(from_attention.value)):
        attention_tiled(*make(), **kwargs)


def test_reference_takes_cpu_float_inputs_and_any_layout():
    q, k, v = _inputs(1, 9, 7, 2, 1, 16, 16, seed=8)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        assert torch.isfinite(attention_reference(q.to(dtype), k.to(dtype), v.to(dtype))).all()
    # A last dimension that is not contiguous: the kernels need a unit stride there, the reference does not.
    q_t = q.transpose(2, 3).contiguous().transpose(2, 3)
    torch.testing.assert_close(attention_reference(q_t, k, v), attention_reference(q, k, v))


@pytest.mark.parametrize("dtype", [torch.int32, torch.float8_e4m3fn])
def test_reference_rejects_other_dtypes(dtype):
    q, k, v = (t.to(dtype) for t in _inputs(1, 4, 4, 1, 1, 8, 8, seed=9))
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        attention_reference(q, k, v)


# --- Extreme softmax scales: the reference stays exact (it is the ground truth of the kernels' tests) ------------
def test_scale_zero_is_uniform_attention_over_visible_keys():
    q, k, v = _inputs(1, 10, 6, 2, 1, 16, 16, seed=10)
    out, lse = attention_reference(q, k, v, causal=True, softmax_scale=0.0, return_lse=True)
    assert torch.isfinite(out).all()
    off = 6 - 10
    for i in range(10):
        visible = i + off + 1
        if visible <= 0:
            assert torch.all(out[:, i] == 0) and torch.all(torch.isneginf(lse[:, :, i]))
        else:
            expect = v[:, :visible].mean(dim=1).repeat_interleave(2, dim=1)
            torch.testing.assert_close(out[:, i], expect)
            torch.testing.assert_close(lse[:, :, i], torch.full_like(lse[:, :, i], math.log(visible)))
    tiled, _, _ = attention_tiled(q, k, v, causal=True, softmax_scale=0.0, compute_dtype=torch.float64)
    torch.testing.assert_close(tiled, out)


@pytest.mark.parametrize("scale", [1e30, 1e300])
def test_huge_scale_is_a_hard_max(scale):
    q, k, v = _inputs(1, 5, 9, 1, 1, 8, 8, seed=11)
    out = attention_reference(q, k, v, softmax_scale=scale, window_size=(None, 0))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k)
    from cute_flash.spec import normalize_mask

    hidden = ~visible_keys(5, 9, normalize_mask(False, (None, 0)))
    best = scores.masked_fill(hidden, float("-inf")).argmax(dim=-1)  # (b, h, sq)
    expect = v[0, best[0, 0], 0]  # (sq, dv)
    torch.testing.assert_close(out[0, :, 0], expect)


def test_tiny_scale_is_nearly_uniform():
    q, k, v = _inputs(1, 4, 8, 1, 1, 8, 8, seed=12)
    out = attention_reference(q, k, v, softmax_scale=1e-30)
    torch.testing.assert_close(out, v.mean(dim=1, keepdim=True).expand_as(out))


# --- Softcap, learnable sinks and negative windows (FlashAttention-4's `attention_ref` semantics) -----------------
def fa4_hidden(sq: int, sk: int, window) -> torch.Tensor:
    """True where query i must not see key j: FlashAttention-4's `construct_local_mask` logic (no padding, no sink
    tokens), restated: with only a right bound, keys right of row + off + right are hidden; with a left bound, keys
    left of row + off - left, and (with a right bound too) keys right of min(row + off + right, sk)."""
    left, right = window
    row = torch.arange(sq).unsqueeze(1)
    col = torch.arange(sk).unsqueeze(0)
    off = sk - sq
    if left is None and right is None:
        return torch.zeros(sq, sk, dtype=torch.bool)
    if left is None:
        return col > row + off + right
    right_hidden = col > sk if right is None else col > torch.minimum(row + off + right, torch.tensor(sk))
    return right_hidden | (col < row + off - left)


def direct_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(None, None), softcap=0.0, sink=None):
    """The float64 formula in one piece, as FlashAttention-4's reference writes it: scaled scores, the tanh cap, the
    mask, then softmax over the keys and the sink together (logsumexp of the row with one more column)."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    kx = k.repeat_interleave(h // k.shape[2], dim=2)
    vx = v.repeat_interleave(h // k.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q * scale, kx)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    left, right = window_size
    if causal:
        right = 0
    scores = scores.masked_fill(fa4_hidden(sq, sk, (left, right)), float("-inf"))
    logits = scores
    if sink is not None:
        logits = torch.cat([scores, sink.view(1, h, 1, 1).expand(b, h, sq, 1)], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1))
    p = torch.where(torch.isneginf(lse).unsqueeze(-1), torch.zeros_like(p), p)  # rows with no key and no sink
    return torch.einsum("bhqk,bkhd->bqhd", p, vx), lse


# Windows of every sign: shifted off the diagonal either way, rows that see no key, bounds beyond the sequence.
SIGNED_WINDOWS = [
    (None, -3),
    (-4, None),
    (-2, 6),
    (5, -2),
    (0, 0),
    (3, -3),
    (-7, -1),
    (10, -40),
    (-300, None),
    (None, 300),
]
FEATURES = [
    {},
    {"softcap": 5.0},
    {"sink": True},
    {"softcap": 2.5, "sink": True},
]


def _sink(h: int, seed: int) -> torch.Tensor:
    return torch.randn(h, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


def _features(feat: dict, h: int, seed: int) -> dict:
    kw = {}
    if feat.get("softcap"):
        kw["softcap"] = feat["softcap"]
    if feat.get("sink"):
        kw["learnable_sink"] = _sink(h, seed)
    return kw


@pytest.mark.parametrize("shape", [(2, 37, 53, 4, 2, 16, 24), (1, 61, 20, 3, 1, 8, 8)])
@pytest.mark.parametrize(
    "mask",
    [{}, {"causal": True}, {"causal": True, "window_size": (9, None)}] + [{"window_size": w} for w in SIGNED_WINDOWS],
    ids=str,
)
@pytest.mark.parametrize("feat", FEATURES, ids=lambda f: "-".join(f) or "plain")
def test_references_match_the_direct_formula(shape, mask, feat):
    q, k, v = _inputs(*shape, seed=len(str(mask)) + shape[1])
    kw = _features(feat, shape[3], seed=shape[2])
    want, want_lse = direct_attention(q, k, v, **mask, softcap=kw.get("softcap", 0.0), sink=kw.get("learnable_sink"))
    out, lse = attention_reference(q, k, v, return_lse=True, **mask, **kw)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse.float(), atol=1e-5, rtol=1e-6)  # the reference's lse is float32
    # The tiled algorithm (the kernels' block walk, the sink folded in at the end) gives the same.
    tiled, tiled_lse, _ = attention_tiled(q, k, v, block_m=32, block_n=16, compute_dtype=torch.float64, **mask, **kw)
    torch.testing.assert_close(tiled, want, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(tiled_lse, want_lse.float(), atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("sq, sk", [(1, 1), (7, 7), (5, 13), (13, 5), (1, 40), (40, 1)])
def test_signed_windows_match_flashattention4s_local_mask(sq, sk):
    bounds = [None, -45, -6, -1, 0, 1, 2, 6, 45]
    for left in bounds:
        for right in bounds:
            ours = ~visible_keys(sq, sk, normalize_mask(False, (left, right)))
            assert torch.equal(ours, fa4_hidden(sq, sk, (left, right))), (sq, sk, left, right)
        # causal: FlashAttention-4 sets the right bound to 0 (ours is min(right, 0): the same for right >= 0)
        for right in (None, 0, 3):
            ours = ~visible_keys(sq, sk, normalize_mask(True, (left, right)))
            assert torch.equal(ours, fa4_hidden(sq, sk, (left, 0))), (sq, sk, left, right, "causal")


def test_rows_without_keys_give_zero_and_their_sink():
    # window (None, -3) on sq == sk: rows 0..2 see no key; (-4, None): the last 4 rows see none.
    q, k, v = _inputs(2, 12, 12, 3, 1, 8, 8, seed=20)
    sink = _sink(3, seed=21)
    for window, empty in (((None, -3), slice(0, 3)), ((-4, None), slice(8, 12))):
        for kw in ({}, {"learnable_sink": sink}, {"learnable_sink": sink, "softcap": 3.0}):
            out, lse = attention_reference(q, k, v, window_size=window, return_lse=True, **kw)
            tiled, tiled_lse, _ = attention_tiled(q, k, v, window_size=window, compute_dtype=torch.float64, **kw)
            for o, l_ in ((out, lse), (tiled, tiled_lse)):
                assert torch.all(o[:, empty] == 0)
                n = empty.stop - empty.start
                expect = sink.float().view(1, 3, 1).expand(2, 3, n) if kw else torch.full((2, 3, n), float("-inf"))
                assert torch.equal(l_[:, :, empty], expect)
                others = torch.ones(12, dtype=torch.bool)
                others[empty] = False
                assert torch.isfinite(l_[:, :, others]).all() and (o[:, others] != 0).any()


@pytest.mark.parametrize("b, sq, sk, h", [(0, 5, 7, 2), (2, 0, 7, 2), (2, 5, 0, 2), (2, 5, 7, 0), (0, 0, 0, 0)])
@pytest.mark.parametrize("sink", [False, True])
def test_every_empty_dimension(b, sq, sk, h, sink):
    # Zero keys used to raise in amax(); the kernels and the tiled reference give out 0 / lse -inf (the sink with
    # sinks), and the gradients of empty problems are zeros, not errors.
    q, k, v = (t.requires_grad_(True) for t in _inputs(b, sq, sk, h, 1 if h else 1, 16, 8, seed=22))
    kw = {"learnable_sink": _sink(h, seed=23).requires_grad_(True)} if sink else {}
    for extra in ({}, {"causal": True}, {"window_size": (-2, 3)}, {"softcap": 4.0}):
        out, lse = attention_reference(q, k, v, return_lse=True, **extra, **kw)
        assert out.shape == (b, sq, h, 8) and lse.shape == (b, h, sq)
        assert torch.all(out == 0) or sk > 0
        if sk == 0:
            expect = kw["learnable_sink"].detach().float().view(1, h, 1).expand(b, h, sq) if sink else None
            assert torch.equal(lse, expect) if sink else torch.all(torch.isneginf(lse))
        tiled, tiled_lse, visited = attention_tiled(q, k, v, compute_dtype=torch.float64, **extra, **kw)
        torch.testing.assert_close(tiled, out.detach())
        assert torch.equal(torch.isneginf(tiled_lse), torch.isneginf(lse))
        leaves = [q, k, v] + ([kw["learnable_sink"]] if sink else [])
        grads = torch.autograd.grad((out.sum(), lse[torch.isfinite(lse)].sum()), leaves, allow_unused=True)
        for leaf, g in zip(leaves, grads):
            assert g is None or (g.shape == leaf.shape and torch.isfinite(g).all())
            if sk == 0 and leaf is q:
                assert g is None or torch.all(g == 0)


def test_sink_gradient_is_the_contracts_formula():
    # Autograd through the float64 reference gives dsink = sum over batch and rows of P_sink * (dlse - D),
    # D = rowsum(dO * O): what `arch.base.sink_grad` computes on the device from lse and D.
    from cute_flash.arch.base import sink_grad

    q, k, v = (t.requires_grad_(True) for t in _inputs(2, 19, 23, 4, 2, 16, 16, seed=24))
    sink = _sink(4, seed=25).requires_grad_(True)
    g = torch.Generator().manual_seed(26)
    dout = torch.randn(2, 19, 4, 16, generator=g, dtype=torch.float64)
    dlse = torch.randn(2, 4, 19, generator=g, dtype=torch.float64)
    for kw in ({"causal": True}, {"window_size": (None, -5)}, {"softcap": 3.0, "window_size": (4, 2)}):
        out, lse = attention_reference(q, k, v, learnable_sink=sink, return_lse=True, **kw)
        (dsink,) = torch.autograd.grad((out, lse), (sink,), (dout, dlse.float()))
        d = (dout * out.detach()).sum(-1).transpose(1, 2)  # (b, h, sq)
        want = torch.empty(4, dtype=torch.float32)
        sink_grad(want, sink.detach().float(), lse.detach(), (d - dlse).float())
        torch.testing.assert_close(dsink.float(), want, atol=1e-5, rtol=1e-5)


def test_gradients_of_softcap_and_sink_are_exact():
    # Finite differences in float64 against autograd through the reference's out: dq, dk, dv, dsink (the float32
    # lse is too coarse for finite differences; its gradient is checked against the formula above).
    q, k, v = (t.requires_grad_(True) for t in _inputs(1, 5, 6, 2, 1, 8, 8, seed=27))
    sink = _sink(2, seed=28).requires_grad_(True)

    def f(q, k, v, sink):
        return attention_reference(q, k, v, causal=True, window_size=(3, -1), softcap=2.0, learnable_sink=sink)

    assert torch.autograd.gradcheck(f, (q, k, v, sink), atol=1e-5)


def test_softcap_bounds_every_logit():
    # Capped logits lie in (-softcap, softcap): even a huge scale leaves the softmax finite and smooth.
    q, k, v = _inputs(1, 9, 11, 2, 2, 16, 16, seed=29)
    out, lse = attention_reference(q, k, v, softmax_scale=1e30, softcap=1.5, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert (lse <= 1.5 + math.log(11) + 1e-6).all() and (lse >= -1.5).all()


def test_sink_at_extreme_scales():
    q, k, v = _inputs(1, 5, 9, 1, 1, 8, 8, seed=30)
    # A hard max (scale * score overflows): the sink's weight is 0 beside it.
    hard = attention_reference(q, k, v, softmax_scale=1e300)
    torch.testing.assert_close(attention_reference(q, k, v, softmax_scale=1e300, learnable_sink=_sink(1, 31)), hard)
    # A sink far above every score takes the whole weight: out 0 (underflowed), lse = the sink.
    out, lse = attention_reference(q, k, v, learnable_sink=torch.tensor([5000.0]), return_lse=True)
    assert torch.all(out.abs() < 1e-300) and torch.all(lse == 5000.0)


SINK_AND_SOFTCAP_ERRORS = [
    ({"softcap": -1.0}, ValueError, "softcap"),
    ({"softcap": float("nan")}, ValueError, "softcap"),
    ({"softcap": True}, ValueError, "softcap"),
    ({"learnable_sink": torch.zeros(3)}, ValueError, "learnable_sink"),
    ({"learnable_sink": torch.zeros(4, 1)}, ValueError, "learnable_sink"),
    ({"learnable_sink": torch.zeros(4, dtype=torch.int32)}, TypeError, "learnable_sink"),
    ({"learnable_sink": [0.0] * 4}, TypeError, "learnable_sink"),
    ({"learnable_sink": torch.zeros(4, device="meta")}, ValueError, "learnable_sink"),
]


@pytest.mark.parametrize("kw, error, match", SINK_AND_SOFTCAP_ERRORS, ids=lambda x: str(x)[:40])
def test_references_check_softcap_and_sinks_as_every_entry_point(kw, error, match):
    from cute_flash import validation

    q, k, v = _inputs(1, 4, 4, 4, 2, 8, 8, seed=32)
    with pytest.raises(error, match=match) as from_reference:
        attention_reference(q, k, v, **kw)
    with pytest.raises(error) as from_tiled:
        attention_tiled(q, k, v, **kw)
    # The messages are the shared checks' own.
    with pytest.raises(error) as shared:
        if "softcap" in kw:
            validation.check_softcap(kw["softcap"])
        else:
            validation.check_learnable_sink(kw["learnable_sink"], 4, q.device)
    assert str(from_reference.value) == str(shared.value) == str(from_tiled.value)


def test_acceptance_checks_take_sinks_and_dsink():
    # cute_flash.testing's checks on the CPU, fed the float32 reference's answers (within the rule of bf16 inputs):
    # softcap and the sink reach the references; dsink is one more report; a wrong dsink fails it.
    from cute_flash.testing import check_backward, check_forward

    q, k, v = (t.to(torch.bfloat16) for t in _inputs(2, 24, 40, 4, 2, 16, 16, seed=33))
    sink = _sink(4, seed=34).float()
    kw = {"causal": True, "window_size": (None, -2), "softcap": 3.0, "learnable_sink": sink}
    out, lse = attention_reference(q, k, v, compute_dtype=torch.float32, return_lse=True, **kw)
    assert [r.name for r in check_forward(q, k, v, out.to(q.dtype), lse, **kw)] == ["out", "lse"]
    leaves = [t.float().requires_grad_(True) for t in (q, k, v)] + [sink.clone().requires_grad_(True)]
    dout = torch.randn(2, 24, 4, 16, generator=torch.Generator().manual_seed(35)).to(torch.bfloat16)
    o = attention_reference(*leaves[:3], compute_dtype=torch.float32, **{**kw, "learnable_sink": leaves[3]})
    *grads, dsink = torch.autograd.grad(o, leaves, dout.float())
    grads = [g.to(torch.bfloat16) for g in grads]
    reports = check_backward(q, k, v, dout, grads, dsink=dsink, **kw)
    assert [r.name for r in reports] == ["dq", "dk", "dv", "dsink"] and all(r.ok for r in reports)
    with pytest.raises(AssertionError, match="dsink"):
        check_backward(q, k, v, dout, grads, dsink=dsink + 0.05 * dsink.abs().max(), **kw)
    with pytest.raises(ValueError, match="learnable_sink"):
        check_backward(q, k, v, dout, grads, dsink=dsink, causal=True)

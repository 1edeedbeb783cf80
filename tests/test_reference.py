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

"""score_mod / mask_mod on the CPU: tracing the issue's examples into graphs, the graphs' torch evaluation against
the callables themselves, cache keys, the errors for what a callable may not contain, score_mod derivatives against
autograd, block masks against brute force, and the float64 reference against the plain reference."""

from __future__ import annotations

import math

import pytest
import torch

from cute_flash.mods import ModError, create_block_mask, score_derivative, trace_mask_mod, trace_score_mod
from cute_flash.mods.block_mask import EMPTY, FULL, PARTIAL
from cute_flash.mods.graph import constant_result, evaluate
from cute_flash.mods.reference import attention_mods_reference
from cute_flash.reference import attention_reference

H = 4
SLOPES = torch.tensor([2.0 ** (-8 * (i + 1) / H) for i in range(H)])
MAX_DIST = 16
T5_TABLE = torch.randn(H, 2 * MAX_DIST + 1, generator=torch.Generator().manual_seed(0))
DOC = torch.tensor([[0] * 20 + [1] * 30 + [2] * 27, [0] * 40 + [1] * 37])  # (2, 77) document ids
HEAD_SCALES = torch.tensor([0.5, 1.0, 1.5, 2.0])
PREFIX = torch.tensor([9, 33])  # per batch row: the bidirectional prefix length
RANDOM_BLOCKS = torch.rand(8, 8, generator=torch.Generator().manual_seed(1)) < 0.5


def alibi(score, b, h, q_idx, kv_idx):
    return score - SLOPES[h] * (q_idx - kv_idx)


def t5_bias(score, b, h, q_idx, kv_idx):
    rel = torch.clamp(kv_idx - q_idx, -MAX_DIST, MAX_DIST) + MAX_DIST
    return score + T5_TABLE[h, rel]


def softcap30(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


def head_scaled(score, b, h, q_idx, kv_idx):  # a temperature per head: a derivative that reads no score
    return score * HEAD_SCALES[h]


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 24)


def document(b, h, q_idx, kv_idx):
    return (DOC[b, q_idx] == DOC[b, kv_idx]) & (q_idx >= kv_idx)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX[b]) | (q_idx >= kv_idx)


def random_blocks(b, h, q_idx, kv_idx):
    return RANDOM_BLOCKS[q_idx // 16, kv_idx // 16]


def strided(b, h, q_idx, kv_idx):  # remainders of negative differences: Python's sign (the divisor's)
    return ((q_idx - kv_idx) % 4) == 1


def chunks41(b, h, q_idx, kv_idx):  # a float quotient of positions: exact (x * (1 / 41) is not, at multiples of 41)
    return torch.floor(q_idx / 41.0) == torch.floor(kv_idx / 41.0)


def near(b, h, q_idx, kv_idx):  # a power of positions: products, exact (exp2(2 log2 6) is 36.000004)
    return (q_idx - kv_idx) ** 2 <= 36


def hidden_by_score(score, b, h, q_idx, kv_idx):  # a mask written as a score_mod: -inf for the hidden keys
    return torch.where((q_idx - kv_idx >= 8) | (kv_idx == 0), score, float("-inf"))


def empty_rows_by_score(score, b, h, q_idx, kv_idx):  # the first 8 rows see no key at all
    return torch.where(q_idx - kv_idx >= 8, score, float("-inf"))


SCORE_MODS = [alibi, t5_bias, softcap30, head_scaled]
MASK_MODS = [causal, sliding, document, prefix_lm, random_blocks, strided, chunks41, near]
B, SQ, SK = 2, 77, 77  # the document table's shape; random_blocks covers 128 positions


def _indices(b=B, h=H, sq=SQ, sk=SK):
    return (torch.arange(b).view(b, 1, 1, 1), torch.arange(h).view(1, h, 1, 1), torch.arange(sq).view(1, 1, sq, 1),
            torch.arange(sk).view(1, 1, 1, sk))  # fmt: skip


@pytest.mark.parametrize("fn", SCORE_MODS, ids=lambda f: f.__name__)
def test_score_mod_graphs_evaluate_as_the_callables(fn):
    graph = trace_score_mod(fn)
    bi, hi, qi, ki = _indices()
    score = torch.randn(B, H, SQ, SK, dtype=torch.float64)
    got = evaluate(graph, {"score": score, "b": bi, "h": hi, "q_idx": qi, "kv_idx": ki})
    torch.testing.assert_close(got.expand_as(score), fn(score, bi, hi, qi, ki).to(torch.float64).expand_as(score))


@pytest.mark.parametrize("fn", MASK_MODS, ids=lambda f: f.__name__)
def test_mask_mod_graphs_evaluate_as_the_callables(fn):
    graph = trace_mask_mod(fn)
    assert graph.nodes[-1].type == "bool"
    bi, hi, qi, ki = _indices()
    got = evaluate(graph, {"b": bi, "h": hi, "q_idx": qi, "kv_idx": ki})
    assert torch.equal(got.expand(B, H, SQ, SK), fn(bi, hi, qi, ki).expand(B, H, SQ, SK))


def test_graph_keys_depend_on_the_operations_not_on_captured_values():
    a = trace_score_mod(lambda s, b, h, q, kv: s + SLOPES[h] * (q - kv))
    b = trace_score_mod(lambda s, b, h, q, kv: s + SLOPES[h] * (q - kv))
    other = SLOPES * 3
    c = trace_score_mod(lambda s, b, h, q, kv: s + other[h] * (q - kv))
    assert a.key == b.key == c.key and a.aux[0] is SLOPES and c.aux[0] is other
    assert trace_score_mod(lambda s, b, h, q, kv: s + SLOPES.double()[h] * (q - kv)).key == a.key  # read as float32
    assert trace_score_mod(lambda s, b, h, q, kv: s - SLOPES[h] * (q - kv)).key != a.key
    assert trace_score_mod(lambda s, b, h, q, kv: s + SLOPES.int()[h] * (q - kv)).key != a.key
    # Unused computations and inputs leave no trace; a mask that ignores b and h says so.
    assert trace_score_mod(lambda s, b, h, q, kv: (q * 7, s)[1]).nodes == trace_score_mod(lambda *a: a[0]).nodes
    g = trace_mask_mod(causal)
    assert not g.uses("b") and not g.uses("h") and g.uses("q_idx")


@pytest.mark.parametrize(
    "fn, message",
    [
        (lambda s, b, h, q, kv: s if q > kv else -s, "control flow"),
        (lambda s, b, h, q, kv: torch.erf(s), "erf"),
        (lambda s, b, h, q, kv: s + SLOPES[h:], "slice bound"),
        (lambda s, b, h, q, kv: s + T5_TABLE[h], "2 dimensions"),
        (lambda s, b, h, q, kv: s + SLOPES[q / 2], "integer expression"),
        (lambda s, b, h, q, kv: s.softmax(0), "softmax"),
        (lambda s, b, h, q, kv: s + "x", "str"),
        (lambda s, b, h, q, kv: s + 2**40, "int32"),
        (lambda s, b, h, q, kv: s.item(), "item"),
    ],
)
def test_unsupported_contents_are_named(fn, message):
    with pytest.raises(ModError, match=message):
        score_derivative(trace_score_mod(fn))


def test_mask_mods_must_return_booleans():
    with pytest.raises(ModError, match="boolean"):
        trace_mask_mod(lambda b, h, q, kv: q - kv)
    with pytest.raises(TypeError):
        trace_mask_mod(3)


def _derivative_cases():
    yield from SCORE_MODS
    yield lambda s, b, h, q, kv: torch.where(q >= kv, s * s, torch.exp(s) / 3.0)
    yield lambda s, b, h, q, kv: torch.maximum(s, (q - kv).float() * 0.1) + torch.sigmoid(s) * torch.sqrt(s.abs() + 1)
    yield lambda s, b, h, q, kv: torch.log(s * s + 2.0) - torch.rsqrt(s * s + 1.0) + torch.pow(s.abs() + 1, 1.5)
    yield lambda s, b, h, q, kv: torch.exp2(s / 4) + torch.log2(s.abs() + 1) - torch.sin(s) * torch.cos(s)
    yield lambda s, b, h, q, kv: (q - kv).float()  # no dependence on the score: derivative 0
    yield lambda s, b, h, q, kv: torch.floor(s) + s * 0.5  # floor: derivative 0, as autograd's
    yield lambda s, b, h, q, kv: 2.0 ** (s / 4) + torch.pow(s.abs() + 1, s / 8)  # exponents that depend on the score


def test_score_derivatives_are_classified_for_the_kernels():
    """What the sm90 backward keeps of each derivative (arch/sm90/flash_bwd_mods.py): a constant (added biases: 1,
    a constant factor), a function of the positions only, or of the score. Terms of operands that do not depend on
    the score are dropped (no 0 * x): s * 2 + 1 folds to 2."""
    derivative = lambda fn: score_derivative(trace_score_mod(fn))  # noqa: E731
    assert constant_result(derivative(alibi)) == constant_result(derivative(t5_bias)) == 1.0
    assert constant_result(derivative(lambda s, b, h, q, kv: s * 2 + 1)) == 2.0
    assert constant_result(derivative(lambda s, b, h, q, kv: (q - kv).float())) == 0.0
    for fn, reads_score in ((head_scaled, False), (softcap30, True)):
        d = derivative(fn)
        assert constant_result(d) is None and d.uses("score") == reads_score


@pytest.mark.parametrize("fn", list(_derivative_cases()))
def test_score_derivative_matches_autograd(fn):
    bi, hi, qi, ki = _indices(1, H, 9, 11)
    score = (torch.randn(1, H, 9, 11, dtype=torch.float64) * 3).requires_grad_()
    value = torch.as_tensor(fn(score, bi, hi, qi, ki), dtype=torch.float64).expand_as(score)
    grad = torch.autograd.grad(value.sum(), score)[0] if value.requires_grad else torch.zeros_like(score)
    d = score_derivative(trace_score_mod(fn))
    got = evaluate(d, {"score": score.detach(), "b": bi, "h": hi, "q_idx": qi, "kv_idx": ki})
    torch.testing.assert_close(got.expand_as(score), grad)


def _brute_states(fn, b, h, sq, sk, tm, tn):
    bi, hi, qi, ki = _indices(b, h, sq, sk)
    vis = fn(bi, hi, qi, ki).expand(b, h, sq, sk)
    m, n = -(-sq // tm), -(-sk // tn)
    want = torch.empty(b, h, m, n, dtype=torch.int8)
    for i in range(m):
        for j in range(n):
            tile = vis[:, :, i * tm : (i + 1) * tm, j * tn : (j + 1) * tn]
            want[:, :, i, j] = torch.where(
                tile.flatten(2).all(-1), FULL, torch.where(tile.flatten(2).any(-1), PARTIAL, EMPTY)
            )
    return want


@pytest.mark.parametrize("fn", MASK_MODS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("tiles", [(16, 16), (32, 16), (64, 128)])
def test_block_masks_classify_tiles(fn, tiles):
    tm, tn = tiles
    mask = create_block_mask(fn, B, H, SQ, SK, tile_m=tm, tile_n=tn)
    b = B if trace_mask_mod(fn).uses("b") else 1
    want = _brute_states(fn, b, 1, SQ, SK, tm, tn)  # none of the examples reads h
    assert mask.partial_index.shape[:2] == (b, 1)
    assert torch.equal(mask.tile_states(), want)
    # Ascending indices, the partial / full ones first.
    n = want.shape[-1]
    for count, index, state in ((mask.partial_count, mask.partial_index, PARTIAL), (mask.full_count, mask.full_index,
                                FULL)):  # fmt: skip
        assert torch.equal(count, (want == state).sum(-1, dtype=torch.int32))
        for row in range(want.shape[2]):
            k = int(count[0, 0, row])
            expect = torch.nonzero(want[0, 0, row] == state).flatten()
            assert torch.equal(index[0, 0, row, :k].long(), expect) and index.shape[-1] == n


def test_block_mask_arguments():
    with pytest.raises(ValueError, match="reads b"):
        create_block_mask(document, None, None, SQ, SK)
    with pytest.raises(ValueError, match="seqlen_q"):
        create_block_mask(causal, 1, 1, -1, SK)
    empty = create_block_mask(causal, None, None, 0, 0)
    assert empty.partial_index.shape == (1, 1, 0, 0)


def test_mods_reference_agrees_with_the_plain_reference():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 37, H, 32, generator=g)
    k = torch.randn(2, 53, 2, 32, generator=g)
    v = torch.randn(2, 53, 2, 16, generator=g)
    out, lse = attention_mods_reference(q, k, v, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    # A causal mask_mod is bottom-right causal when the lengths are equal (top-left positions otherwise).
    qs = q[:, :37]
    ks, vs = k[:, :37], v[:, :37]
    torch.testing.assert_close(
        attention_mods_reference(qs, ks, vs, mask_mod=causal), attention_reference(qs, ks, vs, causal=True)
    )
    # softcap written as a score_mod is the softcap feature.
    torch.testing.assert_close(
        attention_mods_reference(q, k, v, score_mod=softcap30, softmax_scale=0.5),
        attention_reference(q, k, v, softcap=30.0, softmax_scale=0.5),
    )
    # A mask written as a score_mod (-inf scores) is that mask; its rows without keys get out 0 and lse -inf.
    out, lse = attention_mods_reference(qs, ks, vs, score_mod=empty_rows_by_score, return_lse=True)
    torch.testing.assert_close(out, attention_reference(qs, ks, vs, causal=True, window_size=(None, -8)))
    assert torch.all(out[:, :8] == 0) and torch.all(torch.isneginf(lse[:, :, :8]))
    # A row that sees no key: out 0, lse -inf.
    out, lse = attention_mods_reference(q, k, v, mask_mod=lambda b, h, qi, ki: (qi > 0) & (ki >= 0), return_lse=True)
    assert torch.all(out[:, 0] == 0) and torch.all(torch.isneginf(lse[:, :, 0]))


def test_mods_reference_gradients_flow_through_score_mod():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 9, H, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def fn(q, k, v):
        return attention_mods_reference(q, k, v, score_mod=alibi, mask_mod=causal)

    assert torch.autograd.gradcheck(fn, (q, k, v))
    assert math.isfinite(float(fn(q, k, v).detach().sum()))


def test_evaluate_refuses_indices_outside_a_table():
    """Kernels neither wrap negative indices nor check bounds: the graph's own evaluation raises instead of agreeing
    with torch's wrap-around."""
    graph = trace_score_mod(lambda s, b, h, q, kv: s + T5_TABLE[h, q - kv])
    bi, hi, qi, ki = _indices(1, H, 4, 6)
    with pytest.raises(IndexError, match="outside"):
        evaluate(graph, {"score": torch.zeros(1, H, 4, 6), "b": bi, "h": hi, "q_idx": qi, "kv_idx": ki})


def test_integer_semantics_are_the_kernels():
    """Integers are 32-bit (products wrap as in the kernels), a constant index wraps as torch's, and an integer
    division by the constant 0 is refused at trace time."""
    big = trace_mask_mod(lambda b, h, qi, ki: qi * ki < 10**9)
    idx = {"b": torch.zeros(1), "h": torch.zeros(1), "q_idx": torch.tensor([40000]), "kv_idx": torch.tensor([60000])}
    assert bool(evaluate(big, idx)) == (torch.tensor([40000], dtype=torch.int32) * 60000 < 10**9).item()
    table = torch.arange(6.0).view(2, 3)
    last = trace_score_mod(lambda s, b, h, qi, ki: s + table[-1, h])
    got = evaluate(last, {"score": torch.zeros(3), "b": 0, "h": torch.arange(3), "q_idx": 0, "kv_idx": 0})
    assert torch.equal(got.float(), table[-1])
    with pytest.raises(ModError, match="out of range"):
        trace_score_mod(lambda s, b, h, qi, ki: s + table[2, h])
    with pytest.raises(ModError, match="by the constant 0"):
        trace_mask_mod(lambda b, h, qi, ki: qi // 0 == 1)


def test_packed_reference_is_the_dense_one_per_sequence():
    """attention_varlen_mods_reference: sequence b through the dense reference with the callables seeing b and
    positions within the sequence; equal lengths give the dense batch's result, seqused_k drops keys."""
    from cute_flash.mods.reference import attention_varlen_mods_reference

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 77, n, 32, generator=g, dtype=torch.float64) for n in (4, 2, 2))
    cu = torch.tensor([0, 77, 154])
    kw = dict(score_mod=alibi, mask_mod=document, causal=True)
    out, lse = attention_varlen_mods_reference(*(t.flatten(0, 1) for t in (q, k, v)), cu, cu, return_lse=True, **kw)
    want, want_lse = attention_mods_reference(q, k, v, return_lse=True, **kw)
    torch.testing.assert_close(out, want.flatten(0, 1))
    torch.testing.assert_close(lse, want_lse.transpose(0, 1).flatten(1))
    used = torch.tensor([30, 77])
    out = attention_varlen_mods_reference(*(t.flatten(0, 1) for t in (q, k, v)), cu, cu, seqused_k=used, **kw)
    first = attention_mods_reference(q[:1], k[:1, :30], v[:1, :30], **kw)
    torch.testing.assert_close(out[:77], first[0])

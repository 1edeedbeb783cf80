"""GPU (Hopper): the sm90 KV-cache forward (arch/sm90/kvcache/) through `BACKEND.forward_kvcache`, against a float64
oracle written here: each sequence's keys gathered through its page table (the front end's append of new tokens is
not part of the kernel), attended with FlashAttention's rule (max |out - ref| <= 2 * max |torch in the input dtype -
ref| + 1e-5; LSE likewise, -inf exactly for rows that see no key).

The caches are hostile: pages in a random order, prefix pages shared between sequences, every cache row past a
sequence's length NaN (the kernel must mask those keys and zero those V rows), unused page-table entries pointing
nowhere, outputs NaN before the call (every row must be written).

Soft-capping and learnable sinks (the `kvcache_features` builds): the oracle caps scores as FlashAttention-4's
attention_ref does (softcap * tanh(score * scale / softcap), masked after capping; an fp8 cache's scores are its
dequantised keys' before the cap) and adds each query head's sink to its rows' denominators and LSE (rows without
keys: out 0, LSE the sink). The sinks differ per query head, so a row that read another head's sink (a wrong GQA
row mapping in the kernel's view, or in the split combine's) fails the rule.

Run: pytest -m sm90 tests/test_sm90_kvcache.py  (skips without a compute capability 9.0 GPU; ~37 builds).
"""

from __future__ import annotations

from typing import List, Sequence

import pytest
import torch

from cute_flash import compile_cache
from cute_flash.arch.base import KvCacheTensors
from cute_flash.arch.sm90 import BACKEND
from cute_flash.reference import visible_keys
from cute_flash.spec import AttentionSpec, MaskBounds, normalize_mask
from cute_flash.testing import ABS_SLACK
from cute_flash.validation import KvCacheProblem

pytestmark = pytest.mark.sm90

UNUSED_PAGE = 1 << 20  # page-table entries no length reaches: the kernel must never use them


def _oracle(q, k, v, mask: MaskBounds, scale: float, dtype, softcap: float = 0.0, sink=None):
    """out (sq, h, dv) and lse (h, sq) of one sequence (q (sq, h, d), k / v (sk, h_kv, d)), computed in `dtype`;
    softcap > 0 caps the scores, sink (h,) joins each row's denominator and LSE."""
    sq, h, _ = q.shape
    sk, h_kv, _ = k.shape
    kc = k.to(dtype).repeat_interleave(h // h_kv, dim=1)
    vc = v.to(dtype).repeat_interleave(h // h_kv, dim=1)
    raw = torch.einsum("qhd,khd->hqk", q.to(dtype), kc)
    if softcap > 0:  # the logits are base * mult: the capped scores, or the raw ones times the scale
        base, mult = softcap * torch.tanh(raw * (scale / softcap)), 1.0
    else:
        base, mult = raw, scale
    hidden = ~visible_keys(sq, sk, mask, q.device)
    if sk:
        row_max = base.masked_fill(hidden, float("-inf")).amax(dim=-1, keepdim=True)
    else:  # no key at all (amax of an empty dimension raises)
        row_max = torch.full((h, sq, 1), float("-inf"), dtype=base.dtype, device=q.device)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    logits = ((base - row_max) * mult).masked_fill(hidden, float("-inf"))
    top = row_max * mult
    sink_term = 0.0
    if sink is not None:  # one more logit per row, valued at nothing: the larger of it and the keys' max is the shift
        s = sink.to(dtype).view(h, 1, 1)
        logits = logits + torch.clamp(top - s, max=0.0)
        top = torch.maximum(top, s)
        sink_term = torch.exp(s - top)
    p = torch.exp(logits)
    row_sum = p.sum(dim=-1, keepdim=True) + sink_term
    out = torch.einsum("hqk,khd->qhd", p / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum), vc)
    return out, (top + torch.log(row_sum)).squeeze(-1).float()


def _max_abs(a, b) -> float:
    return 0.0 if a.numel() == 0 else (a.double() - b.double()).abs().max().item()


def _check_sequence(out, lse, q, k, v, mask: MaskBounds, scale: float, name: str, softcap=0.0, sink=None) -> None:
    ref, ref_lse = _oracle(q, k, v, mask, scale, torch.float64, softcap, sink)
    low, low_lse = _oracle(q, k, v, mask, scale, q.dtype, softcap, sink)
    assert torch.isfinite(out).all(), f"{name}: out has non-finite values"
    err, bound = _max_abs(out, ref), 2 * _max_abs(low, ref) + ABS_SLACK
    assert err <= bound, f"{name}: out err {err:.3e} > {bound:.3e}"
    empty = torch.isinf(ref_lse)  # rows without keys and without a sink
    assert torch.equal(torch.isneginf(lse), empty), f"{name}: lse -inf rows differ"
    no_keys = ~visible_keys(q.shape[0], k.shape[0], mask, q.device).any(dim=-1)
    assert torch.count_nonzero(out[no_keys]) == 0, f"{name}: rows without keys must give out 0"
    keep = ~empty
    err = _max_abs(lse[keep], ref_lse[keep])
    bound = 2 * max(_max_abs(low_lse[keep], ref_lse[keep]), 1e-4) + ABS_SLACK
    assert err <= bound, f"{name}: lse err {err:.3e} > {bound:.3e}"


class Cache:
    """A random K / V cache for sequences of `seqlens_k` keys: paged (page_size > 0: pages in a random order, the
    first full pages of sequence 1 shared with sequence 0, a spare page) or dense (b, capacity, h_kv, d); NaN in every
    row that no sequence's length reaches; `spare` pages more than the sequences need (capacity: the cache's rows
    per sequence, page table columns x page_size)."""

    def __init__(
        self, seqlens_k: Sequence[int], page_size: int, h_kv: int, d: int, dtype, seed: int, capacity=None, spare=1,
        fp8: bool = False,
    ):  # fmt: skip
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.page_size, self.lengths = page_size, list(seqlens_k)
        b = len(seqlens_k)
        self.k_descale = self.v_descale = None
        if fp8:  # e4m3 values up to ~16 and per (sequence, KV head) descales: the keys are k * k_descale[b, g]
            self.k_descale, self.v_descale = (torch.rand(b, h_kv, generator=gen, device="cuda") + 0.05 for _ in "kv")
        if page_size == 0:
            cap = capacity or max(max(seqlens_k), 1)
            self.k, self.v = (torch.randn(b, cap, h_kv, d, generator=gen, device="cuda").to(dtype) for _ in "kv")
            for i, n in enumerate(seqlens_k):
                self.k[i, n:], self.v[i, n:] = float("nan"), float("nan")
            self.page_table, self.capacity = None, cap
            self._to_fp8(fp8)
            return
        pages = [-(-n // page_size) for n in seqlens_k]
        max_pages = (capacity // page_size) if capacity else max(pages) + 1
        shared = min(pages[0], pages[1]) // 2 if b > 1 else 0  # full pages of sequence 0 reused by sequence 1
        total = sum(pages) - shared + spare
        order = torch.randperm(total, generator=gen, device="cuda").tolist()
        table = torch.full((b, max_pages), UNUSED_PAGE, dtype=torch.int32)
        nxt = 0
        for i, n in enumerate(pages):
            first = shared if i == 1 else 0
            if i == 1:
                table[1, :shared] = table[0, :shared]
            table[i, first:n] = torch.tensor(order[nxt : nxt + n - first], dtype=torch.int32)
            nxt += n - first
        self.page_table, self.capacity = table.cuda(), max_pages * page_size
        self.k, self.v = (torch.randn(total, page_size, h_kv, d, generator=gen, device="cuda").to(dtype) for _ in "kv")
        used = torch.zeros(total, page_size, dtype=torch.bool, device="cuda")
        for i, n in enumerate(seqlens_k):
            rows = self.page_table[i, : pages[i]].long()
            flat = used[rows].reshape(-1)
            flat[:n] = True
            used[rows] = flat.view(-1, page_size)
        self.k[~used], self.v[~used] = float("nan"), float("nan")
        self._to_fp8(fp8)

    def _to_fp8(self, fp8: bool) -> None:
        if fp8:
            self.k, self.v = ((x.float() * 4).to(torch.float8_e4m3fn) for x in (self.k, self.v))

    def keys(self, i: int):
        """Sequence i's (K, V) rows, (seqlen_k, h_kv, d) each (an fp8 cache's times its descales, in fp32)."""
        n = self.lengths[i]
        if self.page_table is None:
            k, v = self.k[i, :n], self.v[i, :n]
        else:
            rows = self.page_table[i, : -(-n // self.page_size)].long()
            k, v = (x[rows].reshape(-1, *x.shape[2:])[:n] for x in (self.k, self.v))
        if self.k_descale is None:
            return k, v
        return k.float() * self.k_descale[i, :, None], v.float() * self.v_descale[i, :, None]


def _run(
    cache: Cache,
    seqlens_q: Sequence[int],
    h: int,
    *,
    packed: bool = False,
    causal: bool = False,
    window=(None, None),
    splits: int = 1,
    seed: int = 0,
    dtype=torch.bfloat16,
    softcap: float = 0.0,
    sink=None,
    scale=None,
):
    """One forward_kvcache call and its tensors: q (b, sq, h, d) with sq = seqlens_q[0] for all (packed: (total_q,
    h, d)); softcap > 0 and sink (h,) fp32 select the feature build; returns (tensors, problem)."""
    b = len(cache.lengths)
    h_kv, d = cache.k.shape[2], cache.k.shape[3]
    fp8 = cache.k_descale is not None
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(seqlens_q) if packed else b * seqlens_q[0]
    max_sq = max(seqlens_q)
    q_shape = (total, h, d) if packed else (b, seqlens_q[0], h, d)
    q = torch.randn(*q_shape, generator=gen, device="cuda").to(dtype)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((h, total) if packed else (b, h, seqlens_q[0]), float("nan"), device="cuda")
    cu = None
    if packed:
        cu = torch.tensor([0] + list(torch.tensor(seqlens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    mask = normalize_mask(causal, window)
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    spec = AttentionSpec(
        name, d, d, mask.kind, name, kvcache=True, page_size=cache.page_size, kv_fp8=fp8, softcap=softcap > 0,
        sink=sink is not None,
    )  # fmt: skip
    assert BACKEND.unsupported_reason(spec, backward=False) is None
    scale = d**-0.5 if scale is None else scale
    problem = KvCacheProblem(
        b, max_sq, total, h, h_kv, d, d, cache.capacity, cache.k.shape[0], spec, mask, scale, softcap, packed_q=packed
    )
    seqlens_k = torch.tensor(cache.lengths, dtype=torch.int32, device="cuda")
    descales = dict(k_descale=cache.k_descale, v_descale=cache.v_descale)
    t = KvCacheTensors(q, cache.k, cache.v, out, lse, seqlens_k, cache.page_table, cu, sink, **descales)
    BACKEND.forward_kvcache(t, problem, splits)
    return t, problem


def _check(cache: Cache, t: KvCacheTensors, problem: KvCacheProblem, seqlens_q: Sequence[int]) -> None:
    offsets = [0] + torch.tensor(seqlens_q).cumsum(0).tolist()
    for i in range(len(cache.lengths)):
        k, v = cache.keys(i)
        if problem.packed_q:
            rows = slice(offsets[i], offsets[i + 1])
            q, out, lse = t.q[rows], t.out[rows], t.lse[:, rows]
        else:
            q, out, lse = t.q[i], t.out[i], t.lse[i]
        if q.shape[0] == 0:
            continue
        name = f"seq {i} (sq {q.shape[0]}, sk {cache.lengths[i]})"
        _check_sequence(out, lse, q, k, v, problem.mask, problem.softmax_scale, name, problem.softcap, t.sink)


def _lengths(page_size: int) -> List[int]:
    """Empty, one key, page boundaries (and either side of them), odd."""
    p = page_size or 16
    return [0, 1, p - 1, p, p + 1, 3 * p, 777]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("page_size", [16, 64, 128, 256, 0], ids=lambda p: f"page{p}" if p else "dense")
def test_page_sizes_and_lengths(page_size, splits):
    cache = Cache(_lengths(page_size), page_size, 2, 128, torch.bfloat16, seed=page_size + splits)
    t, problem = _run(cache, [1], 8, splits=splits, seed=page_size)
    _check(cache, t, problem, [1])


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("sq", [1, 3, 8])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_groups_and_query_tokens(group, sq, splits):
    """GQA in the tile: group query heads per KV head as rows (group x sq <= 64: the decoding tile), causal."""
    cache = Cache([5, 300, 1000, 64], 16, 2, 128, torch.bfloat16, seed=group * 10 + sq)
    t, problem = _run(cache, [sq], 2 * group, causal=True, splits=splits, seed=sq)
    _check(cache, t, problem, [sq])


WINDOWS = [(True, (None, None)), (False, (100, 0)), (False, (37, 5)), (True, (200, None)), (False, (-3, 40)),
           (False, (None, -2)), (False, (0, 0))]  # fmt: skip


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("mask", WINDOWS, ids=lambda m: f"causal{m[1]}" if m[0] else f"window{m[1]}")
def test_masks(mask, splits):
    """Causal and windows (negative bounds too) bottom-right aligned per sequence, with several query tokens."""
    causal, window = mask
    cache = Cache([3, 129, 1000, 2047], 16, 2, 128, torch.bfloat16, seed=splits)
    t, problem = _run(cache, [5], 8, causal=causal, window=window, splits=splits, seed=7)
    _check(cache, t, problem, [5])


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("page_size", [16, 0], ids=["page16", "dense"])
def test_packed_queries(page_size, splits):
    """q (total_q, h, d) with cu_seqlens_q: speculative tokens and a sequence without queries."""
    seqlens_q = [1, 3, 0, 6, 2]
    cache = Cache([17, 500, 40, 1500, 6], page_size, 2, 128, torch.bfloat16, seed=11)
    t, problem = _run(cache, seqlens_q, 8, packed=True, causal=True, splits=splits, seed=5)
    _check(cache, t, problem, seqlens_q)


@pytest.mark.parametrize("splits", [1, 2])
def test_chunked_prefill(splits):
    """More rows than the decoding tile (40 tokens x 4 heads): the forward's own 128-row tile, against a paged
    prefix."""
    seqlens_q = [40, 1, 33, 17]
    cache = Cache([40 + 900, 1, 33, 17 + 64], 16, 2, 128, torch.bfloat16, seed=3)
    t, problem = _run(cache, seqlens_q, 8, packed=True, causal=True, splits=splits, seed=9)
    _check(cache, t, problem, seqlens_q)


@pytest.mark.parametrize("d", [64, 256])
def test_head_dims(d):
    cache = Cache([1, 200, 1031], 16, 2, d, torch.bfloat16, seed=d)
    t, problem = _run(cache, [2], 8, causal=True, seed=d)
    _check(cache, t, problem, [2])


def test_fp16():
    cache = Cache([100, 1030], 16, 2, 128, torch.float16, seed=4)
    t, problem = _run(cache, [1], 8, splits=3, seed=4, dtype=torch.float16)
    _check(cache, t, problem, [1])


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("page_size", [16, 0], ids=["page16", "dense"])
def test_fp8_cache(page_size, splits):
    """An e4m3 cache with descales per (sequence, KV head), against the oracle on its dequantized keys (the kernel
    converts exactly and folds the descales into the scale and O)."""
    cache = Cache([0, 16, 17, 900, 2047], page_size, 2, 128, torch.bfloat16, seed=31 + splits, fp8=True)
    t, problem = _run(cache, [2], 8, causal=True, splits=splits, seed=31)
    _check(cache, t, problem, [2])


@pytest.mark.parametrize("case", ["d256", "more_rows", "fp16"])
def test_fp8_cache_other_tiles(case):
    d, seqlens_q, dtype = {"d256": (256, [3], torch.bfloat16), "more_rows": (128, [40, 5], torch.bfloat16),
                           "fp16": (128, [1], torch.float16)}[case]  # fmt: skip
    packed = case == "more_rows"
    cache = Cache([300, 1111], 16, 2, d, dtype, seed=d, fp8=True)
    t, problem = _run(cache, seqlens_q, 8, packed=packed, causal=True, splits=2, seed=d, dtype=dtype)
    _check(cache, t, problem, seqlens_q)


def _swapped(problem) -> bool:
    from cute_flash.arch.sm90.kvcache.tile_config import SwappedTileConfig, kvcache_tile_config, problem_rows

    return isinstance(kvcache_tile_config(problem.spec, problem_rows(problem)), SwappedTileConfig)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("page_size", [8, 16, 64, 128, 256, 0], ids=lambda p: f"page{p}" if p else "dense")
def test_fp8_cache_swapped_decoder_page_sizes_and_lengths(page_size, splits):
    """The swapped decoder (an fp8 cache at d128, <= 16 rows: kvcache/swapped.py): lengths 0, 1, at and either side
    of page boundaries, NaN in every row past them (masked keys, zeroed V rows)."""
    cache = Cache(_lengths(page_size), page_size, 2, 128, torch.bfloat16, seed=41 + page_size + splits, fp8=True)
    t, problem = _run(cache, [1], 8, splits=splits, seed=page_size)
    assert _swapped(problem)
    _check(cache, t, problem, [1])


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("mask", WINDOWS, ids=lambda m: f"causal{m[1]}" if m[0] else f"window{m[1]}")
def test_fp8_cache_swapped_decoder_masks(mask, sq, splits):
    """Causal and windows (negative bounds too) in the swapped decoder: 4 rows (one token) and 12 (three: two row
    tiles, each row's token its own diagonal)."""
    causal, window = mask
    cache = Cache([3, 129, 1000, 2047], 16, 2, 128, torch.bfloat16, seed=splits + 5 * sq, fp8=True)
    t, problem = _run(cache, [sq], 8, causal=causal, window=window, splits=splits, seed=7 + sq)
    assert _swapped(problem)
    _check(cache, t, problem, [sq])


@pytest.mark.parametrize("group, sq", [(1, 1), (2, 1), (8, 1), (16, 1), (8, 2), (1, 16), (5, 3)])
def test_fp8_cache_swapped_decoder_groups(group, sq):
    """Query heads per KV head x tokens from 1 to 16 rows (odd ones too), causal, split."""
    cache = Cache([5, 300, 1000, 64], 16, 2, 128, torch.bfloat16, seed=group * 10 + sq, fp8=True)
    t, problem = _run(cache, [sq], 2 * group, causal=True, splits=2, seed=sq)
    assert _swapped(problem)
    _check(cache, t, problem, [sq])


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("page_size", [16, 0], ids=["page16", "dense"])
def test_fp8_cache_swapped_decoder_packed_queries(page_size, splits):
    """q (total_q, h, d) with cu_seqlens_q through the swapped decoder: up to 4 tokens x 4 heads, a sequence
    without queries; fp16 q too."""
    seqlens_q = [1, 3, 0, 4, 2]
    cache = Cache([17, 500, 40, 1500, 6], page_size, 2, 128, torch.bfloat16, seed=13, fp8=True)
    for dtype in (torch.bfloat16, torch.float16):
        t, problem = _run(cache, seqlens_q, 8, packed=True, causal=True, splits=splits, seed=6, dtype=dtype)
        assert _swapped(problem)
        _check(cache, t, problem, seqlens_q)


def test_fp8_cache_swapped_decoder_many_short_walks():
    """A grid of at least one CTA per SM with short caches runs the two-CTA form (tile_config.SWAPPED_SHORT_WALKS):
    70 sequences x 2 KV heads of 0-1500 keys, paged."""
    from cute_flash.arch.sm90.kvcache.tile_config import SWAPPED_SHORT_WALKS, problem_tile_config

    lengths = torch.randint(0, 1500, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    cache = Cache(lengths, 16, 2, 128, torch.bfloat16, seed=47, fp8=True)
    t, problem = _run(cache, [1], 8, causal=True, seed=47)
    assert problem_tile_config(problem, compile_cache.sm_count(t.q.device)) == SWAPPED_SHORT_WALKS
    _check(cache, t, problem, [1])


def test_one_long_sequence_with_the_backends_splits():
    """Batch 1 x 32k keys, GQA 32 / 8: the split count kvcache_splits chooses for this GPU."""
    cache = Cache([32768], 128, 8, 128, torch.bfloat16, seed=1)
    b = len(cache.lengths)
    mask = normalize_mask(False, (None, None))
    spec = AttentionSpec("bf16", 128, 128, "none", "bf16", kvcache=True, page_size=128)
    problem = KvCacheProblem(b, 1, b, 32, 8, 128, 128, cache.capacity, cache.k.shape[0], spec, mask, 128**-0.5)
    splits = BACKEND.kvcache_splits(problem, compile_cache.sm_count(torch.device("cuda")))
    assert splits > 1
    t, problem = _run(cache, [1], 32, splits=splits)
    _check(cache, t, problem, [1])


@pytest.mark.parametrize("splits", [1, 3])
def test_reruns_are_bitwise_equal(splits):
    cache = Cache([1000, 333, 64], 16, 2, 128, torch.bfloat16, seed=8)
    t, problem = _run(cache, [4], 8, causal=True, splits=splits)
    first_out, first_lse = t.out.clone(), t.lse.clone()
    for _ in range(3):
        BACKEND.forward_kvcache(t, problem, splits)
        assert torch.equal(t.out, first_out) and torch.equal(t.lse, first_lse)


@pytest.mark.parametrize("page_size", [16, 0], ids=["page16", "dense"])
def test_cuda_graph_replays_with_new_lengths_and_page_tables(page_size):
    """A decode step captured once: replays read the lengths and page tables the static tensors hold then."""
    capacity = 2048
    cache = Cache([700, 5, 2000], page_size, 2, 128, torch.bfloat16, seed=21, capacity=capacity, spare=400)
    t, problem = _run(cache, [1], 8, splits=3)  # compiles, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        BACKEND.forward_kvcache(t, problem, 3)
    for step, lengths in enumerate([[701, 6, 2001], [1, 2048, 0], [1500, 1500, 17]]):
        new = Cache(lengths, page_size, 2, 128, torch.bfloat16, seed=100 + step, capacity=capacity)
        cache.k[: new.k.shape[0]].copy_(new.k)
        cache.v[: new.v.shape[0]].copy_(new.v)
        t.seqlens_k.copy_(torch.tensor(lengths, dtype=torch.int32))
        if page_size:
            t.page_table.copy_(new.page_table)
        t.out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        cache.lengths, cache.page_table = list(lengths), t.page_table
        _check(cache, t, problem, [1])


def _sinks(h: int, seed: int):
    """Sink logits per query head, of both signs and all different (a row reading another head's sink fails the
    rule); head 0's large enough to dominate its rows."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    s = torch.randn(h, generator=gen) * 2.0
    s[0] = 6.0
    return s.cuda()


# Scores of std ~4 (0.35 x sqrt(128)): a cap of 4 bends most of them (tanh is far from linear there).
SOFTCAP = dict(softcap=4.0, scale=0.35)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("feature", ["softcap", "sink"])
def test_softcap_and_sinks(feature, splits):
    """Each feature alone (paged, GQA 4, causal; empty sequences: out 0, LSE the sink); split: the partials leave the
    sink to the combine."""
    cache = Cache(_lengths(16), 16, 2, 128, torch.bfloat16, seed=41 + splits)
    kw = SOFTCAP if feature == "softcap" else dict(sink=_sinks(8, seed=splits))
    t, problem = _run(cache, [2], 8, causal=True, splits=splits, seed=41, **kw)
    _check(cache, t, problem, [2])


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_softcap_and_sinks_gqa_groups(group, splits):
    """Both features over GQA groups (the sink of row s * group + j of KV head g is head g * group + j's), dense
    cache, two query tokens."""
    cache = Cache([5, 300, 0, 1000, 64], 0, 2, 128, torch.bfloat16, seed=group)
    t, problem = _run(cache, [2], 2 * group, causal=True, splits=splits, sink=_sinks(2 * group, group), **SOFTCAP)
    _check(cache, t, problem, [2])


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("mask", WINDOWS[1:2] + WINDOWS[3:], ids=lambda m: f"causal{m[1]}" if m[0] else f"window{m[1]}")
def test_softcap_and_sinks_windows(mask, splits):
    """Windows; with negative bounds or short sequences some rows see no key: out 0, the sink as their LSE."""
    causal, window = mask
    cache = Cache([3, 129, 1000, 2047], 16, 2, 128, torch.bfloat16, seed=splits + 5)
    t, problem = _run(cache, [5], 8, causal=causal, window=window, splits=splits, seed=8, sink=_sinks(8, 3), **SOFTCAP)
    _check(cache, t, problem, [5])


@pytest.mark.parametrize("splits", [1, 3])
def test_softcap_and_sinks_packed_queries(splits):
    """Packed q: the kernel's sink view is indexed by the row within its sequence, the combine's by the packed
    output row."""
    seqlens_q = [1, 3, 0, 6, 2]
    cache = Cache([17, 500, 40, 1500, 0], 16, 2, 128, torch.bfloat16, seed=12)
    t, problem = _run(cache, seqlens_q, 8, packed=True, causal=True, splits=splits, sink=_sinks(8, 4), **SOFTCAP)
    _check(cache, t, problem, seqlens_q)


def test_softcap_and_sinks_chunked_prefill():
    """More rows than the decoding tile: the forward's 128-row tile (two consumers, each its own rows' sinks)."""
    seqlens_q = [40, 1, 33, 17]
    cache = Cache([40 + 900, 1, 33, 17 + 64], 16, 2, 128, torch.bfloat16, seed=13)
    t, problem = _run(cache, seqlens_q, 8, packed=True, causal=True, sink=_sinks(8, 5), **SOFTCAP)
    _check(cache, t, problem, seqlens_q)


@pytest.mark.parametrize("group, splits", [(1, 1), (4, 3), (8, 1), (8, 3)])
def test_softcap_and_sinks_fp8_cache(group, splits):
    """An e4m3 cache: the cap bends the dequantised scores (k_descale joins the score scale before the tanh; a
    descale applied after it would miss the rule by far, the descales spanning 0.05..1.05)."""
    cache = Cache([0, 16, 17, 900, 2047], 16, 2, 128, torch.bfloat16, seed=51 + splits, fp8=True)
    t, problem = _run(
        cache, [2], 2 * group, causal=True, splits=splits, seed=51, sink=_sinks(2 * group, 6), softcap=2.0, scale=0.35
    )
    _check(cache, t, problem, [2])


def test_lengths_and_page_indices_outside_the_contract_stay_inside_the_cache():
    """A length past the cache's capacity reads as the capacity (no page-table entry past the sequence's row is
    read), and a page index outside [0, num_pages) reads zeros (TMA zero-fills boxes outside the cache): the
    kernel's result is then attention over those keys, with no access outside the cache."""
    cache = Cache([100, 64], 16, 2, 128, torch.bfloat16, seed=61, capacity=128)  # 8 page-table columns
    cache.page_table[0, 2] = UNUSED_PAGE
    cache.page_table[0, 3] = -5
    cache.lengths = [100, cache.capacity + 50]  # sequence 1's columns 4.. hold UNUSED_PAGE: zeros
    t, problem = _run(cache, [3], 8, seed=61)
    table = cache.page_table.tolist()
    for i, n in enumerate(cache.lengths):
        n = min(n, cache.capacity)
        keys = [torch.zeros(n, *cache.k.shape[2:], dtype=cache.k.dtype, device="cuda") for _ in "kv"]
        for col in range(-(-n // 16)):
            page = table[i][col]
            if 0 <= page < cache.k.shape[0]:
                rows = slice(col * 16, min(col * 16 + 16, n))
                for x, src in zip(keys, (cache.k, cache.v)):
                    x[rows] = src[page, : rows.stop - rows.start]
        name = f"seq {i} (clamped to {n} keys)"
        _check_sequence(t.out[i], t.lse[i], t.q[i], *keys, problem.mask, problem.softmax_scale, name)


@pytest.mark.parametrize("splits", [1, 3])
def test_packed_rows_past_total_q_are_never_touched(splits):
    """cu_seqlens_q is not checked on the host: a sequence whose rows run past total_q is cut at it (sequence 1
    here: rows 3 and 4 of 5), and nothing of out or lse past total_q is written."""
    cache = Cache([40, 300], 16, 2, 128, torch.bfloat16, seed=71)
    total, h, d = 5, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(71)
    q = torch.randn(total, h, d, generator=gen, device="cuda").to(torch.bfloat16)
    out_buf = torch.full((total + 70, h, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse_buf = torch.full((h, total + 70), float("nan"), device="cuda")
    cu = torch.tensor([0, 3, 100], dtype=torch.int32, device="cuda")
    mask = normalize_mask(True, (None, None))
    spec = AttentionSpec("bf16", d, d, mask.kind, "bf16", kvcache=True, page_size=16)
    problem = KvCacheProblem(2, 3, total, h, 2, d, d, cache.capacity, cache.k.shape[0], spec, mask, d**-0.5, 0.0, True)
    seqlens_k = torch.tensor(cache.lengths, dtype=torch.int32, device="cuda")
    t = KvCacheTensors(q, cache.k, cache.v, out_buf[:total], lse_buf[:, :total], seqlens_k, cache.page_table, cu)
    BACKEND.forward_kvcache(t, problem, splits)
    assert out_buf[total:].isnan().all() and lse_buf[:, total:].isnan().all()
    _check(cache, t, problem, [3, 2])

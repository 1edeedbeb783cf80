"""The KV-cache reference (issue 46): new tokens appended to dense or paged caches, each sequence's keys gathered, one
dense reference per sequence; checked against caches and keys built here slot by slot, on the CPU."""

from __future__ import annotations

import pytest
import torch

from cute_flash.reference import attention_reference, kvcache_reference
from cute_flash.testing import check_kvcache, random_page_table

D, DV = 16, 8


def _randn(*shape, gen, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def _place(cache: torch.Tensor, table_row: list, page_size: int, rows: torch.Tensor, start: int = 0) -> None:
    """Writes rows (n, h_kv, d) at key positions start.. of one sequence, one slot at a time."""
    for j in range(rows.shape[0]):
        pos = start + j
        cache[table_row[pos // page_size], pos % page_size] = rows[j]


def _paged_case(page_size, old_lens, s_new, h, h_kv, *, shared_pages=0, spare_pages=1, seed=0, sq=None):
    """q (b, sq, h, d), paged caches holding each sequence's old keys (garbage elsewhere), the page table, k_new /
    v_new, and each sequence's whole keys / values (old then new) as the reference must see them."""
    gen = torch.Generator().manual_seed(seed)
    b = len(old_lens)
    pages_per_seq = max(shared_pages, -(-(max(old_lens) + s_new) // page_size), 1)
    needed = shared_pages + b * (pages_per_seq - shared_pages)
    table = random_page_table(
        b, pages_per_seq, num_pages=needed + spare_pages, shared_pages=shared_pages, device="cpu", seed=seed
    )
    num_pages = needed + spare_pages
    k_cache = _randn(num_pages, page_size, h_kv, D, gen=gen)
    v_cache = _randn(num_pages, page_size, h_kv, DV, gen=gen)
    prefix = shared_pages * page_size
    shared_k, shared_v = _randn(prefix, h_kv, D, gen=gen), _randn(prefix, h_kv, DV, gen=gen)
    keys, values = [], []
    k_new, v_new = _randn(b, s_new, h_kv, D, gen=gen), _randn(b, s_new, h_kv, DV, gen=gen)
    for i, n in enumerate(old_lens):
        assert n >= min(prefix, n)
        own_k, own_v = _randn(n, h_kv, D, gen=gen), _randn(n, h_kv, DV, gen=gen)
        own_k[: min(n, prefix)], own_v[: min(n, prefix)] = shared_k[:n], shared_v[:n]
        row = table[i].tolist()
        _place(k_cache, row, page_size, own_k)
        _place(v_cache, row, page_size, own_v)
        keys.append(torch.cat([own_k, k_new[i]]))
        values.append(torch.cat([own_v, v_new[i]]))
    q = _randn(b, s_new if sq is None else sq, h, D, gen=gen)
    seqlens = torch.tensor(old_lens, dtype=torch.int32)
    return q, k_cache, v_cache, table, seqlens, k_new, v_new, keys, values


def _per_sequence(q, keys, values, **kw):
    outs, lses = [], []
    for i in range(q.shape[0]):
        o, l_ = attention_reference(q[i : i + 1], keys[i][None], values[i][None], return_lse=True, **kw)
        outs.append(o)
        lses.append(l_)
    return torch.cat(outs), torch.cat(lses)


def _written_slots(table, page_size, old_lens, s_new):
    slots = set()
    for i, n in enumerate(old_lens):
        for pos in range(n, n + s_new):
            slots.add((table[i, pos // page_size].item(), pos % page_size))
    return slots


@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("s_new", [0, 1, 3])
@pytest.mark.parametrize("heads", [(4, 2), (3, 1)], ids=["gqa2", "mqa3"])
def test_paged_cache_equals_each_sequences_dense_reference(page_size, s_new, heads):
    # Lengths 0 and at the page boundaries (one short, exactly, one past, two pages), pages in random order.
    old_lens = [0, max(page_size - 1, 0), page_size, page_size + 1, 2 * page_size, 5]
    q, kc, vc, table, seqlens, k_new, v_new, keys, values = _paged_case(
        page_size, old_lens, s_new, *heads, seed=1, sq=max(s_new, 1)
    )
    kc0, vc0 = kc.clone(), vc.clone()
    got = kvcache_reference(
        q, kc, vc, cache_seqlens=seqlens, page_table=table, k_new=k_new, v_new=v_new, return_lse=True
    )
    want, want_lse = _per_sequence(q, keys, values, causal=True)
    torch.testing.assert_close(got.out, want, rtol=0, atol=0)
    torch.testing.assert_close(got.lse, want_lse, rtol=0, atol=0)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)  # the inputs are not written
    # The updated caches: the new tokens in their slots, every other slot as it was.
    untouched = torch.ones(kc.shape[:2], dtype=torch.bool)
    for p, r in _written_slots(table, page_size, old_lens, s_new):
        untouched[p, r] = False
    for cache, before, new in ((got.k_cache, kc0, k_new), (got.v_cache, vc0, v_new)):
        assert torch.equal(cache[untouched], before[untouched])
        for i, n in enumerate(old_lens):
            for t in range(s_new):
                pos = n + t
                assert torch.equal(cache[table[i, pos // page_size], pos % page_size], new[i, t])
    if 0 in old_lens and s_new == 0:  # a sequence without keys: out 0, lse -inf
        assert torch.all(got.out[0] == 0) and torch.all(torch.isneginf(got.lse[0]))


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_pages(page_size):
    # Every sequence reads the same first two pages (a common prompt) and appends into pages of its own.
    prefix = 2 * page_size
    old_lens = [prefix, prefix + 3, prefix + page_size]
    q, kc, vc, table, seqlens, k_new, v_new, keys, values = _paged_case(
        page_size, old_lens, 2, 4, 1, shared_pages=2, seed=2
    )
    assert torch.equal(table[0, :2], table[1, :2]) and torch.equal(table[0, :2], table[2, :2])
    got = kvcache_reference(
        q,
        kc,
        vc,
        cache_seqlens=seqlens,
        page_table=table,
        k_new=k_new,
        v_new=v_new,
        window_size=(page_size + 1, None),
        return_lse=True,
    )
    want, want_lse = _per_sequence(q, keys, values, causal=True, window_size=(page_size + 1, None))
    torch.testing.assert_close(got.out, want, rtol=0, atol=0)
    torch.testing.assert_close(got.lse, want_lse, rtol=0, atol=0)
    # A new token written into a shared page would change what the other sequences read: rejected.
    with pytest.raises(ValueError, match="reads a page slot|also writes"):
        kvcache_reference(q, kc, vc, cache_seqlens=seqlens - prefix, page_table=table, k_new=k_new, v_new=v_new)


def test_dense_cache_and_packed_queries():
    gen = torch.Generator().manual_seed(3)
    old_lens, lens_q, seqlen_cache = [0, 7, 2, 12], [1, 0, 3, 2], 16
    b, h, h_kv = len(old_lens), 4, 2
    kc, vc = _randn(b, seqlen_cache, h_kv, D, gen=gen), _randn(b, seqlen_cache, h_kv, DV, gen=gen)
    total = sum(lens_q)
    q = _randn(total, h, D, gen=gen)
    k_new, v_new = _randn(total, h_kv, D, gen=gen), _randn(total, h_kv, DV, gen=gen)  # one key per query token
    cu = torch.tensor([0, 1, 1, 4, 6], dtype=torch.int32)
    seqlens = torch.tensor(old_lens, dtype=torch.int32)
    got = kvcache_reference(
        q,
        kc,
        vc,
        cache_seqlens=seqlens,
        k_new=k_new,
        v_new=v_new,
        cu_seqlens_q=cu,
        max_seqlen_q=3,
        softcap=3.0,
        return_lse=True,
    )
    assert got.out.shape == (total, h, DV) and got.lse.shape == (h, total)
    for i in range(b):
        r0, r1 = cu[i].item(), cu[i + 1].item()
        n = old_lens[i]
        keys = torch.cat([kc[i, :n], k_new[r0:r1]])
        values = torch.cat([vc[i, :n], v_new[r0:r1]])
        o, l_ = attention_reference(q[None, r0:r1], keys[None], values[None], causal=True, softcap=3.0, return_lse=True)
        torch.testing.assert_close(got.out[r0:r1], o[0], rtol=0, atol=0)
        torch.testing.assert_close(got.lse[:, r0:r1], l_[0], rtol=0, atol=0)
        assert torch.equal(got.k_cache[i, n : n + r1 - r0], k_new[r0:r1])
        assert torch.equal(got.k_cache[i, n + r1 - r0 :], kc[i, n + r1 - r0 :])
        assert torch.equal(got.v_cache[i, :n], vc[i, :n])
    # Dense q on a dense cache, without new tokens: decoding's plain read.
    qd = _randn(b, 1, h, D, gen=gen)
    out = kvcache_reference(qd, kc, vc, cache_seqlens=seqlens, learnable_sink=torch.zeros(h, dtype=torch.float64))
    want, _ = _per_sequence(
        qd,
        [kc[i, :n] for i, n in enumerate(old_lens)],
        [vc[i, :n] for i, n in enumerate(old_lens)],
        causal=True,
        learnable_sink=torch.zeros(h, dtype=torch.float64),
    )
    torch.testing.assert_close(out.out, want, rtol=0, atol=0)
    assert out.lse is None


def test_fp8_cache_is_dequantised_per_sequence_and_kv_head():
    gen = torch.Generator().manual_seed(4)
    page_size, old_lens = 16, [5, 16, 20]
    q, kc, vc, table, seqlens, k_new, v_new, _, _ = _paged_case(page_size, old_lens, 1, 4, 2, seed=4)
    fp8 = torch.float8_e4m3fn
    kc8, vc8 = (t.to(fp8) for t in (kc, vc))
    kn8, vn8 = k_new.to(torch.bfloat16), v_new.to(torch.bfloat16)  # new tokens in q's dtype, quantised on append
    k_descale = torch.rand(3, 2, generator=gen) + 0.5
    v_descale = torch.rand(3, 2, generator=gen) + 0.5
    q16 = q.to(torch.bfloat16)
    got = kvcache_reference(
        q16,
        kc8,
        vc8,
        cache_seqlens=seqlens,
        page_table=table,
        k_new=kn8,
        v_new=vn8,
        k_descale=k_descale,
        v_descale=v_descale,
        return_lse=True,
    )
    assert got.k_cache.dtype == fp8
    for i, n in enumerate(old_lens):
        slots = [(table[i, p // page_size].item(), p % page_size) for p in range(n + 1)]
        keys = torch.stack([got.k_cache[pg, r] for pg, r in slots]).double() * k_descale[i].double().view(1, 2, 1)
        values = torch.stack([got.v_cache[pg, r] for pg, r in slots]).double() * v_descale[i].double().view(1, 2, 1)
        o, l_ = attention_reference(q16[i : i + 1].double(), keys[None], values[None], causal=True, return_lse=True)
        torch.testing.assert_close(got.out[i], o[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got.lse[i], l_[0])
    with pytest.raises(ValueError, match="k_descale"):
        kvcache_reference(q16, kc8, vc8, cache_seqlens=seqlens, page_table=table)
    with pytest.raises(ValueError, match="come in q's dtype"):
        kvcache_reference(
            q16,
            kc8,
            vc8,
            cache_seqlens=seqlens,
            page_table=table,
            k_new=k_new.to(fp8),
            v_new=v_new.to(fp8),
            k_descale=k_descale,
            v_descale=v_descale,
        )


def test_malformed_calls_raise():
    q, kc, vc, table, seqlens, k_new, v_new, _, _ = _paged_case(16, [3, 17], 2, 4, 2, spare_pages=0, seed=5)
    kw = dict(cache_seqlens=seqlens, page_table=table, k_new=k_new, v_new=v_new)
    with pytest.raises(ValueError, match="holds 32"):  # past the table's capacity (2 pages of 16)
        kvcache_reference(q, kc, vc, **{**kw, "cache_seqlens": torch.tensor([3, 31], dtype=torch.int32)})
    bad = table.clone()
    bad[1, 1] = kc.shape[0]
    with pytest.raises(ValueError, match="outside"):
        kvcache_reference(q, kc, vc, **{**kw, "page_table": bad})
    same = table.clone()
    same[1] = same[0]  # both sequences append into the same slots
    with pytest.raises(ValueError, match="also writes|reads a page slot"):
        kvcache_reference(q, kc, vc, **{**kw, "page_table": same})
    with pytest.raises(ValueError, match="both or neither"):
        kvcache_reference(q, kc, vc, cache_seqlens=seqlens, page_table=table, k_new=k_new)
    with pytest.raises(ValueError, match="int32"):
        kvcache_reference(q, kc, vc, **{**kw, "cache_seqlens": seqlens.long()})
    with pytest.raises(ValueError, match="int32"):
        kvcache_reference(q, kc, vc, **{**kw, "page_table": table.long()})
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        kvcache_reference(q, kc, vc, **kw, cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32), max_seqlen_q=2)
    with pytest.raises(ValueError, match="window_size"):  # the per-sequence checks are attention_reference's
        kvcache_reference(q, kc, vc, **kw, window_size=(1.5, None))


def test_random_page_table():
    t = random_page_table(3, 5, shared_pages=2, num_pages=20, device="cpu", seed=6)
    assert t.dtype == torch.int32 and t.shape == (3, 5)
    assert all(torch.equal(t[0, :2], t[i, :2]) for i in range(3))
    own = t[:, 2:].flatten().tolist() + t[0, :2].tolist()
    assert len(set(own)) == len(own) and all(0 <= p < 20 for p in own)
    assert torch.equal(t, random_page_table(3, 5, shared_pages=2, num_pages=20, device="cpu", seed=6))
    with pytest.raises(ValueError, match="distinct pages"):
        random_page_table(3, 5, num_pages=14, device="cpu")


def test_check_kvcache_applies_the_rule_and_compares_the_caches():
    q, kc, vc, table, seqlens, k_new, v_new, _, _ = _paged_case(16, [3, 17], 1, 4, 2, seed=7)
    q, kc, vc, k_new, v_new = (t.to(torch.bfloat16) for t in (q, kc, vc, k_new, v_new))
    kw = dict(cache_seqlens=seqlens, page_table=table, k_new=k_new, v_new=v_new)
    good = kvcache_reference(q, kc, vc, return_lse=True, compute_dtype=torch.float32, **kw)
    out = good.out.to(torch.bfloat16)
    reports = check_kvcache(q, kc, vc, out, good.lse, good.k_cache, good.v_cache, **kw)
    assert [r.name for r in reports] == ["out", "lse"] and all(r.ok for r in reports)
    with pytest.raises(AssertionError, match="out"):
        check_kvcache(q, kc, vc, out + 0.1, good.lse, **kw)
    stale = good.k_cache.clone()
    stale[table[1, 1], 1] = kc[table[1, 1], 1]  # sequence 1's new token (position 17) never written
    with pytest.raises(AssertionError, match="k_cache"):
        check_kvcache(q, kc, vc, out, good.lse, stale, good.v_cache, **kw)

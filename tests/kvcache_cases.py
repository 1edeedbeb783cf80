"""The KV-cache GPU tests' cases (tests/test_sm80_kvcache*.py): caches built from given key lengths, and one
`forward_kvcache` call checked sequence by sequence against the float64 oracle (tests/feature_oracle.py) with
FlashAttention's rule. Each sequence's keys are gathered from its pages (nothing appended: the front end appends),
its queries bottom-right aligned to them."""

from __future__ import annotations

import copy
import math
from typing import List, Optional

import torch

from cute_flash.arch.base import KvCacheTensors
from cute_flash.spec import UNBOUNDED_WINDOW, AttentionSpec, normalize_mask
from cute_flash.testing import ErrorReport
from cute_flash.validation import KvCacheProblem

from .feature_oracle import assert_reports, attention_oracle, lse_report, max_abs

UNUSED_PAGE = 1 << 28  # page-table entries past a sequence's length: reading one would address far outside the cache


def _backend():
    from cute_flash.arch.sm80 import BACKEND

    return BACKEND


class Cache:
    """A KV cache holding given key lengths: paged (page_size > 0) with a random permuted page table whose
    sequences 0 and 1 share their first page, or dense (page_size 0)."""

    def __init__(self, lengths: List[int], h_kv: int, d: int, dv: int, page_size: int, dtype, seed: int):
        gen = torch.Generator(device="cuda")
        gen.manual_seed(seed)
        self.lengths, self.page_size, self.batch = lengths, page_size, len(lengths)
        capacity = max(max(lengths), 1) + 3  # room past the longest sequence
        self.seqlens_k = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        if page_size == 0:
            self.max_seqlen_k, self.num_pages, self.page_table = capacity, self.batch, None
            self.k = torch.randn(self.batch, capacity, h_kv, d, generator=gen, device="cuda").to(dtype)
            self.v = torch.randn(self.batch, capacity, h_kv, dv, generator=gen, device="cuda").to(dtype)
            return
        max_pages = -(-capacity // page_size)
        self.max_seqlen_k = max_pages * page_size
        self.num_pages = self.batch * max_pages + 5
        self.k = torch.randn(self.num_pages, page_size, h_kv, d, generator=gen, device="cuda").to(dtype)
        self.v = torch.randn(self.num_pages, page_size, h_kv, dv, generator=gen, device="cuda").to(dtype)
        perm = torch.randperm(self.num_pages, generator=gen, device="cuda")[: self.batch * max_pages]
        table = perm.view(self.batch, max_pages).to(torch.int32)
        for b, n in enumerate(lengths):
            table[b, -(-n // page_size) :] = UNUSED_PAGE
        holders = [b for b, n in enumerate(lengths) if n > 0]
        if len(holders) > 1:
            table[holders[1], 0] = table[holders[0], 0]  # a shared prefix page
        self.page_table = table

    k_descale: Optional[torch.Tensor] = None  # (b, h_kv) fp32 of an fp8 cache (`quantized`)
    v_descale: Optional[torch.Tensor] = None

    def quantized(self, k_descale: torch.Tensor, v_descale: torch.Tensor) -> "Cache":
        """This cache's pages rounded to float8_e4m3fn (the same page table and lengths), with per-(sequence, KV head)
        descales: sequence b's keys are the e4m3 values times k_descale[b] (the pages themselves are not divided by
        them: a page shared by two sequences then holds one value per element and each sequence its own scale)."""
        fp8 = copy.copy(self)
        fp8.k, fp8.v = self.k.float().to(torch.float8_e4m3fn), self.v.float().to(torch.float8_e4m3fn)
        fp8.k_descale, fp8.v_descale = k_descale.float().contiguous(), v_descale.float().contiguous()
        return fp8

    def dequantized(self, dtype) -> "Cache":
        """An fp8 cache whose descales are the same for every sequence, as a 16-bit cache holding the same values
        (exactly, for power-of-two descales)."""
        assert torch.equal(self.k_descale, self.k_descale[:1].expand_as(self.k_descale))
        assert torch.equal(self.v_descale, self.v_descale[:1].expand_as(self.v_descale))
        dense = copy.copy(self)
        kd, vd = self.k_descale[0].view(1, 1, -1, 1), self.v_descale[0].view(1, 1, -1, 1)
        dense.k, dense.v = (self.k.float() * kd).to(dtype), (self.v.float() * vd).to(dtype)
        dense.k_descale = dense.v_descale = None
        return dense

    def keys(self, b: int):
        """Sequence b's (1, seqlen_k, h_kv, d) keys and values, gathered from its pages (an fp8 cache's dequantized,
        in float64)."""
        n = self.lengths[b]
        if self.page_size == 0:
            k, v = self.k[b : b + 1, :n], self.v[b : b + 1, :n]
        else:
            pages = self.page_table[b, : -(-n // self.page_size)].long()
            k = self.k[pages].flatten(0, 1)[:n].unsqueeze(0)
            v = self.v[pages].flatten(0, 1)[:n].unsqueeze(0)
        if self.k_descale is not None:
            k = k.double() * self.k_descale[b].double().view(1, 1, -1, 1)
            v = v.double() * self.v_descale[b].double().view(1, 1, -1, 1)
        return k, v


def run_kvcache(
    cache: Cache, seqlens_q: List[int], h: int, d: int, dv: int, dtype, *, packed: bool, causal=False,
    window=(None, None), softcap=0.0, with_sink=False, splits: Optional[int] = None, seed=0,
):  # fmt: skip
    """One forward_kvcache call (splits: None for the backend's own choice) checked sequence by sequence; returns
    (the splits it ran, out, lse). An fp8 cache (`Cache.quantized`) runs the kv_fp8 build with its descales."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed + 1)
    h_kv = cache.k.shape[2]
    b = cache.batch
    mask = normalize_mask(causal, window)
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    spec = AttentionSpec(
        name, d, dv, mask.kind, name, softcap=softcap > 0, sink=with_sink, kvcache=True, page_size=cache.page_size,
        kv_fp8=cache.k_descale is not None,
    )  # fmt: skip
    scale = 1.0 / math.sqrt(d)
    sink = (torch.randn(h, generator=gen, device="cuda") * 2).float() if with_sink else None
    if packed:
        total_q = sum(seqlens_q)
        q = torch.randn(total_q, h, d, generator=gen, device="cuda").to(dtype)
        out = torch.full((total_q, h, dv), float("nan"), dtype=dtype, device="cuda")
        lse = torch.full((h, total_q), float("nan"), device="cuda")
        cu = torch.tensor([0] + list(torch.tensor(seqlens_q).cumsum(0)), dtype=torch.int32, device="cuda")
        seqlen_q = max(seqlens_q)
    else:
        seqlen_q = seqlens_q[0]
        assert all(s == seqlen_q for s in seqlens_q)
        total_q = b * seqlen_q
        q = torch.randn(b, seqlen_q, h, d, generator=gen, device="cuda").to(dtype)
        out = torch.full((b, seqlen_q, h, dv), float("nan"), dtype=dtype, device="cuda")
        lse = torch.full((b, h, seqlen_q), float("nan"), device="cuda")
        cu = None
    problem = KvCacheProblem(
        b, seqlen_q, total_q, h, h_kv, d, dv, cache.max_seqlen_k, cache.num_pages, spec, mask, scale, softcap,
        packed_q=packed,
    )  # fmt: skip
    backend = _backend()
    if splits is None:
        splits = backend.kvcache_splits(problem, torch.cuda.get_device_properties(0).multi_processor_count)
    t = KvCacheTensors(
        q, cache.k, cache.v, out, lse, cache.seqlens_k, cache.page_table, cu, sink, cache.k_descale, cache.v_descale
    )
    backend.forward_kvcache(t, problem, splits)

    left = None if mask.left >= UNBOUNDED_WINDOW else mask.left
    right = None if mask.right >= UNBOUNDED_WINDOW else mask.right
    kw = dict(scale=scale, left=left, right=right, softcap=softcap, sink=sink)
    reports = []
    start = 0
    for i in range(b):
        n = seqlens_q[i]
        if packed:
            qs, os, ls = q[start : start + n].unsqueeze(0), out[start : start + n], lse[:, start : start + n]
            start += n
        else:
            qs, os, ls = q[i : i + 1], out[i], lse[i]
        ks, vs = cache.keys(i)
        ref, ref_lse = attention_oracle(qs, ks, vs, **kw)
        low, low_lse = attention_oracle(qs, ks, vs, compute_dtype=dtype, **kw)
        empty = torch.isneginf(ref_lse[0]).transpose(0, 1)  # (sq, h)
        assert torch.count_nonzero(os[empty]) == 0, f"sequence {i}: rows without keys must give out 0"
        reports += [
            ErrorReport(f"out[{i}]", max_abs(os, ref[0]), max_abs(low[0], ref[0])),
            lse_report(ls, ref_lse[0], low_lse[0]),
        ]
    assert_reports(reports, [("out", out)])
    return splits, out, lse

"""GPU: the sm80 KV-cache forward (arch/base.ArchBackend.forward_kvcache), its paging and GQA packing, each call
checked sequence by sequence against the float64 oracle with FlashAttention's rule (tests/kvcache_cases.py).

Paged caches of page sizes 1 .. 256 and dense ones, page tables randomly permuted with a page shared between
sequences and unused entries pointing far outside the cache (a kernel that read them would fault), key lengths 0, at
page boundaries and odd; GQA groups 1 / 4 / 8 with several query tokens per sequence; one split and several. The
features (packed q, windows, softcap, sinks, head dims, fp8) are in tests/test_sm80_kvcache_features.py.

Run: pytest -m sm80 tests/test_sm80_kvcache.py  (on Hopper the sm80 kernels run for target sm_90a).
"""

from __future__ import annotations

import pytest
import torch

from .kvcache_cases import Cache, run_kvcache

pytestmark = pytest.mark.sm80


# (page size, splits): every page size unsplit or split (each pair is a build of its own), both at page 16 and dense.
PAGE_CASES = [(1, 1), (16, 1), (16, 3), (64, 1), (128, 3), (256, 3), (0, 1), (0, 3)]


@pytest.mark.parametrize("page_size,splits", PAGE_CASES, ids=lambda x: str(x))
def test_page_sizes(page_size, splits):
    # Lengths 0, at page boundaries, odd, and past a whole key tile; 2 query tokens (GQA 4) per sequence.
    lengths = [0, 128, 1, 255, 257, 700]
    if page_size > 1:
        lengths += [page_size, 3 * page_size - 1]
    cache = Cache(lengths, 2, 128, 128, page_size, torch.bfloat16, seed=page_size)
    run_kvcache(cache, [2] * len(lengths), 8, 128, 128, torch.bfloat16, packed=False, causal=True, splits=splits)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_groups_and_tokens(group):
    # Several query tokens per sequence (rows s * group + j over more than one row tile at group 8, 17 tokens).
    cache = Cache([40, 300, 17, 1000], 2, 128, 128, 16, torch.bfloat16, seed=group)
    for tokens in (1, 5, 17):
        run_kvcache(cache, [tokens] * 4, 2 * group, 128, 128, torch.bfloat16, packed=False, causal=True, seed=tokens)

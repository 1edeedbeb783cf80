"""GPU: the sm80 KV-cache forward's features (tests/kvcache_cases.py checks each call against the float64 oracle):
packed queries, windows with negative bounds, softcap, sinks (split 0's partial carries them), other head dims. fp8
caches: tests/test_sm80_kvcache_fp8.py.

Run: pytest -m sm80 tests/test_sm80_kvcache_features.py  (on Hopper the sm80 kernels run for target sm_90a).
"""

from __future__ import annotations

import pytest
import torch

from .kvcache_cases import Cache, run_kvcache

pytestmark = pytest.mark.sm80


def test_packed_queries_windows_softcap_sinks():
    # Packed q with lengths 0 / 1 / several, a window with a negative right bound (rows with no key), softcap, sinks,
    # unsplit and split (the sink joins split 0's partial only).
    cache = Cache([64, 0, 1333, 90, 1], 2, 128, 128, 64, torch.bfloat16, seed=5)
    tokens = [3, 2, 0, 7, 1]
    kw = dict(packed=True, window=(100, -2), softcap=12.0, with_sink=True)
    for splits in (1, None, 5):
        used, _, _ = run_kvcache(cache, tokens, 8, 128, 128, torch.bfloat16, splits=splits, **kw)
        assert splits is not None or used > 1, "a decoding call this small should split"


@pytest.mark.parametrize("window", [(32, 0), (-3, 40), (50, -10), (-5, 2)], ids=lambda w: f"w{w[0]}_{w[1]}")
def test_windows(window):
    # Local windows including negative bounds, on a dense cache with 9 query tokens per sequence.
    cache = Cache([500, 31, 260], 1, 64, 64, 0, torch.float16, seed=9)
    for splits in (1, 4):
        run_kvcache(cache, [9, 9, 9], 4, 64, 64, torch.float16, packed=False, window=window, splits=splits)


def test_softcap_sink_dense_cache_split():
    cache = Cache([2000, 3, 129], 2, 128, 128, 0, torch.bfloat16, seed=13)
    for splits in (1, None):
        run_kvcache(
            cache, [1, 1, 1], 16, 128, 128, torch.bfloat16, packed=False, causal=True, softcap=30.0, with_sink=True,
            splits=splits,
        )  # fmt: skip


@pytest.mark.parametrize("head_dim,page_size", [(64, 32), (256, 16), (96, 8)], ids=lambda x: str(x))
def test_other_head_dims(head_dim, page_size):
    cache = Cache([1, 77, 400], 2, head_dim, head_dim, page_size, torch.bfloat16, seed=head_dim)
    run_kvcache(cache, [4, 4, 4], 4, head_dim, head_dim, torch.bfloat16, packed=False, causal=True, splits=2)

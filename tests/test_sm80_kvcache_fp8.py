"""GPU: the sm80 KV-cache forward on float8_e4m3fn caches (spec.kv_fp8) with per-(sequence, KV head) descales,
against the same values in a 16-bit cache and against the float64 oracle of the dequantized cache
(tests/kvcache_cases.py).

Run: pytest -m sm80 tests/test_sm80_kvcache_fp8.py  (on Hopper the sm80 kernels run for target sm_90a).
"""

from __future__ import annotations

import pytest
import torch

from .kvcache_cases import Cache, run_kvcache

pytestmark = pytest.mark.sm80


def _pow2_descales(batch, h_kv, seed, per_sequence):
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    shape = (batch, h_kv) if per_sequence else (1, h_kv)
    k, v = (2.0 ** torch.randint(-3, 4, shape, generator=gen, device="cuda").float() for _ in range(2))
    return k.expand(batch, h_kv), v.expand(batch, h_kv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp8_cache_matches_bf16_cache(dtype):
    # e4m3 pages with power-of-two descales per KV head: the fp8 build (exact e4m3 -> 16-bit conversion, descales
    # folded into the score scale and O's last factor) must compute what the 16-bit build computes on the same values
    # held in the 16-bit cache, and both follow the oracle's rule. Softcap rides along (K's descale joins the tanh's
    # factor).
    base = Cache([0, 129, 64, 700, 1], 2, 128, 128, 16, dtype, seed=21)
    fp8 = base.quantized(*_pow2_descales(base.batch, 2, 22, per_sequence=False))
    same = fp8.dequantized(dtype)
    kw = dict(packed=False, causal=True, softcap=20.0, seed=3)
    for splits in (1, 3) if dtype == torch.bfloat16 else (3,):
        _, out8, lse8 = run_kvcache(fp8, [2] * base.batch, 8, 128, 128, dtype, splits=splits, **kw)
        _, out16, lse16 = run_kvcache(same, [2] * base.batch, 8, 128, 128, dtype, splits=splits, **kw)
        assert (out8.float() - out16.float()).abs().max().item() <= 1e-2
        finite = torch.isfinite(lse16)
        assert torch.equal(finite, torch.isfinite(lse8))
        assert (lse8[finite] - lse16[finite]).abs().max().item() <= 1e-3


def test_fp8_cache_per_sequence_descales():
    # Descales that differ per sequence and KV head, on a dense fp8 cache and on a paged one with a shared page
    # (each sequence applies its own descale to it), packed queries and sinks.
    for page_size in (0, 64):
        base = Cache([300, 5, 0, 1000], 2, 64, 64, page_size, torch.bfloat16, seed=page_size)
        fp8 = base.quantized(*_pow2_descales(base.batch, 2, 23, per_sequence=True))
        run_kvcache(fp8, [1, 4, 2, 3], 8, 64, 64, torch.bfloat16, packed=True, with_sink=True, splits=None, seed=4)

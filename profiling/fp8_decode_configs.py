"""Study: tile configurations of the sm90 KV-cache forward with an fp8 cache (d128 decoding), side by side.

The shipped configuration (kvcache/tile_config.py: two CTAs per SM, two e4m3 stages each) keeps 64 KiB of e4m3
tiles in flight per SM; the variants here trade the second CTA for deeper e4m3 rings. Each variant replaces
`kvcache_tile_config` for fp8 specs (the launcher and the split count read it through the module).

    CUTE_DSL_ARCH=sm_90a python3 -m profiling.fp8_decode_configs --compile-only   # registers / spills, no GPU
    python3 -m profiling.fp8_decode_configs                                       # times them (GPU, CUDA graphs)
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Optional

# name -> (ctas per SM, e4m3 stages, consumer registers, producer registers). Measured (H200, 2026-12-02, the integer
# conversion then): every one-CTA variant 1.4x slower than the shipped one, whatever its stages.
VARIANTS: Dict[str, tuple] = {
    "shipped 2x2": None,
    "2x2, 200 / 56 regs": (2, 2, 200, 56),  # more registers for the converter warps' independent conversions
    "1 CTA x 4": (1, 4, 216, 40),
    "1 CTA x 6": (1, 6, 216, 40),
    "1 CTA x 8": (1, 8, 216, 40),
}


def variant_config(name: str):
    from cute_flash.arch.sm90.kvcache import tile_config as kv

    shipped = kv._FP8_DECODE_BY_HEAD_DIM[128]
    v = VARIANTS[name]
    if v is None:
        return shipped
    ctas, stages, creg, preg = v
    from dataclasses import replace

    return replace(shipped, ctas_per_sm=ctas, fp8_stages=stages, consumer_regs=creg, producer_regs=preg)


def use_variant(name: str):
    """Make fp8 d128 decoding calls (rows <= 64) run `name`; returns the configuration."""
    from cute_flash import kvcache
    from cute_flash.arch.sm90.kvcache import tile_config as kv

    original = getattr(kv, "_shipped_kvcache_tile_config", kv.kvcache_tile_config)
    kv._shipped_kvcache_tile_config = original
    cfg = variant_config(name)

    def patched(spec, rows):
        if spec.kv_fp8 and spec.head_dim == 128 and rows <= 64:
            return cfg
        return original(spec, rows)

    kv.kvcache_tile_config = patched
    kvcache._plans.clear()
    return cfg


def compile_only() -> int:
    import os
    import tempfile

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from cute_flash import census, compile_cache
    from cute_flash.arch.sm90.kvcache import tile_config as kv
    from cute_flash.arch.sm90.kvcache.launch import kvcache_kernel
    from cute_flash.spec import AttentionSpec

    for page in (0, 128):
        spec = AttentionSpec("bf16", 128, 128, "causal", "bf16", kvcache=True, page_size=page, kv_fp8=True)
        for name in VARIANTS:
            cfg = variant_config(name)
            why = kv.residency_problem(cfg, 128, 128)
            with tempfile.TemporaryDirectory() as dump:
                with census.capture_fd_stderr() as err:
                    kvcache_kernel(spec, cfg, "sm_90a", False, False, compile_cache.keep_artifacts_options(dump))
            ((_, res),) = census.parse_ptxas_reports("".join(err))
            print(f"page {page:>3} {name:<12} smem {kv.kvcache_smem_bytes(cfg, 128, 128) // 1024} KiB, {res}, "
                  f"residency: {why or 'ok'}")  # fmt: skip
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--batches", default="8,64")
    p.add_argument("--contexts", default="8192,32768")
    p.add_argument("--pages", default="0,128")
    args = p.parse_args(argv)
    if args.compile_only:
        return compile_only()
    import torch
    from triton.testing import do_bench_cudagraph

    import cute_flash
    from profiling.decode_benchmark import cache_bytes, make_cache

    dev, gen, h, hkv, d = torch.device("cuda"), torch.Generator().manual_seed(0), 32, 8, 128
    print(f"{torch.cuda.get_device_name()}: fp8-cache decoding d128 h32/8, CUDA graphs; µs (bf16-cache µs, speed-up)")
    with torch.no_grad():
        for b in map(int, args.batches.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                for page in map(int, args.pages.split(",")):
                    q = torch.randn(b, 1, h, d, device=dev, dtype=torch.bfloat16)
                    k, v, table = make_cache(b, ctx, page, hkv, d, torch.bfloat16, dev, gen)
                    lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
                    ds = torch.full((b, hkv), 0.05, device=dev)
                    k8, v8 = (k / 0.05).to(torch.float8_e4m3fn), (v / 0.05).to(torch.float8_e4m3fn)
                    ref = cute_flash.attention_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table)
                    t16 = do_bench_cudagraph(
                        lambda: cute_flash.attention_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table),
                        rep=100, return_mode="median",
                    )  # fmt: skip
                    row = f"{b:>4} x {ctx:>6} page {page:>3}  bf16 {t16 * 1e3:7.1f}"
                    for name in VARIANTS:
                        use_variant(name)

                        def fn():
                            return cute_flash.attention_with_kvcache(
                                q, k8, v8, cache_seqlens=lens, page_table=table, k_descale=ds, v_descale=ds
                            )

                        try:
                            err = (fn().float() - ref.float()).abs().max().item()
                            t = do_bench_cudagraph(fn, rep=100, return_mode="median")
                            row += f" | {name} {t * 1e3:7.1f} ({t16 / t:.2f}x, err {err:.3f})"
                        except Exception as e:  # noqa: BLE001
                            row += f" | {name} failed {type(e).__name__}: {str(e)[:60]}"
                    print(row, flush=True)
                    print(f"{'':>8}K+V bf16 {cache_bytes(b, ctx, hkv, d, 2) / t16 / 1e9:.2f} TB/s")
                    torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Study: tile configurations of the sm90 KV-cache forward (d128 decoding), side by side, for a 16-bit or an fp8 cache.

Each variant replaces `kvcache_tile_config` for d128 decoding specs of that cache kind (the launcher and the split
count read it through the module), then times the same calls (CUDA graphs) and checks them against the shipped one.

  fp8: the shipped d128 decoder is the swapped one (swapped.py: mma.sync with keys on M, the cache converted in
       registers; tile_config.SwappedTileConfig). The variants: the wgmma kernel it replaced (converter warps, 64-row
       tiles: 1.16-1.19x the bf16 cache, 2026-12-03), and the swapped decoder's stages, tile and warps.
  bf16: small grids (batch 1-2, split to one CTA per SM: tile_config.SMALL_GRID_DIVISOR) keep only the 64 KiB of
       one CTA's two stages in flight per SM; the variants deepen the ring of that one CTA.

    CUTE_DSL_ARCH=sm_90a python3 -m profiling.kvcache_configs --cache fp8 --compile-only   # registers, no GPU
    python3 -m profiling.kvcache_configs --cache fp8                                      # times them (GPU)
    python3 -m profiling.kvcache_configs --cache bf16 --batches 1,2 --contexts 4096,32768 --pages 0,16
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Dict, List, Optional

# cache -> name -> None (the shipped configuration), "wgmma" (fp8: the wgmma kernel's decoding configuration), a dict
# of SwappedTileConfig fields (fp8), or (ctas per SM, 16-bit stages, consumer registers, producer registers) (bf16).
VARIANTS: Dict[str, Dict[str, object]] = {
    "fp8": {
        "shipped": None,
        "wgmma kernel": "wgmma",
        "3 stages x 2 CTAs": {"num_stages": 3, "ctas_per_sm": 2},
        "64 keys x 6 stages x 2 CTAs": {"tile_n": 64, "num_stages": 6, "ctas_per_sm": 2},
        "6 stages x 8 warps": {"num_stages": 6, "consumer_warps": 8},
    },
    "bf16": {
        "shipped": None,
        "1 CTA x 3": (1, 3, 232, 24),
        "1 CTA x 4": (1, 4, 232, 24),
        "1 CTA x 6": (1, 6, 232, 24),
    },
}


def variant_config(cache: str, name: str):
    from cute_flash.arch.sm90.kvcache import tile_config as kv

    v = VARIANTS[cache][name]
    if cache == "fp8":
        if v is None:
            return kv.SwappedTileConfig()
        return kv._FP8_DECODE_BY_HEAD_DIM[128] if v == "wgmma" else kv.SwappedTileConfig(**v)
    shipped = kv._DECODE_BY_HEAD_DIM[128]
    if v is None:
        return shipped
    ctas, stages, creg, preg = v
    return replace(shipped, ctas_per_sm=ctas, consumer_regs=creg, producer_regs=preg, num_stages=stages)


def use_variant(cache: str, name: str):
    """Make d128 decoding calls (rows <= 64) of `cache`'s kind run `name`; returns the configuration."""
    from cute_flash import kvcache
    from cute_flash.arch.sm90.kvcache import tile_config as kv

    original = getattr(kv, "_shipped_kvcache_tile_config", kv.kvcache_tile_config)
    kv._shipped_kvcache_tile_config = original
    cfg = variant_config(cache, name)

    def patched(spec, rows):
        if spec.kv_fp8 == (cache == "fp8") and spec.head_dim == 128 and rows <= 8:
            return cfg
        return original(spec, rows)

    kv.kvcache_tile_config = patched
    kvcache._plans.clear()
    return cfg


def compile_only(cache: str) -> int:
    import os
    import tempfile

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from cute_flash import census, compile_cache
    from cute_flash.arch.sm90.kvcache import tile_config as kv
    from cute_flash.arch.sm90.kvcache.launch import kvcache_kernel
    from cute_flash.spec import AttentionSpec

    for page in (0, 128):
        spec = AttentionSpec("bf16", 128, 128, "causal", "bf16", kvcache=True, page_size=page, kv_fp8=cache == "fp8")
        for name in VARIANTS[cache]:
            cfg = variant_config(cache, name)
            why = kv.residency_problem(cfg, 128, 128)
            if isinstance(cfg, kv.KvCacheTileConfig):
                why = why or kv.budget_problem(cfg, 128, 128)
            with tempfile.TemporaryDirectory() as dump:
                with census.capture_fd_stderr() as err:
                    kvcache_kernel(spec, cfg, "sm_90a", False, False, compile_cache.keep_artifacts_options(dump))
            ((_, res),) = census.parse_ptxas_reports("".join(err))
            print(f"page {page:>3} {name:<20} smem {kv.kvcache_smem_bytes(cfg, 128, 128) // 1024} KiB, {res}, "
                  f"fits: {why or 'ok'}")  # fmt: skip
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", choices=sorted(VARIANTS), default="fp8")
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--batches", default=None, help="default: 8,64 (fp8), 1,2 (bf16)")
    p.add_argument("--contexts", default="8192,32768")
    p.add_argument("--pages", default="0,128")
    p.add_argument("--variants", default=None, help="comma-separated names of VARIANTS[cache] (default: all)")
    args = p.parse_args(argv)
    names = list(VARIANTS[args.cache]) if args.variants is None else args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS[args.cache]]
    if unknown:
        p.error(f"--variants: unknown {unknown} (choose from {list(VARIANTS[args.cache])})")
    if args.compile_only:
        return compile_only(args.cache)
    import torch
    from triton.testing import do_bench_cudagraph

    import cute_flash
    from profiling.decode_benchmark import cache_bytes, make_cache

    fp8 = args.cache == "fp8"
    batches = args.batches or ("8,64" if fp8 else "1,2")
    dev, gen, h, hkv, d = torch.device("cuda"), torch.Generator().manual_seed(0), 32, 8, 128
    print(f"{torch.cuda.get_device_name()}: {args.cache}-cache decoding d128 h32/8, CUDA graphs; µs per variant "
          f"(speed-up over the bf16 cache's shipped configuration, max |diff| against it)")  # fmt: skip
    with torch.no_grad():
        for b in map(int, batches.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                for page in map(int, args.pages.split(",")):
                    q = torch.randn(b, 1, h, d, device=dev, dtype=torch.bfloat16)
                    k, v, table = make_cache(b, ctx, page, hkv, d, torch.bfloat16, dev, gen)
                    lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
                    ds = torch.full((b, hkv), 0.05, device=dev)
                    k8, v8 = (k / 0.05).to(torch.float8_e4m3fn), (v / 0.05).to(torch.float8_e4m3fn)
                    use_variant("bf16", "shipped")
                    use_variant("fp8", "shipped")
                    ref = cute_flash.attention_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table)
                    t16 = do_bench_cudagraph(
                        lambda: cute_flash.attention_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table),
                        rep=100, return_mode="median",
                    )  # fmt: skip
                    row = f"{b:>4} x {ctx:>6} page {page:>3}  bf16 {t16 * 1e3:7.1f}"
                    for name in names:
                        use_variant(args.cache, name)
                        cache = (k8, v8, ds, ds) if fp8 else (k, v, None, None)

                        def fn(cache=cache):
                            kc, vc, kd, vd = cache
                            return cute_flash.attention_with_kvcache(
                                q, kc, vc, cache_seqlens=lens, page_table=table, k_descale=kd, v_descale=vd
                            )

                        try:
                            err = (fn().float() - ref.float()).abs().max().item()
                            t = do_bench_cudagraph(fn, rep=100, return_mode="median")
                            row += f" | {name} {t * 1e3:7.1f} ({t16 / t:.2f}x, {err:.3f})"
                        except Exception as e:  # noqa: BLE001
                            row += f" | {name} failed {type(e).__name__}: {str(e)[:60]}"
                    print(row, flush=True)
                    print(f"{'':>8}K+V bf16 {cache_bytes(b, ctx, hkv, d, 2) / t16 / 1e9:.2f} TB/s")
                    torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Study: tile configurations of the sm90 KV-cache forward (d128 decoding), side by side, for a 16-bit or an fp8 cache.

Each variant replaces `kvcache_tile_config` for d128 decoding specs of that cache kind (the launcher and the split
count read it through the module), then times the same calls (CUDA graphs) and checks them against the shipped one.

  fp8: the shipped configuration (two CTAs per SM, two e4m3 stages each) keeps 64 KiB of e4m3 tiles in flight per
       SM, half what the bf16 cache's two 16-bit stages keep: the variants deepen the e4m3 rings in the same shared
       memory. Measured (H200, 2026-12-02): one CTA per SM with 4 or 8 e4m3 stages (half the converter warps per
       SM) 1.45x slower than two; 8 stages of 32-key tiles 1.25x, one 16-bit stage with 4 e4m3 ones 1.1x slower.
       With the loads ahead, 3-4 stages of 48-key tiles 0.94x. The variants now: how many of a converter thread's
       loads go out before their conversions (shipped: 4), and the converter warps converting V as well as K (the
       shipped d128 configuration has the consumers convert V: 2-4% faster, 2026-12-03; docs/performance.md).
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

# cache -> name -> (ctas per SM, stages, consumer registers, producer registers[, other fields]); None: the shipped
# configuration. For fp8 the stages are the e4m3 ring's; for bf16 the 16-bit ring's.
VARIANTS: Dict[str, Dict[str, Optional[tuple]]] = {
    "fp8": {
        "shipped": None,
        # The converter threads' loads issued ahead of their conversions (fp8_loads_ahead), at the registers that
        # hold them spill-free: one (the converter warps wait out every load), all eight.
        "1 ahead, 216 / 40 regs": (2, 2, 216, 40, {"fp8_loads_ahead": 1, "fp8_v_by_consumers": False}),
        "8 ahead, 184 / 72 regs": (2, 2, 184, 72, {"fp8_loads_ahead": 8, "fp8_v_by_consumers": False}),
        # The converter warps convert V too (the shipped d128 configuration has the consumers convert V).
        "converters convert V": (2, 2, 200, 56, {"fp8_loads_ahead": 4, "fp8_v_by_consumers": False}),
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

    shipped = (kv._FP8_DECODE_BY_HEAD_DIM if cache == "fp8" else kv._DECODE_BY_HEAD_DIM)[128]
    v = VARIANTS[cache][name]
    if v is None:
        return shipped
    ctas, stages, creg, preg = v[:4]
    cfg = replace(shipped, ctas_per_sm=ctas, consumer_regs=creg, producer_regs=preg, **(v[4] if len(v) > 4 else {}))
    return replace(cfg, fp8_stages=stages) if cache == "fp8" else replace(cfg, num_stages=stages)


def use_variant(cache: str, name: str):
    """Make d128 decoding calls (rows <= 64) of `cache`'s kind run `name`; returns the configuration."""
    from cute_flash import kvcache
    from cute_flash.arch.sm90.kvcache import tile_config as kv

    original = getattr(kv, "_shipped_kvcache_tile_config", kv.kvcache_tile_config)
    kv._shipped_kvcache_tile_config = original
    cfg = variant_config(cache, name)

    def patched(spec, rows):
        if spec.kv_fp8 == (cache == "fp8") and spec.head_dim == 128 and rows <= 64:
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
            why = kv.residency_problem(cfg, 128, 128) or kv.budget_problem(cfg, 128, 128)
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
    args = p.parse_args(argv)
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
                    for name in VARIANTS[args.cache]:
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

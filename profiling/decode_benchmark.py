"""Decoding speed (GPU): query tokens against a KV cache, cute-flash's `attention_with_kvcache` (dense and paged
caches, bf16 and fp8) beside torch SDPA (dense) and FlashAttention-4's paged decode, in one process. A decoding
step reads the whole cache once, so the figure of merit is the K + V bytes read over the call's time (TB/s),
against the GPU's DRAM bandwidth (H200: 4.8 TB/s by its datasheet).

    python3 -m profiling.decode_benchmark                       # the grid of issue 46 (configs that fit in memory)
    python3 -m profiling.decode_benchmark --batches 8 --contexts 32768 --pages 0,16 --impls cute,sdpa
    python3 -m profiling.decode_benchmark --fp8                 # also an fp8 cache (cute-flash only)
    python3 -m profiling.decode_benchmark --graphs              # time CUDA-graph replays (no host time)

Page size 0 is the dense cache (batch, context, h_kv, d); others are paged caches whose pages are a random
permutation (shared by no sequence). Timing: triton's do_bench median (--graphs: do_bench_cudagraph), a config
whose caches would not fit in --max-gib skipped. Each impl's calls rotate over copies of the inputs (--rotate-mib
of caches at least, 3x the L2 by default), so that no call finds the cache it reads in L2: do_bench flushes L2
before each call, but do_bench_cudagraph replays the same call back to back, and a cache smaller than L2 (50 MiB
on an H100 / H200: batch 1 x 8k is 33.5 MB of bf16 K + V) would be read from it. The % column is of --peak-tbs,
by default the GPU's datasheet bandwidth where its name is known (PEAK_TBS).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Callable, Dict, List, Optional

IMPLS = ("cute", "sdpa", "fa4")
# DRAM bandwidth by its datasheet (TB/s), by a substring of torch.cuda.get_device_name(), the first that matches.
PEAK_TBS = (("H200", 4.8), ("H100 NVL", 3.9), ("H100", 3.35), ("A100-SXM4-80GB", 2.04), ("A100", 1.56))


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,64,256", help="(default: %(default)s)")
    p.add_argument("--contexts", default="1024,8192,32768,131072", help="keys per sequence (default: %(default)s)")
    p.add_argument("--pages", default="0,16,128", help="page sizes; 0 = dense cache (default: %(default)s)")
    p.add_argument("--seqlen-q", type=int, default=1, help="query tokens per sequence (default: %(default)s)")
    p.add_argument("--heads", type=int, default=32, help="(default: %(default)s)")
    p.add_argument("--heads-kv", type=int, default=8, help="(default: %(default)s)")
    p.add_argument("--head-dim", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated, of %(default)s")
    p.add_argument("--fp8", action="store_true", help="also time cute-flash with a float8_e4m3fn cache")
    p.add_argument("--graphs", action="store_true", help="time CUDA-graph replays instead of eager calls")
    p.add_argument("--splits", default="", help="also time cute-flash (and fp8) with these num_splits (e.g. 8,16)")
    p.add_argument("--kernels", action="store_true", help="per config, each impl's kernels and their mean µs")
    p.add_argument("--max-gib", type=float, default=60.0, help="skip configs whose caches exceed this (%(default)s)")
    p.add_argument("--peak-tbs", type=float, default=0.0, help="DRAM bandwidth for the %% column (0: PEAK_TBS's)")
    p.add_argument("--rotate-mib", type=float, default=0.0, help="input copies to rotate over (0: 3 x the L2)")
    args = p.parse_args(argv)
    try:
        for name in ("batches", "contexts", "pages", "splits"):
            setattr(args, name, [int(x) for x in getattr(args, name).split(",") if x != ""])
    except ValueError:
        p.error("--batches, --contexts, --pages and --splits take comma-separated integers")
    if min(args.batches + args.contexts) <= 0 or min(args.pages + args.splits, default=0) < 0:
        p.error("batches and contexts must be positive, page sizes and splits >= 0")
    if args.rotate_mib < 0 or args.peak_tbs < 0:
        p.error("--rotate-mib and --peak-tbs must be >= 0")
    args.impls = [x for x in args.impls.split(",") if x]
    bad = [x for x in args.impls if x not in IMPLS]
    if bad or not args.impls:
        p.error(f"--impls: unknown {bad} (choose from {','.join(IMPLS)})")
    if args.heads % args.heads_kv:
        p.error("--heads must be a multiple of --heads-kv")
    return args


def cache_bytes(batch: int, context: int, heads_kv: int, head_dim: int, elem: int) -> int:
    """K + V bytes a decoding step reads."""
    return 2 * batch * context * heads_kv * head_dim * elem


def make_cache(batch, context, page, hkv, d, dtype, device, gen):
    """(k_cache, v_cache, page_table or None) holding `context` keys per sequence."""
    import torch

    if page == 0:
        shape = (batch, context, hkv, d)
        return torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype), None
    per_seq = -(-context // page)
    pages = batch * per_seq
    k = torch.randn(pages, page, hkv, d, device=device, dtype=dtype)
    v = torch.randn(pages, page, hkv, d, device=device, dtype=dtype)
    table = torch.randperm(pages, generator=gen).to(device=device, dtype=torch.int32).view(batch, per_seq)
    return k, v, table


MAX_COPIES = 64


def peak_tbs(device_name: str) -> float:
    """The datasheet DRAM bandwidth of a GPU named `device_name` (PEAK_TBS), 0.0 where unknown."""
    return next((tbs for name, tbs in PEAK_TBS if name in device_name), 0.0)


def input_copies(nbytes: int, rotate_bytes: int) -> int:
    """Copies of a config's inputs whose caches together hold at least rotate_bytes (1 .. MAX_COPIES)."""
    return max(1, min(MAX_COPIES, -(-rotate_bytes // max(nbytes, 1))))


def rotating(fns: List[Callable]) -> Callable:
    """A call that runs the next of `fns` each time (a CUDA graph captured from it replays them in turn)."""
    turn = itertools.cycle(fns)
    return lambda: next(turn)()


def input_set(args, batch: int, context: int, page: int, device, gen) -> tuple:
    """(q, k_cache, v_cache, page_table, cache_seqlens, fp8 caches and descales or None) of one config."""
    import torch

    h, hkv, d = args.heads, args.heads_kv, args.head_dim
    q = torch.randn(batch, args.seqlen_q, h, d, device=device, dtype=torch.bfloat16)
    k, v, table = make_cache(batch, context, page, hkv, d, torch.bfloat16, device, gen)
    seqlens = torch.full((batch,), context, device=device, dtype=torch.int32)
    fp8 = None
    if args.fp8:
        kd = torch.full((batch, hkv), 0.05, device=device)
        vd = torch.full((batch, hkv), 0.05, device=device)
        fp8 = ((k / 0.05).to(torch.float8_e4m3fn), (v / 0.05).to(torch.float8_e4m3fn), kd, vd)
    return q, k, v, table, seqlens, fp8


def impls_for(args, q, k, v, table, seqlens, fp8=None) -> Dict[str, Callable]:
    import torch
    import torch.nn.functional as F

    import cute_flash

    fns: Dict[str, Callable] = {}
    if "cute" in args.impls:
        fns["cute"] = lambda: cute_flash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, page_table=table)
        for n in args.splits:
            fns[f"cute s={n}"] = lambda n=n: cute_flash.attention_with_kvcache(
                q, k, v, cache_seqlens=seqlens, page_table=table, num_splits=n
            )
        if fp8 is not None:
            k8, v8, kd, vd = fp8
            fns["cute fp8"] = lambda: cute_flash.attention_with_kvcache(
                q, k8, v8, cache_seqlens=seqlens, page_table=table, k_descale=kd, v_descale=vd
            )
            for n in args.splits:
                fns[f"cute fp8 s={n}"] = lambda n=n: cute_flash.attention_with_kvcache(
                    q, k8, v8, cache_seqlens=seqlens, page_table=table, k_descale=kd, v_descale=vd, num_splits=n
                )
    if "sdpa" in args.impls and table is None:
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        fns["sdpa"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
    if "fa4" in args.impls:
        try:
            from flash_attn.cute import flash_attn_varlen_func

            fns["fa4"] = lambda: flash_attn_varlen_func(q, k, v, seqused_k=seqlens, page_table=table, causal=True)
        except Exception as e:  # noqa: BLE001 - reported once per config
            print(f"  (fa4 not timed: {type(e).__name__}: {e})")
    del torch
    return fns


def time_ms(fn, graphs: bool) -> float:
    from triton.testing import do_bench, do_bench_cudagraph

    if graphs:
        return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def kernel_times(fn, calls: int = 20) -> str:
    """The kernels one call of `fn` launches, with their mean device µs (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA and e.count]
    return "; ".join(f"{e.key[:48]} x{e.count / calls:g} {e.device_time_total / e.count:.1f}" for e in rows)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    h, hkv, d, sq = args.heads, args.heads_kv, args.head_dim, args.seqlen_q
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    peak = args.peak_tbs or peak_tbs(torch.cuda.get_device_name())
    rotate_bytes = int(args.rotate_mib * 2**20) if args.rotate_mib else 3 * l2
    mode = "CUDA-graph replays" if args.graphs else "eager calls"
    print(f"{torch.cuda.get_device_name()}: decode sq{sq} h{h}/{hkv} d{d} bf16, {mode}, inputs "
          f"rotated over >= {rotate_bytes / 2**20:.0f} MiB; µs and K+V TB/s (% of {peak or '?'} TB/s)")  # fmt: skip
    print(f"{'batch':>6}{'context':>9}{'page':>6}  " + "  ".join(f"{n:>22}" for n in ("impl", "µs", "TB/s")))
    with torch.no_grad():
        busy = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)  # clocks up before the first row
        for _ in range(500):
            busy = busy @ busy / 64
        torch.cuda.synchronize()
        for b in args.batches:
            for ctx in args.contexts:
                nbytes = cache_bytes(b, ctx, hkv, d, 2)
                if nbytes / 2**30 > args.max_gib:
                    print(f"{b:>6}{ctx:>9}{'':>6}  skipped: {nbytes / 2**30:.0f} GiB of cache > --max-gib")
                    continue
                for page in args.pages:
                    sets = [
                        input_set(args, b, ctx, page, device, gen)
                        for _ in range(input_copies(nbytes, rotate_bytes))
                    ]  # fmt: skip
                    per_set = [impls_for(args, *inputs) for inputs in sets]
                    for name in per_set[0]:
                        fn = rotating([fns[name] for fns in per_set])
                        row = f"{b:>6}{ctx:>9}{page:>6}  {name:>22}"
                        try:
                            ms = time_ms(fn, args.graphs)
                            moved = nbytes // 2 if "fp8" in name.split() else nbytes
                            tbs = moved / ms / 1e9
                            share = f"{100 * tbs / peak:.0f}%" if peak else "?"
                            print(f"{row}{ms * 1e3:>24.1f}{tbs:>18.2f} ({share})")
                            if args.kernels:
                                print(f"{'':>21}kernels: {kernel_times(fn)}")
                        except Exception as e:  # noqa: BLE001 - one failed impl does not stop the grid
                            print(f"{row}  failed: {type(e).__name__}: {str(e)[:100]}")
                    del sets, per_set
                    torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

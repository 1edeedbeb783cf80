"""Decoding speed (GPU): one (or a few) query rows per sequence against a long key cache, cute-flash beside
FlashAttention-4 and torch SDPA in one process. Decoding reads the whole K / V cache once per step, so the figure of
merit is the cache's bytes over the call's time (GB/s), against the GPU's DRAM bandwidth.

    python3 -m profiling.decode_benchmark [--batches 1,8] [--seqlens-k 4096,32768] [--heads 32] [--heads-kv 8]
        [--unsplit] [--min-tiles-per-split N] [--split-configs "1,128,2;1,128,3"]

--unsplit also times cute-flash with split-key decoding off (arch/split_kv.py's MAX_SPLITS = 1), in the same
process: the split's own gain.
"""

from __future__ import annotations

import argparse
import contextlib

import torch


def _ms(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--seqlens-k", default="4096,32768")
    p.add_argument("--seqlen-q", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--peers", default="fa4,sdpa", help="peers to time beside cute-flash ('' for none)")
    p.add_argument("--unsplit", action="store_true", help="also time cute-flash without split-key decoding")
    p.add_argument("--min-tiles-per-split", type=int, help="split_kv.MIN_TILES_PER_SPLIT for this run (a study)")
    p.add_argument(
        "--split-configs",
        default="",
        help="also time split builds with other tile configurations, 'consumers,tile_n,stages;...' (a study)",
    )
    args = p.parse_args()
    if args.min_tiles_per_split:
        from cute_flash.arch import split_kv

        split_kv.MIN_TILES_PER_SPLIT = args.min_tiles_per_split
    import torch.nn.functional as F

    import cute_flash

    impls = {"cute-flash": lambda q, k, v: cute_flash.attention(q, k, v, causal=True)}
    if args.unsplit:
        impls["cute-flash unsplit"] = impls["cute-flash"]
    studies = {}
    for c in filter(None, args.split_configs.split(";")):
        studies[f"split {c}"] = tuple(int(x) for x in c.split(","))
        impls[f"split {c}"] = impls["cute-flash"]
    peers = args.peers.split(",")
    if "fa4" in peers:
        try:
            from flash_attn.cute import flash_attn_func

            impls["fa4"] = lambda q, k, v: flash_attn_func(q, k, v, causal=True)
        except Exception as e:  # noqa: BLE001
            print(f"fa4 not timed: {e}")
    if "sdpa" in peers:
        impls["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True
        )  # one query row per sequence: causal (bottom-right) = every key
    h, hkv, d, sq = args.heads, args.heads_kv, args.head_dim, args.seqlen_q
    print(f"{torch.cuda.get_device_name()}: decode, seqlen_q {sq}, h{h} h_kv{hkv} d{d} bf16; µs and cache GB/s")
    print(f"{'batch':>6}{'seqlen_k':>10}" + "".join(f"{n:>22}" for n in impls))
    with torch.no_grad():
        # The GPU's clocks ramp up under load: a second of matmuls first, or the first row reads slow.
        busy = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        for _ in range(1000):
            busy = busy @ busy / 64
        torch.cuda.synchronize()
        for b in (int(x) for x in args.batches.split(",")):
            for sk in (int(x) for x in args.seqlens_k.split(",")):
                q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
                k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                cache_bytes = 2 * k.numel() * k.element_size()
                row = f"{b:>6}{sk:>10}"
                for name, fn in impls.items():
                    try:
                        if name == "cute-flash unsplit":
                            ctx = _unsplit()
                        elif name in studies:
                            ctx = _split_config(*studies[name])
                        else:
                            ctx = contextlib.nullcontext()
                        with ctx:
                            ms = _ms(lambda: fn(q, k, v))
                        row += f"{ms * 1e3:>12.1f}{cache_bytes / ms / 1e6:>8.0f}GB/s"[:22].rjust(22)
                    except Exception as e:  # noqa: BLE001
                        row += f"{type(e).__name__:>22}"
                print(row)


@contextlib.contextmanager
def _unsplit():
    """Split-key decoding off inside (the plans made meanwhile are forgotten again on the way out)."""
    from cute_flash import interface
    from cute_flash.arch import split_kv

    saved = split_kv.MAX_SPLITS
    split_kv.MAX_SPLITS = 1
    interface.clear_call_cache()
    try:
        yield
    finally:
        split_kv.MAX_SPLITS = saved
        interface.clear_call_cache()


@contextlib.contextmanager
def _split_config(consumers: int, tile_n: int, stages: int):
    """Split builds with this tile configuration inside (kernels and plans made meanwhile forgotten on the way out)."""
    from cute_flash import interface
    from cute_flash.arch.sm90 import backend
    from cute_flash.arch.sm90.tile_config import FwdTileConfig

    cfg = FwdTileConfig(num_consumer_wgs=consumers, tile_n=tile_n, num_stages=stages, ping_pong=consumers > 1)
    saved = backend.split_tile_config
    backend.split_tile_config = lambda spec: cfg
    backend._forward_kernels.clear()
    interface.clear_call_cache()
    try:
        yield
    finally:
        backend.split_tile_config = saved
        backend._forward_kernels.clear()
        interface.clear_call_cache()


if __name__ == "__main__":
    main()

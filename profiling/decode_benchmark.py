"""Decoding speed (GPU): one (or a few) query rows per sequence against a long key cache, cute-flash beside
FlashAttention-4 and torch SDPA in one process. Decoding reads the whole K / V cache once per step, so the figure of
merit is the cache's bytes over the call's time (GB/s), against the GPU's DRAM bandwidth.

    python3 -m profiling.decode_benchmark [--batches 1,8] [--seqlens-k 4096,32768] [--heads 32] [--heads-kv 8]
"""

from __future__ import annotations

import argparse

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
    args = p.parse_args()
    import torch.nn.functional as F

    import cute_flash

    impls = {"cute-flash": lambda q, k, v: cute_flash.attention(q, k, v, causal=True)}
    try:
        from flash_attn.cute import flash_attn_func

        impls["fa4"] = lambda q, k, v: flash_attn_func(q, k, v, causal=True)
    except Exception as e:  # noqa: BLE001
        print(f"fa4 not timed: {e}")
    impls["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True
    )  # one query row per sequence: causal (bottom-right) = every key
    h, hkv, d, sq = args.heads, args.heads_kv, args.head_dim, args.seqlen_q
    print(f"{torch.cuda.get_device_name()}: decode, seqlen_q {sq}, h{h} h_kv{hkv} d{d} bf16; µs and cache GB/s")
    print(f"{'batch':>6}{'seqlen_k':>10}" + "".join(f"{n:>22}" for n in impls))
    with torch.no_grad():
        for b in (int(x) for x in args.batches.split(",")):
            for sk in (int(x) for x in args.seqlens_k.split(",")):
                q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
                k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                cache_bytes = 2 * k.numel() * k.element_size()
                row = f"{b:>6}{sk:>10}"
                for fn in impls.values():
                    try:
                        ms = _ms(lambda: fn(q, k, v))
                        row += f"{ms * 1e3:>12.1f}{cache_bytes / ms / 1e6:>8.0f}GB/s"[:22].rjust(22)
                    except Exception as e:  # noqa: BLE001
                        row += f"{type(e).__name__:>22}"
                print(row)


if __name__ == "__main__":
    main()

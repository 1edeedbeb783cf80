"""One fresh process's first cute_flash calls, for tests/test_disk_cache_gpu.py: forward + backward, d128 causal
bf16, with as many key/value heads as query heads and with grouped ones (GQA); with `packed`, instead packed sequences
without a mask (whose sm90 forward launches 2-CTA clusters: the launch's cluster shape must survive the disk cache).
Saves the results to OUT (torch.save) and prints what the compile cache did as JSON: where each kernel came from,
whether cutlass was imported, seconds.

usage: python tests/cache_gpu_child.py OUT [packed]
"""

import json
import sys
import time

import torch

import cute_flash
from cute_flash import compile_cache
from cute_flash.testing import random_qkv


def main(out_path: str, packed: bool = False) -> None:
    results = {}
    torch.cuda.synchronize()  # the CUDA context exists before the clock starts
    start = time.perf_counter()
    for name, heads_kv in (("mha", 8), ("gqa", 2)):
        if packed:
            lens = [300, 5, 700, 129]
            cu = torch.tensor([0, 300, 305, 1005, 1134], dtype=torch.int32, device="cuda")
            q, k, v = random_qkv(1, sum(lens), sum(lens), 8, heads_kv, 128, seed=0)
            q, k, v = (t[0].detach().requires_grad_() for t in (q, k, v))
            out = cute_flash.attention_varlen(q, k, v, cu, cu, max(lens), max(lens))
        else:
            q, k, v = random_qkv(2, 300, 333, 8, heads_kv, 128, seed=0, requires_grad=True)
            out = cute_flash.attention(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
        results[name] = [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    torch.save(results, out_path)
    print(
        json.dumps(
            {
                "sources": sorted(compile_cache.cache_sources().values()),
                "cutlass_imported": "cutlass" in sys.modules,
                "seconds": seconds,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] == ["packed"])

"""The device timeline of three backward calls, ours and FA4's (GPU): each kernel's start, duration and the idle gap
before it, and the longest CUDA API calls (a host-side stall would show as a gap).

    python3 -m profiling.bwd_timeline BATCH SEQLEN none|causal      # h16 d128 bf16

docs/performance.md session 19 (b11 s5888: no gaps between the kernels).
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import cute_flash


def _impls(causal: bool) -> dict:
    impls = {"ours": lambda q, k, v: cute_flash.attention(q, k, v, causal=causal)}
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # noqa: BLE001
        print("no fa4:", e)
        return impls

    def fa4(q, k, v):
        o = flash_attn_func(q, k, v, causal=causal)
        return o[0] if isinstance(o, tuple) else o

    impls["fa4"] = fa4
    return impls


def main() -> None:
    b, s, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "causal"
    for name, fn in _impls(causal).items():
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(b, s, 16, 128, generator=g, device="cuda").bfloat16().requires_grad_(True) for _ in range(3)
        )
        out = fn(q, k, v)
        dout = torch.randn_like(out)
        cache = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")  # as do_bench's L2 flush

        def bwd():
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        for _ in range(5):
            bwd()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                cache.zero_()
                bwd()
            torch.cuda.synchronize()
        events = sorted(
            (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
            key=lambda e: e.time_range.start,
        )
        t0 = prev_end = events[0].time_range.start
        print(f"== {name} b{b} s{s} causal={causal}")
        for e in events:
            start, end = e.time_range.start, e.time_range.end
            print(f"  {start - t0:9.0f} +{end - start:8.0f} gap {start - prev_end:7.0f}  {e.name[:70]}")
            prev_end = max(prev_end, end)
        api = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cu")]
        # In issue order (host clock, same origin as the device events): which call blocks the host, and until when.
        for e in sorted(api, key=lambda e: e.time_range.start):
            print(f"  api {e.time_range.start - t0:9.0f} +{e.time_range.end - e.time_range.start:6.0f}  {e.name}")


if __name__ == "__main__":
    main()

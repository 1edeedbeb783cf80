"""Host time per warm call, cute-flash beside FlashAttention-4 and torch SDPA (GPU), measured as issue 15's table was:
a long matmul chain is queued first so the GPU stays busy, then 100 back-to-back calls are timed on the host.

  python3 -m profiling.host_overhead [--shape 1,128,8,128] [--calls 100]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _host_us(fn, calls: int, busy: torch.Tensor) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        for _ in range(20):  # ~ tens of ms of queued GPU work, longer than the calls take to issue
            busy = busy @ busy
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1,128,8,128", help="batch,seqlen,heads,head_dim")
    p.add_argument("--calls", type=int, default=100)
    args = p.parse_args()
    b, s, h, d = (int(x) for x in args.shape.split(","))

    import torch.nn.functional as F

    import cute_flash

    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    busy = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    impls = {"cute-flash": lambda q, k, v: cute_flash.attention(q, k, v, causal=True)}
    try:
        from flash_attn.cute import flash_attn_func

        def fa4(q, k, v):
            r = flash_attn_func(q, k, v, causal=True)
            return r[0] if isinstance(r, tuple) else r

        impls["fa4"] = fa4
    except Exception as e:  # noqa: BLE001 - FA4 absent or failing to import: time the others
        print(f"fa4 not timed: {e}")

    class Floor(torch.autograd.Function):
        """torch's own cost: an autograd function with attention's inputs, outputs and allocations, launching
        nothing (on a GPU the backward runs on autograd's device thread, a hand-off the CPU tool does not see)."""

        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return torch.empty_like(q), torch.empty(b, h, s, dtype=torch.float32, device=q.device)

        @staticmethod
        def backward(ctx, dout, _dlse):
            q, k, v = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    impls["torch floor"] = lambda q, k, v: Floor.apply(q, k, v)[0]
    impls["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)

    print(f"host µs per warm call, shape b{b} s{s} h{h} d{d}, bf16 causal, {args.calls} calls, GPU busy")
    print(f"{'impl':>12} {'forward':>10} {'fwd+bwd':>10}")
    for name, fn in impls.items():
        with torch.no_grad():
            fwd = _host_us(lambda: fn(q, k, v), args.calls, busy)
        both = _host_us(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout), args.calls, busy)
        print(f"{name:>12} {fwd:>10.1f} {both:>10.1f}", flush=True)


if __name__ == "__main__":
    main()

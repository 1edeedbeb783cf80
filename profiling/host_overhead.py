"""Host time per warm call, cute-flash beside FlashAttention-4 and torch SDPA (GPU), measured as issue 15's table was:
a long matmul chain is queued first so the GPU stays busy, then 100 back-to-back calls are timed on the host.

  python3 -m profiling.host_overhead [--shape 1,128,8,128] [--seqlen-k N] [--heads-kv N] [--calls 100] [--breakdown]
  python3 -m profiling.host_overhead --cprofile [--backward] [--calls 200]

--seqlen-k / --heads-kv give k and v other extents than q's (decoding: --shape 1,1,32,128 --seqlen-k 8192
--heads-kv 8).

--breakdown also times the pieces of a cute-flash call the same way (what issue 15's host-time targets are spent
on): the plan lookup, the two output allocations, one compiled forward kernel called directly through TVM-FFI with
its outputs given, the backend's forward and the plan's bound launcher around that call, the whole no-grad call
(the C++ call path's when it is available, cute_flash/native.py; with return_lse, the Python path's), the C++ path's
own call, and the backend's backward (four launches and its buffers) without autograd, and its bound launcher.
CUTE_FLASH_NATIVE=0 times every call through the Python path.

--cprofile instead runs a cProfile of --calls warm cute-flash calls (no-grad forwards, or forward + backward with
--backward) and prints the 25 functions with the most own time: where the host time goes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from profiling import HelpFormatter


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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--shape", default="1,128,8,128", help="batch,seqlen,heads,head_dim (bf16, causal)")
    p.add_argument("--seqlen-k", type=int, help="keys (None: the shape's seqlen)")
    p.add_argument("--heads-kv", type=int, help="KV heads (None: the shape's heads)")
    p.add_argument("--calls", type=int, default=100, help="calls per timing (per profile with --cprofile)")
    p.add_argument("--breakdown", action="store_true", help="also time the pieces of a cute-flash call")
    p.add_argument("--cprofile", action="store_true", help="a cProfile of warm cute-flash calls instead of timings")
    p.add_argument("--backward", action="store_true", help="--cprofile: forward + backward calls")
    args = p.parse_args()
    b, s, h, d = (int(x) for x in args.shape.split(","))

    import torch.nn.functional as F

    import cute_flash

    sk, hkv = args.seqlen_k or s, args.heads_kv or h
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    if args.cprofile:
        _cprofile(q, k, v, dout, args.calls, args.backward)
        return
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
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=s == sk, enable_gqa=hkv != h
    ).transpose(1, 2)  # (is_causal is top-left aligned: bottom-right only when square; one query row sees all keys)

    shape = f"b{b} s{s} h{h} d{d} (keys {sk}, KV heads {hkv})"
    print(f"host µs per warm call, shape {shape}, bf16 causal, {args.calls} calls, GPU busy")
    print(f"{'impl':>12} {'forward':>10} {'fwd+bwd':>10}")
    for name, fn in impls.items():
        with torch.no_grad():
            fwd = _host_us(lambda: fn(q, k, v), args.calls, busy)
        both = _host_us(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout), args.calls, busy)
        print(f"{name:>12} {fwd:>10.1f} {both:>10.1f}", flush=True)
    if args.breakdown:
        _breakdown(q, k, v, dout, args.calls, busy)


def _cprofile(q, k, v, dout, calls: int, backward: bool) -> None:
    """cProfile of `calls` warm causal cute-flash calls, the top 25 functions by own time."""
    import cProfile
    import pstats

    import cute_flash

    def call():
        if backward:
            torch.autograd.grad(cute_flash.attention(q, k, v, causal=True), (q, k, v), dout)
        else:
            with torch.no_grad():
                cute_flash.attention(q, k, v, causal=True)

    for _ in range(10):
        call()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def _breakdown(q, k, v, dout, calls: int, busy) -> None:
    """Host µs of the pieces of a warm causal cute-flash call (sm90 backend), each timed as the whole calls are."""
    from cute_flash import compile_cache, interface, native
    from cute_flash.arch.base import BwdTensors, FwdTensors, Grads
    from cute_flash.core import plan as plans

    scalars = (
        True,
        None,
        None,
        None,
        False,
        0.0,
    )  # core/fields.py's: causal, scale, window bounds, deterministic, softcap

    def planned():
        return plans.dense(q, k, v, scalars, (None, None), (None,))

    with torch.no_grad():
        fwd_out, fwd_lse = interface.attention(q, k, v, causal=True, return_lse=True)  # warm: plan, kernels
        plan = planned()
        p = plan.problem
        out = torch.empty(plan.out_shape, dtype=plan.out_dtype, device=q.device)
        lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device)
        target = compile_cache.runtime_target(q.device)
        kernel = plan.forward._forward_kernel(p.spec, target)
        scale, left, right = float(p.softmax_scale), int(p.mask.left), int(p.mask.right)
        grads = Grads(torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        t = BwdTensors(dout, q, k, v, fwd_out, fwd_lse)
        bwd = plan.backward_backend(q)
        bwd_launch = bwd.backward_launcher(p, q.device, False)
        pieces = {
            "signature + plan lookup": planned,
            "torch.empty out + lse": lambda: (
                torch.empty(plan.out_shape, dtype=plan.out_dtype, device=q.device),
                torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device),
            ),
            "torch.cuda.current_device": torch.cuda.current_device,
            "forward kernel call (TVM-FFI)": lambda: kernel(q, k, v, out, lse, scale, left, right),
            "backend.forward": lambda: plan.forward.forward(FwdTensors(q, k, v, out, lse), p),
            "the plan's launcher": lambda: plan.launch(q, k, v, out, lse),
            "attention (no grad)": lambda: interface.attention(q, k, v, causal=True),
            "attention (no grad), Python path": lambda: interface.attention(q, k, v, causal=True, return_lse=True),
            f"backend.backward ({bwd.name})": lambda: bwd.backward(t, grads, p, False),
            "its backward launcher": lambda: bwd_launch(t, grads),
        }
        lib = native.loaded()
        if lib is not None:  # the C++ call path's own call (cute_flash/native.py), the signature registered above
            pieces["the C++ path's forward call (out given)"] = lambda: lib.forward(q, k, v, out, *scalars)
            pieces["torch.empty_like(q) (its out)"] = lambda: torch.empty_like(q, memory_format=torch.contiguous_format)
        for name, fn in pieces.items():
            print(f"  {name:>34} {_host_us(fn, calls, busy):>8.1f} µs", flush=True)


if __name__ == "__main__":
    main()

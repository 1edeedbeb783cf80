"""Host time per warm call of `cute_flash.attention` without a GPU: the Python path from the call to the kernel
launch, with every launch a no-op. CPU tensors stand for CUDA ones (the device check admits "cpu"; `torch.zeros`
allocates without the memset, which is an asynchronous kernel on a GPU), the compute
capability is Hopper's, and `compile_cache.get_or_compile` hands back a no-op instead of compiling, so validation,
routing, allocation, layout checks, the autograd function and the sm90 backend's own launch code all run as on the
GPU; what is missing is the TVM-FFI call itself and the CUDA caching allocator (measure those with
`python3 -m profiling.host_overhead` on a GPU).

  python3 -m profiling.host_overhead_cpu [--shape 1,128,8,128] [--calls 100] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import time
from typing import Callable, Iterator

import torch
from profiling import HelpFormatter


_empty = torch.empty


def _zeros_without_memset(*size, **kwargs):
    return _empty(*size, **kwargs)


@contextlib.contextmanager
def fake_gpu(capability=(9, 0)) -> Iterator[None]:
    """Runs cute_flash's host path on CPU tensors with no-op kernels (see the module docstring)."""
    from cute_flash import compile_cache, native, validation
    from cute_flash.core import device, native_path, plan

    def noop(*args):
        return None

    # The C++ call path launches TVM-FFI functions only: forward kernels are its own no-op when it is available.
    lib = native.library()
    forward_noop = lib.noop_kernel if lib is not None else noop
    saved = [
        (validation, "KERNEL_DEVICE_TYPES", ("cuda", "cpu")),
        (native_path, "DEVICE_TYPES", ("cuda", "cpu")),
        (device, "capability", lambda t: capability),
        (device, "guard", lambda t: contextlib.nullcontext()),
        (
            compile_cache,
            "get_or_compile",
            lambda key, build: forward_noop if key[2] in ("fwd", "fwd_kvcache", "split_combine") else noop,
        ),
        (compile_cache, "runtime_target", lambda device: "sm_90a"),
        # On a GPU, zeroing a buffer is an asynchronous fill kernel; on the CPU it would be a memset of hundreds of
        # KiB that has nothing to do with host overhead.
        (torch, "zeros", _zeros_without_memset),
    ]
    old = [(obj, name, getattr(obj, name, None)) for obj, name, _ in saved]
    try:
        for obj, name, value in saved:
            setattr(obj, name, value)
        plan.clear_call_cache()
        yield
    finally:
        for obj, name, value in old:
            setattr(obj, name, value)
        plan.clear_call_cache()


def host_us(fn: Callable[[], object], calls: int, repeats: int = 7) -> float:
    """Lowest over `repeats` of the mean host µs per call of `calls` back-to-back calls (after a warm-up call): the
    least disturbed sample on a shared machine."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return min(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--shape", default="1,128,8,128", help="batch,seqlen,heads,head_dim")
    p.add_argument("--calls", type=int, default=100, help="calls per timing")
    p.add_argument("--profile", action="store_true", help="print a cProfile of the forward + backward calls")
    p.add_argument("--capability", default="9.0", help="the compute capability the router sees (8.0: the sm80 family)")
    args = p.parse_args()
    capability = tuple(int(x) for x in args.capability.split("."))
    b, s, h, d = (int(x) for x in args.shape.split(","))

    import cute_flash

    torch.set_num_threads(1)
    q, k, v = (torch.empty(b, s, h, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.empty_like(q)

    def forward():
        with torch.no_grad():
            return cute_flash.attention(q, k, v, causal=True)

    def forward_backward():
        return torch.autograd.grad(cute_flash.attention(q, k, v, causal=True), (q, k, v), dout)

    class Floor(torch.autograd.Function):
        """What torch alone costs: an autograd function with the same inputs, outputs and allocations, no work."""

        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return torch.empty_like(q), torch.empty(b, h, s, dtype=torch.float32)

        @staticmethod
        def backward(ctx, dout, _dlse):
            q, k, v = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def floor():
        return torch.autograd.grad(Floor.apply(q, k, v)[0], (q, k, v), dout)

    with fake_gpu(capability):
        fwd = host_us(forward, args.calls)
        both = host_us(forward_backward, args.calls)
        torch_floor = host_us(floor, args.calls)
        print(
            f"host µs per warm call (CPU, no-op kernels, capability {args.capability}), b{b} s{s} h{h} d{d} bf16 "
            f"causal, {args.calls} calls"
        )
        print(f"forward {fwd:.1f}  forward+backward {both:.1f}  (torch's floor, fwd+bwd: {torch_floor:.1f})")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                forward_backward()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

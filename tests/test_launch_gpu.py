"""The launch model every backend relies on: compile once with fake tensors and symbolic extents, call with torch
tensors through TVM-FFI on torch's current stream, reuse the compiled function for new shapes."""

import time

import pytest
import torch


@pytest.mark.sm80
def test_tvm_ffi_launch_on_current_stream_reuses_one_compile():
    import cutlass.cute as cute

    from cute_flash import compile_cache
    from tests.tiny_kernel import _scale, fake_args  # the kernel lives in a file, as CuTe DSL requires

    target = compile_cache.target_for_capability(torch.cuda.get_device_capability())
    fn = compile_cache.get_or_compile(
        ("test", target, "scale"),
        lambda: cute.compile(_scale, *fake_args(), options=compile_cache.compile_options(target)),
    )
    stream = torch.cuda.Stream()
    for size in (1, 1000, 1 << 20):
        a = torch.randn(size, device="cuda", dtype=torch.bfloat16)
        b = torch.full_like(a, float("nan"))
        with torch.cuda.stream(stream):
            fn(a, b, 2.0)
        stream.synchronize()
        torch.testing.assert_close(b, a * 2)
    assert compile_cache.get_or_compile(("test", target, "scale"), lambda: None) is fn
    a = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(1000):
        fn(a, b, 2.0)
    host_us = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    print(f"warm call host overhead: {host_us:.1f} us")

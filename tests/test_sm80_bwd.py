"""GPU: the sm80 backward (dq, dk, dv) against float64 autograd, with FlashAttention's rule.

Two entry points over the same matrix:
  - test_sm80_attention_backward: cute_flash.attention(...).backward() (forward and backward kernels),
  - test_sm80_backward_kernels: the backward kernels alone, fed out/lse from the reference forward, so that a backward
    failure is told apart from a forward one.
On Hopper the `sm80` marker forces the sm80 family (tests/conftest.py).

The matrix is large; `python tests/test_sm80_bwd.py -j N` runs it as N pytest processes split by head dim and dtype
and prints one line per failure plus the totals; `--bench` times the backward against torch SDPA instead.

Last GPU run (2026-11-21, NVIDIA H200, torch 2.11.0+cu130, cutlass-dsl 4.8.1, sm80 family forced, target sm_90a):
  source .devkit/setup.sh && python3 tests/test_sm80_bwd.py -j 7 \
      --test "test_sm80_backward_kernels or test_sm80_attention_backward"
  -> 6 shards x 108 passed (both matrix tests, every dtype/head dim), fully_masked: 4 passed; 0 failures, 52 s wall.
Then (same day and machine) with the dQ "fragment" layout + red.v4 + dQ-before-dK variant, now the sm_90a default at
d64/d128 (fragment_v4_dq_first, then forced by an environment variable since removed):
  fp16/bf16 x d64/d128 shards: 4 x 108 passed, 0 failures (d256 and fully_masked not run in that pass).
"""

from __future__ import annotations

import itertools

import pytest
import torch

HEAD_DIMS = (64, 128, 256)
SEQLENS = ((1, 1), (113, 203), (128, 128), (239, 1), (1023, 1024), (2048, 2048))
MASKS = {  # name -> (causal, window_size)
    "full": (False, (None, None)),
    "causal": (True, (None, None)),
    "window64_0": (False, (64, 0)),
}
HEADS = ((8, 8), (8, 2), (8, 1))
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

CASES = [
    pytest.param(dt, d, sq, sk, mask, h, h_kv, id=f"{dt}-d{d}-{sq}x{sk}-{mask}-h{h}_{h_kv}")
    for dt, d, (sq, sk), mask, (h, h_kv) in itertools.product(DTYPES, HEAD_DIMS, SEQLENS, MASKS, HEADS)
]


def _inputs(dt, d, sq, sk, h, h_kv, seed):
    from cute_flash.testing import backward_inputs

    return backward_inputs(DTYPES[dt], d, sq, sk, h, h_kv, seed)


def _seed(*params) -> int:
    from cute_flash.testing import stable_seed

    return stable_seed(*params)


def _kernel_grads(q, k, v, dout, causal, window_size):
    from cute_flash.arch.sm80.backward import run_backward
    from cute_flash.testing import backward_kernel_grads

    return backward_kernel_grads(run_backward, q, k, v, dout, causal, window_size)


@pytest.mark.sm80
@pytest.mark.parametrize("dt, d, sq, sk, mask, h, h_kv", CASES)
def test_sm80_backward_kernels(dt, d, sq, sk, mask, h, h_kv):
    from cute_flash.testing import check_backward

    causal, window = MASKS[mask]
    q, k, v, dout = _inputs(dt, d, sq, sk, h, h_kv, _seed(dt, d, sq, sk, mask, h, h_kv))
    grads = _kernel_grads(q, k, v, dout, causal, window)
    check_backward(q, k, v, dout, grads, causal=causal, window_size=window)


@pytest.mark.sm80
@pytest.mark.parametrize("dt, d, sq, sk, mask, h, h_kv", CASES)
def test_sm80_attention_backward(dt, d, sq, sk, mask, h, h_kv):
    import cute_flash
    from cute_flash.testing import check_backward

    causal, window = MASKS[mask]
    q, k, v, dout = _inputs(dt, d, sq, sk, h, h_kv, _seed(dt, d, sq, sk, mask, h, h_kv))
    out = cute_flash.attention(q, k, v, causal=causal, window_size=window)
    out.backward(dout)
    check_backward(q, k, v, dout, (q.grad, k.grad, v.grad), causal=causal, window_size=window)


@pytest.mark.sm80
@pytest.mark.parametrize("through_attention", [False, True], ids=["kernels", "attention"])
@pytest.mark.parametrize("d", [64, 128])
def test_sm80_backward_fully_masked_rows(d, through_attention):
    """A batch whose first rows see no key (seqlen_q > seqlen_k, causal; and a window that ends before key 0):
    their dq must be exactly 0, everything finite, the rest within the rule."""
    import cute_flash
    from cute_flash.testing import check_backward

    for sq, sk, causal, window, empty_rows in ((300, 100, True, (None, None), 200), (256, 200, False, (8, 0), 56)):
        q, k, v, dout = _inputs("bf16", d, sq, sk, 4, 2, _seed(d, sq, sk, causal))
        if through_attention:
            out = cute_flash.attention(q, k, v, causal=causal, window_size=window)
            out.backward(dout)
            grads = (q.grad, k.grad, v.grad)
        else:
            grads = _kernel_grads(q, k, v, dout, causal, window)
        check_backward(q, k, v, dout, grads, causal=causal, window_size=window)
        assert torch.count_nonzero(grads[0][:, :empty_rows]) == 0


def _bench() -> None:
    """Backward time (the kernels behind autograd, allocations included) of the sm80 family vs torch SDPA (flash)."""
    import os

    import cute_flash
    from cute_flash import compile_cache
    from torch.nn.attention import SDPBackend, sdpa_kernel

    os.environ["CUTE_FLASH_ARCH"] = "sm80"
    # CuTe DSL reads its target once, at import; name this GPU's before the first kernel (the forward) imports it.
    compile_cache.ensure_cute_dsl_arch(compile_cache.target_for_capability(torch.cuda.get_device_capability()))

    def time_ms(fn, iters=20):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters

    print(
        f"{'b':>2} {'s':>5} {'h':>3} {'h_kv':>4} {'d':>4} {'causal':>6} | {'sm80 bwd ms':>11} {'TFLOP/s':>7} | "
        f"{'sdpa bwd ms':>11} {'TFLOP/s':>7}"
    )
    for b, s, h, h_kv, d, causal in (
        (4, 2048, 16, 16, 64, False),
        (4, 2048, 16, 16, 128, False),
        (2, 4096, 16, 16, 128, True),
        (2, 4096, 16, 2, 128, True),
        (4, 2048, 16, 16, 256, False),
    ):
        q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        out = cute_flash.attention(q, k, v, causal=causal)
        ours = time_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
        # SDPA's flash backend has no GQA: it gets K/V expanded to every query head.
        qt, kt, vt = (
            t.detach().repeat_interleave(h // t.shape[2], dim=2).transpose(1, 2).requires_grad_() for t in (q, k, v)
        )
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        theirs = time_ms(lambda: torch.autograd.grad(ref, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True))
        print(
            f"{b:>2} {s:>5} {h:>3} {h_kv:>4} {d:>4} {str(causal):>6} | {ours:>11.3f} {flops / ours / 1e9:>7.0f} | "
            f"{theirs:>11.3f} {flops / theirs / 1e9:>7.0f}"
        )


def _main() -> int:
    """Runs the matrix as parallel pytest processes (one per dtype and head dim, one for the fully masked rows)."""
    import argparse
    import os
    import re
    import subprocess
    import sys
    import tempfile
    import time

    parser = argparse.ArgumentParser()
    parser.add_argument("-j", "--jobs", type=int, default=7)
    parser.add_argument("--test", default="test_sm80_backward_kernels", help="which matrix test to run")
    parser.add_argument("-k", default="", help="extra pytest -k expression, and-ed with each shard's")
    parser.add_argument("--log-dir", default=None, help="where each shard's pytest output goes (default: a temp dir)")
    parser.add_argument("--bench", action="store_true", help="only time the backward against torch SDPA")
    args = parser.parse_args()
    if args.bench:
        _bench()
        return 0
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="sm80_bwd_")
    shards = [f"({args.test}) and {dt}-d{d}-" for dt in DTYPES for d in HEAD_DIMS] + ["fully_masked"]
    here = os.path.dirname(os.path.abspath(__file__))
    start = time.time()
    procs = []
    for i, shard in enumerate(shards):
        expr = f"({shard}) and ({args.k})" if args.k else shard
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rf",
            "-p",
            "no:cacheprovider",
            "-k",
            expr,
            os.path.join(here, "test_sm80_bwd.py"),
        ]
        while sum(p.poll() is None for _, p, _ in procs) >= args.jobs:
            time.sleep(1)
        log = os.path.join(log_dir, f"shard{i}.log")
        with open(log, "w") as f:
            procs.append((shard, subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT), log))
    failed = 0
    for shard, p, log in procs:
        p.wait()
        with open(log) as f:
            out = f.read()
        summary = [line for line in out.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
        print(f"{shard}: {summary[-1] if summary else out[-3000:]}")
        for line in out.splitlines():
            if line.startswith(("FAILED", "ERROR")):
                failed += 1
                print("   ", line[:600])
    print(f"total failures: {failed}; wall {time.time() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(_main())

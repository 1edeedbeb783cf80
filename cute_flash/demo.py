"""The README's main job.

On a GPU: run `cute_flash.attention` on a realistic shape, check it against the float64 reference, and time it beside
torch SDPA. Without a GPU: show that the tiled online-softmax algorithm equals the float64 reference (at the shape
asked for, or a small GQA one), then cross-compile the forward kernels of every family for the head dim and mask asked
for and print what they are made of (into a temporary directory removed afterwards, unless --out names one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import torch


def _tflops(batch, nheads, seqlen_q, seqlen_k, head_dim, causal, ms) -> float:
    flops = 4 * batch * nheads * seqlen_q * seqlen_k * head_dim * (0.5 if causal else 1.0)
    return flops / (ms * 1e-3) / 1e12


GPU_SHAPE = dict(batch=4, seqlen=4096, nheads=16, head_dim=128)


def _given(args, name: str, default: int) -> int:
    value = getattr(args, name, None)
    return default if value is None else value


def run_gpu(args) -> int:
    import cute_flash
    from cute_flash.testing import check_forward, random_qkv

    b, s, h, d = (_given(args, name, default) for name, default in GPU_SHAPE.items())
    print(
        f"GPU {torch.cuda.get_device_name()}, backend {cute_flash.backend()}; shape b={b} s={s} h={h} d={d} "
        f"causal={args.causal}, bf16"
    )
    q, k, v = random_qkv(b, s, s, h, h, d, dtype=torch.bfloat16)
    try:
        out, lse = cute_flash.attention(q, k, v, causal=args.causal, return_lse=True)
    except NotImplementedError as e:
        print(f"cute_flash cannot serve this GPU yet: {e}")
        return 1
    torch.cuda.synchronize()
    # The float64 reference materialises (h, s, s) scores: check the first batch entry to bound its memory.
    reports = check_forward(q[:1], k[:1], v[:1], out[:1], lse[:1], causal=args.causal)
    for r in reports:
        print(f"  {r}")

    from triton.testing import do_bench

    ms_ours = do_bench(lambda: cute_flash.attention(q, k, v, causal=args.causal), return_mode="median")
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    ms_sdpa = do_bench(
        lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal),
        return_mode="median",
    )
    for name, ms in (("cute_flash", ms_ours), ("torch SDPA", ms_sdpa)):
        print(f"  {name:<11} {ms:8.3f} ms  {_tflops(b, h, s, s, d, args.causal, ms):7.1f} TFLOP/s")
    return 0


def run_cpu(args) -> int:
    from cute_flash.reference import attention_reference, attention_tiled

    print("No GPU visible: showing the algorithm and cross-compiling the kernels instead.")
    b, d = _given(args, "batch", 2), _given(args, "head_dim", 64)
    sq, sk = (args.seqlen, args.seqlen) if args.seqlen else (100, 173)
    h, h_kv = (args.nheads, args.nheads) if args.nheads else (4, 2)
    print(f"  shape b={b} seqlen_q={sq} seqlen_k={sk} heads={h} kv_heads={h_kv} d={d}, float32 inputs")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, sq, h, d, generator=gen)
    k = torch.randn(b, sk, h_kv, d, generator=gen)
    v = torch.randn(b, sk, h_kv, d, generator=gen)
    masks = ({"causal": True},) if args.causal else ({}, {"causal": True}, {"window_size": (32, 8)})
    for kwargs in masks:
        ref, ref_lse = attention_reference(q, k, v, return_lse=True, **kwargs)
        out, lse, tiles = attention_tiled(q.double(), k.double(), v.double(), compute_dtype=torch.float64, **kwargs)
        err = (out - ref).abs().max().item()
        keep = torch.isfinite(ref_lse)
        lse_err = (lse[keep] - ref_lse[keep]).abs().max().item() if keep.any() else 0.0
        total = -(-sq // 64) * -(-sk // 64)
        print(
            f"  tiled online softmax vs float64 reference {kwargs or '(no mask)'}: max|out err| {err:.1e}, "
            f"max|lse err| {lse_err:.1e}, {tiles} of {total} 64x64 tiles visited per (batch, head)"
        )

    if args.no_compile:
        return 0
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        return _cross_compile(args, args.out)
    with tempfile.TemporaryDirectory(prefix="cute_flash_demo_") as out_dir:
        return _cross_compile(args, out_dir)


def _cross_compile(args, out_dir: str) -> int:
    d = _given(args, "head_dim", 128)
    mask = ["--causal"] if args.causal else []
    print(f"Cross-compiling d{d} bf16 {'causal' if args.causal else 'unmasked'} forward kernels (CuTe DSL on the CPU):")
    for arch in ("sm80", "sm90", "sm100"):
        cmd = [
            sys.executable,
            "-m",
            "cute_flash",
            "compile",
            "--arch",
            arch,
            "--head-dim",
            str(d),
            "--dtype",
            "bf16",
            *mask,
            "--json",
            "--out",
            out_dir,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            print(f"  {arch}: {last}")
            continue
        for line in proc.stdout.splitlines():
            r = json.loads(line)
            census = ", ".join(f"{k} {v}" for k, v in r["census"].items() if v)
            print(
                f"  {arch} {r['kernel']}: {r['registers']} regs, spill {r['spill_bytes']} B, "
                f"{r['threads']} threads, smem {r['shared_bytes']} B; {census}"
            )
    if args.out:
        print(f"  PTX and cubins in {out_dir}")
    return 0


def run(args) -> int:
    if torch.cuda.is_available():
        return run_gpu(args)
    return run_cpu(args)

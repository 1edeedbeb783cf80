"""Quick forward timing of the sm90 kernel against torch SDPA (and FlashAttention-4 when importable), plus tile
configuration sweeps. GPU only.

    python -m profiling.sm90_fwd_sweep --head-dims 128 --seqlens 8192 [--sweep]
    python -m profiling.sm90_fwd_sweep --head-dims 192 --head-dim-v 128 --sweep --sm80   # DeepSeek-style

Shapes follow the project's benchmark convention: batch * seqlen = 16k tokens, heads * head_dim = 2048.
FLOPs = 2 * b * h * sq * sk * (d + dv), halved when causal; times are triton.testing.do_bench medians.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, Dict, List, Optional, Tuple

import torch

from cute_flash import compile_cache
from cute_flash.bench.flops import attention_flops
from cute_flash.bench.flops import tflops as flops_to_tflops
from cute_flash.spec import UNBOUNDED_WINDOW, AttentionSpec
from cute_flash.arch.sm90.tile_config import FwdTileConfig, budget_problem, fwd_tile_config

TOKENS = 16384
HIDDEN = 2048

# Alternatives measured against each (head_dim, head_dim_v) default (tile_config.py documents the outcome).
SWEEP: Dict[Tuple[int, int], List[FwdTileConfig]] = {
    (64, 64): [
        FwdTileConfig(num_consumer_wgs=2, tile_n=128, num_stages=2),
        FwdTileConfig(num_consumer_wgs=2, tile_n=192, num_stages=2),
        FwdTileConfig(
            num_consumer_wgs=3, tile_n=128, num_stages=2, ping_pong=False, consumer_regs=160, producer_regs=32
        ),
        FwdTileConfig(num_consumer_wgs=3, tile_n=128, num_stages=3, consumer_regs=160, producer_regs=32),
    ],
    (128, 128): [
        FwdTileConfig(num_consumer_wgs=2, tile_n=128, num_stages=2, ping_pong=False),
        FwdTileConfig(num_consumer_wgs=2, tile_n=176, num_stages=2),
        FwdTileConfig(num_consumer_wgs=2, tile_n=112, num_stages=3),
    ],
    (256, 256): [
        FwdTileConfig(num_consumer_wgs=2, tile_n=80, num_stages=2, ping_pong=True),
        FwdTileConfig(num_consumer_wgs=2, tile_n=64, num_stages=2, ping_pong=False),
    ],
    (192, 128): [  # the d192 / d256 tile it would get by its wider head dim, and neighbours of the default
        FwdTileConfig(num_consumer_wgs=2, tile_n=80, num_stages=2, ping_pong=False),
        FwdTileConfig(num_consumer_wgs=2, tile_n=128, num_stages=2, ping_pong=False),
        FwdTileConfig(num_consumer_wgs=2, tile_n=112, num_stages=2),
        FwdTileConfig(num_consumer_wgs=2, tile_n=64, num_stages=3),
    ],
}


def tflops(batch: int, heads: int, seqlen: int, head_dim: int, head_dim_v: int, causal: bool, ms: float) -> float:
    return flops_to_tflops(attention_flops(batch, heads, seqlen, seqlen, head_dim, head_dim_v, causal=causal), ms)


def _bench(fn: Callable[[], object]) -> float:
    from cute_flash.bench.timing import TimingOptions, median_ms

    return median_ms(fn, TimingOptions(warmup_ms=25, rep_ms=100))


def _ours(spec: AttentionSpec, cfg: FwdTileConfig, q, k, v, causal: bool):
    from cute_flash.arch.sm90.build import compile_forward

    target = compile_cache.target_for_capability(torch.cuda.get_device_capability())
    fn = compile_cache.get_or_compile(("sm90-bench", target, spec, cfg), lambda: compile_forward(spec, cfg, target))
    b, s, h, _ = q.shape
    out = torch.empty(b, s, h, spec.head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
    scale = 1.0 / math.sqrt(spec.head_dim)
    right = 0 if causal else UNBOUNDED_WINDOW
    return lambda: fn(q, k, v, out, lse, scale, UNBOUNDED_WINDOW, right)


def _sm80(q, k, v, causal: bool):
    """The sm80 kernels on this GPU: the route a call takes where the sm90 family has no kernel."""
    from cute_flash.arch import get_backend
    from cute_flash.arch.base import FwdTensors
    from cute_flash.validation import validate

    problem = validate(q, k, v, causal=causal, softmax_scale=None, window_size=(None, None), dtype=None)
    b, s, h, _ = q.shape
    out = torch.empty(b, s, h, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
    sm80 = get_backend("sm80")

    def run():
        sm80.forward(FwdTensors(q, k, v, out, lse), problem)

    run()
    return run


def _sdpa(q, k, v, causal: bool, backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    run()
    return run


def _fa4(q, k, v, causal: bool):
    from flash_attn.cute.interface import flash_attn_func

    def run():
        return flash_attn_func(q, k, v, causal=causal)

    run()
    return run


def _try_time(make: Callable[[], Callable[[], object]]) -> Optional[float]:
    try:
        return _bench(make())
    except Exception as e:  # a peer that is not installed or refuses the shape: report it as missing
        print(f"  (peer unavailable: {type(e).__name__}: {str(e)[:120]})")
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dims", type=int, nargs="+", default=[128])
    p.add_argument("--head-dim-v", type=int, default=None, help="head_dim_v of every case (default: its head_dim)")
    p.add_argument("--seqlens", type=int, nargs="+", default=[8192])
    p.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    p.add_argument("--sweep", action="store_true", help="also time the alternative tile configurations")
    p.add_argument("--peers", action="store_true", help="also time torch SDPA (cuDNN, flash) and FlashAttention-4")
    p.add_argument("--sm80", action="store_true", help="also time the sm80 kernels (the fallback route) on this GPU")
    args = p.parse_args(argv)
    causals = {"both": [False, True], "no": [False], "yes": [True]}[args.causal]
    dev = torch.cuda.get_device_name()
    rows = []
    for d in args.head_dims:
        dv = args.head_dim_v or d
        for s in args.seqlens:
            b, h = max(TOKENS // s, 1), HIDDEN // d
            q, k = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            v = torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16)
            for causal in causals:
                spec = AttentionSpec("bf16", d, dv, "causal" if causal else "none")
                configs = [fwd_tile_config(spec)] + (SWEEP.get((d, dv), []) if args.sweep else [])
                for i, cfg in enumerate(configs):
                    if budget_problem(cfg, d, dv):
                        continue
                    ms = _try_time(lambda: _ours(spec, cfg, q, k, v, causal))
                    name = "cute_flash sm90" + ("" if i == 0 else " (alt)")
                    tile = f"{cfg.tile_m}x{cfg.tile_n} st{cfg.num_stages} pp{int(cfg.ping_pong)}"
                    rows.append((d, dv, s, causal, name, tile, ms, b, h))
                others = [("cute_flash sm80", lambda: _sm80(q, k, v, causal))] if args.sm80 else []
                if args.peers:
                    others += [
                        ("sdpa cudnn", lambda: _sdpa(q, k, v, causal, "CUDNN_ATTENTION")),
                        ("sdpa flash2", lambda: _sdpa(q, k, v, causal, "FLASH_ATTENTION")),
                        ("fa4 sm90", lambda: _fa4(q, k, v, causal)),
                    ]
                for name, make in others:
                    rows.append((d, dv, s, causal, name, "", _try_time(make), b, h))
    print(f"\nforward, bf16, {dev}, batch*seqlen={TOKENS}, heads*d={HIDDEN}, do_bench median")
    print(f"{'d':>4} {'dv':>4} {'seqlen':>6} {'causal':>6} {'kernel':<22} {'tile':<20} {'ms':>8} {'TFLOP/s':>8}")
    for d, dv, s, causal, name, tile, ms, b, h in rows:
        tf = "-" if ms is None else f"{tflops(b, h, s, d, dv, causal, ms):8.1f}"
        ms_s = "-" if ms is None else f"{ms:8.3f}"
        print(f"{d:>4} {dv:>4} {s:>6} {str(causal):>6} {name:<22} {tile:<20} {ms_s:>8} {tf:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""FP8 speed on an sm90 GPU: the FP8 kernel alone, with its pre-pass, the pre-pass alone, our bf16 sm90 kernel and
FlashAttention-4's bf16 forward (when `flash_attn.cute` imports), in TFLOP/s (4·b·h·sq·sk·d, halved when causal;
the pre-pass row gives GB/s of its own traffic: one read of q, k, v, one e4m3 write).

    python -m profiling.fp8_benchmark [--seqlen 16384] [--heads 16] [--head-dim 128 ...] [--json out.json]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from functools import partial
import json
import math
from typing import Callable, Dict, List, Optional

import torch

from profiling import HelpFormatter


def _bench_ms(fn: Callable[[], object]) -> float:
    """Median device time (cute_flash.bench.timing: do_bench, or CUDA events without triton)."""
    from cute_flash.bench.timing import TimingOptions, median_ms

    return median_ms(fn, TimingOptions(warmup_ms=50, rep_ms=200))


def _fa4() -> Optional[Callable]:
    try:
        from flash_attn.cute import flash_attn_func

        return flash_attn_func
    except Exception:  # noqa: BLE001
        return None


def bench_case(
    batch: int,
    seqlen: int,
    heads: int,
    head_dim: int,
    causal: bool,
    *,
    peers: bool = True,
) -> Dict[str, object]:
    """One shape: every row's TFLOP/s (GB/s for the pre-pass), its ms, and errors as text."""
    import cute_flash

    from cute_flash.arch.sm90.fp8.launch import run_forward_fp8
    from cute_flash.bench.flops import attention_flops
    from cute_flash.bench.flops import tflops as flops_to_tflops
    from cute_flash.arch.sm90.fp8.tile_config import fp8_fwd_config, kv_scale_block
    from cute_flash.spec import AttentionSpec, normalize_mask
    from cute_flash.fp8.prepare import prepare_fp8_inputs

    torch.manual_seed(0)
    shape = (batch, seqlen, heads, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=causal)
    tflops = partial(flops_to_tflops, flops)
    row: Dict[str, object] = {"b": batch, "s": seqlen, "h": heads, "d": head_dim, "causal": causal}

    prepare = partial(prepare_fp8_inputs, block_n=kv_scale_block(head_dim, head_dim))
    f = prepare(q, k, v)
    spec = AttentionSpec("fp8", head_dim, head_dim, "causal" if causal else "none", "bf16")
    mask = normalize_mask(causal, (None, None))
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seqlen, device="cuda", dtype=torch.float32)
    scale = 1.0 / math.sqrt(head_dim)
    cfg = fp8_fwd_config(head_dim, head_dim, spec.mask)

    def timed(name, fn, unit=tflops):
        try:
            fn()
            torch.cuda.synchronize()
            ms = _bench_ms(fn)
            row[name + "_ms"] = round(ms, 4)
            row[name] = round(unit(ms), 1)
        except Exception as e:  # noqa: BLE001  (a row records what failed instead of ending the run)
            row[name] = f"error: {type(e).__name__}: {str(e)[:160]}"

    for promote in sorted({cfg.promote_pv, False}, reverse=True):
        c = cfg if promote == cfg.promote_pv else replace(cfg, promote_pv=False, row_sum_mma=False)
        timed(
            f"fp8_kernel{'' if promote == cfg.promote_pv else '_no_promote'}",
            lambda c=c: run_forward_fp8(
                f.q, f.k, f.v_t, out, lse, descale=f.descales(), spec=spec, softmax_scale=scale, mask=mask, cfg=c
            ),
        )

    def fp8_with_prepass():
        # What cute_flash.attention(q, k, v, dtype="fp8") launches (without its Python validation).
        g = prepare(q, k, v)
        run_forward_fp8(g.q, g.k, g.v_t, out, lse, descale=g.descales(), spec=spec, softmax_scale=scale, mask=mask)

    if not peers:
        timed("bf16_ours", lambda: cute_flash.attention(q, k, v, causal=causal))
        ours, fp8 = row.get("bf16_ours"), row.get("fp8_kernel")
        if isinstance(ours, float) and isinstance(fp8, float):
            row["fp8_kernel_over_bf16_ours"] = round(fp8 / ours, 2)
        return row
    timed("fp8_with_prepass", fp8_with_prepass)
    prepass_bytes = 3 * q.numel() * 2 + 3 * q.numel()
    timed("prepass_GBps", lambda: prepare(q, k, v), unit=lambda ms: prepass_bytes / (ms * 1e-3) / 1e9)
    timed("bf16_ours", lambda: cute_flash.attention(q, k, v, causal=causal))
    fa4 = _fa4()
    if fa4 is not None:
        timed("bf16_fa4", lambda: fa4(q, k, v, causal=causal))
    else:
        row["bf16_fa4"] = "n/a (flash_attn.cute does not import)"
    ours, fp8 = row.get("bf16_ours"), row.get("fp8_kernel")
    if isinstance(ours, float) and isinstance(fp8, float):
        row["fp8_kernel_over_bf16_ours"] = round(fp8 / ours, 2)
    return row


def format_table(rows: List[Dict[str, object]]) -> str:
    """TFLOP/s (GB/s for the pre-pass) per measurement (rows) and shape (columns), errors shortened."""
    shapes = [f"d{r['d']} s{r['s']} {'causal' if r['causal'] else 'full'}" for r in rows]
    names: List[str] = []
    for r in rows:
        names += [k for k in r if k not in ("b", "s", "h", "d", "causal") and not k.endswith("_ms") and k not in names]
    width = max(len(n) for n in names) if names else 10
    lines = [" " * width + "".join(f" | {s:>18}" for s in shapes)]
    for n in names:
        cells = []
        for r in rows:
            v = r.get(n, "")
            cells.append(
                f"{v:>18.1f}"
                if isinstance(v, float) and n != "fp8_kernel_over_bf16_ours"
                else f"{v:>18.2f}"
                if isinstance(v, float)
                else f"{str(v)[:18]:>18}"
            )
        lines.append(f"{n:<{width}}" + "".join(f" | {c}" for c in cells))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--seqlen", type=int, nargs="+", default=[16384], help="sequence lengths (seqlen_q = seqlen_k)")
    ap.add_argument("--batch", type=int, default=1, help="batch")
    ap.add_argument("--heads", type=int, default=16, help="heads")
    ap.add_argument("--head-dim", type=int, nargs="+", default=[128], help="head dims")
    ap.add_argument("--causal", choices=("no", "yes", "both"), default="both", help="masks to time")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--no-peers", action="store_true", help="only the FP8 kernel and our bf16 kernel")
    args = ap.parse_args(argv)
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    rows = []
    for d in args.head_dim:
        for s in args.seqlen:
            for causal in causals:
                row = bench_case(args.batch, s, args.heads, d, causal, peers=not args.no_peers)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()

"""The FP8 accuracy study (FlashAttention-3's §4.3 setup): RMSE against float64 of four ways to compute attention.

Inputs: Q, K, V drawn from N(0, 1), with 0.1% of the entries replaced by draws from N(0, 10²) (standard deviation 10),
stored in bf16. Schemes:
  bf16              our bf16 arithmetic (emulated) or kernel
  fp8_tensor        FP8 with one scale per tensor, no rotation (the baseline)
  fp8_block         FP8 with one scale per tile-sized block
  fp8_block_rotate  block scales + incoherent processing (randomised Hadamard on Q and K)
`--mode emulate` runs the torch model of the kernel's arithmetic (`cute_flash.fp8.emulate`, CPU or GPU);
`--mode kernel` runs cute_flash.attention on an sm90 GPU (fp8_tensor goes through the pre-quantised-input path with
per-(batch, kv-head) descales that all equal the tensor's one scale).

    python -m profiling.fp8_accuracy --mode emulate --seqlen 1024 4096 --device cpu
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Dict, List, Optional, Sequence

import torch

from cute_flash.reference import attention_reference
from cute_flash.fp8.emulate import SCHEMES, emulated_attention
from cute_flash.fp8.prepare import BLOCK_M

OUTLIER_FRACTION = 1e-3
OUTLIER_STD = 10.0


def outlier_qkv(batch, seqlen, nheads, head_dim, *, device="cpu", seed=0, dtype=torch.bfloat16):
    """Q, K, V ~ N(0, 1) with OUTLIER_FRACTION of the entries from N(0, OUTLIER_STD²)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def make():
        x = torch.randn(batch, seqlen, nheads, head_dim, generator=gen, device=device)
        wild = torch.rand(x.shape, generator=gen, device=device) < OUTLIER_FRACTION
        x = torch.where(wild, torch.randn(x.shape, generator=gen, device=device) * OUTLIER_STD, x)
        return x.to(dtype)

    return make(), make(), make()


def rmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.double() - ref.double()).pow(2).mean().sqrt().item()


def _reference_chunked(q, k, v, causal, chunk_rows=4096):
    """float64 reference one head (and, without a mask, one block of query rows) at a time, so that the score matrix
    of a 32k sequence fits in memory. Heads are equal in number for q, k, v here (no GQA in the study)."""
    outs = []
    for h0 in range(q.shape[2]):
        sl = slice(h0, h0 + 1)
        if causal:
            outs.append(attention_reference(q[:, :, sl], k[:, :, sl], v[:, :, sl], causal=True))
            continue
        rows = [
            attention_reference(q[:, r0 : r0 + chunk_rows, sl], k[:, :, sl], v[:, :, sl])
            for r0 in range(0, q.shape[1], chunk_rows)
        ]
        outs.append(torch.cat(rows, dim=1))
    return torch.cat(outs, dim=2)


def run_emulated(q, k, v, *, causal: bool, schemes: Sequence[str], block_m: int, block_n: int, extra: bool) -> Dict:
    ref = _reference_chunked(q, k, v, causal)
    row: Dict[str, float] = {}
    for scheme in schemes:
        out = emulated_attention(q, k, v, scheme=scheme, causal=causal, block_m=block_m, block_n=block_n)
        row[scheme] = rmse(out, ref)
    if extra:
        # Side studies of choices the kernel makes.
        row["fp8_block_rotate_no_p_offset"] = rmse(
            emulated_attention(
                q, k, v, scheme="fp8_block_rotate", causal=causal, block_m=block_m, block_n=block_n, p_offset_log2=0.0
            ),
            ref,
        )
        row["fp8_block_rotate_sum_rounded_p"] = rmse(
            emulated_attention(
                q, k, v, scheme="fp8_block_rotate", causal=causal, block_m=block_m, block_n=block_n, sum_rounded_p=True
            ),
            ref,
        )
    return row


def _fp8_kernel_out(q, k, v, causal: bool, scheme: str, cfg=None) -> torch.Tensor:
    """FP8 kernel output of `scheme`; `cfg` (an `Fp8FwdConfig`) overrides the default tile configuration."""
    from cute_flash.arch.sm90.fp8.launch import run_forward_fp8
    from cute_flash.arch.sm90.fp8.tile_config import fp8_fwd_config, kv_scale_block
    from cute_flash.spec import AttentionSpec, normalize_mask
    from cute_flash.fp8.prepare import check_prequantized, prepare_fp8_inputs
    from cute_flash.fp8.quantize import quantize_per_tensor

    if scheme == "fp8_tensor":
        b, hkv = k.shape[0], k.shape[2]
        (q8, dq), (k8, dk), (v8, dv) = quantize_per_tensor(q), quantize_per_tensor(k), quantize_per_tensor(v)
        per_head = lambda d: d.to(torch.float32).reshape(1, 1).expand(b, hkv).contiguous()  # noqa: E731
    d, dv_ = q.shape[-1], v.shape[-1]
    block_n = kv_scale_block(d, dv_)
    if scheme == "fp8_tensor":
        f = check_prequantized(q8, k8, v8, (per_head(dq), per_head(dk), per_head(dv)), block_n=block_n)
    else:
        f = prepare_fp8_inputs(q, k, v, rotate=scheme == "fp8_block_rotate", block_n=block_n)
    cfg = cfg or fp8_fwd_config(d, dv_, "causal" if causal else "none")
    spec = AttentionSpec("fp8", d, dv_, "causal" if causal else "none", "bf16")
    out = torch.empty(*q.shape[:3], dv_, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    run_forward_fp8(
        f.q,
        f.k,
        f.v_t,
        out,
        lse,
        descale=f.descales(),
        spec=spec,
        softmax_scale=1.0 / math.sqrt(d),
        mask=normalize_mask(causal, (None, None)),
        cfg=cfg,
    )
    return out


def run_kernel(q, k, v, *, causal: bool, schemes: Sequence[str], accumulation: bool = False) -> Dict:
    """The same study on the GPU with the real kernels (an sm90 GPU); with `accumulation`, also the FP8 kernel's
    128-key-tile builds with and without P·V promotion (the default 192-key tile accumulates P·V in the wgmma), and
    the emulated model (which accumulates exactly in fp32) for comparison."""
    import cute_flash

    ref = _reference_chunked(q, k, v, causal)
    row: Dict[str, float] = {}
    for scheme in schemes:
        try:
            if scheme == "bf16":
                out = cute_flash.attention(q, k, v, causal=causal)
            else:
                out = _fp8_kernel_out(q, k, v, causal, scheme)
            torch.cuda.synchronize()
            row[scheme] = rmse(out, ref)
        except Exception as e:  # noqa: BLE001  (a study row says what failed instead of stopping the study)
            row[scheme] = f"error: {type(e).__name__}: {str(e)[:120]}"
    if accumulation:
        from cute_flash.arch.sm90.fp8.tile_config import kv_scale_block
        from profiling.fp8_variants import VARIANTS

        for name in ("tile128", "tile128_promote"):
            out = _fp8_kernel_out(q, k, v, causal, "fp8_block_rotate", cfg=VARIANTS[name])
            row[f"fp8_block_rotate_{name}"] = rmse(out, ref)
        block_n = kv_scale_block(q.shape[-1], v.shape[-1])
        row["fp8_block_rotate_emulated"] = rmse(
            emulated_attention(q, k, v, scheme="fp8_block_rotate", causal=causal, block_m=BLOCK_M, block_n=block_n), ref
        )
    return row


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("emulate", "kernel"), default="emulate")
    ap.add_argument("--seqlen", type=int, nargs="+", default=[1024])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--block-m", type=int, default=BLOCK_M)
    ap.add_argument(
        "--block-n",
        type=int,
        default=None,
        help="emulate mode: keys per K/V scale (default: the sm90 " "kernel's block at --head-dim)",
    )
    ap.add_argument("--extra", action="store_true", help="also the side studies (P offset, rounded row sum)")
    ap.add_argument("--accumulation", action="store_true", help="kernel mode: also P·V promotion on/off")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.block_n is None:
        from cute_flash.arch.sm90.fp8.tile_config import kv_scale_block

        args.block_n = kv_scale_block(args.head_dim, args.head_dim)

    rows = []
    for s in args.seqlen:
        q, k, v = outlier_qkv(args.batch, s, args.heads, args.head_dim, device=args.device, seed=args.seed)
        t0 = time.perf_counter()
        if args.mode == "emulate":
            row = run_emulated(
                q,
                k,
                v,
                causal=args.causal,
                schemes=SCHEMES,
                block_m=args.block_m,
                block_n=args.block_n,
                extra=args.extra,
            )
        else:
            row = run_kernel(q, k, v, causal=args.causal, schemes=SCHEMES, accumulation=args.accumulation)
        row.update(
            seqlen=s,
            mode=args.mode,
            causal=args.causal,
            head_dim=args.head_dim,
            block_m=args.block_m,
            block_n=args.block_n,
            seconds=round(time.perf_counter() - t0, 1),
        )
        if isinstance(row.get("fp8_tensor"), float) and isinstance(row.get("fp8_block_rotate"), float):
            row["baseline_over_block_rotate"] = row["fp8_tensor"] / row["fp8_block_rotate"]
        rows.append(row)
        if not args.json:
            print(
                " ".join(
                    f"{k}={v:.3e}" if isinstance(v, float) and (k in SCHEMES or "rotate_" in k) else f"{k}={v}"
                    for k, v in row.items()
                ),
                flush=True,
            )
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()

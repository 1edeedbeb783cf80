"""Variants of the sm80 backward's tile configuration (VARIANTS below) side by side.

    python3 -m profiling.sm80_bwd_variants cpu [--variants a,b] [--head-dims 128,64] [--target sm_90a]
        cross-compiles each variant's main kernel (and its dQ postprocess) on the CPU: registers, spills, census.
    python3 -m profiling.sm80_bwd_variants gpu [--variants a,b]
        times every variant's backward (preprocess + main + postprocess, allocations included) against torch SDPA's
        flash backward (FlashAttention-2) at bf16, 16k tokens, h * d = 2048, seqlen 4k and 16k, causal or not, for
        --head-dims (default 128,64), and compares every variant's gradients with the first one's.
The table is printed last. Each variant is a function of (the default config, head dim, target major); it reaches the
kernels as `backward.run_backward(cfg=...)`. A variant becomes the default in `tile_config.bwd_tile_config`, after the
tests/test_sm80_bwd.py matrix passes with it.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from cute_flash.arch.sm80.tile_config import _fa2_tile_config, _target_major, default_opt_level, fragment_dq

# name -> (FlashAttention-2 tile config at the default ptxas level, head_dim, target major) -> config. Timed on an
# H200 (docs/performance.md, 2026-11-21).
VARIANTS = {
    "rows": lambda cfg, d, major: cfg,
    "fragment": lambda cfg, d, major: replace(cfg, dq_layout="fragment"),
    "fragment_v4": lambda cfg, d, major: fragment_dq(cfg, 4, major),
    "fragment_v4_dq_first": lambda cfg, d, major: fragment_dq(cfg, 4, major, dq_first=True),
}


# Every variant also at a forced optimisation level ("<variant>_o1" ... "_o3"; the level only changes ptxas, the PTX
# is the same): at 3, ptxas hoists shared-memory loads ahead of the mmas and spills a few bytes at d96-d128; 1
# schedules conservatively and does not spill (tile_config.default_opt_level).
def _at_opt_level(variant, level: int):
    return lambda cfg, d, major: replace(variant(cfg, d, major), opt_level=level)


VARIANTS.update(
    {f"{name}_o{lvl}": _at_opt_level(variant, lvl) for name, variant in list(VARIANTS.items()) for lvl in (1, 2, 3)}
)


def variant_config(name: str, head_dim: int, target: str):
    major = _target_major(target)
    base = replace(_fa2_tile_config(head_dim), opt_level=default_opt_level(head_dim, major))
    return VARIANTS[name](base, head_dim, major)


def _variants(arg):
    return list(VARIANTS) if not arg else arg.split(",")


def cpu(args) -> None:
    from cute_flash.arch.sm80 import backward
    from cute_flash.census import capture_fd_stderr, cubin_resources, parse_ptxas_report, ptx_census
    from cute_flash.compile_cache import ensure_cute_dsl_arch, keep_artifacts_options
    from cute_flash.spec import AttentionSpec
    import tempfile

    ensure_cute_dsl_arch(args.target)
    rows = []
    for variant in _variants(args.variants):
        for d in (int(x) for x in args.head_dims.split(",")):
            spec = AttentionSpec("bf16", d, d, args.mask, "bf16")
            cfg = variant_config(variant, d, args.target)
            for role in [r for r in backward._roles(spec, args.target, cfg) if r in ("bwd", "bwd_dq_postprocess")]:
                with tempfile.TemporaryDirectory() as dump, capture_fd_stderr() as err:
                    opts = backward._options(role, spec, args.target, keep_artifacts_options(dump), cfg=cfg)
                    start = time.perf_counter()
                    compiled = backward._ROLES[role](spec, opts, args.target, cfg)
                    secs = time.perf_counter() - start
                ptx = compiled.artifacts.PTX
                ((entry, res),) = cubin_resources(compiled.artifacts.CUBIN).items()
                rep = parse_ptxas_report("".join(err))
                spill = rep.get(entry, {}).get("spill_bytes", f"frame{res.get('stack_frame_bytes')}")
                c = ptx_census(ptx)
                reds = sum(ptx.count(s) for s in ("atom.global.add", "red.global.add"))
                rows.append(
                    f"{variant:<22} d{d:<4} {role:<19} regs {res['registers']:>3} spill {spill} "
                    f"mma {c['mma.sync']:>4} ldsm {c['ldmatrix']:>4} red/atom {reds:>3} "
                    f"v4 {ptx.count('red.global.add.v4')} bar {ptx.count('bar.sync')} {secs:.1f}s"
                )
                print(rows[-1], flush=True)
    print("\n".join(["", "== cpu compile (" + args.target + ") =="] + rows))


def _time_ms(fn):
    """Median device time of a warm call (cute_flash.bench.timing)."""
    from cute_flash.bench.timing import TimingOptions, median_ms

    return median_ms(fn, TimingOptions())


def gpu(args) -> int:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cute_flash import compile_cache
    from cute_flash.arch.sm80.backward import run_backward
    from cute_flash.arch.base import BwdTensors, Grads
    from cute_flash.validation import validate

    target = compile_cache.target_for_capability(torch.cuda.get_device_capability())
    compile_cache.ensure_cute_dsl_arch(target)
    variants = _variants(args.variants)
    head_dims = [int(x) for x in args.head_dims.split(",")]
    configs = [(d, s, causal) for d in head_dims for s in (4096, 16384) for causal in (False, True)]
    table = {}
    for d, s, causal in configs:
        h, b = 2048 // d, 16384 // s
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out_t = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        ms = _time_ms(lambda: torch.autograd.grad(out_t, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True))
        table[(d, s, causal, "sdpa-flash")] = flops / ms / 1e9
        # out / lse from SDPA's flash forward (the backward kernels only read them).
        with torch.no_grad():
            out_ref, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, is_causal=causal)[:2]
        out = out_ref.transpose(1, 2)
        problem = validate(q, k, v, causal=causal, softmax_scale=None, window_size=(None, None), dtype=None)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        ref_grads = None
        for variant in variants:
            try:
                cfg = variant_config(variant, d, target)
                call = lambda: run_backward(BwdTensors(dout, q, k, v, out, lse), Grads(*grads), problem, cfg=cfg)
                ms = _time_ms(call)
                table[(d, s, causal, variant)] = flops / ms / 1e9
                # Cheap agreement check between variants (the full check is the test matrix).
                if ref_grads is None:
                    ref_grads = [t.clone() for t in grads]
                else:
                    err = max((a.float() - r.float()).abs().max().item() for a, r in zip(grads, ref_grads))
                    if err > 5e-2:
                        table[(d, s, causal, variant)] = f"DIFF{err:.2g}"
            except Exception as e:  # a variant that fails to compile or launch must not hide the others
                table[(d, s, causal, variant)] = f"ERR {type(e).__name__}"
                print(f"{variant} d{d} s{s} causal={causal}: {e!r}"[:2000], flush=True)
            print(d, s, causal, variant, table[(d, s, causal, variant)], flush=True)
        # Drop this shape's tensors before the next one (the timing lambdas above read them while they run).
        q = k = v = dout = out = grads = ref_grads = out_t = qt = kt = vt = None
        torch.cuda.empty_cache()
    cols = ["sdpa-flash"] + variants
    print(f"\n== {torch.cuda.get_device_name()}: backward TFLOP/s, bf16, 16k tokens, h*d=2048 (x = ratio to sdpa) ==")
    print(f"{'d':>4} {'seqlen':>6} {'causal':>6} " + " ".join(f"{c[:22]:>22}" for c in cols))
    for d, s, causal in configs:
        base = table[(d, s, causal, "sdpa-flash")]
        cells = []
        for c in cols:
            val = table.get((d, s, causal, c))
            cells.append(f"{val:>14.0f} ({val / base:.2f}x)" if isinstance(val, float) else f"{str(val):>22}")
        print(f"{d:>4} {s:>6} {str(causal):>6} " + " ".join(f"{x:>22}" for x in cells))
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["cpu", "gpu"])
    p.add_argument("--variants", default="")
    p.add_argument("--head-dims", default="128,64")
    p.add_argument("--mask", default="causal")
    p.add_argument("--target", default="sm_90a")
    args = p.parse_args()
    if args.mode == "cpu":
        cpu(args)
        return 0
    return gpu(args)


if __name__ == "__main__":
    raise SystemExit(main())

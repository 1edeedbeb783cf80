"""Times sm90 backward tile configurations against each other and FlashAttention-4 in one process (GPU).

  python3 -m profiling.sm90_bwd_variants --head-dim 128 --seqlens 4096,16384 \
      --variants default,opt2 [--fa4] [--deterministic]

Each variant is a `BwdTileConfig` derived from the default of that head dim (see VARIANTS; the short-sequence default:
from 4096 query rows d128 without a mask runs "m80_la7" in the library, tile_config.long_queries); the kernels
alone are timed (`run_backward` on precomputed out / lse, allocations included), as TFLOP/s with FLOPs =
2.5 x 4 b h s^2 d (halved when causal). Every variant's gradients are compared with the default's (max
|difference|), so a faster variant that computes something else shows up. B·S = 16k tokens (--tokens), H·D = 2048,
bf16, as in the issue grid.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from functools import partial

import torch

from cute_flash.arch.base import Grads

VARIANTS = {
    "default": {},
    "opt2": {"opt_level": 2},
    "opt3": {"opt_level": 3},
    "stages1": {"num_stages": 1},
    # d128: 64-row query tiles (dQ = dS·K) against 80-row ones (dQᵀ = Kᵀ·dSᵀ, FlashAttention-3's unmasked shape).
    # (stats_at_use / lse_ahead off: on top of the long-query default through bwd_variant_patch they would not apply)
    "m64": {"tile_m": 64, "dq_swap_ab": False, "stats_at_use": False, "lse_ahead": 0},
    # (A off, as session 9 timed it: the mask defaults now carry A, which has no register room at 80 rows)
    "m80": {
        "tile_m": 80,
        "dq_swap_ab": True,
        "dv_before_dp_wait": False,
        "dv_early_kblocks": None,
        "d_after_dv_issue": False,
    },
    # docs/sm90_bwd_sass_study.md: A (dV's whole product issued before the dP wait; 64-row tiles), B (dQ staging from
    # one base address), C (tile_m 80 with every column's LSE / D in registers instead of shuffles).
    "dv_early": {"dv_before_dp_wait": True, "dv_early_kblocks": None},
    "dv_early_b": {"dv_before_dp_wait": True, "dv_early_kblocks": None, "dq_stage_single_base": True},
    # A with only dV's first 2 (3) of 4 k-blocks before the dP wait (session 13; d128 causal builds spill-free).
    "dv_kb2": {"dv_before_dp_wait": True, "dv_early_kblocks": 2},
    "dv_kb3": {"dv_before_dp_wait": True, "dv_early_kblocks": 3},
    "dq_base": {"dq_stage_single_base": True},
    # The 80-row tile with dV's first 1 (2) of 5 k-blocks before the dP wait (session 14; 2: 8 spilled bytes, two
    # values reloaded per step).
    # (m80_kb1 shuffles LSE / D: the long-query default until session 22, which loads them where used)
    "m80_kb1": {
        "tile_m": 80,
        "dq_swap_ab": True,
        "dv_before_dp_wait": True,
        "dv_early_kblocks": 1,
        "d_after_dv_issue": False,
        "stats_at_use": False,
        "lse_ahead": 0,
    },  # fmt: skip
    "m80_kb2": {"tile_m": 80, "dq_swap_ab": True, "dv_before_dp_wait": True, "dv_early_kblocks": 2},
    "m80_regstats": {
        "tile_m": 80,
        "dq_swap_ab": True,
        "max_unshuffled_stat_cols": 20,
        "stats_at_use": False,
        "lse_ahead": 0,
        "dv_before_dp_wait": False,
        "dv_early_kblocks": None,
        "d_after_dv_issue": False,
    },  # fmt: skip
    "m80_regstats_b": {
        "tile_m": 80,
        "dq_swap_ab": True,
        "max_unshuffled_stat_cols": 20,
        "stats_at_use": False,
        "lse_ahead": 0,
        "dv_before_dp_wait": False,
        "dv_early_kblocks": None,
        "d_after_dv_issue": False,
        "dq_stage_single_base": True,
    },  # fmt: skip
    # The long-query default before session 22 (m80_kb1) with LSE / D held in registers (no 40 shuffles per step;
    # spills: 7 local loads and 2 stores per step), and with B as well (session 16).
    "m80_kb1_regstats": {
        "tile_m": 80,
        "dq_swap_ab": True,
        "dv_before_dp_wait": True,
        "dv_early_kblocks": 1,
        "max_unshuffled_stat_cols": 20,
        "stats_at_use": False,
        "lse_ahead": 0,
    },  # fmt: skip
    "m80_kb1_regstats_b": {
        "tile_m": 80,
        "dq_swap_ab": True,
        "dv_before_dp_wait": True,
        "dv_early_kblocks": 1,
        "max_unshuffled_stat_cols": 20,
        "stats_at_use": False,
        "lse_ahead": 0,
        "dq_stage_single_base": True,
    },  # fmt: skip
    # Fixed cost around the main kernel (any head dim; BwdTileConfig's launch-overhead switches, all on by default):
    # "plain" turns all three off (a torch.zeros of the dQ accumulator, the sm80 family's preprocess, ordinary
    # launches), "memset" only the zeroing in the preprocess, "no_pdl" only the programmatic dependent launches.
    "plain": {"zero_dq_in_preprocess": False, "pdl": False, "pdl_dq_post": False},
    "memset": {"zero_dq_in_preprocess": False},
    "no_pdl": {"pdl": False, "pdl_dq_post": False},
    "no_pdl_pre": {"pdl": False},  # only the preprocess -> main kernel launch
    "no_pdl_post": {"pdl_dq_post": False},  # only the main kernel -> dQ postprocess launch
    "pre_plain": {"zero_dq_in_preprocess": False, "pdl": False},  # what packed calls ran before session 14
    # A CTA's first S product behind one K + V barrier (the order before session 10) instead of K with Q's first
    # stage and V with dO's.
    "kv_barrier": {"kv_with_first_tile": False},
    # dQ added from registers (red.global.add.v4.f32) instead of the staged bulk reduce-add; with the freed shared
    # memory, d256 gets a second Q / dO stage ("red2"; at d128 the same as "red") and d128 a third ("red3"; does not
    # fit at d256).
    "red": {"dq_red": True, "dq_buffers": 1},  # (no shared dQ buffer: d64 causal's second one goes too)
    "red2": {"dq_red": True, "num_stages": 2, "dq_buffers": 1},
    "red3": {"dq_red": True, "num_stages": 3, "dq_buffers": 1},
    # Two shared dQ buffers (session 21): a consumer's dQ stores wait for the bulk reduce-add of the tile before the
    # previous one, not of the previous one. 64-row tiles only at d128 (the 80-row tile has no room for a second).
    "dqbuf1": {"dq_buffers": 1},
    "dqbuf2": {"dq_buffers": 2},
    # Session 22. D's shared-memory loads after dV's early product is issued (d_dv; the d128 causal default) or
    # between the exponentials and P's conversion (d_exp), where ptxas gave a D load and the exponential that P's
    # first conversion waits for one scoreboard; the 80-row tile with it (m80_kb1_d_dv). The 80-row tile's LSE / D
    # loaded where used, 8 bytes per two columns, instead of shuffled (m80_kb1_at_use; the long-query default until
    # session 24, which loads the LSE of the first 7 column pairs while S runs: m80_la7).
    "d_exp": {"d_after_dv_issue": False},
    "d_dv": {"d_after_dv_issue": True},
    "m80_kb1_d_dv": {
        "tile_m": 80,
        "dq_swap_ab": True,
        "dv_before_dp_wait": True,
        "dv_early_kblocks": 1,
        "d_after_dv_issue": True,
    },  # fmt: skip
    **{
        name: {
            "tile_m": 80,
            "dq_swap_ab": True,
            "dv_before_dp_wait": True,
            "dv_early_kblocks": 1,
            "d_after_dv_issue": False,
            "stats_at_use": True,
            "lse_ahead": pairs,
        }
        for name, pairs in (("m80_kb1_at_use", 0), ("m80_la7", 7))
    },  # fmt: skip
}


def _run(sm90_bwd, saved, grads, problem, det, cfg) -> None:
    sm90_bwd.run_backward(saved, Grads(*grads), problem, det, cfg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlens", default="4096,16384")
    p.add_argument("--variants", default="default")
    p.add_argument("--causal", default="both", choices=("no", "yes", "both"))
    p.add_argument("--fa4", action="store_true", help="also time FlashAttention-4's backward (flash_attn.cute)")
    p.add_argument("--deterministic", action="store_true", help="also time deterministic=True of the default")
    p.add_argument("--rounds", type=int, default=3, help="timing rounds, each over every variant in turn")
    p.add_argument("--rep-ms", type=int, default=60, help="do_bench time per variant and round")
    p.add_argument("--tokens", type=int, default=16384, help="batch x seqlen (batch = tokens // seqlen)")
    args = p.parse_args()

    from cute_flash import compile_cache
    from cute_flash.arch.sm90 import backward as sm90_bwd
    from cute_flash.arch.sm90.tile_config import bwd_tile_config
    from cute_flash.bench.flops import attention_flops
    from cute_flash.bench.timing import TimingOptions, median_ms
    from cute_flash.reference import attention_reference  # noqa: F401  (imports torch helpers only)
    from cute_flash.arch.base import BwdTensors
    from cute_flash.validation import validate

    compile_cache.ensure_cute_dsl_arch(compile_cache.target_for_capability(torch.cuda.get_device_capability()))
    d = args.head_dim
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    rows = []
    for seqlen in [int(s) for s in args.seqlens.split(",")]:
        for causal in causals:
            b, h = max(1, args.tokens // seqlen), 2048 // d
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, dout = (
                torch.randn(b, seqlen, h, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(4)
            )
            problem = validate(q, k, v, causal=causal, softmax_scale=None, window_size=(None, None), dtype=None)
            spec = problem.spec
            # out / lse of the exact forward (the backward kernels only read them).
            from cute_flash import attention

            out, lse = attention(q, k, v, causal=causal, return_lse=True)
            flops = attention_flops(b, h, seqlen, seqlen, d, causal=causal, backward=True)
            base = None
            runs = [
                (name, dataclasses.replace(bwd_tile_config(spec), **VARIANTS[name]), False)
                for name in args.variants.split(",")
            ]
            if args.deterministic:
                runs.append(("deterministic", bwd_tile_config(spec, True), True))
            calls = {}
            for name, cfg, det in runs:
                grads = [torch.empty_like(t) for t in (q, k, v)]
                calls[name] = (
                    partial(_run, sm90_bwd, BwdTensors(dout, q, k, v, out, lse), grads, problem, det, cfg),
                    grads,
                )
                calls[name][0]()
            torch.cuda.synchronize()
            # Rounds alternate the variants, so that drifting clocks hit every variant alike; medians over rounds.
            times = {name: [] for name in calls}
            for _ in range(args.rounds):
                for name, (call, _) in calls.items():
                    times[name].append(median_ms(call, TimingOptions(warmup_ms=10, rep_ms=args.rep_ms)))
            base = None
            for name, (_, grads) in calls.items():
                ms = statistics.median(times[name])
                diff = 0.0
                if base is None:
                    base = grads
                else:
                    diff = max((g.float() - r.float()).abs().max().item() for g, r in zip(grads, base))
                rows.append((d, seqlen, causal, name, ms, flops / ms / 1e9, diff))
            if args.fa4:
                from flash_attn.cute import flash_attn_func

                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                o = flash_attn_func(*leaves, causal=causal)
                o = o[0] if isinstance(o, tuple) else o
                ms = median_ms(lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True), TimingOptions())
                rows.append((d, seqlen, causal, "fa4 (autograd)", ms, flops / ms / 1e9, float("nan")))
    ratios = {}
    for d_, s, c, name, ms, tf, diff in rows:
        default = next(r[4] for r in rows if r[:3] == (d_, s, c))
        ratios.setdefault(name, []).append(default / ms)
    print(f"{'d':>4} {'seqlen':>6} {'causal':>6} {'variant':>16} {'ms':>8} {'TFLOP/s':>8} {'max|diff|':>10}")
    for d_, s, c, name, ms, tf, diff in rows:
        print(f"{d_:>4} {s:>6} {str(c):>6} {name:>16} {ms:>8.3f} {tf:>8.1f} {diff:>10.2e}")
    for name, r in ratios.items():
        print(f"geomean speed vs {rows[0][3]}: {name:>16} {statistics.geometric_mean(r):.3f}")


if __name__ == "__main__":
    main()

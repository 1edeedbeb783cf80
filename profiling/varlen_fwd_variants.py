"""Study: variants of the sm90 packed (varlen) forward timed against each other and FA4's varlen in one process.

Each variant is a subclass of the library's forward kernel, defined here (research code stays outside the library),
compiled through the library's own packed build and put in place of the default in the forward's kernel memo, so
`cute_flash.attention_varlen` runs it. Rows are timed in turn for --rounds rounds; medians printed. Every variant's
output is compared with the default's (max abs difference).

    python -m profiling.varlen_fwd_variants --seeds 0,1,2 --rounds 3 [--variants default,no_zero_v,one_trip]
        [--sustained 1.5]      # each row back to back for 1.5 s, SM clock sampled (under the power cap)
    python -m profiling.varlen_fwd_variants --tile c2s3='{"num_stages": 3}' --variants default,c2s3 --sustained 1.5
        # --tile NAME=JSON: a variant of the library's kernel with these FwdTileConfig fields changed
    python -m profiling.varlen_fwd_variants --causal --tile s3='{"num_stages": 3}' --variants default,s3
        # --causal: causal calls (the default and --tile variants only)

Under a power cap the back-to-back timings move by a few percent between rounds; --cycles instead launches every row
once inside a profiler range, for Nsight Compute to count cycles at the clock it finds (one-shot, caches flushed),
with rows labelled in launch order in --labels (what `--join` matches with ncu's CSV):

    ncu --profile-from-start off --clock-control none --kernel-name regex:'Forward|Variant' --csv \
        --print-units base --log-file ncu.csv --metrics gpc__cycles_elapsed.max,gpu__time_duration.sum \
        python -m profiling.varlen_fwd_variants --cycles --labels out/labels.txt
    python -m profiling.varlen_fwd_variants --join ncu.csv out/labels.txt

Variants:
  default       the library's kernel (d128: 2-CTA clusters sharing K / V by multicast, FwdTileConfig.cluster_m)
  no_multicast  the library's kernel with one CTA per cluster (the default before session 25)
  multicast     the library's kernel in 2-CTA clusters whatever the head dim (the default at d128; with
                --head-dim 64 / 96 / 256 it measures multicast where the library does not use it yet)
  no_zero_v     skips zeroing the V rows past seqlen_k in the first key tile (unsafe with non-finite neighbours:
                measures what the zeroing costs)
  one_trip      each CTA's sequence, row offsets and lengths from one round of cu_seqlens loads (the warp scan's
                lanes load cu_seqlens_q / _k at b and b + 1 together; the hit lane's values are shuffled), instead of
                the scan followed by a second dependent round of loads (common/packed.seq_rows); one CTA per cluster
  seq_major     FA4's CTA order: sequence-major (every head of sequence 0, then sequence 1, ...) instead of
                head-major; one CTA per cluster
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Dict, List

import torch

from .varlen_benchmark import MAX_LEN, MIN_LEN, _bench_ms, draw_lengths, equal_work_dense, peer_calls

VARIANTS = ("default", "no_multicast", "multicast", "no_zero_v", "one_trip", "seq_major")
SINGLE_CTA = ("no_multicast", "one_trip", "seq_major")  # built with cluster_m 1 (the last two map CTAs to tiles alone)
TILES: Dict[str, dict] = {}  # --tile NAME=JSON: FwdTileConfig fields changed on the library's kernel


def _variant_class(name: str):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, pipeline

    from cute_flash.arch.sm90 import flash_fwd
    from cute_flash.arch.sm90.cta import CtaWork
    from cute_flash.common.block_info import BlockInfo
    from cute_flash.common.packed_tiles import warp_inclusive_sum

    base = flash_fwd.Sm90FlashForward
    if name in ("default", "no_multicast", "multicast"):
        return base

    @cute.jit
    def scan(idx: Int32, tile: cutlass.Constexpr[int], mult: Int32, cu_q: cute.Tensor, cu_k: cute.Tensor):
        """(batch, index within the sequence's mult x tiles, offset_q, seqlen_q, offset_k, seqlen_k, tiles)."""
        batch = cu_q.shape[0] - 1
        lane = cute.arch.lane_idx()
        found_b, found_t = Int32(batch), Int32(0)
        oq, sq, ok, sk, nt = Int32(0), Int32(0), Int32(0), Int32(0), Int32(0)
        first, base_ = Int32(0), Int32(0)
        while first < batch:
            b = first + lane
            n, q0, q1, k0, k1 = Int32(0), Int32(0), Int32(0), Int32(0), Int32(0)
            if b < batch:
                q0 = cu_q[b]
                q1 = cu_q[b + 1]
                k0 = cu_k[b]
                k1 = cu_k[b + 1]
                n = (q1 - q0 + tile - 1) // tile
            w = n * mult
            incl = warp_inclusive_sum(w, lane)
            hits = cute.arch.vote_ballot_sync(base_ + incl > idx)
            if hits != 0:
                hit = Int32(cute.arch.clz(cute.arch.brev(hits)))
                found_b = first + hit
                found_t = idx - base_ - cute.arch.shuffle_sync(incl - w, hit)
                oq = cute.arch.shuffle_sync(q0, hit)
                sq = cute.arch.shuffle_sync(q1 - q0, hit)
                ok = cute.arch.shuffle_sync(k0, hit)
                sk = cute.arch.shuffle_sync(k1 - k0, hit)
                nt = cute.arch.shuffle_sync(n, hit)
                first = Int32(batch)
            else:
                base_ = base_ + cute.arch.shuffle_sync(incl, 31)
                first = first + 32
        return found_b, found_t, oq, sq, ok, sk, nt

    class Variant(base):
        pass

    if name == "no_zero_v":

        def zero_v_tail(self, *args):
            return None

        Variant.zero_v_tail = zero_v_tail
        return Variant

    @cute.jit
    def work_of(self, mQ, mK, window_left, window_right, packed):
        """no-mask packed builds only (the study's configurations)."""
        bidx, head, _ = cute.arch.block_idx()
        cu_q, cu_k, _seqused = packed
        num_seqs = cu_q.shape[0] - 1
        heads = mQ.shape[2]
        if cutlass.const_expr(name == "one_trip"):
            batch, m_block, oq, sq, ok, sk, _nt = scan(bidx, self.tile_m, Int32(1), cu_q, cu_k)
        else:  # seq_major: linear launch index over (sequence, head, tile)
            lin = bidx + head * cute.arch.grid_dim()[0]
            batch, r, oq, sq, ok, sk, nt = scan(lin, self.tile_m, heads, cu_q, cu_k)
            head = Int32(0)
            m_block = Int32(0)
            if nt > 0:
                head = r // nt
                m_block = r - head * nt
        if batch >= num_seqs:
            sq = Int32(0)
        batch = cutlass.min(batch, num_seqs - 1)
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        info = BlockInfo(self.tile_m, self.tile_n, self.mask_kind, sq, sk, window_left, window_right)
        n_min, n_max = info.kv_block_range(m_block)
        return CtaWork(m_block, head, head_kv, batch, sq, info, n_min, n_max, oq, ok, None)

    @cute.jit
    def run_roles(self, warp_idx, tidx, pipes, atoms, gmem, smem, window_left, window_right, consume, packed=None):
        # work_of maps tiles for the study's builds only: no mask (tiles in order) and no seqused_k
        assert self.mask_kind == "none" and packed[2] is None, "study variant: packed builds without a mask only"
        work = work_of(self, gmem[0], gmem[1], window_left, window_right, packed)
        pipeline.pipeline_init_wait()
        if work.active(self.tile_m):
            self.roles(warp_idx, tidx, pipes, atoms, gmem, smem, consume, work)

    Variant.run_roles = run_roles
    return Variant


def build_variant(name: str, spec, target: str, extra_options=None):
    """The compiled packed forward of `spec` for `target` with variant `name`'s kernel class (and its tile
    configuration: SINGLE_CTA)."""
    from dataclasses import replace

    from cute_flash.arch.sm90 import build
    from cute_flash.arch.sm90.tile_config import fwd_tile_config

    cfg = fwd_tile_config(spec)
    if name in TILES:  # (--tile: the library's kernel class)
        cfg, name = replace(cfg, **TILES[name]), "default"
    elif name in SINGLE_CTA or name == "multicast":
        cfg = replace(cfg, cluster_m=2 if name == "multicast" else 1)
    cls = _variant_class(name)
    saved = build.Sm90FlashForward
    build.Sm90FlashForward = cls
    try:
        return build.compile_forward_packed(spec, cfg, target, extra_options)
    finally:
        build.Sm90FlashForward = saved


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--tile", action="append", default=[], metavar="NAME=JSON", help="a variant NAME: the library's "
                    "kernel with these FwdTileConfig fields, e.g. c2s3='{\"num_stages\": 3}'")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--causal", action="store_true", help="causal calls (--tile variants and the default only)")
    ap.add_argument("--cycles", action="store_true", help="one profiled launch per row (run under ncu, see above)")
    ap.add_argument("--labels", default="out/labels.txt", help="--cycles: where the rows' labels go, in launch order")
    shapes_help = (
        "--cycles: also the first seed's lengths rounded up to 128, equal lengths (a multiple of 128 and one less), "
        "the dense batch at equal work; ours and FA4"
    )
    ap.add_argument("--shapes", action="store_true", help=shapes_help)
    ap.add_argument("--join", nargs=2, metavar=("NCU_CSV", "LABELS"), help="print ncu's cycles per labelled row")
    ap.add_argument("--sustained", type=float, metavar="SECONDS", help="time each row back to back for this long "
                    "with the SM clock sampled (profiling.sustained_clocks) instead of by do_bench")  # fmt: skip
    args = ap.parse_args(argv)
    if args.join:
        return join(*args.join)
    if args.shapes and not args.cycles:
        ap.error("--shapes adds rows to --cycles only")
    if args.sustained and args.cycles:
        ap.error("--sustained times rows; --cycles launches each once for ncu: one or the other")
    if args.cycles:
        os.makedirs(os.path.dirname(args.labels) or ".", exist_ok=True)
        open(args.labels, "w").close()  # this run's launches only: join pairs labels and launches by position

    from cute_flash.arch.sm90 import backend

    TILES.update({name: json.loads(fields) for name, _, fields in (t.partition("=") for t in args.tile)})
    names = args.variants.split(",")
    if args.causal and set(names) - {"default", *TILES}:
        # (the study classes map CTAs to tiles for builds without a mask only, and clusters need no mask)
        ap.error(f"--causal times the default and --tile variants only, not {sorted(set(names) - {'default', *TILES})}")
    mask = "causal" if args.causal else "no mask"
    print(f"{torch.cuda.get_device_name()}: h{args.heads} d{args.head_dim} bf16, {mask}, {args.tokens} tokens")
    kernels: Dict[str, object] = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        lens = draw_lengths(args.tokens, MIN_LEN, MAX_LEN, seed)
        calls = peer_calls(lens, args.heads, args.head_dim, args.causal, dense=False, seed=seed)
        ours = calls["ours varlen"][0]
        fa4 = calls["FA4 varlen"][0] if "FA4 varlen" in calls else None
        flops = sum(4 * args.heads * args.head_dim * s * s for s in lens) * (0.5 if args.causal else 1.0)
        ref = ours()  # builds the default kernel; its memo key is the one the variants replace
        key = next(kk for kk in backend._forward_kernels if kk[0].varlen and kk[2] == "")
        default_kernel = backend._forward_kernels[key]
        for name in names:
            if name not in kernels:
                kernels[name] = default_kernel if name == "default" else build_variant(name, key[0], key[1])
        if args.cycles:
            for name in names:
                backend._forward_kernels[key] = kernels[name]
                print(f"seed {seed} {name}: max|out - default's| {float((ours() - ref).abs().max()):.2e}")
                profiled(f"seed{seed} {name}", flops, ours, args.labels)
            backend._forward_kernels[key] = default_kernel
            if fa4 is not None:
                profiled(f"seed{seed} FA4", flops, fa4, args.labels)
            if args.shapes and seed == int(args.seeds.split(",")[0]):
                shapes(lens, args)
            continue
        rows: Dict[str, List[float]] = {name: [] for name in names}
        clocks: Dict[str, List[float]] = {name: [] for name in names}
        if fa4 is not None:
            rows["FA4 varlen"], clocks["FA4 varlen"] = [], []
        diffs = {}

        def timed(name, fn):
            if args.sustained:
                from .sustained_clocks import sampled

                r = sampled(fn, args.sustained)
                rows[name].append(r["ms"])
                clocks[name].append(r["mhz"])
            else:
                rows[name].append(_bench_ms(fn))

        for _ in range(args.rounds):
            for name in names:
                backend._forward_kernels[key] = kernels[name]
                diffs[name] = float((ours() - ref).abs().max())
                timed(name, ours)
            backend._forward_kernels[key] = default_kernel
            if fa4 is not None:
                timed("FA4 varlen", fa4)
        print(f"\nseed {seed}: {len(lens)} sequences {min(lens)}..{max(lens)}; median of {args.rounds} rounds")
        fa4_ms = statistics.median(rows["FA4 varlen"]) if fa4 is not None else None
        for name, times in rows.items():
            ms = statistics.median(times)
            vs = f"  x FA4 {fa4_ms / ms:.3f}" if fa4_ms else ""
            diff = f"  max|diff| {diffs[name]:.2e}" if name in diffs else ""
            spread = f"  ({min(times):.3f}-{max(times):.3f})"
            mhz = f"  {statistics.median(clocks[name]):.0f} MHz" if clocks[name] else ""
            print(f"  {name:<12} {ms:7.3f} ms {flops / ms / 1e9:7.1f} TF/s{vs}{spread}{mhz}{diff}")


def profiled(label: str, flops: float, fn, labels_path: str) -> None:
    """fn once for warm-up, then once between cudaProfilerStart / Stop; the label appended to labels_path."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    with open(labels_path, "a") as f:
        f.write(f"{label}\t{flops}\n")


def shapes(lens: List[int], args) -> None:
    """Where packing's cost comes from: the drawn lengths rounded up to whole tiles, equal lengths on whole tiles and
    one short of them (packed), and the dense batch at equal work; ours (the library's kernel) and FA4's."""
    batch, seqlen = equal_work_dense(lens)
    cases = {
        "rounded": [(s + 127) // 128 * 128 for s in lens],
        f"{batch}x{seqlen}": [seqlen] * batch,
        f"{batch}x{seqlen - 1}": [seqlen - 1] * batch,
    }
    h, d, half = args.heads, args.head_dim, 0.5 if args.causal else 1.0
    for name, ls in cases.items():
        flops = sum(4 * h * d * s * s for s in ls) * half
        for row, (fn, _) in peer_calls(ls, h, d, args.causal, dense=False).items():
            profiled(f"{name} {row.split()[0]}", flops, fn, args.labels)  # "{case} ours", "{case} FA4"
    flops = 4 * h * d * batch * seqlen * seqlen * half
    for row, (fn, _) in peer_calls(lens, h, d, args.causal).items():
        if "dense" in row:  # "ours dense BxL" -> "dense BxL ours"
            who, _, shape = row.split()
            profiled(f"dense {shape} {who}", flops, fn, args.labels)


# Metric units ncu may print, to cycles and nanoseconds (base units: "cycle", "nsecond"; ncu's default scales them).
_UNIT_SCALE = {
    "cycle": 1.0, "Kcycle": 1e3, "Mcycle": 1e6, "Gcycle": 1e9,
    "nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9, "s": 1e9,
    "byte": 1.0, "sector": 1.0, "inst": 1.0, "": 1.0,  # (counters ncu prints in base units with --print-units base)
}  # fmt: skip


def ncu_launches(ncu_csv: str) -> List[Dict[str, object]]:
    """The profiled launches of an `ncu --csv --print-units base` log, in launch order: each its metrics (cycles,
    nanoseconds) and its "kernel" name."""
    import csv

    with open(ncu_csv) as f:
        lines = [line for line in f if line.startswith('"')]
    per_id: Dict[str, Dict[str, object]] = {}
    for r in csv.DictReader(lines):
        unit = r.get("Metric Unit", "")
        if unit not in _UNIT_SCALE:
            raise SystemExit(f"{r['Metric Name']}: unit {unit!r} (run ncu with --print-units base)")
        value = float(r["Metric Value"].replace(",", "")) * _UNIT_SCALE[unit]
        per_id.setdefault(r["ID"], {"kernel": r["Kernel Name"]})[r["Metric Name"]] = value
    return [per_id[i] for i in sorted(per_id, key=int)]


def join(ncu_csv: str, labels_path: str) -> None:
    """ncu's per-launch cycles and durations beside the labels written by --cycles (same order)."""
    labels = [line.rstrip("\n").split("\t") for line in open(labels_path) if line.strip()]
    launches = ncu_launches(ncu_csv)
    if len(launches) != len(labels):
        raise SystemExit(f"{len(launches)} profiled launches but {len(labels)} labels: not the same run")
    print(f"{'row':<28}{'Mcycles':>9}{'us':>9}{'TF/s':>8}{'MHz':>7}")
    for (label, flops), m in zip(labels, launches):
        cyc, ns = m.get("gpc__cycles_elapsed.max", 0.0), m.get("gpu__time_duration.sum", 0.0)
        print(f"{label:<28}{cyc / 1e6:>9.3f}{ns / 1e3:>9.0f}{float(flops) / ns / 1e3:>8.1f}{cyc / ns * 1e3:>7.0f}")


if __name__ == "__main__":
    main()

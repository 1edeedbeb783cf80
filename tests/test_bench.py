"""CPU-only tests of the benchmark and profiling tooling: FLOP counts, grids, files, tables, plots, summaries."""

from __future__ import annotations

import argparse
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from cute_flash.bench import check, cli, flops, grid, report
from cute_flash.bench.memory import MemoryPoint, memory_seqlens
from cute_flash.bench.peers import IMPL_NAMES, Naive
from cute_flash.bench.results import RESULT_FIELDS, Result, read_csv, read_json, write_csv, write_json
from cute_flash.bench.runner import RunOptions, measure


def brute_pairs(sq, sk, left, right):
    off = sk - sq
    return sum(
        1
        for i in range(sq)
        for j in range(sk)
        if (left is None or j >= i + off - left) and (right is None or j <= i + off + right)
    )


# --- FLOPs ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sq,sk", [(1, 1), (7, 7), (5, 12), (12, 5), (16, 3)])
@pytest.mark.parametrize("window", [(None, None), (None, 0), (2, 0), (3, 1), (0, 0), (1, -1), (None, 4), (20, 20)])
def test_visible_pairs_matches_brute_force(sq, sk, window):
    assert flops.visible_pairs(sq, sk, *window) == brute_pairs(sq, sk, *window)


def test_dense_flops_are_4bhssd():
    assert flops.attention_flops(2, 16, 1024, 1024, 128) == 4 * 2 * 16 * 1024 * 1024 * 128


def test_causal_counts_the_unmasked_half():
    s = 4096
    dense = flops.attention_flops(1, 8, s, s, 64)
    causal = flops.attention_flops(1, 8, s, s, 64, causal=True)
    assert causal == dense / 2  # the published convention: causal counts half of the dense FLOPs


def test_backward_is_two_and_a_half_forwards_and_dv_counts():
    fwd = flops.attention_flops(1, 4, 512, 256, 128, 64)
    assert fwd == 2 * 4 * 512 * 256 * (128 + 64)
    assert flops.attention_flops(1, 4, 512, 256, 128, 64, backward=True) == 2.5 * fwd


def test_forward_backward_case_counts_three_and_a_half_forwards():
    shape = grid.default_shape(1024, 128)
    fwd, fb = (grid.Case("bf16", d, True, shape).flops for d in ("fwd", "fwdbwd"))
    assert fb == 3.5 * fwd
    assert [c.direction for c in grid.build_grid(["bf16"], [128], [1024], directions=["fwdbwd"])] == ["fwdbwd"] * 2


def test_tflops():
    assert flops.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert flops.tflops(1e12, None) is None


# --- grid -----------------------------------------------------------------------------------------------------
def test_default_grid_holds_tokens_and_width_fixed():
    cases = grid.build_grid()
    assert len(cases) == 3 * 3 * 6 * 2 * 2
    for c in cases:
        assert c.shape.batch * c.shape.seqlen_q == grid.DEFAULT_TOKENS
        assert c.shape.heads * c.shape.head_dim == grid.DEFAULT_HIDDEN
    # One dtype's curves complete before the next dtype, forward before backward.
    dtypes = [c.dtype for c in cases]
    assert dtypes == sorted(dtypes, key=["bf16", "fp16", "fp8"].index)
    first = cases[: len(grid.SEQLENS)]
    assert [c.shape.seqlen_q for c in first] == list(grid.SEQLENS)
    assert len({(c.direction, c.causal, c.shape.head_dim) for c in first}) == 1


def test_grid_overrides_and_custom_shapes():
    cases = grid.build_grid(
        dtypes=["bf16"], head_dims=[64], seqlens=[32768], causals=[True], directions=["fwd"], tokens=8192, hidden=1024
    )
    assert [(c.shape.batch, c.shape.heads) for c in cases] == [(1, 16)]  # batch is at least 1
    shapes = [grid.parse_shape("2,1024,4096,32,8,128"), grid.parse_shape("1,512,512,8,8,192,128")]
    cases = grid.build_grid(dtypes=["fp16"], causals=[False], directions=["fwd", "bwd"], shapes=shapes)
    assert len(cases) == 4
    assert cases[0].shape == grid.Shape(2, 1024, 4096, 32, 8, 128, 128)
    assert cases[1].shape.head_dim_v == 128 and cases[1].shape.head_dim == 192
    assert "sq1024-sk4096" in cases[0].label() and "h32-kv8" in cases[0].label()


@pytest.mark.parametrize("bad", ["1,2,3", "a,b,c,d,e,f", "1,128,128,6,4,64", "0,128,128,8,8,64"])
def test_parse_shape_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        grid.parse_shape(bad)


def test_grid_rejects_unknown_names():
    with pytest.raises(ValueError):
        grid.build_grid(dtypes=["fp32"])
    with pytest.raises(ValueError):
        grid.build_grid(directions=["sideways"])


# --- results, tables ------------------------------------------------------------------------------------------
def synthetic_results():
    out = []
    for direction in ("fwd", "bwd"):
        for causal in (False, True):
            for s in (1024, 2048, 4096):
                case = grid.Case("bf16", direction, causal, grid.default_shape(s, 128))
                for impl, speed in (("cute-flash", 500.0), ("fa4", 550.0), ("sdpa-flash", 300.0)):
                    ms = case.flops / (speed * 1e12) * 1e3
                    out.append(
                        Result.for_case(
                            impl,
                            case,
                            "ok",
                            ms=ms,
                            tflops=flops.tflops(case.flops, ms),
                            first_call_s=2.0 if s == 1024 else 0.01,
                            host_us=12.0,
                            compile_s=1.5 if impl == "cute-flash" and s == 1024 else None,
                            peak_extra_mib=64.0,
                            max_err=1e-3,
                            err_bound=4e-3,
                        )
                    )
                out.append(
                    Result.for_case(
                        "naive",
                        case,
                        "oom" if s == 4096 else "ok",
                        tflops=None if s == 4096 else 50.0,
                        ms=None if s == 4096 else 1.0,
                    )
                )
    out.append(Result.for_case("sdpa-math", case, "wrong", max_err=0.5, err_bound=0.01, note="out: err ..."))
    return out


def synthetic_memory():
    pts = []
    for s in (1024, 2048, 4096):
        pts.append(MemoryPoint("cute-flash", "fwd", "bf16", 1, 16, 128, s, "ok", s / 256))
        pts.append(
            MemoryPoint(
                "naive",
                "fwd",
                "bf16",
                1,
                16,
                128,
                s,
                "ok" if s < 4096 else "oom",
                s * s * 16 * 6 / 2**20 if s < 4096 else None,
            )
        )
    return pts


def test_csv_and_json_round_trip(tmp_path):
    results, memory = synthetic_results(), synthetic_memory()
    write_csv(str(tmp_path / "r.csv"), results, RESULT_FIELDS)
    rows = read_csv(str(tmp_path / "r.csv"))
    assert len(rows) == len(results)
    assert list(rows[0]) == RESULT_FIELDS
    assert rows[0]["impl"] == "cute-flash" and float(rows[0]["tflops"]) == pytest.approx(500.0, rel=1e-5)
    assert rows[-1]["status"] == "wrong" and rows[-1]["tflops"] == ""
    meta = {"device": "Test GPU", "date_utc": "2026-01-01 00:00 UTC"}
    bad = Result.for_case("x", grid.Case("bf16", "fwd", False, grid.default_shape(512, 64)), "wrong", max_err=math.inf)
    write_json(str(tmp_path / "r.json"), meta, results + [bad], memory)
    json.loads((tmp_path / "r.json").read_text())  # strict JSON: no Infinity / NaN tokens
    meta2, results2, memory2 = read_json(str(tmp_path / "r.json"))
    assert meta2 == meta and results2[: len(results)] == results and memory2 == memory
    assert results2[-1].max_err is None


def test_tables_show_numbers_statuses_and_ratio():
    results = synthetic_results()
    text = report.tflops_tables(results)
    assert "**bf16 fwd**" in text and "**bf16 bwd**" in text
    header = next(line for line in text.splitlines() if line.startswith("| d |"))
    assert header.split(" | ")[5:8] == ["cute-flash", "fa4", "sdpa-flash"]  # cute-flash first
    row = next(line for line in text.splitlines() if line.startswith("| 128 | none | 1024 |"))
    assert "| 500 | 550 | 300 |" in row and "| 0.91 | fa4 |" in row
    assert "OOM" in text and "WRONG" in text
    first = report.first_call_table(results)
    assert "| cute-flash | bf16 | fwd | 128 | none | 1024 | 2.000 | 1.50 | 12.0 |" in first
    assert "sdpa-math" in report.problems_table(results)
    mem = report.memory_table(synthetic_memory())
    assert "| 4096 | 16 | OOM |" in mem


def test_ratio_needs_both_sides():
    case = grid.Case("bf16", "fwd", False, grid.default_shape(512, 64))
    only_ours = [Result.for_case("cute-flash", case, "ok", tflops=100.0)]
    assert report.ratio_to_best_peer(only_ours) is None
    with_peer = only_ours + [
        Result.for_case("fa4", case, "ok", tflops=200.0),
        Result.for_case("sdpa-flash", case, "n/a"),
    ]
    assert report.ratio_to_best_peer(with_peer) == pytest.approx(0.5)


def test_plots_from_synthetic_data(tmp_path):
    pytest.importorskip("matplotlib")
    from cute_flash.bench.plots import write_plots

    paths = write_plots(str(tmp_path), synthetic_results(), synthetic_memory(), log=lambda m: None)
    names = sorted(os.path.basename(p) for p in paths)
    assert names == ["memory.png", "ratio_bf16.png", "tflops_bf16_bwd.png", "tflops_bf16_fwd.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_memory_seqlens_double():
    assert memory_seqlens(1024, 8192) == [1024, 2048, 4096, 8192]
    assert memory_seqlens(1024, 1000) == []


# --- command line ---------------------------------------------------------------------------------------------
def parse(argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(argv)


def test_cli_builds_the_requested_grid():
    args = parse(
        [
            "--dtypes",
            "bf16",
            "--head-dims",
            "64,128",
            "--seqlens",
            "1024",
            "--masks",
            "causal",
            "--directions",
            "fwd",
            "--impls",
            "cute-flash,fa4",
        ]
    )
    cases = cli.build_cases(args)
    assert [(c.shape.head_dim, c.causal) for c in cases] == [(64, True), (128, True)]
    assert args.impls == ["cute-flash", "fa4"]
    custom = cli.build_cases(
        parse(["--shape", "1,256,256,4,4,64", "--dtypes", "fp16", "--masks", "none", "--directions", "bwd"])
    )
    assert len(custom) == 1 and custom[0].shape.heads == 4


def test_cli_rejects_unknown_impl_and_mask(capsys):
    assert cli.main(parse(["--impls", "nonesuch"])) == 2
    assert cli.main(parse(["--masks", "sliding"])) == 2
    assert set(IMPL_NAMES) >= {"cute-flash", "fa4", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "sdpa-math", "naive"}


def test_cli_replays_a_saved_run(tmp_path, capsys):
    write_json(str(tmp_path / "results.json"), {"device": "Test GPU"}, synthetic_results(), synthetic_memory())
    assert cli.main(parse(["--from-json", str(tmp_path / "results.json"), "--no-plots"])) == 0
    out = capsys.readouterr().out
    assert "- device: Test GPU" in out and "**bf16 fwd**" in out and "peak extra memory" in out


# --- runner and checks that need no GPU ---------------------------------------------------------------------------
def test_measure_records_unsupported_and_skipped_without_running():
    # Neither path touches the inputs, so a stand-in without tensors (and without a GPU) is enough.
    case = grid.Case("fp8", "fwd", False, grid.default_shape(1024, 64))
    assert measure(Naive(), SimpleNamespace(case=case), RunOptions()).status == "n/a"
    long_case = grid.Case("bf16", "fwd", False, grid.default_shape(16384, 64))
    skipped = measure(Naive(), SimpleNamespace(case=long_case), RunOptions(quadratic_max_seqlen=8192))
    assert skipped.status == "skipped" and skipped.tflops is None


def test_accuracy_check_accepts_right_and_rejects_wrong_outputs():
    g = torch.Generator().manual_seed(2)
    case = grid.Case("bf16", "fwd", True, grid.Shape(1, 64, 96, 4, 2, 32, 32))
    q, k, v = (torch.randn(1, s, h, 32, generator=g).bfloat16() for s, h in ((64, 4), (96, 2), (96, 2)))
    scale = 32**-0.5
    out = Naive()(q, k, v, case, scale)
    verdict = check.check_forward(case, q, k, v, out, scale)
    assert verdict.ok, verdict.summary()
    assert not check.check_forward(case, q, k, v, out + 0.05, scale).ok
    nan_out = out.clone()
    nan_out[0, -1, 0, 0] = float("nan")
    assert not check.check_forward(case, q, k, v, nan_out, scale).ok


def test_backward_check_on_the_naive_peer():
    # Seeded: the naive peer's bf16 gradients miss the rule (2 x torch's own error) for 12 of 200 seeds at this size
    # (unseeded, CI once drew one: dv 0.0142 against 2 x 0.0069 with inputs from whatever state earlier tests left).
    g = torch.Generator().manual_seed(3)
    case = grid.Case("bf16", "bwd", False, grid.Shape(1, 48, 48, 2, 1, 32, 32))
    q, k, v = (torch.randn(1, 48, h, 32, generator=g).bfloat16().requires_grad_() for h in (2, 1, 1))
    out = Naive()(q, k, v, case, 32**-0.5)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    out.backward(dout)
    verdict = check.check_backward(case, q, k, v, dout, [q.grad, k.grad, v.grad], 32**-0.5)
    assert verdict.ok and [r.name for r in verdict.reports] == ["dq", "dk", "dv"]
    assert not check.check_backward(case, q, k, v, dout, [q.grad * 1.1, k.grad, v.grad], 32**-0.5).ok


def test_fp8_check_uses_the_fp8_emulation_as_baseline():
    """The fp8 baseline is per-tensor FP8 from cute_flash.fp8.emulate; our block-scaled, rotated recipe passes it
    and an output off by more than the budget does not."""
    from cute_flash.fp8.emulate import emulated_attention

    case = grid.Case("fp8", "fwd", True, grid.Shape(1, 96, 128, 2, 1, 64, 64))
    torch.manual_seed(0)  # fixed inputs and rotation signs: the verdict must not depend on the tests run before
    q, k, v = (
        torch.randn(1, 96, 2, 64).bfloat16(),
        torch.randn(1, 128, 1, 64).bfloat16(),
        torch.randn(1, 128, 1, 64).bfloat16(),
    )
    ours = emulated_attention(q, k, v, scheme="fp8_block_rotate", causal=True, softmax_scale=0.125).bfloat16()
    verdict = check.check_forward(case, q, k, v, ours, 0.125)
    assert verdict.ok and verdict.reports[0].baseline_err > 1e-3  # fp8 error, far above bf16's
    assert verdict.reports[0].bound == pytest.approx(2 * verdict.reports[0].baseline_err + 2e-3)
    wrong = ours.clone()
    wrong[0, -1, 0, 0] += 0.5
    assert not check.check_forward(case, q, k, v, wrong, 0.125).ok


# --- profiling tools --------------------------------------------------------------------------------------------
RAW_CSV = """"ID","Process ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","dram__bytes_write.sum","sm__throughput.avg.pct_of_peak_sustained_elapsed","sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum","l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum","launch__registers_per_thread"
"","","","ns","byte","byte","%","%","","","","","register/thread"
"0","123","kernel_fwd(Params)","1,000,000","3000000000","1000000000","85.5","70.25","0.5","1.5","100","1000","168"
"1","123","kernel_post(Params)","10000","1000","2000","10","0","0.1","0.2","0","0","32"
"""


def test_ncu_summary_parses_raw_csv(tmp_path):
    from profiling import summary

    (tmp_path / "raw.csv").write_text("==PROF== Disconnected\n" + RAW_CSV)
    meta = {"label": "bf16 fwd causal", "flops": 2e12, "io_bytes": {"compulsory": 1e9, "tiled": 8e9}}
    kernels = summary.summarize(summary.read_raw_csv(str(tmp_path / "raw.csv")), meta)
    assert [k["kernel"] for k in kernels] == ["kernel_fwd", "kernel_post"]
    k = kernels[0]
    assert k["duration_us"] == pytest.approx(1000.0)
    assert k["dram_bytes"] == pytest.approx(4e9)
    assert k["tensor_pipe_pct"] == pytest.approx(70.25)
    assert k["top_stalls"].startswith("long_scoreboard=1.50")
    assert k["smem_ld_conflict_pct"] == pytest.approx(10.0)
    assert k["call_duration_us"] == pytest.approx(1010.0)
    assert k["call_tflops"] == pytest.approx(2e12 / 1010e-6 / 1e12)
    assert k["call_dram_over_compulsory"] == pytest.approx((4e9 + 3000) / 1e9)
    text = summary.text_table(kernels)
    assert "tensor pipe active, %" in text and "IO model" in text
    summary.write_csv(str(tmp_path / "summary.csv"), kernels)

    from profiling import compare

    before = compare.load(str(tmp_path))
    after = [dict(r, duration_us=str(float(r["duration_us"]) / 2)) for r in before]
    table = compare.compare_table(before, after)
    assert "-50.0%" in table


SOURCE_CSV = """"Kernel Name","kernel_fwd",
"Address","Source","# Samples","stall_barrier","stall_wait","stall_barrier (Not Issued)"
"0x10","MUFU.EX2 R1, R1","30","0","28","0"
"0x20","@!P0  BRA 0x40","60","55","1","50"
"0x30","MUFU.EX2 R2, R2","10","0","9","0"
"""


def test_hotspots_rank_instructions_and_opcodes(tmp_path):
    from profiling import hotspots

    (tmp_path / "src.csv").write_text(SOURCE_CSV)
    rows = hotspots.read_source_csv(str(tmp_path / "src.csv"))
    assert [r["Address"] for r in rows] == ["0x10", "0x20", "0x30"]
    text = hotspots.report(rows, top=2)
    assert "stall mix: barrier 59.1%, wait 40.9%" in text  # "(Not Issued)" columns are not counted twice
    assert "by opcode: BRA 60.0%, MUFU 40.0%" in text
    lines = text.splitlines()
    ranked = lines[lines.index(next(l for l in lines if l.strip().startswith("address"))) + 1 :]
    assert len(ranked) == 2 and "BRA" in ranked[0] and "barrier:55" in ranked[0] and "R1, R1" in ranked[1]


def test_io_model_bounds():
    from profiling.io_model import predicted_bytes

    case = grid.Case("bf16", "fwd", False, grid.Shape(1, 1024, 1024, 1, 1, 128, 128))
    model = predicted_bytes(case, tile_m=128)
    tensor = 1024 * 128 * 2
    assert model["compulsory"] == 4 * tensor + 1024 * 4
    assert model["tiled"] == 2 * tensor + 1024 * 4 + 8 * 2 * tensor  # K and V re-read by each of 8 query tiles
    causal = predicted_bytes(grid.Case("bf16", "fwd", True, case.shape), tile_m=128)
    assert model["compulsory"] == causal["compulsory"] and causal["tiled"] < model["tiled"]
    bwd = predicted_bytes(grid.Case("bf16", "bwd", False, case.shape))
    assert bwd["tiled"] > bwd["compulsory"] > model["compulsory"]


SASS_TEXT = """
        Function : kern
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT, gsb0 ;
        /*0020*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0030*/                   MUFU.EX2 R2, R2 ;
        /*0040*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0050*/                   MUFU.EX2 R3, R3 ;
        /*0060*/                   HGMMA.64x128x16.F32.BF16 R88, R184, gdesc[UR8].tnspB, R88, gsb0 ;
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x1, 0x100 ;
        /*0080*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R0 ;
        /*0090*/              @!P0 BRA 0x80 ;
        /*00a0*/               @P1 BRA 0x10 ;
        /*00b0*/                   EXIT ;
"""


def test_sass_census_loops_and_sections():
    from profiling import sass_census

    instrs = sass_census.parse(SASS_TEXT)["kern"]
    assert sass_census.loops(instrs) == [(0x80, 0x90), (0x10, 0xA0)]
    body = sass_census.body(instrs, 0x10, 0xA0)
    census = sass_census.census(body)
    assert census["HGMMA"] == 2 and census["MUFU.EX2"] == 2 and census["BAR.SYNC"] == 1 and census["BRA"] == 2
    sections = sass_census.sections(body)
    assert [s.get("MUFU.EX2", 0) for s in sections[:3]] == [0, 1, 1]  # one exponential before the second wait
    order = sass_census.order(body)
    assert order[0] == "HGMMA.64x64x16.SS [commit]" and "HGMMA.64x128x16.RS [commit]" in order


def test_varlen_benchmark_rounds_take_each_rows_median():
    # profiling.varlen_benchmark --rounds: each row's times are the median over the rounds and its TFLOP/s follow
    # them; rows without times (a peer that failed) pass through.
    from profiling.varlen_benchmark import median_rows

    def row(fwd, bwd):
        return {"impl": "ours", "fwd_ms": fwd, "fwd_tflops": 600.0 / fwd, "bwd_ms": bwd, "bwd_tflops": 1500.0 / bwd}

    rounds = [[row(f, b), {"impl": "FA4 varlen: failed"}] for f, b in ((2.0, 4.0), (1.0, 5.0), (4.0, 6.0))]
    ours, failed = median_rows(rounds)
    assert (ours["fwd_ms"], ours["bwd_ms"]) == (2.0, 5.0)
    assert ours["fwd_tflops"] == pytest.approx(300.0) and ours["bwd_tflops"] == pytest.approx(300.0)
    assert failed == {"impl": "FA4 varlen: failed"}


def test_varlen_benchmark_rounds_start_at_successive_rows():
    # profiling.varlen_benchmark --rounds: round r times its rows starting from row r (mod their number), so that no
    # row always runs first (a 200-ms row inherits the power state the rows before it left).
    from profiling.varlen_benchmark import rotated

    rows = ["ours varlen", "ours dense", "FA4 varlen", "FA4 dense"]
    assert [rotated(rows, r)[0] for r in range(5)] == rows + rows[:1]
    assert rotated(rows, 2) == ["FA4 varlen", "FA4 dense", "ours varlen", "ours dense"]
    assert rotated([], 3) == []


def test_sustained_clocks_ratios_over_ours_and_their_geomean_over_seeds():
    # profiling.sustained_clocks --seeds: each row's median ms / MHz / Mcycles over ours' per seed (above 1: slower
    # than ours), then their geometric mean over the seeds.
    from profiling.sustained_clocks import geomean_ratios, ratios

    def sample(ms, mhz):
        return {"ms": ms, "mhz": mhz, "mcycles": ms * mhz / 1e3}

    seed1 = {"ours varlen": [sample(10.0, 1500), sample(12.0, 1400), sample(11.0, 1450)], "FA4 varlen": []}
    seed1["FA4 varlen"] = [sample(11.0, 1500), sample(11.55, 1600), sample(30.0, 1000)]
    r1 = ratios(seed1)
    assert list(r1) == ["FA4 varlen"]
    assert r1["FA4 varlen"]["ms"] == pytest.approx(1.05) and r1["FA4 varlen"]["mhz"] == pytest.approx(1500 / 1450)
    r2 = ratios({"ours varlen": [sample(10.0, 1500)], "FA4 varlen": [sample(10.0 / 1.05, 1500)]})
    assert geomean_ratios([r1, r2])["FA4 varlen"]["ms"] == pytest.approx(1.0)
    assert ratios({"FA4 varlen": [sample(1.0, 1.0)]}) == {} and geomean_ratios([]) == {}


def test_sustained_clocks_refuses_seeds_with_given_lengths(capsys):
    # --lengths replaces the draw, so --seeds beside it would be ignored: a usage error instead.
    from profiling.sustained_clocks import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--lengths", "512x4", "--seeds", "1,0"])
    assert exit_info.value.code == 2 and "--seeds or --lengths" in capsys.readouterr().err


def test_sustained_clocks_rows_come_from_varlen_benchmarks_peer_calls(monkeypatch):
    # profiling.varlen_benchmark.peer_calls builds sustained_clocks' rows: ours and FA4's packed calls and, with
    # dense, both dense calls at equal work; on the CPU here with a fake FA4.
    import torch

    from profiling import varlen_benchmark

    randn = torch.randn
    monkeypatch.setattr(
        torch, "randn", lambda *shape, generator=None, device=None, dtype=None: randn(*shape, dtype=dtype)
    )
    monkeypatch.setattr(torch, "Generator", lambda device=None: type("G", (), {"manual_seed": lambda self, s: self})())
    cu_seqlens = varlen_benchmark.cu_seqlens
    monkeypatch.setattr(varlen_benchmark, "cu_seqlens", lambda lens, dev: cu_seqlens(lens, "cpu"))
    monkeypatch.setattr(varlen_benchmark, "fa4_function", lambda name: (lambda *a, **k: None))

    calls = varlen_benchmark.peer_calls([300, 500], 2, 64, grad=True, seed=1)
    assert list(calls) == ["ours varlen", "FA4 varlen", "ours dense 2x384", "FA4 dense 2x384"]
    assert [t.shape for t in calls["ours dense 2x384"][1]] == [(2, 384, 2, 64)] * 3
    assert all(t.requires_grad for _, leaves in calls.values() for t in leaves)
    assert list(varlen_benchmark.peer_calls([300], 2, 64, dense=False, peers=False)) == ["ours varlen"]


def test_profiling_target_packed_meta_counts_each_sequences_work():
    # profiling.target --varlen-seed (and ncu_profile, which passes it on): the lengths varlen_benchmark draws for
    # batch x seqlen tokens, FLOPs summed per sequence, the flag kept for the profiled subprocess.
    import argparse

    from profiling import target
    from profiling.varlen_benchmark import draw_lengths

    p = argparse.ArgumentParser()
    target.add_config_arguments(p)
    args = p.parse_args("--direction bwd --batch 1 --seqlen 65536 --causal --varlen-seed 2".split())
    meta = target.describe(args)
    lens = draw_lengths(65536, 128, 8192, 2)
    assert meta["lengths"] == lens and sum(lens) == 65536
    assert meta["flops"] == pytest.approx(sum(4 * 16 * 128 * s * s for s in lens) * 0.5 * 2.5)
    assert target.config_argv(args)[-3:] == ["--varlen-seed", "2", "--causal"]


def test_profiling_target_varlen_equal_packs_the_dense_shape():
    # profiling.target --varlen-equal: batch sequences of seqlen each, the dense case's FLOPs, the flag passed on.
    import argparse

    from profiling import target

    p = argparse.ArgumentParser()
    target.add_config_arguments(p)
    args = p.parse_args("--batch 12 --seqlen 5248 --varlen-equal".split())
    meta = target.describe(args)
    assert meta["lengths"] == [5248] * 12 and meta["flops"] == pytest.approx(12 * 4 * 16 * 128 * 5248**2)
    assert "(equal)" in meta["label"] and target.config_argv(args)[-1] == "--varlen-equal"


def test_varlen_benchmark_equal_work_dense_shapes():
    # The dense batch at the work of the drawn mixes of seeds 0 / 1 / 2 (11 x 5888, 12 x 5248, 10 x 6272: the dense
    # rows docs/performance_archive.md quotes beside them), and the offsets of packed lengths.
    from profiling.varlen_benchmark import cu_seqlens, draw_lengths, equal_work_dense

    shapes = [equal_work_dense(draw_lengths(65536, 128, 8192, seed)) for seed in (0, 1, 2)]
    assert shapes == [(11, 5888), (12, 5248), (10, 6272)]
    assert cu_seqlens([3, 0, 5], "cpu").tolist() == [0, 3, 3, 8]


PROFILING_TOOLS = [
    "cache_first_call",
    "compare",
    "fp8_benchmark",
    "host_overhead",
    "host_overhead_cpu",
    "hotspots",
    "ncu_profile",
    "ptx_identity",
    "ring_benchmark",
    "sanitize_target",
    "sass_census",
    "summary",
    "sustained_clocks",
    "target",
    "varlen_benchmark",
]


@pytest.mark.parametrize("tool", PROFILING_TOOLS)
def test_profiling_tools_have_a_help_with_their_defaults(tool, monkeypatch, capsys):
    # Every tool of profiling/README.md answers --help (without a GPU) with what it does and each option's default.
    import importlib
    import sys

    module = importlib.import_module(f"profiling.{tool}")
    monkeypatch.setattr(sys, "argv", [tool, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert module.__doc__.split()[0] in text
    if "--" in text.split("options:")[-1].replace("--help", ""):
        assert "(default:" in text, text

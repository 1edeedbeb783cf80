"""The command line works on a machine without a GPU."""

import json
import subprocess
import sys

import pytest
import torch

from cute_flash.census import parse_ptxas_report, ptx_census, ptx_threads


def run_cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "cute_flash", *args], capture_output=True, text=True, **kw)


def test_info_runs():
    proc = run_cli("info")
    assert proc.returncode == 0, proc.stderr
    assert "cute_flash" in proc.stdout and "backend" in proc.stdout and "C++ call path: " in proc.stdout
    if not torch.cuda.is_available():  # it points at the cross-compiling commands, which take --arch
        assert "compile --arch" in proc.stdout and "CUTE_FLASH_ARCH to pick" not in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU demo is exercised by the GPU tests")
def test_demo_without_gpu_shows_the_algorithm():
    # --no-compile: its three cross-compiles are the builds tests/test_compile_sm*.py check (CI time).
    proc = run_cli("demo", "--no-compile", timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "tiled online softmax vs float64 reference" in proc.stdout


def test_compile_rejects_unknown_arch():
    proc = run_cli("compile", "--arch", "sm70", "--head-dim", "128")
    assert proc.returncode != 0 and "invalid choice" in proc.stderr


def test_ptx_census_counts_instructions():
    ptx = "\n".join(
        [
            "\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1, %f2, %f3, %f4}, {%r1, %r2}, {%r3}, {%f5};",
            "\t@%p1 cp.async.cg.shared.global [%r1], [%rd1], 16;",
            "\twgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 1, 1;",
            "\twgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}, {%r1, %r2, %r3, %r4}, %rd2, p, 1, 1, 1;",
            "\tsetmaxnreg.inc.sync.aligned.u32 240;",
            "\t// mma.sync in a comment does not count",
            "\ttcgen05.mma.cta_group::2.kind::f16 [%r1], %rd1, %rd2, %r2, p;",
            ".reqntid 384, 1, 1",
        ]
    )
    c = ptx_census(ptx)
    assert c["mma.sync"] == 1 and c["cp.async"] == 1 and c["setmaxnreg"] == 1
    assert c["wgmma.mma_async"] == 2 and c["wgmma.mma_async.rs"] == 1
    assert c["tcgen05.mma"] == 1 and c["tcgen05.mma.cta_group::2"] == 1
    assert ptx_threads(ptx) == 384


def test_parse_ptxas_report():
    text = """ptxas info    : Compiling entry function 'kern_a' for 'sm_90a'
ptxas info    : Function properties for kern_a
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
"""
    assert parse_ptxas_report(text) == {"kern_a": {"stack_frame_bytes": 8, "spill_bytes": 8, "registers": 168}}


@pytest.mark.parametrize("target", ["sm_80", "sm_90a", "sm_100a"])
def test_census_reads_a_real_cross_compiled_kernel(target):
    import os
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, CUTE_DSL_ARCH=target, PYTHONPATH=str(root))
    proc = subprocess.run(
        [sys.executable, str(root / "tests" / "tiny_kernel.py"), target],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rep["target_line"] == f".target {target}"
    ((entry, res),) = rep["resources"].items()
    assert 0 < res["registers"] <= 32 and res["stack_frame_bytes"] == 0
    assert rep["ptxas"][entry]["spill_bytes"] == 0 and rep["ptxas"][entry]["registers"] == res["registers"]
    assert rep["threads"] in (0, 128)


def test_parse_ptxas_report_with_wrapped_names_and_several_kernels():
    # CuTe DSL's remark printer wraps long lines: the name can follow its label on the next line.
    text = """ptxas info    : Compiling entry function
          'kern_pre' for 'sm_80'
ptxas info    : Function properties for kern_pre
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 80 registers
ptxas info    : Compiling entry function 'kern_main' for 'sm_80'
ptxas info    : Function properties for
          kern_main
ptxas         .     16 bytes stack frame, 24 bytes spill stores, 28 bytes spill loads
ptxas info    : Used 255 registers
"""
    rep = parse_ptxas_report(text)
    assert rep["kern_pre"] == {"stack_frame_bytes": 0, "spill_bytes": 0, "registers": 80}
    assert rep["kern_main"] == {"stack_frame_bytes": 16, "spill_bytes": 52, "registers": 255}


def test_reports_are_matched_to_artifacts_by_name_and_stack_frame():
    from cute_flash.cli import _take_report

    reports = [
        ("fwd", {"stack_frame_bytes": 16, "spill_bytes": 120}),  # a discarded candidate
        ("fwd", {"stack_frame_bytes": 0, "spill_bytes": 0}),
        ("bwd", {"stack_frame_bytes": 8, "spill_bytes": 16}),
        ("bwd", {"stack_frame_bytes": 32, "spill_bytes": 68}),  # same class, GQA build
    ]
    assert _take_report(reports, "fwd", 0)["spill_bytes"] == 0
    assert _take_report(reports, "bwd", 8)["spill_bytes"] == 16
    assert _take_report(reports, "bwd", 32)["spill_bytes"] == 68
    assert _take_report(reports, "missing", 0) == {}


def test_demo_refuses_bad_options(capsys):
    from cute_flash.cli import build_parser

    for bad in (["--batch", "-3"], ["--seqlen", "0"], ["--head-dim", "x"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["demo", "--no-compile", *bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and ("positive integer" in err or "invalid" in err), bad


def test_demo_without_gpu_uses_its_options_and_leaves_no_directory(monkeypatch, tmp_path):
    """The CPU demo runs the algorithm at the shape asked for and cross-compiles for the head dim and mask asked for,
    into a temporary directory removed afterwards (or --out, kept)."""
    import argparse
    import os

    from cute_flash import demo

    seen = []

    def fake_run(cmd, **kw):  # the cross-compiles (tests/test_compile_sm*.py run real ones)
        seen.append(cmd)
        out = cmd[cmd.index("--out") + 1]
        assert os.path.isdir(out)
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(demo.subprocess, "run", fake_run)
    args = argparse.Namespace(batch=1, seqlen=40, nheads=2, head_dim=32, causal=True, no_compile=False, out=None)
    assert demo.run_cpu(args) == 0
    assert len(seen) == 3 and all("--causal" in c and c[c.index("--head-dim") + 1] == "32" for c in seen)
    assert not os.path.exists(seen[0][seen[0].index("--out") + 1])
    seen.clear()
    assert demo.run_cpu(argparse.Namespace(**{**vars(args), "out": str(tmp_path / "k"), "causal": False})) == 0
    assert os.path.isdir(tmp_path / "k") and all("--causal" not in c for c in seen)


def test_bench_help_explains_every_option_with_its_default():
    from cute_flash.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    bench = sub.choices["bench"]
    for action in bench._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, action.option_strings
            if action.default is not None and not isinstance(action.default, bool):
                assert "default" in action.help, action.option_strings
    assert "(default 512,1024,2048,4096,8192,16384)" in " ".join(bench.format_help().split())


def test_compile_and_warmup_take_the_new_builds():
    from cute_flash.cli import _spec_from_args, _warmup_capability, build_parser
    from cute_flash.warmup import configs

    args = build_parser().parse_args(
        ["compile", "--arch", "sm90", "--head-dim", "128", "--local", "--softcap", "--sink"]
    )
    spec = _spec_from_args(args)
    assert (spec.mask, spec.softcap, spec.sink) == ("local", True, True)
    args = build_parser().parse_args(["warmup", "--capability", "sm90", "--head-dims", "64", "--softcap"])
    assert _warmup_capability(args) == (9, 0)
    (cfg,) = configs(args.head_dims, masks=["causal"], softcap=args.softcap, sink=args.sink)
    assert cfg.spec.softcap and not cfg.spec.sink and cfg.describe() == "forward bf16 d64 causal softcap"
    from cute_flash.cli import main

    assert main(["warmup", "--capability", "nine"]) == 2


def test_warmup_kvcache_configs_are_the_specs_calls_compile_for(monkeypatch):
    """`warmup --kvcache` warms the specs that attention_with_kvcache's calls validate to (else a warmed cache would
    be looked up under other keys): dense and paged, bf16 and fp8 caches."""
    import torch

    from cute_flash import validation
    from cute_flash.cli import build_parser
    from cute_flash.validation import KvCacheArgs, validate_kvcache
    from cute_flash.warmup import configs

    args = build_parser().parse_args(["warmup", "--arch", "sm90", "--kvcache", "--fp8-cache", "both"])
    assert args.kvcache and args.page_sizes is None and args.fp8_cache == "both"
    from cute_flash.cli import main

    # Options that would be ignored are usage errors.
    assert main(["warmup", "--arch", "sm90", "--kvcache", "--backward"]) == 2
    assert main(["warmup", "--arch", "sm90", "--page-sizes", "16"]) == 2
    cfgs = configs([128], masks=["causal"], kvcache=True, page_sizes=[0, 16], fp8_cache=(False, True))
    assert [c.describe() for c in cfgs] == [
        "kvcache dense bf16 d128 causal", "kvcache dense fp8 bf16 d128 causal", "kvcache paged 16 bf16 d128 causal",
        "kvcache paged 16 fp8 bf16 d128 causal",
    ]  # fmt: skip
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "meta"))

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")

    q, lens = meta(2, 1, 8, 128), meta(2, dtype=torch.int32)
    for cfg in cfgs:
        s = cfg.spec
        cache_dtype = torch.float8_e4m3fn if s.kv_fp8 else torch.bfloat16
        shape = (6, s.page_size, 2, 128) if s.page_size else (2, 64, 2, 128)
        k, v = meta(*shape, dtype=cache_dtype), meta(*shape, dtype=cache_dtype)
        table = meta(2, 3, dtype=torch.int32) if s.page_size else None
        descale = meta(2, 2, dtype=torch.float32) if s.kv_fp8 else None
        call = KvCacheArgs(q, k, v, lens, table, None, None, None, None, descale, descale, None)
        p = validate_kvcache(call, max_seqlen_q=None, causal=True, softmax_scale=None, window_size=(None, None),
                             softcap=0.0, num_splits=0)  # fmt: skip
        assert p.spec == s

"""The generated code of score_mod / mask_mod graphs (cute_flash/mods/codegen.py), cross-compiled without a GPU: the
elementwise probe kernel of every example of tests/test_mods.py for sm_90a and sm_80, spill-free, with one global
load per input it reads and per captured-tensor read."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_COMPILE = textwrap.dedent(
    """
    import json, os, re, sys, tempfile
    os.environ["CUTE_DSL_ARCH"] = sys.argv[1]
    from cute_flash import census, compile_cache
    from cute_flash.mods import trace_mask_mod, trace_score_mod
    from cute_flash.mods.probe import compile_probe
    import tests.test_mods as T

    for fn in T.SCORE_MODS + T.MASK_MODS:
        graph = trace_score_mod(fn) if fn in T.SCORE_MODS else trace_mask_mod(fn)
        with tempfile.TemporaryDirectory() as dump:
            with census.capture_fd_stderr() as err:
                k = compile_probe(graph, sys.argv[1], compile_cache.keep_artifacts_options(dump))
            ptx = k.artifacts.PTX
        (_, res), = census.parse_ptxas_reports("".join(err))
        loads = len(re.findall(r"ld\\.global", ptx))
        print(json.dumps(dict(name=fn.__name__, loads=loads, **res)), flush=True)
    """
)

# Global loads per example: the inputs it reads (score, q_idx, kv_idx, b, h vectors) and its captured-tensor reads.
WANT_LOADS = {"alibi": 4 + 1, "t5_bias": 4 + 1, "softcap30": 1, "head_scaled": 2 + 1, "causal": 2, "sliding": 2,
              "document": 3 + 2, "prefix_lm": 3 + 1, "random_blocks": 2 + 1, "strided": 2,
              "chunks41": 2, "near": 2}  # fmt: skip


def _reports(target):
    done = subprocess.run([sys.executable, "-c", _COMPILE, target], cwd=REPO, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["name"]: r for r in map(json.loads, (x for x in done.stdout.splitlines() if x.startswith("{")))}


def test_mod_probes_compile_for_sm90_and_sm80():
    for target in ("sm_90a", "sm_80"):
        reports = _reports(target)
        assert set(reports) == set(WANT_LOADS), target
        for name, r in reports.items():
            assert r["spill_bytes"] == 0, (target, r)
            assert r["loads"] == WANT_LOADS[name], (target, r)


_ATTENTION = textwrap.dedent(
    """
    import json, os, sys
    os.environ["CUTE_DSL_ARCH"] = sys.argv[1]
    from cute_flash.arch.sm80.build import compile_forward
    from cute_flash.mods import trace_mask_mod, trace_score_mod
    from cute_flash.spec import ModsSpec
    import tests.test_mods as T

    for score, mask in json.loads(sys.argv[2]):
        spec = ModsSpec("bf16", 128, 128, "none", "bf16",
                        score_mod=trace_score_mod(getattr(T, score)).key if score else None,
                        mask_mod=trace_mask_mod(getattr(T, mask)).key if mask else None)
        cf = compile_forward(spec, sys.argv[1])
        print(json.dumps(dict(score=score, mask=mask, kept=cf.tried[-1], tanh=cf.ptx.count("tanh"))), flush=True)
    """
)


def test_mods_attention_kernels_compile_spill_free():
    """The sm80 forward with score_mod / mask_mod (arch/sm80/flash_fwd_mods.py), for sm_90a (the family on Hopper)
    and sm_80: the tile search keeps a spill-free build for each pair."""
    for target, pairs in (("sm_90a", [["alibi", "causal"], ["t5_bias", "document"]]), ("sm_80", [["softcap30",
                          "sliding"]])):  # fmt: skip
        done = subprocess.run([sys.executable, "-c", _ATTENTION, target, json.dumps(pairs)], cwd=REPO,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        reports = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
        assert [[r["score"], r["mask"]] for r in reports] == pairs
        for r in reports:
            assert r["kept"]["stack_frame_bytes"] == 0, (target, r)


_BACKWARD = textwrap.dedent(
    """
    import json, os, sys, tempfile
    os.environ["CUTE_DSL_ARCH"] = sys.argv[1]
    from cute_flash import census, compile_cache
    from cute_flash.arch.sm80 import backward as B
    from cute_flash.mods import trace_mask_mod, trace_score_mod
    from cute_flash.spec import ModsSpec
    import tests.test_mods as T

    for score, mask, gqa, d in json.loads(sys.argv[2]):
        spec = ModsSpec("bf16", d, d, "none", "bf16", score_mod=trace_score_mod(getattr(T, score)).key,
                        mask_mod=trace_mask_mod(getattr(T, mask)).key)
        role = "bwd_gqa" if gqa else "bwd"
        with tempfile.TemporaryDirectory() as dump:
            with census.capture_fd_stderr() as err:
                B._ROLES[role](spec, B._options(role, spec, sys.argv[1], compile_cache.keep_artifacts_options(dump)),
                               sys.argv[1], None)
        (_, res), = census.parse_ptxas_reports("".join(err))
        print(json.dumps(dict(score=score, mask=mask, gqa=gqa, d=d, **res)), flush=True)
    """
)


def test_mods_backward_kernels_compile():
    """The sm80 backward main kernel with score_mod and mask_mod (arch/sm80/flash_bwd_mods.py): spill-free at d64
    for sm_90a and sm_80, MHA and GQA. (d128 on sm_90a spills tens to hundreds of bytes, as the plain d128 backward
    there does: docs/status.md.)"""
    cases = [["alibi", "causal", False, 64], ["t5_bias", "document", True, 64]]
    for target in ("sm_90a", "sm_80"):
        done = subprocess.run([sys.executable, "-c", _BACKWARD, target, json.dumps(cases)], cwd=REPO,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        reports = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
        assert len(reports) == len(cases)
        for r in reports:
            assert r["spill_bytes"] == 0, (target, r)


_SM90 = textwrap.dedent(
    """
    import json, os, sys, tempfile
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    from cute_flash import census, compile_cache
    from cute_flash.arch.sm90.build import compile_forward
    from cute_flash.arch.sm90.tile_config import fwd_tile_config
    from cute_flash.mods import trace_mask_mod, trace_score_mod
    from cute_flash.spec import ModsSpec
    import tests.test_mods as T

    for score, mask, d, kind, sparse in json.loads(sys.argv[1]):
        spec = ModsSpec("bf16", d, d, kind, "bf16",
                        score_mod=trace_score_mod(getattr(T, score)).key if score else None,
                        mask_mod=trace_mask_mod(getattr(T, mask)).key if mask else None, block_sparse=sparse)
        with tempfile.TemporaryDirectory() as dump:
            with census.capture_fd_stderr() as err:
                compile_forward(spec, fwd_tile_config(spec), "sm_90a", compile_cache.keep_artifacts_options(dump))
        (_, res), = census.parse_ptxas_reports("".join(err))
        print(json.dumps(dict(score=score, mask=mask, d=d, **res)), flush=True)
    """
)


def test_sm90_mods_forward_compiles_spill_free():
    """The sm90 forward with score_mod / mask_mod (arch/sm90/flash_fwd_mods.py), dense and block-sparse, at d64 /
    d128 / d256; the document mask (two table reads per score) spills up to 144 bytes at d128 causal, and with a
    bias table read per score (t5_bias + document) ~550: ptxas schedules a tile's loads early (docs/mods.md).)"""
    cases = [["alibi", "causal", 128, "none", False], ["softcap30", "sliding", 64, "none", True],
             [None, "document", 128, "causal", True], ["alibi", None, 256, "causal", False]]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _SM90, json.dumps(cases)], cwd=REPO, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    assert len(reports) == len(cases)
    for r in reports:
        assert r["spill_bytes"] <= (256 if r["mask"] == "document" else 0), r


_SM90_BACKWARD = textwrap.dedent(
    """
    import json, os, sys
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    from cute_flash import census
    from cute_flash.arch.sm90.backward import compile_backward_artifacts
    from cute_flash.mods import trace_mask_mod, trace_score_mod
    from cute_flash.spec import ModsSpec
    import tests.test_mods as T

    for score, mask, d, kind, role, sparse in json.loads(sys.argv[1]):
        spec = ModsSpec("bf16", d, d, kind, "bf16",
                        score_mod=trace_score_mod(getattr(T, score)).key if score else None,
                        mask_mod=trace_mask_mod(getattr(T, mask)).key if mask else None, block_sparse=sparse)
        with census.capture_fd_stderr() as err:
            (art,) = compile_backward_artifacts(spec, "sm_90a", roles=[role])
        (_, res), = census.parse_ptxas_reports("".join(err))
        c = census.ptx_census(art.ptx)
        wgmma = c["wgmma.mma_async"] + c["wgmma.mma_async.rs"]
        print(json.dumps(dict(score=score, mask=mask, d=d, kind=kind, wgmma=wgmma, tanh=art.ptx.count("tanh.approx"),
                              **res)), flush=True)
    """
)


def test_sm90_mods_backward_compiles():
    """The sm90 backward main kernel with score_mod / mask_mod (arch/sm90/flash_bwd_mods.py): each kind of score_mod
    derivative (constant: alibi; of positions: head_scaled; of the score: softcap30, one tanh per score), keys on
    the accumulator rows (d64, d128) and queries (d192, d256), MHA and GQA, dense and block-sparse (a list of query
    tiles per key tile, full tiles without the mask_mod). Spill-free at d192 / d256 and for a
    constant or a positions' derivative at d128; at d128 a derivative of the score kept through the step spills 16
    bytes (328 causal), a document mask 160 causal, and a bias table read per score 56 at d64 (docs/mods.md)."""
    cases = [  # score, mask, d, mask kind, role, block-sparse, most spill bytes
        ["alibi", None, 128, "causal", "bwd", False, 0],
        ["head_scaled", "causal", 128, "none", "bwd_gqa", False, 0],
        ["softcap30", "document", 256, "causal", "bwd", True, 0],
        ["t5_bias", "sliding", 64, "none", "bwd_gqa", True, 128],
        ["softcap30", None, 128, "none", "bwd", False, 64],
        ["alibi", "document", 192, "causal", "bwd_gqa", False, 0],
        [None, "document", 128, "causal", "bwd", True, 128],
    ]
    done = subprocess.run([sys.executable, "-c", _SM90_BACKWARD, json.dumps([c[:6] for c in cases])], cwd=REPO,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    assert len(reports) == len(cases)
    for r, case in zip(reports, cases):
        assert r["spill_bytes"] <= case[6], (case, r)
        assert (r["tanh"] > 0) == (r["score"] == "softcap30"), r  # (one per score and copy of the step)
        assert r["wgmma"] > 0, r


_SM90_PACKED = textwrap.dedent(
    """
    import json, os, sys, tempfile
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    from cute_flash import census, compile_cache
    from cute_flash.arch.sm90.backward import compile_backward_artifacts
    from cute_flash.arch.sm90.build import compile_forward_packed
    from cute_flash.arch.sm90.tile_config import fwd_tile_config
    from cute_flash.mods import trace_mask_mod, trace_score_mod
    from cute_flash.spec import ModsSpec
    import tests.test_mods as T

    for score, mask, d, kind in json.loads(sys.argv[1]):
        spec = ModsSpec("bf16", d, d, kind, "bf16", varlen=True,
                        score_mod=trace_score_mod(getattr(T, score)).key if score else None,
                        mask_mod=trace_mask_mod(getattr(T, mask)).key if mask else None)
        with tempfile.TemporaryDirectory() as dump, census.capture_fd_stderr() as err:
            compile_forward_packed(spec, fwd_tile_config(spec), "sm_90a", compile_cache.keep_artifacts_options(dump),
                                   seqused=True)
            compile_backward_artifacts(spec, "sm_90a", roles=["bwd_gqa_seqused"])
        for role, (name, res) in zip(("fwd", "bwd"), census.parse_ptxas_reports("".join(err))):
            print(json.dumps(dict(role=role, score=score, mask=mask, d=d, mods="Mods" in name, **res)), flush=True)
    """
)


def test_sm90_packed_mods_kernels_compile_spill_free():
    """attention_varlen(score_mod=, mask_mod=): the sm90 packed forward (`packed_mods` entry) and backward (with
    seqused_k, GQA) with the callables, d64 / d128 / d256."""
    cases = [["alibi", None, 128, "causal"], ["head_scaled", "sliding", 64, "none"],
             ["softcap30", "prefix_lm", 256, "causal"]]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _SM90_PACKED, json.dumps(cases)], cwd=REPO, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    assert [r["role"] for r in reports] == ["fwd", "bwd"] * len(cases)
    for r in reports:
        assert r["spill_bytes"] == 0 and r["mods"], r  # (the mods kernels' classes, not the plain ones)


_WARMUP = textwrap.dedent(
    """
    import json
    from cute_flash import compile_cache, mods
    import tests.test_mods as T

    kw = dict(head_dim=64, causal=False, block_mask=True, backward=True, capability=(9, 0))
    first = mods.warmup(T.alibi, T.causal, **kw)
    compile_cache.clear()  # (as a new process would: the in-memory cache is gone, the disk entries stay)
    print(json.dumps([first["totals"], mods.warmup(T.alibi, T.causal, **kw)["totals"],
                      [i["family"] for i in first["items"]]]))
    """
)


def test_warmup_writes_the_mods_kernels_a_call_loads(tmp_path):
    """cute_flash.mods.warmup cross-compiles a block-masked score_mod / mask_mod call's forward and backward (both
    sm90 on Hopper) into the disk cache, and warming again finds both there (their keys: the spec tests/test_mods_api.py
    checks against the call's)."""
    import os

    env = dict(os.environ, CUTE_FLASH_CACHE_DIR=str(tmp_path), CUTE_DSL_ARCH="sm_90a", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", _WARMUP], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    first, again, families = json.loads(done.stdout.splitlines()[-1])
    assert (first["built"], first["failed"], again["cached"], again["built"]) == (2, 0, 2, 0), (first, again)
    assert families == ["sm90", "sm90"]


_SM80_PACKED = textwrap.dedent(
    """
    import json, os, re, sys
    os.environ["CUTE_DSL_ARCH"] = sys.argv[1]
    from cute_flash import census
    from cute_flash.arch.sm80.backward import compile_backward_artifacts
    from cute_flash.arch.sm80.build import compile_forward
    from cute_flash.mods import trace_mask_mod, trace_score_mod
    from cute_flash.spec import ModsSpec
    import tests.test_mods as T

    for score, mask, d, kind, seqused, role in json.loads(sys.argv[2]):
        spec = ModsSpec("bf16", d, d, kind, "bf16", varlen=True,
                        score_mod=trace_score_mod(getattr(T, score)).key if score else None,
                        mask_mod=trace_mask_mod(getattr(T, mask)).key if mask else None)
        fwd = compile_forward(spec, sys.argv[1], seqused=seqused)
        with census.capture_fd_stderr() as err:
            (art,) = compile_backward_artifacts(spec, sys.argv[1], roles=[role])
        ((name, res),) = census.parse_ptxas_reports("".join(err))
        entry = re.search(r"\\.entry\\s+(\\w+)", fwd.ptx).group(1)
        print(json.dumps(dict(score=score, mask=mask, d=d, role=role, fwd=fwd.tried[-1], fwd_entry=entry,
                              bwd_entry=name, **res)), flush=True)
    """
)


def test_sm80_packed_mods_kernels_compile_spill_free():
    """attention_varlen(score_mod=, mask_mod=) off Hopper: the sm80 packed forward (`packed_mods` entry, tile search:
    a spill-free tile kept) and backward main kernel (its `packed_mods` entry: the mods class, not the plain one), d64
    / d128, causal or not, with and without seqused_k, MHA and GQA, for sm_80; one d64 case for sm_90a (the family
    built for Hopper's target). (A bias table read per score with a document mask, t5_bias + document, spills in
    every forward tile candidate at d64 causal, dense as packed: sm_80 304 / 368 bytes, sm_90a 320 / 368.)"""
    for target, cases in (
        ("sm_80", [["alibi", None, 64, "causal", False, "bwd"], ["softcap30", "sliding", 128, "none", True,
                   "bwd_gqa_seqused"], [None, "prefix_lm", 128, "causal", False, "bwd_gqa"],
                   ["head_scaled", "causal", 64, "none", True, "bwd_seqused"]]),
        ("sm_90a", [["alibi", "document", 64, "causal", True, "bwd_gqa_seqused"]]),
    ):  # fmt: skip
        done = subprocess.run([sys.executable, "-c", _SM80_PACKED, target, json.dumps(cases)], cwd=REPO,
                              capture_output=True, text=True, timeout=900)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        reports = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
        assert len(reports) == len(cases), (target, done.stdout[-2000:])
        for r in reports:
            assert r["fwd"]["stack_frame_bytes"] == 0 and r["spill_bytes"] == 0, (target, r)
            assert "Mods" in r["fwd_entry"] and "Mods" in r["bwd_entry"], r  # (the mods kernels, not the plain)

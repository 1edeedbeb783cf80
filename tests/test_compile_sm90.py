"""CPU: the sm90 forward cross-compiles for sm_90a and is built the way the design says (no GPU needed).

The DeepSeek-style head_dim 192 / head_dim_v 128 (the d == dv head dims: tests/test_compile_sm90_bwd.py) and causal
on/off, by running
`python -m cute_flash compile --arch sm90 ... --json` in a subprocess (CuTe DSL fixes its target at import, and
ptxas' report goes to the process's own stderr): the PTX must hold wgmma (both the shared-memory form for Q·Kᵀ and
the register-A form for P·V), TMA bulk-tensor copies and setmaxnreg; ptxas must report zero spill bytes for
d <= 128 and for (192, 128).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cute_flash.spec import AttentionSpec

REPO = Path(__file__).resolve().parents[1]


def _compile_report(tmp_path, head_dim: int, causal: bool, head_dim_v: int = None) -> dict:
    cmd = [sys.executable, "-m", "cute_flash", "compile", "--arch", "sm90", "--head-dim", str(head_dim)]
    cmd += ["--head-dim-v", str(head_dim_v or head_dim)]
    cmd += ["--dtype", "bf16", "--out", str(tmp_path), "--json"] + (["--causal"] if causal else [])
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1, done.stdout[-2000:]
    return reports[0]


def check_census(report: dict) -> None:
    census = report["census"]
    assert report["kernel"] == "fwd"
    assert census["wgmma.mma_async"] > 0
    assert census["wgmma.mma_async.rs"] > 0, "P·V must take P from registers (RS wgmma)"
    assert census["wgmma.mma_async.rs"] < census["wgmma.mma_async"], "Q·Kᵀ must read both operands from smem"
    assert census["cp.async.bulk.tensor"] > 0
    assert census["setmaxnreg"] >= 2  # producer decreases, consumers increase
    assert report["threads"] == report["config"]["num_consumer_wgs"] * 128 + 128
    assert report["spill_bytes"] is not None


# The d == dv builds (d 64 / 96 / 128 / 256, causal both) are checked by tests/test_compile_sm90_bwd.py, whose
# `compile --backward` runs build the forward first (test_sm90_forward_compiles there), with check_census below.


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_forward_compiles_dv_differs(tmp_path, causal):
    # (192, 128): d128's 128 x 128 ping-pong tile with 12 k-blocks of Q·Kᵀ (d / 16) and 8 of P·V (tile_n / 16), O in
    # the Q slots; no spills.
    report = _compile_report(tmp_path, 192, causal, head_dim_v=128)
    check_census(report)
    assert (report["head_dim"], report["head_dim_v"]) == (192, 128)
    assert (report["config"]["tile_m"], report["config"]["tile_n"], report["config"]["ping_pong"]) == (128, 128, True)
    census = report["census"]
    qk = census["wgmma.mma_async"] - census["wgmma.mma_async.rs"]
    assert qk * 8 == census["wgmma.mma_async.rs"] * 12, census  # every Q·Kᵀ issue has 12 k-blocks, every P·V 8
    assert report["shared_bytes"] == 128 * 192 * 2 + 2 * 128 * (192 + 128) * 2 + 1024  # O reuses Q's 48 KiB
    assert report["spill_bytes"] == 0, f"(192, 128) spills {report['spill_bytes']} bytes"


def test_sm90_rejects_what_it_lacks():
    from cute_flash.arch.sm90 import BACKEND

    assert BACKEND.unsupported_reason(AttentionSpec("bf16", 128, 128, "none"), backward=False) is None
    assert "forward-only" in BACKEND.unsupported_reason(AttentionSpec("fp8", 128, 128, "none"), backward=True)
    assert "head dims" in BACKEND.unsupported_reason(AttentionSpec("bf16", 80, 80, "none"), backward=False)
    assert "head_dim_v 80" in BACKEND.unsupported_reason(AttentionSpec("bf16", 128, 80, "none"), backward=False)
    # head_dim != head_dim_v: the forward serves it, the backward too (kernels of its own).
    assert BACKEND.unsupported_reason(AttentionSpec("bf16", 192, 128, "causal"), backward=False) is None
    assert BACKEND.unsupported_reason(AttentionSpec("bf16", 192, 128, "none"), backward=True) is None
    # The backward's head dims do not depend on the forward's: d72 (an sm80 forward) trains on the d96 kernels.
    assert BACKEND.unsupported_reason(AttentionSpec("bf16", 72, 72, "none"), backward=True) is None

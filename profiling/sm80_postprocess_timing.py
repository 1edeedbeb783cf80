"""Times the sm80 backward's postprocess kernels alone (dQ from the fragment layout, and the row-major fp32 -> 16-bit
conversion), optionally beside another version of `flash_bwd_postprocess.py` in the same process:

    git show REV:cute_flash/arch/sm80/flash_bwd_postprocess.py > out/postprocess_baseline.py   # on the CPU machine
    python3 -m profiling.sm80_postprocess_timing [--baseline-file out/postprocess_baseline.py] [--seqlen 16383]

Prints time and GB/s (one fp32 read, one 16-bit write of the rows < seqlen) per kernel and version, and whether the
versions' outputs are bitwise equal. bf16, d128, b 1, h 16 by default; the kernels are built for the device's target.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Dict, Optional, Tuple

import torch


def _load_baseline(path: str):
    # Imported inside cute_flash.arch.sm80 so that the file's relative imports resolve as in the package.
    spec = importlib.util.spec_from_file_location("cute_flash.arch.sm80._postprocess_baseline", os.path.abspath(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(module, spec, target: str) -> Tuple[object, object]:
    """(row-major conversion, dQ fragment conversion) compiled from `module`'s classes through backward's builders."""
    from cute_flash.arch.sm80 import backward, flash_bwd_postprocess as current

    saved = (current.AccumConvertSm80, current.DqFragmentConvertSm80)
    current.AccumConvertSm80, current.DqFragmentConvertSm80 = module.AccumConvertSm80, module.DqFragmentConvertSm80
    try:
        rows = backward._build_postprocess(spec, backward._options("bwd_postprocess", spec, target), target)
        frag = backward._build_postprocess(
            spec, backward._options("bwd_dq_postprocess", spec, target), target, fragment=True
        )
    finally:
        current.AccumConvertSm80, current.DqFragmentConvertSm80 = saved
    return rows, frag


def main(argv: Optional[list] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-file", default=None)
    ap.add_argument("--seqlen", type=int, default=16383)
    ap.add_argument("--heads", type=int, default=16)
    args = ap.parse_args(argv)

    from cute_flash.bench.timing import TimingOptions, median_ms

    from cute_flash import compile_cache
    from cute_flash.arch.sm80 import backward, flash_bwd_postprocess
    from cute_flash.spec import AttentionSpec

    target = compile_cache.runtime_target(torch.device("cuda"))
    spec = AttentionSpec("bf16", 128, 128, "causal", "bf16")
    cfg = backward.bwd_tile_config(128, target)
    b, s, h, d = 1, args.seqlen, args.heads, 128
    s_pad = backward._round_up(s, max(cfg.block_m, backward._PRE_POST_BLOCK_M))
    torch.manual_seed(0)
    frag_accum = torch.randn(b, h, s_pad * d, dtype=torch.float32, device="cuda")
    row_accum = torch.randn(b, s_pad, h, d, dtype=torch.float32, device="cuda")
    gb = (b * s * h * d * (4 + 2)) / 1e9
    versions = {"current": flash_bwd_postprocess}
    if args.baseline_file:
        versions = {"baseline": _load_baseline(args.baseline_file), **versions}
    outputs: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
    print(f"{torch.cuda.get_device_name()} ({target}), bf16 d{d} b{b} h{h} seqlen {s}, dQ layout {cfg.dq_layout}")
    for name, module in versions.items():
        rows, frag = _build(module, spec, target)
        out_rows = torch.empty(b, s, h, d, dtype=torch.bfloat16, device="cuda")
        out_frag = torch.empty_like(out_rows)
        rows(row_accum, out_rows, 0.5)
        frag(frag_accum, out_frag, 0.5)
        torch.cuda.synchronize()
        outputs[name] = (out_rows, out_frag)
        t_rows = median_ms(lambda: rows(row_accum, out_rows, 0.5), TimingOptions())
        t_frag = median_ms(lambda: frag(frag_accum, out_frag, 0.5), TimingOptions())
        print(
            f"{name:>8}: row-major {t_rows * 1e3:7.1f} us ({gb / t_rows * 1e3:5.0f} GB/s)   "
            f"dQ fragment {t_frag * 1e3:7.1f} us ({gb / t_frag * 1e3:5.0f} GB/s)"
        )
    if len(outputs) == 2:
        same = all(torch.equal(x, y) for x, y in zip(*outputs.values()))
        print(f"outputs bitwise equal: {same}")


if __name__ == "__main__":
    main()

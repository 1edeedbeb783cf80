"""Normalised PTX of a few dense sm80 builds, to show that a change leaves them byte-identical (CPU only).

Compiles the forward (d64 causal, d128 none, d128 local) and every backward kernel of d128 causal for one target and
writes their PTX with comment lines dropped (those hold tool versions and file paths) into a directory; run it on two
checkouts and compare the directories:

    PYTHONPATH=<checkout A> python profiling/sm80_ptx_identity.py sm_90a /tmp/ptx_a
    PYTHONPATH=<checkout B> python profiling/sm80_ptx_identity.py sm_90a /tmp/ptx_b
    diff -r /tmp/ptx_a /tmp/ptx_b && echo identical

Used when the packed (varlen) variants were added to the sm80 kernels (docs/varlen.md): all 15 builds (sm_80 and
sm_90a) came out identical.
"""

from __future__ import annotations

import hashlib
import os
import sys


def normalise(ptx: str) -> str:
    return "\n".join(line for line in ptx.splitlines() if not line.lstrip().startswith("//"))


def main(target: str, outdir: str) -> None:
    os.environ.setdefault("CUTE_DSL_ARCH", target)
    from cute_flash.arch.sm80.backend import compile_forward
    from cute_flash.arch.sm80.backward import compile_backward_artifacts
    from cute_flash.spec import AttentionSpec

    os.makedirs(outdir, exist_ok=True)
    builds = {}
    for d, mask in ((64, "causal"), (128, "none"), (128, "local")):
        builds[f"fwd_d{d}_{mask}"] = compile_forward(AttentionSpec("bf16", d, d, mask, "bf16"), target).ptx
    for a in compile_backward_artifacts(AttentionSpec("bf16", 128, 128, "causal", "bf16"), target):
        builds[f"bwd_d128_causal_{a.kernel}"] = a.ptx
    for name, ptx in sorted(builds.items()):
        text = normalise(ptx)
        with open(os.path.join(outdir, name + ".ptx"), "w") as f:
            f.write(text)
        print(name, hashlib.sha256(text.encode()).hexdigest()[:16])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Small attention calls that reach every kernel role, for compute-sanitizer (see profiling/sanitize.sh).

Covers forward and backward, bf16 and fp16 (and fp8 forward where the backend has it), head dims 64/128/256 (and
dv != d), no mask, causal and a local window, sequence lengths that are not tile multiples, seqlen_q != seqlen_k in
both directions and GQA. Shapes stay small because racecheck tracks every shared-memory access. Configurations the
backend does not support are listed and skipped; any other failure, and any result that breaks the accuracy rule,
exits non-zero.
"""

from __future__ import annotations

import argparse
import sys
from profiling import HelpFormatter

CASES = (
    # (dtype, b, sq, sk, h, hkv, d, dv, causal, window)
    ("bf16", 1, 128, 128, 2, 2, 128, 128, False, (None, None)),
    ("bf16", 2, 200, 200, 2, 2, 64, 64, True, (None, None)),
    ("fp16", 1, 257, 131, 4, 1, 128, 128, True, (None, None)),
    ("bf16", 1, 96, 300, 4, 2, 256, 256, False, (None, None)),
    ("bf16", 1, 190, 190, 2, 2, 128, 64, False, (None, None)),
    ("fp16", 1, 256, 256, 2, 2, 64, 64, False, (48, 16)),
    ("fp8", 1, 256, 256, 2, 2, 128, 128, True, (None, None)),
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--forward-only", action="store_true", help="skip the backward calls")
    args = p.parse_args(argv)

    import torch

    import cute_flash
    from cute_flash.testing import check_backward, check_forward, random_qkv

    failures, skipped, ran = [], [], 0
    for dtype, b, sq, sk, h, hkv, d, dv, causal, window in CASES:
        kw = dict(causal=causal, window_size=window)
        label = f"{dtype} b{b} sq{sq} sk{sk} h{h}/{hkv} d{d}/{dv} causal={causal} window={window}"
        torch_dtype = torch.float16 if dtype == "fp16" else torch.bfloat16
        backward = dtype != "fp8" and not args.forward_only
        q, k, v = random_qkv(b, sq, sk, h, hkv, d, dv, dtype=torch_dtype, requires_grad=backward)
        try:
            out = cute_flash.attention(q, k, v, dtype="fp8" if dtype == "fp8" else None, **kw)
            if dtype != "fp8":
                check_forward(q.detach(), k.detach(), v.detach(), out.detach(), **kw)
            if backward:
                dout = torch.randn_like(out)
                out.backward(dout)
                check_backward(q.detach(), k.detach(), v.detach(), dout, (q.grad, k.grad, v.grad), **kw)
            torch.cuda.synchronize()
            ran += 1
            print(f"ok       {label}", flush=True)
        except NotImplementedError as e:
            skipped.append(label)
            print(f"skipped  {label}: {str(e).splitlines()[0]}", flush=True)
        except AssertionError as e:
            failures.append(label)
            print(f"WRONG    {label}: {e}", flush=True)
    print(f"sanitize_target: {ran} ran, {len(skipped)} not supported, {len(failures)} wrong")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""cProfile of warm cute-flash calls on the host (GPU): where the host time of `attention` (and its backward) goes.

python3 -m profiling.host_profile [--backward]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backward", action="store_true")
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    import cute_flash

    q, k, v = (torch.randn(1, 128, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)

    def call():
        if args.backward:
            torch.autograd.grad(cute_flash.attention(q, k, v, causal=True), (q, k, v), dout)
        else:
            with torch.no_grad():
                cute_flash.attention(q, k, v, causal=True)

    for _ in range(10):
        call()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

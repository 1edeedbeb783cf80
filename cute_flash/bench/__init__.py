"""Benchmark of cute-flash against its peers: TFLOP/s, peak extra memory and first-call cost.

Run it as `python -m cute_flash bench` (or `python -m cute_flash.bench`); see `cli.py` for the options and
docs/performance.md for the recorded results. Nothing here imports torch.cuda, triton or cutlass at import time, so
the pure parts (FLOP counting, grids, reporting) work and are tested on a CPU-only machine.
"""

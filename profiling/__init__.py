"""Tools outside the library: benchmarks, Nsight Compute runs and their summaries, compute-sanitizer runs, and the
PTX identity check of refactors. See profiling/README.md."""

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every tool's --help: its docstring as written, and each option's default."""

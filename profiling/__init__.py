"""Profiling tools: Nsight Compute runs of one kernel configuration, their summaries and comparisons, and
compute-sanitizer runs. See profiling/README.md."""

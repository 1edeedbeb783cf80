"""The FP8 path: randomised Hadamard rotation, block-scaled e4m3 quantisation, the GPU pre-pass that does both, and
the bookkeeping for callers who bring their own e4m3 tensors. Importing this package does not import cutlass.

  hadamard        sign vector from a seed, the transform and its torch reference
  quantize        block scales and e4m3 rounding (torch reference), V's transposed layout
  prepass_kernel  the CuTe DSL pre-pass (rotate + scale + quantise Q and K, quantise and transpose V)
  prepare         `prepare_fp8_inputs` / `check_prequantized` -> `Fp8Inputs`, what the FP8 attention kernel reads
  emulate         the kernel's arithmetic in torch (the oracle of the FP8 tests and the benchmark's FP8 baseline)

The speed benchmark is a research script outside the library: profiling/fp8_benchmark.py (accuracy: docs/fp8.md).
"""

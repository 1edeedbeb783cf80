"""Arch-neutral building blocks shared by every attention kernel family.

- `block_info`: which KV blocks a query block visits (and the reverse, for backward kernels) under the none / causal /
  local masks, and which of those blocks need element-wise masking. Pure integer arithmetic that works on Python ints
  (host code, tests) and on CuTe DSL `Int32` values (kernels).
- `acc_views`: (rows, cols) views of MMA accumulator fragments (mma.sync and WGMMA), and the accumulator-to-A-operand
  view that lets P feed the P@V mma.sync straight from registers.
- `mask`: sets masked scores to -inf in an accumulator, given coordinates partitioned the same way.
- `online_softmax`: the running row max / row sum recurrence, O rescaling, final normalisation and LSE.

Nothing here imports torch; importing this package imports cutlass only through the modules that need it.
"""

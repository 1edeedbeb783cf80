"""A minimal CuTe DSL kernel, cross-compiled in a subprocess to check that the census reads real compiler output."""

import json
import sys
import tempfile

import cutlass
import cutlass.cute as cute
from cuda.bindings.driver import CUstream
from cutlass import Float32

from cute_flash.census import capture_fd_stderr, cubin_resources, parse_ptxas_report, ptx_census, ptx_threads
from cute_flash.compile_cache import compile_options, keep_artifacts_options


@cute.kernel
def _scale_kernel(x: cute.Tensor, y: cute.Tensor, s: Float32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * 128 + tidx
    if i < x.shape[0]:
        y[i] = (x[i].to(Float32) * s).to(y.element_type)


@cute.jit
def _scale(x: cute.Tensor, y: cute.Tensor, s: Float32, stream: CUstream):
    _scale_kernel(x, y, s).launch(grid=[cute.ceil_div(x.shape[0], 128), 1, 1], block=[128, 1, 1], stream=stream)


def fake_args():
    """Fake tensors with a symbolic length and torch's current stream taken from the TVM-FFI environment."""
    n = cute.sym_int()
    x = cute.runtime.make_fake_tensor(cutlass.BFloat16, (n,), (1,), assumed_align=16)
    y = cute.runtime.make_fake_tensor(cutlass.BFloat16, (n,), (1,), assumed_align=16)
    return x, y, Float32(1.0), cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


if __name__ == "__main__":
    target = sys.argv[1]
    opts = compile_options(target) + " " + keep_artifacts_options(tempfile.mkdtemp())
    with capture_fd_stderr() as err:
        compiled = cute.compile(_scale, *fake_args(), options=opts)
    ptx, cubin = compiled.artifacts.PTX, compiled.artifacts.CUBIN
    print(
        json.dumps(
            {
                "resources": cubin_resources(cubin),
                "ptxas": parse_ptxas_report("".join(err)),
                "census": ptx_census(ptx),
                "threads": ptx_threads(ptx),
                "target_line": next(l for l in ptx.splitlines() if l.startswith(".target")),
            }
        )
    )

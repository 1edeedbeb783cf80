"""The eager forward's C++ call path (cute_flash/native.py, csrc/eager_forward.cc), on CPU tensors with stand-in
kernels: its key sees every part of a call signature the Python plan cache keys on, a warm no-grad call takes it and
launches what the Python path registered, and everything else (gradients, lse, refused arguments) does not."""

import warnings

import numpy as np
import pytest
import torch

import cute_flash
from cute_flash import native
from cute_flash.core import plan

tvm_ffi = pytest.importorskip("tvm_ffi")


@pytest.fixture(scope="module")
def lib():
    lib = native.library()
    if lib is None:
        pytest.skip("no C++ compiler here: the C++ call path is unavailable")
    return lib


@pytest.fixture(autouse=True)
def empty_table():
    plan.clear_call_cache()
    yield
    plan.clear_call_cache()


class Recorder:
    """A stand-in kernel (a TVM-FFI function) that records its arguments and fills out with 1 (lse with -5)."""

    def __init__(self):
        self.calls = []
        self.fn = tvm_ffi.convert(self._call)

    def _call(self, q, k, v, out, lse, scale, left, right):
        out, lse = torch.from_dlpack(out), torch.from_dlpack(lse)  # (a Python callee gets TVM-FFI tensors)
        self.calls.append((tuple(out.shape), out.dtype, tuple(lse.shape), lse.dtype, scale, left, right))
        lse.fill_(-5)
        out.fill_(1)


def _qkv(shape=(2, 33, 4, 64), kv_heads=2, dtype=torch.bfloat16):
    b, s, h, d = shape
    return torch.randn(b, s, h, d, dtype=dtype), *(torch.randn(b, s + 7, kv_heads, d, dtype=dtype) for _ in range(2))


# The call's scalar fields as the C++ key takes them (core/fields.py): causal, softmax_scale, window_left,
# window_right, deterministic, softcap.
ARGS = (True, None, None, 0, False, 0.0)


def _put(lib, q, k, v, kernel, args=ARGS, softcap=0.0, features=False):
    return lib.put(q, k, v, *args, kernel, 0.125, -1, 0, softcap, features, "bfloat16", None, 1, 1, 0, None)


def _python_s(lib, q, k, v, args):
    """Registers the signature as the Python path's own (no kernel)."""
    return lib.put(q, k, v, *args, None, 0.0, 0, 0, 0.0, False, "bfloat16", None, 1, 1, 0, None)


def _forward(lib, q, k, v, *args, out=None):
    """lib.forward with an out allocated as attention's fast path allocates it; (result, out)."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    return lib.forward(q, k, v, out, *args), out


def test_a_registered_signature_launches_its_kernel(lib):
    q, k, v = _qkv()
    rec = Recorder()
    args = ARGS
    assert _forward(lib, q, k, v, *args)[0] is None
    assert _put(lib, q, k, v, rec.fn, args)
    launched, out = _forward(lib, q, k, v, *args)
    assert launched is True and bool((out == 1).all())  # lse (elsewhere) did not reach out
    assert rec.calls == [((2, 33, 4, 64), torch.bfloat16, (2, 4, 33), torch.float32, 0.125, -1, 0)]
    # out must be the contiguous (b, s, h, dv) tensor of the output dtype: anything else is Python's to serve
    wrong = [
        torch.empty(2, 4, 33, 64, dtype=torch.bfloat16).transpose(1, 2),
        torch.empty(2, 33, 4, 64, dtype=torch.float16),
        torch.empty(2, 33, 4, 32, dtype=torch.bfloat16),
        torch.empty(2 * 33 * 4 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 33, 4, 64),  # 2 bytes off
        "out",
    ]
    for bad in wrong:
        assert lib.forward(q, k, v, bad, *args) is False
    assert len(rec.calls) == 1
    # A signature registered as the Python path's answers False (no launch).
    assert _python_s(lib, q, k, v, (False, None, None, 0, False, 0.0))
    assert _forward(lib, q, k, v, False, None, None, 0, False, 0.0)[0] is False
    assert lib.size() == 2
    lib.clear()
    assert lib.size() == 0 and _forward(lib, q, k, v, *args)[0] is None


def test_the_key_sees_every_part_of_the_signature(lib, monkeypatch):
    q, k, v = _qkv()
    rec = Recorder()
    args = (True, 0.5, 3, None, False, 0.0)
    _put(lib, q, k, v, rec.fn, args)
    assert _forward(lib, q, k, v, *args)[0] is True
    q2 = torch.randn(2, 34, 4, 64, dtype=torch.bfloat16)
    q_strided = torch.randn(2, 4, 33, 64, dtype=torch.bfloat16).transpose(1, 2)
    q_offset = torch.randn(2 * 33 * 4 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 33, 4, 64)  # 2 bytes off
    q_size1 = torch.randn(2, 33, 4, 1, 64, dtype=torch.bfloat16)[:, :, :, 0]  # same layout, another object
    q_unit_batch = torch.randn(1, 33, 4, 64, dtype=torch.bfloat16)
    k1, v1 = k[:1], v[:1]
    others = [
        ((q2, k, v), args),
        ((q_strided, k, v), args),
        ((q_offset, k, v), args),
        ((q.half(), k, v), args),
        ((q, k[:, :-1], v[:, :-1]), args),
        ((q_unit_batch, k1, v1), args),
        ((q, k, v), (1, 0.5, 3, None, False, 0.0)),  # 1 == True, but not a bool
        ((q, k, v), (True, None, 3, None, False, 0.0)),
        ((q, k, v), (True, 0.5000001, 3, None, False, 0.0)),
        ((q, k, v), (True, 0.5, 3, 0, False, 0.0)),
        ((q, k, v), (True, 0.5, None, None, False, 0.0)),
        ((q, k, v), (True, 0.5, 3, None, True, 0.0)),
        ((q, k, v), (True, 0.5, 3.0, None, False, 0.0)),
        ((q, k, v), (True, 0.5, -3, None, False, 0.0)),  # a negative bound
        ((q, k, v), (True, 0.5, 3, None, False, 30.0)),  # softcap
        ((q, k, v), (True, 0.5, 3, None, False, 0)),  # 0 == 0.0, but an int
    ]
    for tensors, other in others:
        assert _forward(lib, *tensors, *other)[0] is None, other
    assert _forward(lib, q_size1, k, v, *args)[0] is True  # equal metadata, equal key
    # Strings, tensors and other objects as scalars are not keyed (Python validates them).
    assert _forward(lib, q, k, v, "yes", 0.5, 3, None, False, 0.0)[0] is None
    assert _forward(lib, q, k, v, True, torch.tensor(0.5), 3, None, False, 0.0)[0] is None
    assert lib.forward(q[0], k[0], v[0], q[0], *args) is None  # 3-D tensors
    monkeypatch.setenv("CUTE_FLASH_ARCH", "sm80")  # routing may change: the key is not served
    assert _forward(lib, q, k, v, *args)[0] is None
    monkeypatch.delenv("CUTE_FLASH_ARCH")
    assert _forward(lib, q, k, v, *args)[0] is True
    assert len(rec.calls) == 3


@pytest.fixture
def fake_gpu_with_recorder(lib, monkeypatch):
    """cute_flash.attention on CPU tensors as on a Hopper GPU, every forward kernel the recorder."""
    from cute_flash import compile_cache
    from profiling.host_overhead_cpu import fake_gpu

    rec = Recorder()
    with fake_gpu((9, 0)):
        compile_cache.get_or_compile = lambda key, build: rec.fn if key[2] == "fwd" else (lambda *a: None)
        plans = []
        real_plan = plan.dense
        monkeypatch.setattr(plan, "dense", lambda *a: plans.append(a) or real_plan(*a))
        yield rec, plans


def test_a_warm_no_grad_call_takes_the_cpp_path(lib, fake_gpu_with_recorder, monkeypatch):
    rec, plans = fake_gpu_with_recorder
    q, k, v = _qkv()
    with torch.no_grad():
        first = cute_flash.attention(q, k, v, causal=True, window_size=(5, 0))
        assert len(plans) == 1 and lib.size() == 1
        second = cute_flash.attention(q, k, v, causal=True, window_size=[5, 0])
        assert len(plans) == 1  # no Python plan lookup: served by the C++ path
        assert rec.calls[0] == rec.calls[1] and torch.equal(first, second)
        assert second.is_contiguous() and type(second) is torch.Tensor
        # lse asked for: the Python path (the C++ path fills out only)
        out, lse = cute_flash.attention(q, k, v, causal=True, window_size=(5, 0), return_lse=True)
        assert len(plans) == 2 and lse.shape == (2, 4, 33)
        # refused arguments stay refused with a warm key of an equal value
        with pytest.raises(TypeError, match="causal must be a bool"):
            cute_flash.attention(q, k, v, causal=np.bool_(True), window_size=(5, 0))
        with pytest.raises(ValueError, match="window_size left"):
            cute_flash.attention(q, k, v, causal=True, window_size=(np.int64(5), 0))
        for window in ((5, 0, 1), range(5, 7), iter((5, 0)), {5: 0, 0: 0}):
            with pytest.raises(ValueError, match="window_size"):
                cute_flash.attention(q, k, v, causal=True, window_size=window)
        # a device check in force that refuses these tensors is not answered from keys registered under another
        from cute_flash import validation

        with monkeypatch.context() as m:
            m.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda",))
            with pytest.raises(ValueError, match="CUDA GPUs only"):
                cute_flash.attention(q, k, v, causal=True, window_size=(5, 0))
    # gradients: the autograd function, never the C++ path
    qg = q.clone().requires_grad_()
    n = len(plans)
    cute_flash.attention(qg, k, v, causal=True, window_size=(5, 0))
    assert len(plans) == n + 1


def test_calls_python_serves_are_registered_as_its_own(lib, fake_gpu_with_recorder):
    """Layout copies and packed decoding are the Python path's: registered so (False), launched by Python."""
    rec, plans = fake_gpu_with_recorder
    q, k, v = _qkv()
    qt = torch.randn(2, 33, 4, 68, dtype=torch.bfloat16)[..., :64]  # rows of 136 bytes: the kernels get a copy
    with torch.no_grad():
        for _ in range(2):
            cute_flash.attention(qt, k, v)
    assert len(plans) == 2 and len(rec.calls) == 2
    assert _forward(lib, qt, k, v, False, None, None, None, False, 0.0)[0] is False
    vw = torch.randn(2, 40, 2, 32, dtype=torch.bfloat16)  # head_dim_v != head_dim: out is not shaped like q
    with torch.no_grad():
        for _ in range(2):
            assert cute_flash.attention(q, k, vw).shape == (2, 33, 4, 32)
    assert len(plans) == 4 and _forward(lib, q, k, vw, False, None, None, None, False, 0.0)[0] is False


def test_clearing_the_caches_clears_the_cpp_keys(lib, fake_gpu_with_recorder):
    from cute_flash import compile_cache

    q, k, v = _qkv()
    with torch.no_grad():
        cute_flash.attention(q, k, v)
    assert lib.size() == 1
    compile_cache.clear()
    assert lib.size() == 0


def test_without_a_compiler_the_python_path_serves_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_failed", False)
    monkeypatch.setattr(native, "cxx_compiler", lambda: None)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        assert native.library() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.library() is None  # warned once
    monkeypatch.setenv("CUTE_FLASH_NATIVE", "0")
    monkeypatch.setattr(native, "_failed", False)
    assert native.library() is None and "off (CUTE_FLASH_NATIVE='0')" in native.describe()
    # warnings as errors: the path still just falls back (a call whose kernel ran must not fail afterwards)
    monkeypatch.delenv("CUTE_FLASH_NATIVE")
    monkeypatch.setattr(native, "_failed", False)
    monkeypatch.setattr(native, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.library() is None


def test_a_missing_library_is_built_in_the_background(lib, monkeypatch, tmp_path):
    """The eager path asks with block=False: no call waits for the compiler; the library is there afterwards."""
    monkeypatch.setenv("CUTE_FLASH_CACHE_DIR", str(tmp_path))
    for name, value in (("_library", None), ("_path", None), ("_failed", False), ("_builder", None)):
        monkeypatch.setattr(native, name, value)
    assert native.library(block=False) is None
    native._builder.join(timeout=300)
    built = native.loaded()
    path = tmp_path / "native" / native._build_hash(native.cxx_compiler()) / "eager_forward.so"
    assert built is not None and native.loaded_path() == str(path)
    assert [p.name for p in path.parent.iterdir()] == ["eager_forward.so"]  # written atomically: no temporaries
    assert native.library(block=False) is built and built.size() == 0
    # a later process finds it on disk and loads it at once
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_builder", None)
    assert native.library(block=False) is not None and native._builder is None


def test_what_the_library_can_launch():
    fn = tvm_ffi.convert(lambda *a: None)

    class Wrapped:  # CuTe DSL's compiled kernel with keyword support hands its function over this way
        def __tvm_ffi_object__(self):
            return fn

    class PointerArgs(Wrapped):  # its Python call converts pointer arguments first: not launchable from C++
        class execution_args:
            has_pointer_address_arg_specs = True

    assert native.launchable(fn) is fn and native.launchable(Wrapped()) is fn
    assert native.launchable(PointerArgs()) is None and native.launchable(lambda *a: None) is None


def _reference_kernels(calls):
    """Stand-ins for the forward ("" variant), the split forward and the combine that compute with the float64
    reference on the tensors they are handed (views included), recording their shapes and strides: the split puts
    the whole result in split 0 and leaves the other splits empty (O 0, LSE -inf), which the combine must ignore."""
    from cute_flash.reference import attention_reference

    def forward(q, k, v, out, lse, scale, left, right):
        q, k, v, out, lse = (torch.from_dlpack(t) for t in (q, k, v, out, lse))
        calls.append(("fwd", tuple(q.shape), q.stride(), tuple(k.shape), out.stride()))
        o, l = attention_reference(q, k, v, softmax_scale=scale, return_lse=True)
        out.copy_(o)
        lse.copy_(l)

    def split(q, k, v, o_part, lse_part, scale, left, right):
        q, k, v, o_part, lse_part = (torch.from_dlpack(t) for t in (q, k, v, o_part, lse_part))
        calls.append(("split", tuple(q.shape), q.stride(), tuple(k.shape), tuple(o_part.shape)))
        o, l = attention_reference(q, k, v, softmax_scale=scale, return_lse=True)
        o_part.zero_()
        lse_part.fill_(float("-inf"))
        o_part[: q.shape[0]] = o
        lse_part[: q.shape[0]] = l

    def combine(o_part, lse_part, out, lse):
        o_part, lse_part, out, lse = (torch.from_dlpack(t) for t in (o_part, lse_part, out, lse))
        calls.append(("combine", tuple(out.shape), out.stride()))
        b = out.shape[0]
        parts = lse_part.view(-1, b, *lse_part.shape[1:])
        total = torch.logsumexp(parts, dim=0)
        weights = torch.exp(parts - total).transpose(-1, -2).unsqueeze(-1)  # (splits, b, rows, h, 1)
        out.copy_((weights * o_part.view(-1, b, *o_part.shape[1:])).sum(0))
        lse.copy_(total)

    fns = {"": forward, "split": split, "combine": combine}
    return {name: tvm_ffi.convert(fn) for name, fn in fns.items()}


@pytest.mark.parametrize(
    "shape,kw,launches",
    [
        ((2, 3, 4, 4, 1500), dict(), ["split", "combine"]),  # MHA, 3 rows: split, not packed
    ],
    ids=["mha_split"],
)
def test_decoding_calls_take_the_cpp_path(lib, monkeypatch, shape, kw, launches):
    """Packed GQA decoding and split-key calls are launched by the C++ path as the Python path launches them: the
    same views of q / out (and of the keys a window leaves), the same partials and combine, the same result."""
    from cute_flash import compile_cache
    from cute_flash.reference import attention_reference
    from profiling.host_overhead_cpu import fake_gpu

    calls = []
    kernels = _reference_kernels(calls)
    b, sq, h, hkv, sk = shape
    g = torch.Generator().manual_seed(sk)
    q = torch.randn(b, sq, h, 64, generator=g).to(torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
    k, v = (torch.randn(b, sk, hkv, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    with fake_gpu((9, 0)):
        variant = lambda key: "combine" if key[2] == "split_combine" else (key[5] if len(key) > 5 else "")  # noqa: E731
        compile_cache.get_or_compile = lambda key, build: kernels[variant(key)]
        monkeypatch.setattr(compile_cache, "sm_count", lambda device: 132)
        compile_cache.clear()  # (the kernel memos hold other tests' stand-ins)
        with torch.no_grad():
            python = cute_flash.attention(q, k, v, **kw)
            first = list(calls)
            plans = []
            real_plan = plan.dense
            monkeypatch.setattr(plan, "dense", lambda *a: plans.append(a) or real_plan(*a))
            cpp = cute_flash.attention(q, k, v, **kw)
    assert not plans, "the warm call did not take the C++ path"
    assert [c[0] for c in first] == launches and calls[len(first) :] == first  # same launches, same views
    assert torch.equal(python, cpp)
    want = attention_reference(q, k, v, **kw)
    torch.testing.assert_close(cpp.double(), want.double(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(700, None))], ids=["causal", "window"])
def test_gqa_decoding_runs_on_the_kvcache_forward_on_the_python_path(lib, monkeypatch, kw):
    """Decoding under GQA (one query token, several query heads per KV head) is the KV-cache forward's (each KV byte
    read once per group); the C++ path does not serve it, so the call is never registered there."""
    from cute_flash import compile_cache
    from profiling.host_overhead_cpu import fake_gpu

    kinds = []
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 8, 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 2000, 2, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    with fake_gpu((9, 0)):
        compile_cache.get_or_compile = lambda key, build: kinds.append(key[2]) or (lambda *a: None)
        monkeypatch.setattr(compile_cache, "sm_count", lambda device: 132)
        compile_cache.clear()
        with torch.no_grad():
            for _ in range(2):
                cute_flash.attention(q, k, v, **kw)
    assert "fwd_kvcache" in kinds and "fwd" not in kinds, kinds
    assert lib.size() == 0


def test_softcap_calls_take_the_cpp_path_with_the_feature_arguments_and_sinks_stay_python(lib, monkeypatch):
    """softcap is one more scalar of the key: a softcap build (the feature entry, common/entries.py) is launched with
    (softcap, sink=None) after the window bounds by either path. Calls with learnable sinks are the Python path's
    (never registered, never answered from a key)."""
    from cute_flash import compile_cache
    from profiling.host_overhead_cpu import fake_gpu

    calls = []

    def kernel(q, k, v, out, lse, scale, left, right, *features):
        calls.append((scale, left, right, features))
        torch.from_dlpack(out).fill_(1)

    fn = tvm_ffi.convert(kernel)
    q, k, v = _qkv()
    with fake_gpu((9, 0)):
        compile_cache.get_or_compile = lambda key, build: fn if key[2] == "fwd" else (lambda *a: None)
        plans = []
        real_plan = plan.dense
        monkeypatch.setattr(plan, "dense", lambda *a: plans.append(a) or real_plan(*a))
        with torch.no_grad():
            for _ in range(2):
                cute_flash.attention(q, k, v, causal=True, softcap=30.0)
            assert len(plans) == 1 and lib.size() == 1  # the second call: the C++ path
            assert calls[0] == calls[1] and calls[0][3] == (30.0, None)
            cute_flash.attention(q, k, v, causal=True, softcap=20.0)  # another cap: another key
            assert len(plans) == 2 and lib.size() == 2 and calls[2][3] == (20.0, None)
            sink = torch.zeros(4)
            for _ in range(2):
                cute_flash.attention(q, k, v, causal=True, softcap=30.0, learnable_sink=sink)
            assert len(plans) == 4 and lib.size() == 2

"""Every bad input is rejected by the one validation place, with a message naming the argument.

These run without a GPU: tensors on the "meta" device stand in for CUDA tensors (the device check is widened for
the test), and the backend lookup is pointed at a family explicitly.
"""

import pytest
import torch

import cute_flash
from cute_flash import validation
from cute_flash.arch import arch_for_capability, resolve_arch
from cute_flash.core import device


@pytest.fixture
def meta_is_gpu(monkeypatch):
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "meta"))


@pytest.fixture
def on_sm80(monkeypatch, meta_is_gpu):
    # An Ampere GPU as far as routing can tell (meta tensors stand in for its tensors).
    monkeypatch.delenv("CUTE_FLASH_ARCH", raising=False)
    monkeypatch.setattr(device, "capability", lambda t: (8, 0))


def qkv(b=2, sq=16, sk=16, h=4, hkv=4, d=64, dv=None, dtype=torch.bfloat16, device="meta"):
    dv = d if dv is None else dv
    return (
        torch.empty(b, sq, h, d, dtype=dtype, device=device),
        torch.empty(b, sk, hkv, d, dtype=dtype, device=device),
        torch.empty(b, sk, hkv, dv, dtype=dtype, device=device),
    )


def test_cpu_tensors_point_at_the_reference():
    q, k, v = qkv(device="cpu")
    with pytest.raises(ValueError, match=r"q is on cpu.*cute_flash\.reference"):
        cute_flash.attention(q, k, v)


def test_mismatched_devices(monkeypatch):
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("meta", "cpu"))
    q, _, v = qkv()
    _, k, _ = qkv(device="cpu")
    with pytest.raises(ValueError, match="k is on cpu but q is on meta"):
        cute_flash.attention(q, k, v)


def test_mismatched_dtypes(meta_is_gpu):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="v has dtype torch.float16 but q has torch.bfloat16"):
        cute_flash.attention(q, k, v.to(torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8])
def test_unsupported_dtype(meta_is_gpu, dtype):
    q, k, v = qkv(dtype=dtype)
    with pytest.raises(TypeError, match="expected torch.float16 or torch.bfloat16"):
        cute_flash.attention(q, k, v)


@pytest.mark.parametrize("d", [4, 12, 264, 512])
def test_unsupported_head_dim(meta_is_gpu, d):
    q, k, v = qkv(d=d)
    with pytest.raises(NotImplementedError, match=f"head_dim of q/k is {d}"):
        cute_flash.attention(q, k, v)


def test_unsupported_head_dim_v(meta_is_gpu):
    q, k, v = qkv(dv=100)
    with pytest.raises(NotImplementedError, match="head_dim of v is 100"):
        cute_flash.attention(q, k, v)


def test_wrong_rank(meta_is_gpu):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q must have 4 dimensions.*\(2, 16, 256\)"):
        cute_flash.attention(q.flatten(2), k, v)


@pytest.mark.parametrize(
    "which, make, pattern",
    [
        (
            "batch",
            lambda: qkv()[:2] + (torch.empty(3, 16, 4, 64, dtype=torch.bfloat16, device="meta"),),
            "batch sizes differ",
        ),
        (
            "seqlen",
            lambda: qkv()[:2] + (torch.empty(2, 15, 4, 64, dtype=torch.bfloat16, device="meta"),),
            "same seqlen",
        ),
        (
            "heads",
            lambda: qkv()[:2] + (torch.empty(2, 16, 2, 64, dtype=torch.bfloat16, device="meta"),),
            "same number of heads",
        ),
        (
            "qk_dim",
            lambda: (qkv()[0], torch.empty(2, 16, 4, 32, dtype=torch.bfloat16, device="meta"), qkv()[2]),
            "k head_dim 32 must equal q head_dim 64",
        ),
    ],
)
def test_wrong_shapes(meta_is_gpu, which, make, pattern):
    with pytest.raises(ValueError, match=pattern):
        cute_flash.attention(*make())


def test_nheads_not_divisible(meta_is_gpu):
    q, k, v = qkv(h=6, hkv=4)
    with pytest.raises(ValueError, match=r"nheads of q \(6\) must be a multiple of nheads of k/v \(4\)"):
        cute_flash.attention(q, k, v)


def test_last_dim_not_contiguous(meta_is_gpu):
    q, k, v = qkv()
    q_t = torch.empty(2, 16, 64, 4, dtype=torch.bfloat16, device="meta").transpose(2, 3)
    with pytest.raises(ValueError, match="q must be contiguous in its last dimension"):
        cute_flash.attention(q_t, k, v)


@pytest.mark.parametrize("window", [(1.5, None), (True, 0), "wide", (1, 2, 3)])
def test_bad_window(meta_is_gpu, window):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="window_size"):
        cute_flash.attention(q, k, v, window_size=window)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "0.1"])
def test_bad_softmax_scale(meta_is_gpu, scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="softmax_scale"):
        cute_flash.attention(q, k, v, softmax_scale=scale)


def test_negative_softmax_scale_is_malformed_input(meta_is_gpu):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="softmax_scale must be >= 0"):
        cute_flash.attention(q, k, v, softmax_scale=-0.1)
    with pytest.raises(ValueError, match="softmax_scale must be >= 0"):
        cute_flash.explain(q, k, v, softmax_scale=-0.1, capability=(9, 0))


def test_fp8_rotate_off_without_fp8_quantisation_is_rejected(meta_is_gpu):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="fp8_rotate=False applies only"):
        cute_flash.attention(q, k, v, fp8_rotate=False)


def test_bad_compute_dtype(meta_is_gpu):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="dtype must be None"):
        cute_flash.attention(q, k, v, dtype="int4")


def test_fp8_on_sm80_is_not_implemented(on_sm80):
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match="sm80"):
        cute_flash.attention(q, k, v, dtype="fp8")


def test_non_contiguous_inputs_with_unit_last_stride_pass_validation(meta_is_gpu):
    # (b, h, s, d) storage viewed as (b, s, h, d): unit last stride, other strides permuted.
    q = torch.empty(2, 4, 16, 64, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    k = torch.empty(2, 4, 16, 64, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    v = torch.empty(2, 4, 16, 64, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    problem = validation.validate(q, k, v, causal=True, softmax_scale=None, window_size=(None, None), dtype=None)
    assert problem.spec.mask == "causal" and problem.seqlen_q == 16 and problem.nheads == 4


def test_spec_ignores_sequence_lengths(meta_is_gpu):
    """The compile-cache key (AttentionSpec) must not change with seqlen, batch or heads."""
    specs = {
        validation.validate(
            *qkv(b=b, sq=sq, sk=sk, h=h, hkv=h), causal=False, softmax_scale=None, window_size=(None, None), dtype=None
        ).spec
        for b, sq, sk, h in [(1, 1, 1, 1), (2, 113, 203, 4), (3, 4096, 17, 8)]
    }
    assert len(specs) == 1


def test_window_sizes_share_one_spec(meta_is_gpu):
    specs = {
        validation.validate(*qkv(), causal=False, softmax_scale=None, window_size=w, dtype=None).spec
        for w in [(64, 0), (3, 9), (None, 1)]
    }
    assert len(specs) == 1


def test_unknown_capability_lists_families():
    with pytest.raises(NotImplementedError, match=r"sm80 .*sm90 .*sm100"):
        arch_for_capability((7, 5))


def test_arch_override(monkeypatch):
    monkeypatch.setenv("CUTE_FLASH_ARCH", "sm80")
    assert resolve_arch((9, 0)) == "sm80"
    monkeypatch.setenv("CUTE_FLASH_ARCH", "sm70")
    with pytest.raises(ValueError, match="CUTE_FLASH_ARCH"):
        resolve_arch((9, 0))


@pytest.mark.parametrize("cap, family", [((8, 0), "sm80"), ((8, 9), "sm80"), ((9, 0), "sm90"), ((10, 0), "sm100")])
def test_capability_dispatch(monkeypatch, cap, family):
    monkeypatch.delenv("CUTE_FLASH_ARCH", raising=False)
    assert resolve_arch(cap) == family


def test_huge_window_bounds_mean_unbounded():
    """A bound near 2^31 would wrap in the kernels' Int32 arithmetic and hide every key: it is clamped, as any bound
    >= max(seqlen_q, seqlen_k) means the same."""
    from cute_flash.spec import UNBOUNDED_WINDOW, normalize_mask

    m = normalize_mask(False, (2**31 - 1, 2**40))
    assert (m.kind, m.left, m.right) == ("local", UNBOUNDED_WINDOW, UNBOUNDED_WINDOW)
    assert normalize_mask(True, (2**33, None)).left == UNBOUNDED_WINDOW


def test_launch_limits_are_checked_before_anything_runs():
    from cute_flash.validation import validate

    meta = dict(dtype=torch.bfloat16, device="meta")
    q = torch.empty(70000, 4, 2, 64, **meta)
    with pytest.raises(NotImplementedError, match="grid"):
        validate(q, q, q, causal=False, softmax_scale=None, window_size=(None, None), dtype=None, any_device=True)
    q = torch.empty(1, 2**24, 1, 256, **meta)
    with pytest.raises(NotImplementedError, match="Int32"):
        validate(q, q, q, causal=False, softmax_scale=None, window_size=(None, None), dtype=None, any_device=True)


def test_deterministic_is_a_bool_and_not_for_fp8():
    from cute_flash.validation import validate

    q = torch.empty(1, 16, 2, 64, dtype=torch.bfloat16, device="meta")
    kw = dict(causal=False, softmax_scale=None, window_size=(None, None), any_device=True)
    with pytest.raises(TypeError, match="deterministic"):
        validate(q, q, q, dtype=None, deterministic=1, **kw)
    with pytest.raises(ValueError, match="FP8"):
        validate(q, q, q, dtype="fp8", deterministic=True, **kw)


# --- soft-capping and learnable sinks: checked by the one validation, on every entry point -----------------------
def _entry_points(q, k, v):
    """Every public entry point, called with extra keywords: dense, packed, and their explain."""
    seqs = (torch.zeros(3, dtype=torch.int32, device="meta"),) * 2 + (8, 8)
    qp, kp, vp = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    return [
        lambda **kw: cute_flash.attention(q, k, v, **kw),
        lambda **kw: cute_flash.explain(q, k, v, capability="sm90", **kw),
        lambda **kw: cute_flash.attention_varlen(qp, kp, vp, *seqs, **kw),
        lambda **kw: cute_flash.explain_varlen(qp, kp, vp, *seqs, capability="9.0", **kw),
    ]


@pytest.mark.parametrize(
    "kw,error,match",
    [
        (dict(softcap=-1.0), ValueError, "softcap must be >= 0"),
        (dict(softcap=float("inf")), ValueError, "softcap must be a finite float"),
        (dict(softcap=True), ValueError, "softcap must be a finite float"),
        (dict(softcap="30"), ValueError, "softcap must be a finite float"),
        (dict(learnable_sink=[0.0] * 4), TypeError, "learnable_sink must be a torch.Tensor"),
        (dict(learnable_sink=torch.zeros(3, device="meta")), ValueError, r"learnable_sink must have shape \(nheads,\)"),
        (dict(learnable_sink=torch.zeros(4, 1, device="meta")), ValueError, "learnable_sink must have shape"),
        (dict(learnable_sink=torch.zeros(4, dtype=torch.float64, device="meta")), TypeError, "has dtype"),
        (dict(learnable_sink=torch.zeros(4)), ValueError, "learnable_sink is on cpu but q is on meta"),
    ],
)
def test_softcap_and_sinks_are_validated_on_every_entry_point(meta_is_gpu, monkeypatch, kw, error, match):
    monkeypatch.setattr(device, "capability", lambda t: (9, 0))
    for entry in _entry_points(*qkv(b=2, sq=4, sk=4)):
        with pytest.raises(error, match=match):
            entry(**kw)


def test_softcap_and_sinks_reach_the_spec_and_the_problem(meta_is_gpu):
    q, k, v = qkv()
    kw = dict(causal=False, softmax_scale=None, window_size=(None, None), dtype=None)
    plain = validation.validate(q, k, v, **kw)
    assert (plain.spec.softcap, plain.spec.sink, plain.softcap) == (False, False, 0.0)
    p = validation.validate(q, k, v, softcap=30, learnable_sink=torch.zeros(4, device="meta"), **kw)
    assert (p.spec.softcap, p.spec.sink, p.softcap) == (True, True, 30.0) and isinstance(p.softcap, float)
    # softcap 0 is off: the plain build
    assert validation.validate(q, k, v, softcap=0, **kw).spec == plain.spec
    # a sink of any accepted dtype is one build (the kernels read it as fp32)
    specs = {
        validation.validate(q, k, v, learnable_sink=torch.zeros(4, dtype=dt, device="meta"), **kw).spec
        for dt in validation.SINK_DTYPES
    }
    assert len(specs) == 1


def test_the_fp8_path_refuses_softcap_and_sinks(meta_is_gpu):
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match="FP8 path .* has no soft-capping"):
        cute_flash.explain(q, k, v, dtype="fp8", softcap=10.0, capability=(9, 0))
    with pytest.raises(NotImplementedError, match="FP8 path .* has no learnable sinks"):
        cute_flash.attention(q, k, v, dtype="fp8", learnable_sink=torch.zeros(4, device="meta"))


def test_negative_window_bounds_are_accepted(meta_is_gpu):
    q, k, v = qkv()
    p = validation.validate(q, k, v, causal=False, softmax_scale=None, window_size=(-2, 5), dtype=None)
    assert (p.mask.kind, p.mask.left, p.mask.right) == ("local", -2, 5)


def test_scalars_past_their_ranges_and_a_non_bool_return_lse_are_refused(on_sm80):
    """An int past the float range (whose float() would overflow) as softmax_scale or softcap, and a positive softcap
    below float32's normal range (the kernels divide by it in float32) are refused by name; so is a return_lse that
    is not a bool. (A huge float scale is a hard max, served: test_reference.py.)"""
    q, k, v = qkv()
    for kw, match in (
        (dict(softmax_scale=10**400), "softmax_scale"),
        (dict(softcap=10**400), "softcap"),
        (dict(softcap=1e-300), "below float32's range"),
    ):
        with pytest.raises(ValueError, match=match):
            cute_flash.attention(q, k, v, **kw)
    for bad in ("no", None, 1):
        with pytest.raises(TypeError, match="return_lse must be a bool"):
            cute_flash.attention(q, k, v, return_lse=bad)


def test_packed_rows_that_no_sequence_bound_covers_are_refused(on_sm80):
    """cu_seqlens end at the packed totals, so more rows than batch x max_seqlen means a sequence longer than its
    bound (rows never written, keys never read): refused without reading the lengths."""
    q, k, v = (torch.empty(100, 4, 64, dtype=torch.bfloat16, device="meta") for _ in range(3))
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    for max_q, max_k, name in ((10, 50, "q"), (60, 20, "k"), (0, 50, "q")):
        with pytest.raises(ValueError, match=f"{name} has 100 rows but 2 sequences"):
            cute_flash.attention_varlen(q, k, v, cu, cu, max_q, max_k)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        cute_flash.attention_varlen(q, k, v, cu, cu, 50, 50, return_lse="yes")

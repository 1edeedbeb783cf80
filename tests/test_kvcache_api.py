"""attention_with_kvcache's host side on the CPU: validation (every malformed call raises before any launch), the
plan cache, the split choice, and what reaches the backend (meta tensors, a recording backend)."""

import pytest
import torch

import cute_flash
from cute_flash import kvcache, validation
from cute_flash.core import device


class _Recorder:
    name = "fake"
    kvcache = True

    def __init__(self):
        self.calls = []

    def kvcache_splits(self, problem, sm_count):
        return 3

    def forward_kvcache(self, t, problem, num_splits):
        self.calls.append((t, problem, num_splits))

    def kvcache_launcher(self, problem, device, num_splits):
        return lambda t: self.forward_kvcache(t, problem, num_splits)


@pytest.fixture
def backend(monkeypatch):
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "meta"))
    rec = _Recorder()
    monkeypatch.setattr(device, "route", lambda spec, t, backward=False, deterministic=False: rec)
    kvcache._plans.clear()
    yield rec
    kvcache._plans.clear()


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def _paged(b=2, sq=1, h=8, hkv=2, d=64, pages=10, page=16, max_pages=4, dtype=torch.bfloat16):
    q = _meta(b, sq, h, d, dtype=dtype)
    cache_dtype = dtype
    k = _meta(pages, page, hkv, d, dtype=cache_dtype)
    v = _meta(pages, page, hkv, d, dtype=cache_dtype)
    kw = dict(cache_seqlens=_meta(b, dtype=torch.int32), page_table=_meta(b, max_pages, dtype=torch.int32))
    return q, k, v, kw


def test_a_paged_decoding_call_reaches_the_backend_with_its_problem(backend):
    q, k, v, kw = _paged()
    out = cute_flash.attention_with_kvcache(q, k, v, **kw)
    assert out.shape == (2, 1, 8, 64)
    ((t, p, splits),) = backend.calls
    assert splits == 3 and p.spec.kvcache and p.spec.page_size == 16 and p.max_seqlen_k == 64
    assert p.spec.mask == "causal" and not p.spec.kv_fp8 and t.seqlens_k is kw["cache_seqlens"]
    cute_flash.attention_with_kvcache(q, k, v, **kw, num_splits=5)
    assert backend.calls[-1][2] == 5
    cute_flash.attention_with_kvcache(q, k, v, **kw, softmax_scale=1e30)  # a hard max may follow: unsplit
    assert backend.calls[-1][2] == 1


def test_a_dense_cache_is_one_page_per_sequence(backend):
    q = _meta(3, 2, 4, 128)
    k, v = _meta(3, 300, 4, 128), _meta(3, 300, 4, 128)
    cute_flash.attention_with_kvcache(q, k, v, cache_seqlens=_meta(3, dtype=torch.int32))
    p = backend.calls[-1][1]
    assert p.spec.page_size == 0 and p.max_seqlen_k == 300 and p.num_pages == 3 and p.seqlen_q == 2


def test_packed_queries_and_an_fp8_cache(backend):
    q = _meta(7, 8, 64)
    k = _meta(10, 16, 2, 64, dtype=torch.float8_e4m3fn)
    v = _meta(10, 16, 2, 64, dtype=torch.float8_e4m3fn)
    desc = dict(k_descale=_meta(3, 2, dtype=torch.float32), v_descale=_meta(3, 2, dtype=torch.float32))
    cute_flash.attention_with_kvcache(
        q, k, v, cache_seqlens=_meta(3, dtype=torch.int32), page_table=_meta(3, 5, dtype=torch.int32),
        cu_seqlens_q=_meta(4, dtype=torch.int32), max_seqlen_q=4, **desc,
    )  # fmt: skip
    p = backend.calls[-1][1]
    assert p.packed_q and p.total_q == 7 and p.seqlen_q == 4 and p.spec.kv_fp8


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(cache_seqlens=_meta(2, dtype=torch.int64)), ValueError, "cache_seqlens must be an int32"),
        (dict(page_table=_meta(3, 4, dtype=torch.int32)), ValueError, "page_table must be an int32"),
        (dict(k_new=_meta(2, 1, 2, 64)), ValueError, "k_new and v_new go together"),
        (dict(k_new=_meta(2, 1, 3, 64), v_new=_meta(2, 1, 3, 64)), ValueError, "k_new must have shape"),
        (dict(k_descale=_meta(2, 2, dtype=torch.float32)), ValueError, "belong to a float8_e4m3fn cache"),
        (dict(softcap=-1.0), ValueError, "softcap must be >= 0"),
        (dict(softmax_scale=-0.5), ValueError, "softmax_scale"),
        (dict(window_size=(1.5, None)), ValueError, "window_size"),
        (dict(num_splits=-1), ValueError, "num_splits"),
        (dict(num_splits=129), ValueError, r"num_splits must be an int in \[0, 128\]"),
        (dict(num_splits=2, softmax_scale=1e30), ValueError, "the split combine cannot weigh"),
        (dict(out=_meta(2, 1, 8, 32)), ValueError, "out must be"),
        (dict(max_seqlen_q=3), ValueError, "max_seqlen_q belongs to packed"),
        (dict(learnable_sink=_meta(7, dtype=torch.float32)), ValueError, "learnable_sink must have shape"),
        (dict(causal=1), TypeError, "causal must be a bool"),
        (dict(k_new=_meta(2, 65, 2, 64), v_new=_meta(2, 65, 2, 64)), ValueError, "more than the cache holds"),
        (dict(cache_seqlens=_meta(4, dtype=torch.int32)[::2]), ValueError, "contiguous in its last dimension"),
        (dict(window_size=None), ValueError, "window_size must be a pair"),
        (dict(window_size=5), ValueError, "window_size must be a pair"),
        (dict(return_lse="no"), TypeError, "return_lse must be a bool"),
    ],
)
def test_malformed_calls_raise_before_any_launch(backend, change, error, match):
    q, k, v, kw = _paged()
    kw.update(change)
    with pytest.raises(error, match=match):
        cute_flash.attention_with_kvcache(q, k, v, **kw)
    assert backend.calls == []


def test_cache_layouts_the_kernels_cannot_use_in_place_are_refused(backend):
    q, k, v, kw = _paged()
    k_strided = _meta(10, 16, 2, 128)[..., :60]  # rows not in 16-byte units
    with pytest.raises(ValueError, match="k_cache"):
        cute_flash.attention_with_kvcache(q, k_strided, v, **kw)
    fp8 = _meta(10, 16, 2, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="an fp8 cache needs k_descale"):
        cute_flash.attention_with_kvcache(q, fp8, fp8, **kw)
    with pytest.raises(TypeError, match="must share one dtype"):
        cute_flash.attention_with_kvcache(q, k, fp8, **kw)


def test_a_0d_cu_seqlens_q_is_refused_by_name(backend):
    _, k, v, kw = _paged()
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be an int32 tensor of shape \(batch \+ 1,\)"):
        cute_flash.attention_with_kvcache(_meta(5, 8, 64), k, v, **kw, cu_seqlens_q=_meta(dtype=torch.int32),
                                          max_seqlen_q=3)  # fmt: skip


def test_fp8_cache_head_dims_must_fill_16_byte_rows(backend):
    q, _, _, kw = _paged(d=8)
    k8 = _meta(10, 16, 2, 8, dtype=torch.float8_e4m3fn)
    desc = dict(k_descale=_meta(2, 2, dtype=torch.float32), v_descale=_meta(2, 2, dtype=torch.float32))
    with pytest.raises(NotImplementedError, match="multiples of 16"):
        cute_flash.attention_with_kvcache(q, k8, k8, **kw, **desc)


def test_gradients_are_refused(backend):
    q, k, v, kw = _paged()
    with pytest.raises(NotImplementedError, match="forward-only"):
        cute_flash.attention_with_kvcache(q, k, v, **kw, out=_meta(2, 1, 8, 64).requires_grad_())
    with pytest.raises(NotImplementedError, match="forward-only"):
        cute_flash.attention_with_kvcache(q.requires_grad_(), k, v, **kw)
    with torch.no_grad():
        cute_flash.attention_with_kvcache(q, k, v, **kw)


def test_a_warm_call_reuses_its_plan_and_a_rejected_argument_is_never_cached(backend):
    q, k, v, kw = _paged()
    cute_flash.attention_with_kvcache(q, k, v, **kw)
    cute_flash.attention_with_kvcache(q, k, v, **kw)
    assert len(kvcache._plans) == 1
    with pytest.raises(TypeError, match="causal"):
        cute_flash.attention_with_kvcache(q, k, v, **kw, causal=1)
    assert len(kvcache._plans) == 1


def test_packed_rows_beyond_max_seqlen_q_and_an_out_over_the_cache_are_refused(backend, monkeypatch):
    q = _meta(9, 8, 64)
    k, v = _meta(10, 16, 2, 64), _meta(10, 16, 2, 64)
    kw = dict(cache_seqlens=_meta(2, dtype=torch.int32), page_table=_meta(2, 5, dtype=torch.int32),
              cu_seqlens_q=_meta(3, dtype=torch.int32))  # fmt: skip
    with pytest.raises(ValueError, match="at most max_seqlen_q=4"):  # 9 rows cannot be 2 sequences of <= 4
        cute_flash.attention_with_kvcache(q, k, v, **kw, max_seqlen_q=4)
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    q = torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16)
    k, v = (torch.zeros(10, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    kw = dict(cache_seqlens=torch.zeros(2, dtype=torch.int32), page_table=torch.zeros(2, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="share memory"):  # (heads 8 elements apart, 64 wide)
        cute_flash.attention_with_kvcache(q, k, v, **kw, out=torch.zeros(600, dtype=q.dtype).as_strided(
            (2, 1, 8, 64), (256, 256, 8, 1)))  # fmt: skip
    with pytest.raises(ValueError, match="out overlaps v_cache"):
        cute_flash.attention_with_kvcache(q, k, v, **kw, out=v[0, :8].reshape(2, 1, 8, 64))
    assert backend.calls == []
    cute_flash.attention_with_kvcache(q, k, v, **kw, out=torch.empty_like(q))  # (a warm plan of this signature)
    with pytest.raises(ValueError, match="out overlaps q"):  # checked on every call: addresses are in no plan key
        cute_flash.attention_with_kvcache(q, k, v, **kw, out=q)


def _cpu_call(monkeypatch):
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    q = torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16)
    k, v = (torch.zeros(10, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    kw = dict(cache_seqlens=torch.zeros(2, dtype=torch.int32), page_table=torch.zeros(2, 4, dtype=torch.int32))
    return q, k, v, kw


def test_a_q_the_kernels_cannot_read_in_place_is_copied_into_their_layout(backend, monkeypatch):
    """q is only read: a misaligned base or a broadcast head is copied (as `attention` does), the caches never."""
    q, k, v, kw = _cpu_call(monkeypatch)
    misaligned = torch.zeros(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    broadcast = torch.zeros(2, 1, 1, 64, dtype=q.dtype).expand(2, 1, 8, 64)
    for x in (misaligned, broadcast):
        cute_flash.attention_with_kvcache(x, k, v, **kw)
        t = backend.calls[-1][0]
        assert t.q is not x and t.q.data_ptr() % 16 == 0 and t.q.stride() == (512, 512, 64, 1) and torch.equal(t.q, x)
    cute_flash.attention_with_kvcache(q, k, v, **kw)
    assert backend.calls[-1][0].q is q  # (already in the kernels' layout: no copy)


def test_appending_into_one_tensor_passed_as_both_caches_is_refused(backend, monkeypatch):
    """With k_new / v_new the append writes both caches: one tensor passed twice (or views sharing elements) is
    refused on every call, cold or warm; a combined cache's disjoint K / V halves (FlashInfer's (pages, 2, ...)
    layout) are not."""
    q, k, v, kw = _cpu_call(monkeypatch)
    appended = []

    def append_kernel(args, p, dev):
        return None if args.k_new is None else lambda *a: appended.append(a)

    monkeypatch.setattr(kvcache, "_append_kernel", append_kernel)
    new = dict(k_new=torch.zeros(2, 1, 2, 64, dtype=q.dtype), v_new=torch.zeros(2, 1, 2, 64, dtype=q.dtype))
    kv = torch.zeros(10, 2, 16, 2, 64, dtype=q.dtype)
    cute_flash.attention_with_kvcache(q, kv[:, 0], kv[:, 1], **kw, **new)
    cute_flash.attention_with_kvcache(q, k, v, **kw, **new)  # (warm: the same signature as the next call)
    assert len(appended) == 2
    for kc, vc in ((k, k), (kv[:, 0], kv.view(10, 32, 2, 64)[:, :16])):
        with pytest.raises(ValueError, match="share elements"):
            cute_flash.attention_with_kvcache(q, kc, vc, **kw, **new)
    cute_flash.attention_with_kvcache(q, k, k, **kw)  # (nothing appended: reading one tensor twice is fine)
    assert len(appended) == 2


def test_out_may_not_overlap_any_tensor_the_kernels_read(backend, monkeypatch):
    q, k, v, kw = _cpu_call(monkeypatch)
    out = torch.zeros_like(q)
    lens = out.view(torch.int32).view(-1)[:2]
    with pytest.raises(ValueError, match="out overlaps cache_seqlens"):
        cute_flash.attention_with_kvcache(q, k, v, cache_seqlens=lens, page_table=kw["page_table"], out=out)
    table = out.view(torch.int32).view(-1)[8:16].view(2, 4)
    with pytest.raises(ValueError, match="out overlaps page_table"):
        cute_flash.attention_with_kvcache(q, k, v, cache_seqlens=kw["cache_seqlens"], page_table=table, out=out)
    assert backend.calls == []


def test_no_sequence_launches_nothing_even_with_new_tokens(backend, monkeypatch):
    q, k, v, kw = _cpu_call(monkeypatch)
    appended = []
    monkeypatch.setattr(kvcache, "_append_kernel", lambda args, p, dev: lambda *a: appended.append(a))
    empty = dict(cache_seqlens=torch.zeros(0, dtype=torch.int32), page_table=torch.zeros(0, 4, dtype=torch.int32))
    new = dict(k_new=torch.zeros(0, 1, 2, 64, dtype=q.dtype), v_new=torch.zeros(0, 1, 2, 64, dtype=q.dtype))
    out = cute_flash.attention_with_kvcache(q[:0], k, v, **empty, **new)
    assert out.shape == (0, 1, 8, 64) and appended == [] and backend.calls == []

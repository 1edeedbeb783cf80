"""The eager host path's plan cache (core/plan.py): a warm call skips validation and routing, but never accepts
what a cold call rejects, and sees a changed CUTE_FLASH_ARCH."""

import pytest
import torch

import cute_flash
from cute_flash import validation
from cute_flash.core import device, plan


@pytest.fixture(autouse=True)
def meta_is_gpu(monkeypatch):
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "meta"))
    monkeypatch.setattr(device, "capability", lambda t: (9, 0))


def _qkv():
    return tuple(torch.empty(1, 16, 2, 64, device="meta", dtype=torch.bfloat16) for _ in range(3))


def _plan(q, k, v, causal, softmax_scale, window_size, deterministic, softcap=0.0, sink=None):
    return plan.dense(q, k, v, (causal, softmax_scale, *window_size, deterministic, softcap), window_size, (sink,))


def test_a_cached_signature_never_accepts_a_rejected_argument():
    q, k, v = _qkv()
    a = _plan(q, k, v, True, 0.5, (3, None), False)
    assert _plan(q, k, v, True, 0.5, (3, None), False) is a  # one lookup when warm
    with pytest.raises(TypeError, match="causal must be a bool"):
        _plan(q, k, v, 1, 0.5, (3, None), False)  # 1 == True, but it is not a bool
    with pytest.raises(ValueError, match="window_size left"):
        _plan(q, k, v, True, 0.5, (True, None), False)
    with pytest.raises(ValueError, match="softcap"):
        _plan(q, k, v, True, 0.5, (3, None), False, softcap=True)  # True == 1.0, but not a cap
    with pytest.raises(ValueError, match="window_size"):
        cute_flash.attention(q, k, v, window_size=[3])  # not a pair, validated the slow way


def test_the_sink_is_keyed_by_its_metadata():
    q, k, v = _qkv()
    sink = torch.zeros(2, device="meta")
    a = _plan(q, k, v, True, None, (None, None), False, sink=sink)
    other = torch.ones(2, device="meta")  # other values, the same metadata: the same plan
    assert a.problem.spec.sink and _plan(q, k, v, True, None, (None, None), False, sink=other) is a
    assert not _plan(q, k, v, True, None, (None, None), False).problem.spec.sink
    with pytest.raises(TypeError, match="learnable_sink has dtype"):
        _plan(q, k, v, True, None, (None, None), False, sink=sink.double())
    with pytest.raises(ValueError, match="learnable_sink must have shape"):
        _plan(q, k, v, True, None, (None, None), False, sink=torch.zeros(3, device="meta"))
    with pytest.raises(TypeError, match="learnable_sink must be a torch.Tensor"):
        _plan(q, k, v, True, None, (None, None), False, sink=[0.0, 0.0])  # no metadata: validated the slow way


def test_cute_flash_arch_is_part_of_the_signature(monkeypatch):
    q, k, v = _qkv()
    assert _plan(q, k, v, True, None, (None, None), False).forward.name == "sm90"
    monkeypatch.setenv("CUTE_FLASH_ARCH", "sm80")
    assert _plan(q, k, v, True, None, (None, None), False).forward.name == "sm80"


def test_a_plans_backward_is_routed_as_cute_flash_arch_was_when_it_was_planned(monkeypatch):
    """The variable is part of the plan's key: a backward routed after it changed still takes the forced family
    (and a plan made without it the natural one), whenever the first backward runs."""
    q, k, v = _qkv()
    monkeypatch.setenv("CUTE_FLASH_ARCH", "sm80")
    forced = _plan(q, k, v, True, None, (None, None), False)
    monkeypatch.delenv("CUTE_FLASH_ARCH")
    natural = _plan(q, k, v, True, None, (None, None), False)
    assert forced.backward_backend(q).name == "sm80"
    monkeypatch.setenv("CUTE_FLASH_ARCH", "sm80")
    assert natural.backward_backend(q).name == "sm90"


def test_device_check_is_part_of_the_signature(monkeypatch):
    q, k, v = _qkv()
    _plan(q, k, v, False, None, (None, None), False)
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda",))
    with pytest.raises(ValueError, match="CUDA GPUs only"):
        _plan(q, k, v, False, None, (None, None), False)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_sm80_bound_launchers_launch_each_kernel_once_per_call(heads):
    """The sm80 family's bound launchers (an Ampere GPU, no-op kernels on CPU tensors: profiling/host_overhead_cpu):
    a cold and a warm call launch the same kernels in the same order with the same buffer shapes and scalars."""
    from cute_flash import compile_cache
    from profiling.host_overhead_cpu import fake_gpu

    import cute_flash

    def recorder(key, build):
        return lambda *args: calls.append((key[2], [tuple(a.shape) if hasattr(a, "shape") else a for a in args]))

    h, h_kv = heads
    q = torch.randn(2, 77, h, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 77, h_kv, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    runs = []
    with fake_gpu((8, 0)):
        compile_cache.get_or_compile = recorder  # (fake_gpu restores the real one)
        assert cute_flash.explain(q, k, v, causal=True).forward_family == "sm80"
        for _ in range(2):
            calls = []
            out = cute_flash.attention(q, k, v, causal=True, softmax_scale=0.25)
            out.backward(torch.ones_like(out))
            runs.append(calls)
    cold, warm = runs
    assert cold == warm
    from cute_flash.arch.sm80.tile_config import bwd_tile_config

    gqa = h != h_kv
    fragment = bwd_tile_config(64, "sm_90a").dq_layout == "fragment"  # (fake_gpu's runtime target)
    assert [role for role, _ in warm] == [
        "fwd", "bwd_preprocess", "bwd_gqa" if gqa else "bwd", "bwd_dq_postprocess" if fragment else "bwd_postprocess"
    ] + ["bwd_postprocess"] * (2 if gqa else 0)  # fmt: skip
    fwd_args, main_args = warm[0][1], warm[2][1]
    assert fwd_args[-3] == main_args[-3] == 0.25 and fwd_args[-1] == main_args[-1] == 0  # scale; causal: right 0
    assert fwd_args[-2] == main_args[-2]  # the same (unbounded) left edge


def test_a_cached_packed_signature_never_accepts_a_rejected_argument(monkeypatch):
    """attention_varlen's plans (core/plan.packed), keyed like the dense ones plus the packed-sequence arguments."""
    import numpy as np

    from cute_flash.validation import PackedSeqs

    def packed(q, k, v, seqs, causal, softmax_scale, window_size, deterministic):
        scalars = (causal, softmax_scale, *window_size, deterministic, 0.0)
        return plan.packed(q, k, v, scalars, window_size, (None,), seqs)

    q = torch.empty(2, 2, 64, device="meta", dtype=torch.bfloat16)  # (2 rows: a bound of 1 row per sequence holds)
    k, v = (torch.empty(40, 2, 64, device="meta", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.empty(3, device="meta", dtype=torch.int32)
    seqs = PackedSeqs(cu, cu, None, 30, 30)
    a = packed(q, k, v, seqs, True, None, (None, None), False)
    assert packed(q, k, v, seqs, True, None, (None, None), False) is a and not a.copy_seqs
    packed(q, k, v, seqs._replace(max_seqlen_q=1), True, None, (None, None), False)  # cached with 1
    rejected = [
        (seqs._replace(max_seqlen_q=True), "max_seqlen_q"),  # True == 1, but not a host int
        (seqs._replace(max_seqlen_k=np.int64(30)), "max_seqlen_k"),  # 30, but a numpy scalar
        (seqs._replace(cu_seqlens_q=cu.long()), "cu_seqlens_q"),
        (seqs._replace(cu_seqlens_k=torch.empty(4, device="meta", dtype=torch.int32)), "cu_seqlens_k"),
        (seqs._replace(seqused_k=torch.empty(2, device="meta", dtype=torch.int64)), "seqused_k"),
    ]
    for other, match in rejected:
        with pytest.raises(ValueError, match=match):
            packed(q, k, v, other, True, None, (None, None), False)
    strided = torch.empty(6, device="meta", dtype=torch.int32)[::2]
    assert packed(q, k, v, seqs._replace(cu_seqlens_q=strided), True, None, (None, None), False).copy_seqs
    monkeypatch.setenv("CUTE_FLASH_ARCH", "sm80")
    assert packed(q, k, v, seqs, True, None, (None, None), False).forward.name == "sm80"
    cute_flash.interface.clear_call_cache()
    assert not plan._plans


def _decoding(s, layout="bhsd", b=2, h=8, h_kv=2, d=64):
    q = torch.empty(b, 1, h, d, device="meta", dtype=torch.bfloat16)
    shape = (b, h_kv, s, d) if layout == "bhsd" else (b, s, h_kv, d)
    k, v = (torch.empty(shape, device="meta", dtype=torch.bfloat16) for _ in range(2))
    return (q, k.transpose(1, 2), v.transpose(1, 2)) if layout == "bhsd" else (q, k, v)


def test_a_growing_cache_plans_from_its_family_without_validating_again(monkeypatch):
    """Decoding calls whose keys differ only in their count (and the strides that scale with it) share a family
    (fields.decode_key): a new length is planned from the family's first plan by validation.with_seqlen_k, with the
    problem a full validation gives."""
    plan.clear_call_cache()
    first = _plan(*_decoding(500), True, None, (None, None), False)
    assert first.decode_keys == (0, 500)
    validated = []
    real = validation.validate
    monkeypatch.setattr(plan, "validate", lambda *a, **kw: validated.append(a) or real(*a, **kw))
    grown = _plan(*_decoding(501), True, None, (None, None), False)
    assert not validated and grown is not first and grown.decode_keys == (0, 501)
    assert grown.forward is first.forward and grown.copies == first.copies
    plan.clear_call_cache()
    assert _plan(*_decoding(501), True, None, (None, None), False).problem == grown.problem
    assert len(validated) == 1  # (the cleared cache planned it afresh)


def test_a_family_keeps_what_a_cold_call_would_refuse_and_route_apart(monkeypatch):
    plan.clear_call_cache()
    _plan(*_decoding(500), True, None, (None, None), False)
    # The kernels' indexing limit is the length's own check: a family member past it is refused as a cold call is.
    longest = validation.MAX_ELEMENTS_PER_HEAD // 64
    with pytest.raises(NotImplementedError, match="Int32 indexing"):
        _plan(*_decoding(longest), True, None, (None, None), False)
    # Another layout, window, length-1 cache or several query rows is another family (or none).
    from cute_flash.core import fields

    args = ((True, None, None, None, False, 0.0), (None, None), (None,))

    def family(q, k, v):
        return fields.decode_key(q, k, v, fields.key(q, k, v, *args))

    assert family(*_decoding(500)) == family(*_decoding(900))
    # (head-major or token-major memory: the same class, which validation and the kernels read alike)
    assert family(*_decoding(500)) == family(*_decoding(500, "bshd"))
    q, k, v = _decoding(500)
    expanded = k[:, :, :1].expand(2, 500, 2, 64)  # (one KV head's keys broadcast: stride 0, copied for the kernels)
    assert family(q, expanded, v) != family(q, k, v)
    assert family(*_decoding(1)) is None
    q, k, v = _decoding(500)
    assert family(q.expand(2, 3, 8, 64), k, v) is None
    odd = torch.empty(2, 2, 501, 64, device="meta", dtype=torch.bfloat16)[:, :, 1:].transpose(1, 2)  # (same class)
    assert family(q, odd, v) == family(*_decoding(500))
    narrow = torch.empty(2, 2, 500, 68, device="meta", dtype=torch.bfloat16)[..., :64].transpose(1, 2)  # rows 136 B
    assert family(q, narrow, v) != family(*_decoding(500))
    windowed = _plan(*_decoding(500), True, None, (100, None), False)
    assert windowed.decode_keys == (399, 500)
    assert _plan(*_decoding(600), True, None, (100, None), False).decode_keys == (499, 600)


def test_decoding_lengths_are_rows_of_shared_tables():
    """A growing cache's decoding plans read their (b,) lengths from rows of one table per 1024 lengths (no fill per
    step); under CUDA-graph capture never (a vector of the graph's own: the table's memory belongs to a cache)."""
    plan.clear_call_cache()
    q = torch.empty(3, 1, 8, 64)
    a, b, c = (plan.lengths_vector(3, n, q) for n in (1500, 1501, 2048))
    assert a.dtype == torch.int32 and a.shape == (3,) and a.is_contiguous()
    assert a.tolist() == [1500] * 3 and b.tolist() == [1501] * 3 and c.tolist() == [2048] * 3
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # (one table for 1024 .. 2047)
    assert c.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(plan.device, "capturing", lambda t: True)
        fresh, shared_block = plan.lengths_vector(3, 5000, q), plan.lengths_vector(3, 1502, q)
        assert fresh.tolist() == [5000] * 3 and shared_block.tolist() == [1502] * 3
        assert fresh._base is None and shared_block._base is None  # (not views of a table)
    assert (3, q.device, 5000 // 1024) not in plan._length_tables
    wide = plan.lengths_vector(1 << 16, 77, q)  # (a table of at most 2^20 entries)
    assert wide.tolist() == [77] * (1 << 16) and wide._base.numel() <= 1 << 20

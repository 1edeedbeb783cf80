"""attention(..., score_mod=, mask_mod=) on the CPU: the experimental gate, what it refuses, the spec and tables the
backend receives (a recording backend on meta tensors), explain's route (forward and backward on sm90 on Hopper,
else sm80), the sm90 host path with no-op kernels."""

from __future__ import annotations

import pytest
import torch

import cute_flash
from cute_flash import validation
from cute_flash.core import device
from cute_flash.mods import trace_score_mod
from cute_flash.spec import ModsSpec

from . import test_mods as examples


class _Recorder:
    name = "sm80"

    def __init__(self):
        self.calls = []

    def forward_mods(self, q, k, v, out, lse, problem, tables, blocks=None, seqs=None):
        self.calls.append((problem, tables))
        self.blocks, self.seqs = blocks, seqs

    def mods_key_tiles(self, spec):
        return (128, 128)

    def mods_query_tiles(self, spec):
        return (64, 128)

    def backward_mods(self, t, grads, problem, tables, blocks=None, seqs=None):
        self.calls.append(("backward", problem, tables, blocks))
        self.backward_seqs = seqs


@pytest.fixture
def backend(monkeypatch):
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "meta"))
    rec = _Recorder()
    monkeypatch.setattr(device, "route", lambda spec, t, backward=False, deterministic=False: rec)
    monkeypatch.setattr(device, "guard", lambda t: __import__("contextlib").nullcontext())
    return rec


def _qkv(b=2, s=77, h=4, hk=2, d=64, device="meta"):
    return (torch.empty(b, s, h, d, dtype=torch.bfloat16, device=device),
            torch.empty(b, s, hk, d, dtype=torch.bfloat16, device=device),
            torch.empty(b, s, hk, d, dtype=torch.bfloat16, device=device))  # fmt: skip


def test_a_call_reaches_the_backend_with_its_spec_and_tables(backend, monkeypatch):
    monkeypatch.setattr(examples, "DOC", examples.DOC.to("meta"))
    monkeypatch.setattr(examples, "SLOPES", examples.SLOPES.to("meta"))
    q, k, v = _qkv()
    out, lse = cute_flash.attention(q, k, v, score_mod=examples.alibi, mask_mod=examples.document, return_lse=True)
    assert out.shape == (2, 77, 4, 64) and lse.shape == (2, 4, 77)
    ((problem, tables),) = backend.calls
    spec = problem.spec
    assert isinstance(spec, ModsSpec) and spec.mask == "none" and spec.score_mod[0] == "score"
    assert spec.mask_mod[0] == "mask" and [t.dtype for t in tables] == [torch.float32, torch.int32]
    # Equal callables give the same spec (one kernel); the tables' values are runtime data.
    cute_flash.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s - examples.SLOPES[h] * (qi - ki),
                         mask_mod=examples.document)  # fmt: skip
    assert backend.calls[1][0].spec == spec


def test_boolean_and_scalar_tables_are_stored_as_the_kernel_reads_them(backend):
    q, k, v = _qkv(device="meta")
    blocks = examples.RANDOM_BLOCKS.to("meta")
    bias = torch.tensor(0.5, device="meta")
    cute_flash.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias,
                         mask_mod=lambda b, h, qi, ki: blocks[qi // 16, ki // 16])  # fmt: skip
    ((_, tables),) = backend.calls
    assert [(t.dtype, tuple(t.shape)) for t in tables] == [(torch.float32, (1,)), (torch.uint8, (8, 8))]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(softcap=5.0), "softcap"),
        (dict(deterministic=True), "deterministic"),
        (dict(dtype="fp8"), "dtype"),
    ],
)
def test_what_does_not_combine_is_refused(backend, kwargs, match):
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=match):
        cute_flash.attention(q, k, v, score_mod=examples.alibi, **kwargs)


def test_gradients_go_through_one_node_to_the_backward_with_the_tables(backend, monkeypatch):
    monkeypatch.setattr(examples, "SLOPES", examples.SLOPES.to("meta"))
    q, k, v = (t.requires_grad_() for t in _qkv())
    out, lse = cute_flash.attention(q, k, v, score_mod=examples.alibi, return_lse=True)
    assert out.requires_grad and lse.requires_grad
    dq, dk, dv = torch.autograd.grad((out.sum(), lse.sum()), (q, k, v))
    (problem, tables), (tag, problem_b, tables_b, blocks) = backend.calls
    assert tag == "backward" and problem_b is problem and len(tables_b) == len(tables) == 1 and blocks is None
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_captured_tensors_that_require_grad_are_refused(backend):
    q, k, v = _qkv()
    bias = torch.zeros(4, device="meta", requires_grad=True)
    with pytest.raises(NotImplementedError, match="requires grad"):
        cute_flash.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h])


def test_foreign_tables_and_unsupported_callables_are_refused(backend):
    q, k, v = _qkv()
    with torch.no_grad():
        with pytest.raises(ValueError, match="is on cpu"):
            cute_flash.attention(q, k, v, score_mod=examples.alibi)  # SLOPES lives on the CPU, q on meta
        with pytest.raises(cute_flash.mods.ModError, match="erf"):
            cute_flash.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: torch.erf(s))


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0)])
def test_explain_routes_mods_calls_to_sm90_on_hopper_and_to_sm80_elsewhere(capability):
    hopper = capability == (9, 0)
    q, k, v = _qkv(device="cpu")
    e = cute_flash.explain(q, k, v, mask_mod=examples.causal, capability=capability)
    assert e.forward.family == e.backward.family == ("sm90" if hopper else "sm80"), e
    # No sm90 forward tile at d72 (its forward: sm80); the sm90 backward runs it on d128 kernels (zero-padded: no
    # d96 tile for score_mod builds), the sm80 one takes head_dim == head_dim_v, a multiple of 32, only.
    q, k, v = _qkv(d=72, device="cpu")
    e = cute_flash.explain(q, k, v, mask_mod=examples.causal, capability=capability)
    assert e.forward.family == "sm80" and e.backward.family == ("sm90" if hopper else None), e
    assert e.backward_padded_to == (128 if hopper else None), e


def test_a_block_mask_reaches_the_backend_as_key_tile_lists(backend, monkeypatch):
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))  # (the lists are built with torch ops)
    q, k, v = (torch.empty(1, 300, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    mask = cute_flash.mods.create_block_mask(examples.causal, None, None, 300, 300, tile_m=64, tile_n=64)
    with torch.no_grad():
        cute_flash.attention(q, k, v, mask_mod=examples.causal, block_mask=mask)
    ((problem, _),) = backend.calls
    assert problem.spec.block_sparse
    count, index, full, tiles = backend.blocks
    assert count.shape == tiles.shape == (1, 1, 3) and index.shape == full.shape == (1, 1, 3, 3)
    assert count.dtype == index.dtype == full.dtype == tiles.dtype == torch.int32
    assert tiles.tolist() == [[[2, 1, 0]]] and count.tolist() == [[[3, 2, 1]]]  # the longest list first
    with pytest.raises(ValueError, match="needs the mask_mod"):
        cute_flash.attention(q, k, v, block_mask=mask)
    with pytest.raises(ValueError, match="seqlen_q, seqlen_k"):
        cute_flash.attention(q[:, :200], k, v, mask_mod=examples.causal, block_mask=mask)


@pytest.mark.parametrize("mask_tiles, kernel_tiles", [((64, 64), (128, 128)), ((128, 128), (128, 80)),
                                                      ((32, 48), (128, 176))])  # fmt: skip
@pytest.mark.parametrize("mask_mod", [examples.sliding, examples.prefix_lm])
@pytest.mark.parametrize("by_key", [False, True], ids=["forward", "backward"])
def test_tile_lists_cover_every_visible_key_of_the_kernel_tiles(mask_tiles, kernel_tiles, mask_mod, by_key):
    """The kernel's lists (any tile sizes from any block mask's) hold, ascending, every kernel tile with a visible key
    (exactly those where the mask's tiles divide the kernel's); a tile flagged full sees every in-range key (and
    where the tiles divide, every such tile is flagged). The forward's by query tile, the backward's by key tile."""
    from cute_flash.mods.call import key_tile_lists, query_tile_lists
    from cute_flash.mods.graph import evaluate, trace_mask_mod

    sq, sk = 333, 517
    graph = trace_mask_mod(mask_mod)
    batch = 2 if graph.uses("b") else None
    mask = cute_flash.mods.create_block_mask(mask_mod, batch, None, sq, sk, tile_m=mask_tiles[0],
                                             tile_n=mask_tiles[1], device="cpu")  # fmt: skip
    lists = query_tile_lists if by_key else key_tile_lists
    count, index, full, tiles = lists(mask, *kernel_tiles, torch.device("cpu"))
    assert sorted(tiles[0, 0].tolist()) == list(range(count.shape[-1]))  # a permutation, the longest lists first
    assert torch.all(count[..., :-1] >= count[..., 1:])
    position = {m: p for p, m in enumerate(tiles[0, 0].tolist())}
    idx = {"b": torch.zeros(1, dtype=torch.long), "h": torch.zeros(1), "q_idx": torch.arange(sq).view(-1, 1),
           "kv_idx": torch.arange(sk).view(1, -1)}  # fmt: skip
    vis = evaluate(graph, idx).expand(sq, sk)
    tm, tn = kernel_tiles
    divides = tm % mask_tiles[0] == 0 and tn % mask_tiles[1] == 0
    if by_key:  # (rows: the key tiles, each listing query tiles)
        vis, (tm, tn), (sq, sk) = vis.T, (tn, tm), (sk, sq)
    for m in range(-(-sq // tm)):
        want = [n for n in range(-(-sk // tn)) if vis[m * tm : (m + 1) * tm, n * tn : (n + 1) * tn].any()]
        p = position[m]
        got = index[0, 0, p, index.shape[-1] - count[0, 0, p] :].tolist()  # (right-aligned)
        assert got == sorted(got) and set(want) <= set(got), (m, got, want)
        if divides:  # (finer mask tiles: exactly the visible ones)
            assert got == want, (m, got, want)
        for n in range(-(-sk // tn)):
            all_visible = bool(vis[m * tm : (m + 1) * tm, n * tn : (n + 1) * tn].all())
            assert not full[0, 0, m, n] or all_visible, (m, n)
            if divides:
                assert bool(full[0, 0, m, n]) == all_visible, (m, n)
    assert full.any() or mask_mod is examples.sliding  # (its window is narrower than a tile)


def test_under_torch_compile_the_call_runs_eagerly_as_a_graph_break(backend, monkeypatch):
    """Dynamo does not trace the callables (mods/graph.py does): the call leaves the compiled graph and reaches the
    backend as an eager call would, with the same spec; fullgraph=True reports the break."""
    import torch._dynamo

    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    q, k, v = (torch.zeros(1, 64, 2, 64, dtype=torch.bfloat16) for _ in range(3))

    def step(q, k, v):
        return cute_flash.attention(q * 2, k, v, score_mod=examples.softcap30, mask_mod=examples.causal) + 1

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(step, backend="eager")(q, k, v)
    assert out.shape == q.shape
    ((problem, _),) = backend.calls
    assert problem.spec.score_mod == trace_score_mod(examples.softcap30).key
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match="(?i)graph break|disable|skip"):
        torch.compile(step, backend="eager", fullgraph=True)(q, k, v)

    class Step(torch.nn.Module):
        def forward(self, q, k, v):
            return step(q, k, v)

    with pytest.raises(NotImplementedError, match="cannot be exported"):  # (no graph break there to fall back on)
        torch.export.export(Step(), (q, k, v), strict=False)
    torch._dynamo.reset()  # with autograd: the backward reaches the backend too, between the compiled graphs
    q.requires_grad_()
    torch.compile(step, backend="aot_eager")(q, k, v).sum().backward()
    assert backend.calls[-1][0] == "backward" and q.grad is not None


def test_warmup_builds_the_specs_a_call_runs(backend, monkeypatch):
    """cute_flash.mods.warmup's configurations are the call's forward spec and its backward's (both block-sparse on
    Hopper), so the disk cache holds what the call looks up."""
    from cute_flash import warmup as warm

    warmed = []
    monkeypatch.setattr(warm, "run", lambda configs, capability: warmed.extend(configs) or {})
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    cute_flash.mods.warmup(examples.alibi, examples.sliding, head_dim=64, block_mask=True, backward=True, gqa=True)
    q = torch.zeros(1, 300, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.zeros(1, 300, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    mask = cute_flash.mods.create_block_mask(examples.sliding, None, None, 300, 300)
    cute_flash.attention(q, k, v, score_mod=examples.alibi, mask_mod=examples.sliding, block_mask=mask).sum().backward()
    (forward, _), (_, backward, _, blocks) = backend.calls
    assert [c.spec for c in warmed] == [forward.spec, backward.spec] and warmed[0].spec.block_sparse
    assert warmed[1].spec.block_sparse and blocks is not None
    assert [(c.backward, c.gqa) for c in warmed] == [(False, False), (True, True)]
    with pytest.raises(ValueError, match="block_mask needs"):
        cute_flash.mods.warmup(examples.alibi, head_dim=64, block_mask=True)


def test_block_masks_that_do_not_fit_the_call_are_refused(backend, monkeypatch):
    """A mask built for batch 1 of a mask_mod that reads b is not a broadcast; shapes must match the lengths; a mask
    of another mask_mod is refused; padding past a row's count may hold anything; an in-place change of the mask's
    tensors makes new lists."""
    from cute_flash.mods import BlockMask
    from cute_flash.mods.call import key_tile_lists

    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    doc = torch.tensor([[0] * 100 + [1] * 100, [0] * 50 + [1] * 150])

    def documents(b, h, qi, ki):
        return doc[b, qi] == doc[b, ki]

    q, k, v = (torch.zeros(2, 200, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    one = cute_flash.mods.create_block_mask(documents, 1, None, 200, 200, tile_m=64, tile_n=64)
    with torch.no_grad(), pytest.raises(ValueError, match="reads them"):
        cute_flash.attention(q, k, v, mask_mod=documents, block_mask=one)
    mask = cute_flash.mods.create_block_mask(examples.causal, None, None, 200, 200, tile_m=64, tile_n=64)
    with torch.no_grad(), pytest.raises(ValueError, match="another mask_mod"):
        cute_flash.attention(q, k, v, mask_mod=examples.sliding, block_mask=mask)
    short = BlockMask(64, 64, 200, 200, mask.partial_count[:, :, :2], mask.partial_index[:, :, :2],
                      mask.full_count[:, :, :2], mask.full_index[:, :, :2])  # fmt: skip
    with torch.no_grad(), pytest.raises(ValueError, match="needs"):
        cute_flash.attention(q, k, v, mask_mod=examples.causal, block_mask=short)
    padded = BlockMask(64, 64, 200, 200, mask.partial_count, mask.partial_index.masked_fill(
        torch.arange(4) >= mask.partial_count.unsqueeze(-1), -1), mask.full_count, mask.full_index)  # fmt: skip
    want = key_tile_lists(mask, 64, 64, torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(key_tile_lists(padded, 64, 64, torch.device("cpu")), want))
    before = key_tile_lists(mask, 64, 64, torch.device("cpu"))
    mask.full_count.zero_()  # (every full tile now partial: visited, with the mask_mod)
    after = key_tile_lists(mask, 64, 64, torch.device("cpu"))
    assert before is not after and not after.full.any() and before.full.any()


def test_the_sm90_backward_launches_its_mods_kernel_with_the_tables():
    """Forward and backward of a block-masked call on the sm90 host path with recording no-op kernels (CPU): the
    main backward kernel is keyed on the callables and the block mask and takes (q .. dv, scale, window bounds, the
    tables, None past them, the lists by key tile at its tiles); the pre- and postprocess are keyed on plain specs
    (they do not read the callables)."""
    from cute_flash import compile_cache
    from cute_flash.arch.sm90 import backward as sm90_backward
    from profiling.host_overhead_cpu import fake_gpu

    launches = []

    def kernel(key):
        return lambda *args: launches.append((key, args))

    q, k, v = (t.requires_grad_() for t in (torch.randn(2, 77, 4, 64).to(torch.bfloat16),
               *(torch.randn(2, 77, 2, 64).to(torch.bfloat16) for _ in range(2))))  # fmt: skip
    block = cute_flash.mods.create_block_mask(examples.document, 2, 1, 77, 77)
    with fake_gpu((9, 0)):
        compile_cache.get_or_compile = lambda key, build: kernel(key)
        compile_cache.clear()
        sm90_backward._launch_sets.clear()
        out = cute_flash.attention(q, k, v, score_mod=examples.alibi, mask_mod=examples.document, block_mask=block)
        out.sum().backward()
    roles = {key[2]: (key, args) for key, args in launches}
    key, args = roles["bwd_gqa"]
    spec = key[3]
    assert isinstance(spec, ModsSpec) and spec.score_mod is not None and spec.mask_mod is not None
    assert spec.block_sparse and (key[4].tile_m, key[4].tile_n) == (64, 128)  # (tile_config.score_heavy)
    tables, blocks = args[12:16], args[16:]
    assert len(args) == 20 and args[9] == 64**-0.5 and tables[2:] == (None, None)
    assert torch.equal(tables[0], examples.SLOPES) and torch.equal(tables[1].cpu(), examples.DOC.int())
    want = cute_flash.mods.call.query_tile_lists(block, 64, 128, torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(blocks, want)) and blocks[0].shape == (2, 1, 1)
    for role in ("bwd_preprocess", "bwd_dq_postprocess"):
        assert not isinstance(roles[role][0][3], ModsSpec), role
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def _packed(total_q=100, total_k=120, d=64, heads_kv=2):
    q = torch.randn(total_q, 4, d).to(torch.bfloat16)
    k, v = (torch.randn(total_k, heads_kv, d).to(torch.bfloat16) for _ in range(2))
    cu_q = torch.tensor([0, 40, total_q], dtype=torch.int32)
    cu_k = torch.tensor([0, 50, total_k], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def test_a_packed_call_reaches_the_backend_with_its_sequences(backend, monkeypatch):
    """attention_varlen(score_mod=, mask_mod=): a varlen ModsSpec, the sequences to the forward and the backward;
    out (total_q, h, dv), lse (h, total_q); what it does not combine with is refused."""
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    q, k, v, cu_q, cu_k = _packed()
    q.requires_grad_()
    kw = dict(score_mod=examples.alibi, mask_mod=examples.causal)
    out, lse = cute_flash.attention_varlen(q, k, v, cu_q, cu_k, 60, 70, return_lse=True, **kw)
    assert out.shape == (100, 4, 64) and lse.shape == (4, 100)
    ((problem, tables),) = backend.calls
    assert isinstance(problem.spec, ModsSpec) and problem.spec.varlen and not problem.spec.block_sparse
    assert torch.equal(backend.seqs.cu_seqlens_q, cu_q) and backend.seqs.max_seqlen_k == 70
    out.float().sum().backward()
    assert backend.calls[-1][0] == "backward" and backend.backward_seqs is backend.seqs
    for bad in (dict(seqused_q=torch.tensor([10, 20], dtype=torch.int32)), dict(deterministic=True),
                dict(softcap=5.0), dict(learnable_sink=torch.zeros(4))):  # fmt: skip
        with pytest.raises(NotImplementedError, match="packed sequences do not combine"):
            cute_flash.attention_varlen(q, k, v, cu_q, cu_k, 60, 70, **kw, **bad)
    for capability, family in (((8, 0), "sm80"), ((8, 6), "sm80"), ((9, 0), "sm90"), ((10, 0), "sm80")):
        e = cute_flash.explain_varlen(q, k, v, cu_q, cu_k, 60, 70, **kw, capability=capability)
        assert (e.forward.family, e.backward.family) == (family, family), (capability, e)


def test_explain_varlen_routes_packed_mods_to_sm80_off_hopper_with_its_limits():
    """On Ampere (and Blackwell) packed score_mod / mask_mod calls go to the sm80 family, forward and backward; its
    backward takes head_dim == head_dim_v, a multiple of 32 (d72: a forward only, the backward refused with why)."""
    q, k, v, cu_q, cu_k = _packed(d=72)
    e = cute_flash.explain_varlen(q, k, v, cu_q, cu_k, 60, 70, mask_mod=examples.causal, capability=(8, 0))
    assert e.forward.family == "sm80" and e.backward.family is None, e
    assert "multiple of 32" in dict(e.backward.skipped)["sm80"], e
    q, k, v, cu_q, cu_k = _packed(d=128)
    e = cute_flash.explain_varlen(q, k, v, cu_q, cu_k, 60, 70, score_mod=examples.softcap30, causal=True,
                                  seqused_k=torch.tensor([30, 60], dtype=torch.int32), capability=(8, 0))  # fmt: skip
    assert (e.forward.family, e.backward.family) == ("sm80", "sm80"), e


def test_the_sm90_packed_kernels_take_the_tables_and_the_sequences():
    """The sm90 host path of a packed call with recording no-op kernels: the packed forward and backward main
    kernels are keyed on the varlen ModsSpec and take the tables, then the packed arguments (the forward's
    `packed_mods` entry; the backward's without semaphores)."""
    from cute_flash import compile_cache
    from cute_flash.arch.sm90 import backward as sm90_backward
    from profiling.host_overhead_cpu import fake_gpu

    launches = []
    q, k, v, cu_q, cu_k = _packed()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with fake_gpu((9, 0)):
        compile_cache.get_or_compile = lambda key, build: lambda *args: launches.append((key, args))
        compile_cache.clear()
        sm90_backward._launch_sets.clear()
        out = cute_flash.attention_varlen(q, k, v, cu_q, cu_k, 60, 70, score_mod=examples.alibi,
                                          mask_mod=examples.causal)  # fmt: skip
        out.sum().backward()
    roles = {key[2]: (key, args) for key, args in launches}
    (fkey, fargs), (bkey, bargs) = roles["fwd"], roles["bwd_gqa"]
    for key in (fkey, bkey):
        assert isinstance(key[3], ModsSpec) and key[3].varlen
    assert len(fargs) == 16 and torch.equal(fargs[8], examples.SLOPES) and fargs[9:12] == (None,) * 3
    assert torch.equal(fargs[12], cu_q) and fargs[14] is None and fargs[15] == 60
    assert len(bargs) == 20 and torch.equal(bargs[12], examples.SLOPES) and torch.equal(bargs[17], cu_k)
    assert bargs[19] == 70 and q.grad.shape == q.shape and k.grad.shape == k.shape


@pytest.mark.parametrize("seqused, heads_kv", [(False, 2), (True, 2), (False, 4)], ids=["gqa", "gqa-seqused", "mha"])
def test_the_sm80_packed_kernels_take_the_tables_and_the_sequences(seqused, heads_kv):
    """The sm80 host path of a packed call (capability 8.0) with recording no-op kernels: the packed forward and
    backward main kernels are keyed on the varlen ModsSpec (the forward under forward_varlen's keys, with seqused_k
    or not) and take the tables, then the packed arguments (the `packed_mods` entries: no semaphores); the pre- and
    postprocess are the plain packed ones."""
    from cute_flash import compile_cache
    from cute_flash.arch.sm80 import backward as sm80_backward
    from profiling.host_overhead_cpu import fake_gpu

    launches = []
    q, k, v, cu_q, cu_k = _packed(heads_kv=heads_kv)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    used = torch.tensor([33, 70], dtype=torch.int32) if seqused else None
    with fake_gpu((8, 0)):
        compile_cache.get_or_compile = lambda key, build: lambda *args: launches.append((key, args))
        compile_cache.clear()
        sm80_backward._cache_key.cache_clear()
        out = cute_flash.attention_varlen(q, k, v, cu_q, cu_k, 60, 70, score_mod=examples.alibi,
                                          mask_mod=examples.causal, seqused_k=used)  # fmt: skip
        out.sum().backward()
    roles = {key[2]: (key, args) for key, args in launches}
    main = ("bwd_gqa" if heads_kv < 4 else "bwd") + ("_seqused" if seqused else "")
    post = "bwd_postprocess" if heads_kv < 4 else "bwd_dq_postprocess"  # (MHA: dK / dV written in place)
    assert set(roles) >= {"fwd", "bwd_preprocess", main, post}, sorted(roles)
    (fkey, fargs), (bkey, bargs) = roles["fwd"], roles[main]
    assert fkey[0] == "sm80" and fkey[4] is seqused  # (the key forward_varlen and warm use)
    for key in (fkey, bkey):
        assert isinstance(key[3], ModsSpec) and key[3].varlen and not key[3].block_sparse
    assert len(fargs) == 16 and torch.equal(fargs[8], examples.SLOPES) and fargs[9:12] == (None,) * 3
    assert torch.equal(fargs[12], cu_q) and (fargs[14] is used) and fargs[15] == 60
    assert len(bargs) == 20 and bargs[9] == 64**-0.5 and torch.equal(bargs[12], examples.SLOPES)
    assert bargs[13:16] == (None,) * 3 and torch.equal(bargs[17], cu_k) and bargs[19] == 70
    for role in ("bwd_preprocess", post):
        assert not isinstance(roles[role][0][3], ModsSpec), role
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_autocast_casts_the_inputs_as_the_plain_path_does(backend, monkeypatch):
    """Under torch.autocast("cuda", dtype=bf16) fp32 inputs reach the mods kernels in bf16 (as `attention`'s)."""
    monkeypatch.setattr(examples, "SLOPES", examples.SLOPES.to("meta"))
    q, k, v = (t.float() for t in _qkv())
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: True)
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda *a: torch.bfloat16)
    with torch.no_grad():
        out = cute_flash.attention(q, k, v, score_mod=examples.alibi)
    assert out.dtype == torch.bfloat16 and backend.calls[0][0].spec.dtype == "bf16"


def test_a_block_mask_changed_between_forward_and_backward_is_refused(backend, monkeypatch):
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    q = torch.zeros(1, 300, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.zeros(1, 300, 4, 64, dtype=torch.bfloat16) for _ in range(2))
    mask = cute_flash.mods.create_block_mask(examples.causal, None, None, 300, 300)
    out = cute_flash.attention(q, k, v, mask_mod=examples.causal, block_mask=mask)
    mask.partial_count.add_(0)  # (an in-place change: a new version)
    with pytest.raises(RuntimeError, match="changed in place"):
        out.sum().backward()

"""attention_with_kvcache end to end on a GPU (the append kernel, then the serving family's KV-cache forward) against
`cute_flash.reference.kvcache_reference` in float64 with FlashAttention's rule, and the caches after the call bit
for bit (the new rows in their slots, every other slot unchanged).

Unmarked tests run on the family the GPU routes to (Hopper: sm90 for the page sizes its TMA loads take, sm80's
gathers for the others); the `sm80` ones force the sm80 family."""

import pytest
import torch

import cute_flash
from cute_flash.testing import check_hard_max, check_kvcache, random_page_table

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _case(batch, sq, h, hkv, d, page, lens, new=0, packed=False, shared=0, fp8=False, seed=0):
    """q, caches, the call's keyword arguments; lens: cache_seqlens (a list)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dt)

    capacity = max(max(lens) + max(new, sq if packed else new), 1)
    kw = {"cache_seqlens": torch.tensor(lens, dtype=torch.int32, device="cuda")}
    if page:
        per_seq = -(-capacity // page)
        table = random_page_table(batch, per_seq, shared_pages=min(shared, per_seq), num_pages=batch * per_seq + 3,
                                  seed=seed)  # fmt: skip
        shape = (batch * per_seq + 3, page, hkv, d)
        kw["page_table"] = table
    else:
        shape = (batch, capacity, hkv, d)
    k, v = randn(*shape), randn(*shape)
    if packed:
        q_lens = torch.randint(1, sq + 1, (batch,), generator=torch.Generator().manual_seed(seed)).tolist()
        cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
        q = randn(int(cu[-1]), h, d)
        kw.update(cu_seqlens_q=cu, max_seqlen_q=max(q_lens))
        if new:
            kw.update(k_new=randn(int(cu[-1]), hkv, d), v_new=randn(int(cu[-1]), hkv, d))
    else:
        q = randn(batch, sq, h, d)
        if new:
            kw.update(k_new=randn(batch, new, hkv, d), v_new=randn(batch, new, hkv, d))
    if fp8:
        kd = torch.rand(batch, hkv, generator=g, device="cuda") * 0.02 + 0.01
        vd = torch.rand(batch, hkv, generator=g, device="cuda") * 0.02 + 0.01
        kw.update(k_descale=kd, v_descale=vd)
        k = (k.float() / 0.02).to(torch.float8_e4m3fn)
        v = (v.float() / 0.02).to(torch.float8_e4m3fn)
    return q, k, v, kw


def _run_and_check(q, k, v, kw, **options):
    k0, v0 = k.clone(), v.clone()
    out, lse = cute_flash.attention_with_kvcache(q, k, v, **kw, **options, return_lse=True)
    torch.cuda.synchronize()
    options.pop("num_splits", None)  # (a scheduling choice: the reference has none)
    reports = check_kvcache(q, k0, v0, out, lse, k, v, **kw, **options)
    bad = [r for r in reports if not r.ok]
    assert not bad, bad


@pytest.mark.parametrize("page", [0, 1, 16, 64, 128, 256])
@pytest.mark.parametrize("hkv", [8, 2, 1])
def test_decoding_over_page_sizes_and_gqa(page, hkv):
    lens = [0, 1, 255, 256, 257, 1000, 64]
    q, k, v, kw = _case(len(lens), 1, 8, hkv, 128, page, lens, shared=1, seed=page + hkv)  # no appends: pages shared
    _run_and_check(q, k, v, kw)


@pytest.mark.parametrize("page", [0, 16, 3])
@pytest.mark.parametrize("sq, new", [(1, 1), (4, 4), (5, 2)])
def test_appended_tokens_see_each_other_causally(page, sq, new):
    q, k, v, kw = _case(4, sq, 8, 2, 64, page, [0, 17, 300, 63], new=new, seed=sq + new)
    _run_and_check(q, k, v, kw)


@pytest.mark.parametrize("d", [96, 80])
@pytest.mark.parametrize("packed", [False, True])
def test_long_appends_at_head_dims_whose_rows_do_not_divide_the_block(d, packed):
    """More than one 128-row block of new tokens at d 96 / 80 (12 / 10 threads per row: the append's last rows of
    each block take a pass of their own)."""
    q, k, v, kw = _case(2, 200, 8, 2, d, 16, [3, 130], new=200, packed=packed, seed=d)
    _run_and_check(q, k, v, kw)


@pytest.mark.parametrize("page", [0, 16])
def test_chunked_prefill_with_packed_queries(page):
    q, k, v, kw = _case(3, 40, 8, 2, 128, page, [0, 100, 513], new=40, packed=True, seed=3)
    _run_and_check(q, k, v, kw)


@pytest.mark.parametrize(
    "options",
    [
        dict(window_size=(100, 0)),
        dict(window_size=(None, -20)),
        dict(window_size=(-5, 50), causal=False),
        dict(softcap=30.0),
        dict(softcap=4.0, softmax_scale=0.35),  # scores of std ~4: the cap bends them (at 30 tanh is near linear)
        dict(learnable_sink=True),
        dict(softcap=10.0, learnable_sink=True, window_size=(64, 0)),
        dict(causal=False),
    ],
    ids=["window", "neg-right", "neg-left", "softcap", "softcap-bends", "sink", "all", "noncausal"],
)
def test_masks_softcap_and_sinks(options):
    q, k, v, kw = _case(5, 3, 8, 2, 128, 16, [5, 0, 700, 128, 33], new=2, seed=7)
    if options.pop("learnable_sink", False):
        options["learnable_sink"] = torch.randn(8, device="cuda")
    _run_and_check(q, k, v, kw, **options)


@pytest.mark.parametrize("splits", [1, 3, 0])
def test_splits_agree_and_a_given_split_is_deterministic(splits):
    q, k, v, kw = _case(2, 1, 32, 8, 128, 16, [4000, 9000], seed=11)
    a = cute_flash.attention_with_kvcache(q, k, v, **kw, num_splits=splits)
    b = cute_flash.attention_with_kvcache(q, k, v, **kw, num_splits=splits)
    assert torch.equal(a, b)
    _run_and_check(q, k, v, kw, num_splits=splits)


@pytest.mark.parametrize("splits", [16, 17, 40, 128])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_combine_merges_more_splits_than_one_chunk_of_its_loads(splits, sink, fp8):
    """The combine loads its splits' partials 16 at a time and merges the chunks online: split counts past one
    chunk, splits that see no key (lengths 0 and shorter than the splits' runs), sinks, both KV-cache kernels."""
    q, k, v, kw = _case(4, 1, 32, 8, 128, 16, [9000, 0, 300, 4097], fp8=fp8, seed=splits)
    options = {"learnable_sink": torch.randn(32, device="cuda")} if sink else {}
    _run_and_check(q, k, v, kw, num_splits=splits, **options)


def test_preallocated_out_is_filled_in_place():
    q, k, v, kw = _case(2, 1, 8, 2, 64, 16, [10, 20], seed=13)
    out = torch.full((2, 1, 8, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = cute_flash.attention_with_kvcache(q, k, v, **kw, out=out)
    assert got is out and not out.isnan().any()


def test_cuda_graph_replays_with_new_lengths_and_page_tables():
    q, k, v, kw = _case(4, 1, 16, 4, 128, 16, [10, 200, 3000, 0], new=1, seed=17)
    lens, table = kw["cache_seqlens"], kw["page_table"]
    cute_flash.attention_with_kvcache(q, k.clone(), v.clone(), **kw)  # compile and plan outside the capture
    graph = torch.cuda.CUDAGraph()
    k_live, v_live = k.clone(), v.clone()
    with torch.cuda.graph(graph):
        out = cute_flash.attention_with_kvcache(q, k_live, v_live, **kw)
    for step in range(3):
        new_lens = torch.tensor([11 + step, 2000, 5 * step, 3001], dtype=torch.int32, device="cuda")
        lens.copy_(new_lens)
        table.copy_(table.flip(0))
        k_before, v_before = k_live.clone(), v_live.clone()
        graph.replay()
        torch.cuda.synchronize()
        reports = check_kvcache(q, k_before, v_before, out, None, k_live, v_live, **kw)
        assert all(r.ok for r in reports), reports


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_traces_one_op_that_appends_in_place(mode):
    """Inductor over the custom op (cute_flash::kvcache_fwd), with and without its CUDA graphs: the same output and
    the same appended cache as the eager call."""
    q, k, v, kw = _case(3, 1, 16, 4, 128, 16, [10, 300, 0], new=1, seed=23)

    def step(q, k, v):
        return cute_flash.attention_with_kvcache(q, k, v, **kw) * 1.0

    k_eager, v_eager = k.clone(), v.clone()
    want = step(q, k_eager, v_eager)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, mode=None if mode == "default" else mode)
    for _ in range(3):  # (reduce-overhead records its graph on a later call)
        k_live, v_live = k.clone(), v.clone()
        got = compiled(q, k_live, v_live)
    torch.testing.assert_close(got, want)
    assert torch.equal(k_live, k_eager) and torch.equal(v_live, v_eager)


def test_fp8_cache_against_its_dequantised_cache():
    q, k, v, kw = _case(3, 1, 32, 8, 128, 16, [1000, 4096, 17], new=1, fp8=True, seed=19)
    _run_and_check(q, k, v, kw)


@pytest.mark.parametrize("q_scale", [1e-30, 1e-6, 300.0, 3e5, 1e30])
def test_fp8_cache_with_extreme_query_magnitudes(q_scale):
    """The sm90 fp8 cache's GEMMs run in fp16: bf16 queries far outside fp16's range (3e5, 1e30) or below its
    normals must neither overflow nor flush (load_q_rows_as_fp16's power-of-two scale); one batch row with zero
    queries (every row's scale its own tile's)."""
    q, k, v, kw = _case(3, 2, 16, 4, 128, 0, [300, 77, 1], fp8=True, seed=23)
    q = (q.float() * q_scale).to(q.dtype)
    q[2] = 0
    _run_and_check(q, k, v, kw)


@pytest.mark.sm80
@pytest.mark.parametrize("page", [0, 1, 5, 16, 128])
def test_the_sm80_family_serves_every_page_size(page):
    q, k, v, kw = _case(4, 2, 8, 2, 128, page, [0, 33, 700, 255], new=2, shared=0, seed=page)
    _run_and_check(q, k, v, kw)


@pytest.mark.parametrize("family", ["default", pytest.param("sm80", marks=pytest.mark.sm80)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_cache_values_convert_exactly(family, dtype):
    """One key per sequence: out is that key's value row, so every finite e4m3 byte (NaN bytes aside) must come
    back as exactly its value, subnormals included."""
    codes = torch.arange(256, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0
    v = codes.to(torch.uint8).view(torch.float8_e4m3fn).view(2, 1, 1, 128).expand(2, 4, 2, 128).contiguous().cuda()
    k = torch.zeros_like(v)
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=dtype)
    ones = torch.ones(2, 2, device="cuda")
    lens = torch.ones(2, dtype=torch.int32, device="cuda")
    out = cute_flash.attention_with_kvcache(q, k, v, cache_seqlens=lens, k_descale=ones, v_descale=ones)
    want = v[:, :1].float().repeat_interleave(4, dim=2).to(dtype)
    assert torch.equal(out, want), (out - want).abs().max()


@pytest.mark.parametrize("rows", [4, 20])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("fp8", [False, True])
def test_scaled_logits_overflowing_fp32(fp8, sign, sink, rows):
    """softmax_scale 1e38: scale x score overflows fp32 (a hard max). Every row's output is v at its best key, also
    where every score is negative (sign -1: the scaled maximum is -inf in fp32 although keys exist) — except that
    a sink then outweighs every key (output 0); beside a positive maximum (+inf) its weight is 0. Both KV-cache
    kernels of the fp8 cache (4 query rows per KV head: the swapped decoder; 20: the wgmma kernel). Such calls run
    unsplit (problem.MAX_SPLIT_SCALE): 8 key tiles per sequence, which would otherwise be split."""
    q, k, v, kw = _case(2, 1, rows * 2, 2, 128, 0, [1000, 1000], fp8=fp8, seed=29 + rows)
    if sign < 0:  # every score < 0: q > 0, k < 0 (fp8: negated through fp32)
        q, k = q.abs(), (-k.float().abs()).to(k.dtype)
    k_deq, v_deq = k.float(), v.float()
    if fp8:
        k_deq = k_deq * kw["k_descale"][:, None, :, None]
        v_deq = v_deq * kw["v_descale"][:, None, :, None]
    extra = {"learnable_sink": torch.zeros(q.shape[2], device="cuda")} if sink else {}
    out = cute_flash.attention_with_kvcache(q, k, v, **kw, softmax_scale=1e38, **extra)
    torch.cuda.synchronize()
    if sink and sign < 0:
        assert torch.equal(out, torch.zeros_like(out))
    else:
        check_hard_max(q, k_deq, v_deq, out, causal=True)

"""Argument handling of the end-to-end benchmarks (profiling/model_step.py, profiling/decode_benchmark.py): usage
errors before anything touches a GPU."""

import pytest

from profiling import decode_benchmark, mods_benchmark, model_step


def test_model_step_defaults_and_lists():
    args = model_step.parse_args(["--models", "llama,gemma2", "--seqs", "512,2048", "--batches", "1,8"])
    assert args.models == ["llama", "gemma2"] and args.seqs == [512, 2048] and args.batches == [1, 8]
    assert args.impls == list(model_step.IMPLS) and args.padding == "none"


@pytest.mark.parametrize(
    "argv",
    [
        ["--models", "gpt5"],
        ["--impls", "cute,xformers"],
        ["--seqs", "1k"],
        ["--batches", "0"],
        ["--heads", "12", "--kv-heads", "5"],
        ["--cuda-graphs"],
        ["--padding", "packed", "--generate", "8"],
    ],
)
def test_model_step_usage_errors(argv):
    with pytest.raises(SystemExit) as e:
        model_step.parse_args(argv)
    assert e.value.code == 2


def test_decode_benchmark_grid_and_bytes():
    args = decode_benchmark.parse_args(["--batches", "8", "--contexts", "32768", "--pages", "0,16"])
    assert args.batches == [8] and args.contexts == [32768] and args.pages == [0, 16]
    assert args.splits == [] and not args.kernels
    args = decode_benchmark.parse_args(["--splits", "8,16", "--kernels"])
    assert args.splits == [8, 16] and args.kernels
    # 8 x 32k keys, 8 KV heads, d128, bf16: K and V are 1 GiB together
    assert decode_benchmark.cache_bytes(8, 32768, 8, 128, 2) == 2**30


def test_decode_benchmark_rotates_over_copies_larger_than_l2():
    """Calls rotate over input copies holding 3 x L2 of caches at least (a CUDA graph of back-to-back replays would
    otherwise read a small cache from L2), at most MAX_COPIES, one copy for caches past that size."""
    l2 = 50 * 2**20
    assert decode_benchmark.input_copies(decode_benchmark.cache_bytes(1, 8192, 8, 128, 2), 3 * l2) == 5
    assert decode_benchmark.input_copies(decode_benchmark.cache_bytes(8, 32768, 8, 128, 2), 3 * l2) == 1
    assert decode_benchmark.input_copies(1024, 3 * l2) == decode_benchmark.MAX_COPIES
    calls = []
    fn = decode_benchmark.rotating([lambda i=i: calls.append(i) for i in range(3)])
    for _ in range(7):
        fn()
    assert calls == [0, 1, 2, 0, 1, 2, 0]
    assert decode_benchmark.parse_args(["--rotate-mib", "512"]).rotate_mib == 512
    assert decode_benchmark.peak_tbs("NVIDIA H100 80GB HBM3") == 3.35
    assert decode_benchmark.peak_tbs("NVIDIA H200") == 4.8
    assert decode_benchmark.peak_tbs("NVIDIA H100 NVL") == 3.9 and decode_benchmark.peak_tbs("some GPU") == 0.0


@pytest.mark.parametrize(
    "argv",
    [
        ["--pages", "-1"],
        ["--impls", "flashinfer"],
        ["--contexts", "x"],
        ["--splits", "-2"],
        ["--rotate-mib", "-1"],
        ["--peak-tbs", "-3"],
    ],
)
def test_decode_benchmark_usage_errors(argv):
    with pytest.raises(SystemExit) as e:
        decode_benchmark.parse_args(argv)
    assert e.value.code == 2


def test_mods_benchmark_arguments():
    args = mods_benchmark._parse(["--examples", "alibi,causal", "--shapes", "2x1024,1x4096"])
    assert args.examples == ["alibi", "causal"] and args.shapes == [(2, 1024), (1, 4096)]
    assert not args.no_fa4 and not args.no_flex  # FA4 and FlexAttention on by default
    args = mods_benchmark._parse(["--no-fa4"])
    assert args.no_fa4 and not args.no_flex and args.examples == list(mods_benchmark.EXAMPLES)
    assert not args.backward and mods_benchmark._parse(["--backward"]).backward
    with pytest.raises(SystemExit):
        mods_benchmark._parse(["--examples", "relu"])


def test_mods_benchmark_tables_for_fa4():
    """_callables hands FA4 (profiling/fa4_mods.py) what each example's callables read; fa4_mods imports without
    flash_attn."""
    from profiling import fa4_mods

    keys = {"alibi": {"slopes"}, "t5_bias": {"table", "max_distance"}, "sliding": {"window"}, "document": {"doc"}}
    keys["prefix_lm"] = {"prefix"}
    for name in mods_benchmark.EXAMPLES:
        score_mod, mask_mod, _, tables = mods_benchmark._callables(name, 2, 1024, 4, "cpu")
        assert set(tables) == keys.get(name, set()) and (mask_mod is not None) == (name in fa4_mods.MASK_EXAMPLES)
    assert fa4_mods.BLOCK_SIZE == (128, 128)


def test_model_step_models_of_one_config_keep_their_own_attention():
    """from_config writes the attention implementation into the config it is given: the models of one config's
    impls must each get their own copy, or all of them run the last one built (transformers on the CPU)."""
    pytest.importorskip("transformers")
    from cute_flash.integrations import transformers as cft
    from profiling.model_step import build_model, make_config, parse_args

    args = parse_args(["--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--seqs", "16"])
    cfg = make_config("mistral", args)
    first = build_model(cfg, cft.register())
    second = build_model(cfg, "sdpa")
    assert first.config._attn_implementation == cft.DEFAULT_NAME and second.config._attn_implementation == "sdpa"


def test_model_step_fa4_impl_hands_flash_attn_func_its_layout(monkeypatch):
    """The fa4 impl: FlashAttention-4's flash_attn_func (a stand-in here) gets (b, s, h, d) views, the layer's window
    and softcap, and no mask for a batch without padding (transformers on the CPU)."""
    import sys
    import types

    import torch

    pytest.importorskip("transformers")
    seen = []

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0):
        seen.append((tuple(q.shape), tuple(k.shape), causal, window_size, softcap))
        return torch.zeros_like(q), None

    fake = types.ModuleType("flash_attn")
    fake.cute = types.SimpleNamespace(flash_attn_func=flash_attn_func)
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fake.cute)
    args = model_step.parse_args(["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--seqs", "16"])
    name, _ = model_step.impl_context("fa4")
    model = model_step.build_model(model_step.make_config("gemma2", args), name)
    ids = torch.randint(0, 100, (2, 16))
    model(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert seen == [((2, 16, 4, 16), (2, 16, 2, 16), True, (255, 0), 50.0), ((2, 16, 4, 16), (2, 16, 2, 16), True,
                                                                             (None, None), 50.0)]  # fmt: skip
    with pytest.raises(NotImplementedError, match="packed documents"):  # (one flattened row: not the same work)
        model(**model_step.make_batch(2, 16, "packed", 100, "cpu"))

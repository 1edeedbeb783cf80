"""End-to-end speed of small randomly initialised transformers models (GPU): training steps (forward + backward)
and `generate`, with cute-flash's attention beside torch SDPA's backends (flash, cuDNN, efficient) and
FlashAttention-4 where it runs, in one process. Prints ms per step, tokens per second and the attention share of
the step (profiler time of the attention kernels, layout copies included, over the step's GPU time).

    python3 -m profiling.model_step                                  # the default grid (below), every impl
    python3 -m profiling.model_step --models llama --seqs 512,2048 --batches 1,4 --impls cute,sdpa_flash
    python3 -m profiling.model_step --padding left --trace /tmp/trace   # + Chrome traces of one step per impl
    python3 -m profiling.model_step --generate 64                    # decoding: 64 new tokens per sequence
    python3 -m profiling.model_step --compile                        # torch.compile of the whole model

Models (--models): llama (GQA 16/4, d64), mistral (sliding window 256, GQA), qwen (GQA, qkv bias), gemma2 (softcap,
sliding window), gptoss (learnable sinks, sliding window). --padding: none, left (every second row shorter), or
packed (documents flattened into one row, DataCollatorWithFlattening's keywords). The implementations: cute
(cute_flash.integrations.transformers), fa4 (FlashAttention-4's flash_attn.cute.flash_attn_func behind a small
attention function here: batches without padding, windows and softcap, no sinks), sdpa_flash / sdpa_cudnn /
sdpa_efficient (torch SDPA forced to one backend), sdpa (torch's own choice), eager; an implementation a model or
batch cannot use is reported as such, not timed. Each impl's model is built on its own copy of the config
(`build_model`).

Training steps are host-bound at these sizes, so they follow the host's speed, which drifts between runs and
machines: the impls of one config are built side by side and timed in interleaved rounds (--rounds blocks of
--steps steps each; with --generate, one generate() call each), and each impl's best round is reported beside all
of them.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from typing import Dict, List, Optional

IMPLS = ("cute", "fa4", "sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "eager")
FA4_NAME = "fa4_cute"  # (transformers 5.x takes names with "flash" for Hub kernels)
MODELS = ("llama", "mistral", "qwen", "gemma2", "gptoss")
PADDINGS = ("none", "left", "packed")
ATTN_MARKERS = ("flash", "fmha", "attention", "attn", "cute_flash", "sdpa", "cudnn", "kernel_cutlass")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama", help=f"comma-separated, of {','.join(MODELS)} (default: %(default)s)")
    p.add_argument("--seqs", default="512,2048,8192", help="tokens per sequence (default: %(default)s)")
    p.add_argument("--batches", default="1,4", help="sequences per batch (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=0, help="if > 0, skip configs with more tokens than this")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated, of %(default)s")
    p.add_argument("--padding", default="none", choices=PADDINGS, help="(default: %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--hidden", type=int, default=1024, help="(default: %(default)s)")
    p.add_argument("--heads", type=int, default=16, help="(default: %(default)s)")
    p.add_argument("--kv-heads", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per round (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per impl, interleaved (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: %(default)s)")
    p.add_argument("--compile", action="store_true", help="torch.compile the whole model")
    p.add_argument("--generate", type=int, default=0, help="time generate() of this many new tokens instead")
    p.add_argument("--cuda-graphs", action="store_true", help="with --generate: a static cache, CUDA-graphed steps")
    p.add_argument("--trace", default="", help="folder for one Chrome trace per (config, impl)")
    p.add_argument("--no-profile", action="store_true", help="skip the profiler pass (no attention share)")
    p.add_argument("--summary", type=int, default=0, help="print the profiler's top N ops by GPU and by CPU time")
    args = p.parse_args(argv)
    for name, allowed in (("models", MODELS), ("impls", IMPLS)):
        values = [x for x in getattr(args, name).split(",") if x]
        bad = [x for x in values if x not in allowed]
        if bad or not values:
            p.error(f"--{name}: unknown {bad} (choose from {','.join(allowed)})")
        setattr(args, name, values)
    try:
        args.seqs = [int(x) for x in args.seqs.split(",") if x]
        args.batches = [int(x) for x in args.batches.split(",") if x]
    except ValueError:
        p.error("--seqs and --batches take comma-separated integers")
    if not args.seqs or not args.batches or min(args.seqs + args.batches) <= 0:
        p.error("--seqs and --batches take positive integers")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    if args.cuda_graphs and not args.generate:
        p.error("--cuda-graphs applies to --generate")
    if args.padding == "packed" and args.generate:
        p.error("--padding packed is a training layout; --generate takes none or left")
    return args


def make_config(model: str, args):
    import transformers as tf

    common = dict(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seqs) + args.generate + 16,
    )
    if model == "llama":
        return tf.LlamaConfig(**common)
    if model == "mistral":
        return tf.MistralConfig(**common, sliding_window=256)
    if model == "qwen":
        return tf.Qwen2Config(**common, use_sliding_window=False)
    if model == "gemma2":
        return tf.Gemma2Config(
            **common, head_dim=args.hidden // args.heads, sliding_window=256, attn_logit_softcapping=50.0
        )
    if model == "gptoss":
        return tf.GptOssConfig(
            **{k: v for k, v in common.items() if k != "intermediate_size"},
            intermediate_size=args.hidden,
            head_dim=args.hidden // args.heads,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=128,
        )
    raise ValueError(model)


def build_model(cfg, attn_name: str):
    """A randomly initialised model of `cfg` (seed 0) running `attn_name`, on its own copy of the config:
    from_config sets the config's attention implementation in place, and every model built from one config object
    shares it, so the models of a config's impls would all run the last one's attention."""
    import copy

    import torch
    import transformers as tf

    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn_name)


def fa4_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, softcap=None, **kwargs
):
    """transformers' attention-function contract over FlashAttention-4's flash_attn_func, for the comparison only:
    causal batches without padding (the flash mask function hands over None then) or packed documents, windows and
    softcap."""
    from flash_attn.cute import flash_attn_func

    from cute_flash.integrations.transformers import _PACKED_KEYWORDS  # (the collator's keywords of packed documents)

    packed = any(kwargs.get(n) is not None for n in _PACKED_KEYWORDS)
    if attention_mask is not None or packed or dropout or kwargs.get("s_aux") is not None:
        raise NotImplementedError("the fa4 impl here takes no padding mask, packed documents, dropout or sinks")
    window = (sliding_window - 1, 0) if sliding_window else (None, None)
    out = flash_attn_func(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), softmax_scale=scaling, causal=True,
        window_size=window, softcap=softcap or 0.0,
    )  # fmt: skip
    return (out[0] if isinstance(out, tuple) else out), None


def register_fa4() -> str:
    """fa4_attention under FA4_NAME, with transformers' flash-attention mask function (None without padding)."""
    import flash_attn.cute  # noqa: F401  (fails here, reported as the impl's "not run", when FA4 is not installed)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(FA4_NAME, fa4_attention)
    AttentionMaskInterface.register(FA4_NAME, flash_attention_mask)
    return FA4_NAME


def impl_context(impl: str):
    """(attn_implementation name, a context manager around each step)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if impl == "fa4":
        return register_fa4(), contextlib.nullcontext
    if impl == "cute":
        import cute_flash.integrations.transformers as cft

        cft.register()
        return cft.DEFAULT_NAME, contextlib.nullcontext
    if impl == "eager":
        return "eager", contextlib.nullcontext
    backends = {
        "sdpa_flash": SDPBackend.FLASH_ATTENTION,
        "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    if impl in backends:
        return "sdpa", lambda: sdpa_kernel([backends[impl]])
    del torch
    return "sdpa", contextlib.nullcontext


def make_batch(batch: int, seq: int, padding: str, vocab: int, device):
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    if padding == "packed":
        # One row of `batch` documents of `seq` tokens each (DataCollatorWithFlattening's layout).
        ids = ids.reshape(1, batch * seq)
        pos = torch.arange(seq, device=device).repeat(batch).unsqueeze(0)
        cu = torch.arange(0, batch * seq + 1, seq, device=device, dtype=torch.int32)
        extra = dict(position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=seq, max_length_k=seq)
        return dict(input_ids=ids, labels=ids, **extra)
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    if padding == "left":
        for b in range(1, batch, 2):
            mask[b, : seq // 4] = 0  # every second row a quarter shorter, padded on the left
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _kernel_times(prof) -> Dict[str, float]:
    """GPU time (µs) of the profiled region: all kernels, and those whose names look like attention."""
    total = attn = 0.0
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if evt.device_type is not None and str(evt.device_type).endswith("CUDA") and t:
            total += t
            if any(m in evt.key.lower() for m in ATTN_MARKERS):
                attn += t
    return {"gpu_us": total, "attn_us": attn}


def training_step(model, batch, ctx):
    """One forward + backward step of `model` on `batch` (returns the loss, on the device)."""

    def step():
        with ctx():
            out = model(**batch)
            out.loss.backward()
        return out.loss.detach()

    return step


def time_steps(step, steps: int) -> float:
    """ms per step over `steps` back-to-back steps (CUDA events around the block)."""
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def profile_training(step, args, trace_path: str = "") -> Dict[str, float]:
    """The attention share and GPU busy time of three profiled steps (after the timed rounds)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    times = _kernel_times(prof)
    result = {"attn_share": times["attn_us"] / max(times["gpu_us"], 1e-9), "attn_ms": times["attn_us"] / 3 / 1000}
    result["gpu_ms"] = times["gpu_us"] / 3 / 1000
    if trace_path:
        os.makedirs(os.path.dirname(trace_path) or ".", exist_ok=True)
        prof.export_chrome_trace(trace_path)
    if args.summary:
        averages = prof.key_averages()
        print(averages.table(sort_by="self_device_time_total", row_limit=args.summary, max_name_column_width=60))
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.summary, max_name_column_width=60))
    return result


def generate_runner(model, batch, ctx, args):
    """generate() of --generate new tokens, warmed up once; returns (run: () -> ms of one timed call, profile: prints
    where one call's host and device time go)."""
    import torch

    kwargs = dict(max_new_tokens=args.generate, min_new_tokens=args.generate, do_sample=False)
    if args.cuda_graphs:
        kwargs["cache_implementation"] = "static"
        kwargs["compile_config"] = None
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    with torch.no_grad(), ctx():
        model.generate(**inputs, **kwargs)  # warm-up
    torch.cuda.synchronize()

    def run() -> float:
        with torch.no_grad(), ctx():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model.generate(**inputs, **kwargs)
            end.record()
            torch.cuda.synchronize()
        return start.elapsed_time(end)

    def profile_once() -> None:
        from torch.profiler import ProfilerActivity, profile

        with torch.no_grad(), ctx(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model.generate(**inputs, **kwargs)
            torch.cuda.synchronize()
        averages = prof.key_averages()
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.summary, max_name_column_width=60))
        print(averages.table(sort_by="self_device_time_total", row_limit=args.summary, max_name_column_width=60))

    return run, profile_once


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    import torch
    import transformers as tf

    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}: torch {torch.__version__}, transformers {tf.__version__}")
    mode = f"generate {args.generate}" if args.generate else "train fwd+bwd"
    print(f"{mode}, {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads}, "
          f"padding {args.padding}{', compiled' if args.compile else ''}")  # fmt: skip
    header = f"{'model':>8}{'batch':>6}{'seq':>6}{'impl':>16}{'ms':>9}{'tok/s':>11}{'attn ms':>9}{'attn %':>8}"
    header += f"{'busy %':>8}{'loss':>9}"
    print(header)
    rows = []
    for name in args.models:
        cfg = make_config(name, args)
        for b in args.batches:
            for s in args.seqs:
                if args.tokens and b * s > args.tokens:
                    continue
                batch = make_batch(b, s, args.padding, cfg.vocab_size, device)
                built = {}  # impl -> (model, a training step, or generate's (run, profile_once))
                for impl in args.impls:
                    label = f"{name:>8}{b:>6}{s:>6}{impl:>16}"
                    try:
                        attn_name, ctx = impl_context(impl)
                        model = build_model(cfg, attn_name).to(device=device, dtype=torch.bfloat16)
                        model.train(not args.generate)
                        if args.compile:
                            model = torch.compile(model)
                        if args.generate:
                            built[impl] = (model, generate_runner(model, batch, ctx, args))
                        else:
                            step = training_step(model, batch, ctx)
                            for _ in range(args.warmup):
                                step()
                            built[impl] = (model, step)
                    except Exception as e:  # noqa: BLE001 - reported per row, the grid goes on
                        print(f"{label}  not run: {type(e).__name__}: {str(e)[:120]}")
                    finally:
                        model = None
                        torch.cuda.empty_cache()
                # The impls' timed blocks interleaved over --rounds rounds (a host-bound step follows the host's
                # speed, which drifts), each impl's best round reported.
                times = {impl: [] for impl in built}
                for _ in range(args.rounds):
                    for impl, (_, step) in built.items():
                        times[impl].append(step[0]() if args.generate else time_steps(step, args.steps))
                if args.generate:
                    for impl, (_, (_, profile_once)) in built.items():
                        ms = min(times[impl])
                        print(f"{name:>8}{b:>6}{s:>6}{impl:>16}{ms:>9.1f}{b * args.generate / ms * 1000:>11.0f}"
                              f"{'':>34}  rounds " + " ".join(f"{t:.1f}" for t in times[impl]))  # fmt: skip
                        rows.append((name, b, s, impl, {"ms": ms, "rounds_ms": times[impl]}))
                        if args.summary:
                            profile_once()
                    built.clear()
                    torch.cuda.empty_cache()
                    continue
                for impl, (model, step) in built.items():
                    label = f"{name:>8}{b:>6}{s:>6}{impl:>16}"
                    r = {"ms": min(times[impl]), "rounds_ms": times[impl], "loss": float(step())}
                    if not args.no_profile:
                        trace = f"{args.trace}/{name}_b{b}_s{s}_{impl}.json" if args.trace else ""
                        r.update(profile_training(step, args, trace))
                        r["gpu_busy"] = r["gpu_ms"] / r["ms"]
                    model.zero_grad(set_to_none=True)
                    tok_s = b * s / r["ms"] * 1000
                    share = r.get("attn_share", math.nan) * 100
                    busy = r.get("gpu_busy", math.nan) * 100
                    print(f"{label}{r['ms']:>9.2f}{tok_s:>11.0f}{r.get('attn_ms', math.nan):>9.2f}"
                          f"{share:>8.1f}{busy:>8.1f}{r['loss']:>9.4f}  rounds "
                          + " ".join(f"{t:.2f}" for t in times[impl]))  # fmt: skip
                    rows.append((name, b, s, impl, r))
                built.clear()
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

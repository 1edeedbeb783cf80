"""Packed (varlen) attention speed: `cute_flash.attention_varlen` beside dense cute-flash at equal tokens and equal
work, and FlashAttention-4's `flash_attn_varlen_func` (and `flash_attn_func` on the dense shape) when it imports
(issue 16's benchmark).

The batch: sequence lengths drawn uniformly from 128..8192 (seeded) until 64k tokens, the last one cut to fit. Work is
counted per sequence: forward 4·h·d·s² FLOPs (halved when causal), backward 2.5x that; TFLOP/s = work / median time.
The dense comparison runs batch x L with L = sum(s²) / sum(s) rounded to 128, which has (nearly) the same tokens and
the same work as the packed batch. cute-flash runs on the sm80 family and, on Hopper, also on the router's choice
(the sm90 kernels, packed and dense). One process, one GPU:

    python -m profiling.varlen_benchmark [--tokens 65536] [--heads 16] [--head-dim 128] [--causal both|yes|no]
    python -m profiling.varlen_benchmark --lengths 8192x8 --no-sm80      # equal lengths: what packing itself costs
    python -m profiling.varlen_benchmark --no-sm80 --rounds 3            # medians of 3 rounds, FA4 in between
"""

from __future__ import annotations

import argparse
import os
import random
from contextlib import contextmanager
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch


SETTLE_S = [0.0]  # --settle: seconds each timed function first runs untimed (set by main)


def back_to_back(fn: Callable[[], object], seconds: float) -> int:
    """Runs `fn` back to back for `seconds` (synchronising every 5 calls) and returns how many calls ran. --settle
    runs it before a timing, so that the timing starts in the power state this workload itself reaches rather than
    the one the row before left; sustained_clocks times it."""
    import time

    calls, t0 = 0, time.time()
    while time.time() - t0 < seconds:
        for _ in range(5):
            fn()
        calls += 5
        torch.cuda.synchronize()
    return calls


def _bench_ms(fn: Callable[[], object]) -> float:
    if SETTLE_S[0] > 0:
        back_to_back(fn, SETTLE_S[0])
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=50, rep=200, return_mode="median"))
    except ImportError:  # pragma: no cover - the GPU machine has triton
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 20


def draw_lengths(tokens: int, lo: int, hi: int, seed: int) -> List[int]:
    rng = random.Random(seed)
    lens: List[int] = []
    while sum(lens) < tokens:
        lens.append(rng.randint(lo, hi))
    lens[-1] -= sum(lens) - tokens
    if lens[-1] < lo and len(lens) > 1:  # fold a short remainder into its neighbour
        lens[-2] += lens.pop()
    return lens


def cu_seqlens(lens: List[int], device) -> torch.Tensor:
    """int32 (batch + 1,) offsets of packed sequences of these lengths."""
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def equal_work_dense(lens: List[int]) -> tuple:
    """(batch, seqlen) of the dense call with (nearly) the packed batch's tokens and work: seqlen = sum(s²) / sum(s)
    rounded to 128, batch = tokens / seqlen."""
    total = sum(lens)
    seqlen = max(128, round(sum(s * s for s in lens) / total / 128) * 128)
    return max(1, round(total / seqlen)), seqlen


def parse_lengths(text: str) -> List[int]:
    """`--lengths`: comma-separated sequence lengths, LxN for N of length L."""
    return [int(n) for part in text.split(",") for n in _expand(part)]


def _expand(part: str) -> List[str]:
    length, _, count = part.partition("x")
    return [length] * int(count or 1)


@contextmanager
def _family(name: Optional[str]):
    old = os.environ.get("CUTE_FLASH_ARCH")
    if name is None:
        os.environ.pop("CUTE_FLASH_ARCH", None)
    else:
        os.environ["CUTE_FLASH_ARCH"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUTE_FLASH_ARCH", None)
        else:
            os.environ["CUTE_FLASH_ARCH"] = old


MIN_LEN, MAX_LEN = 128, 8192  # the drawn sequence lengths (--min-len, --max-len; profiling.target --varlen-seed)


def fa4_function(name: str) -> Optional[Callable]:
    """flash_attn.cute's `name` (flash_attn_varlen_func / flash_attn_func), or None where FA4 does not import."""
    try:
        import flash_attn.cute as fa4

        return getattr(fa4, name)
    except Exception:  # noqa: BLE001
        return None


def first_output(out):
    return out[0] if isinstance(out, tuple) else out


def peer_calls(
    lens: List[int],
    heads: int,
    head_dim: int,
    causal: bool = False,
    grad: bool = False,
    dense: bool = True,
    peers: bool = True,
    seed: Optional[int] = None,
) -> Dict[str, Tuple[Callable[[], torch.Tensor], tuple]]:
    """The forward calls of one packed batch of `lens` on random bf16 inputs (drawn from `seed` when given):
    "ours varlen", "FA4 varlen"; with `dense` also "ours dense BxL" / "FA4 dense BxL" at equal work
    (`equal_work_dense`). Each with its (q, k, v), which require grad when `grad`. FA4's rows only with `peers` and
    where flash_attn.cute imports."""
    import cute_flash

    g = None if seed is None else torch.Generator(device="cuda").manual_seed(seed)

    def make(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_(grad)

    q, k, v = (make(sum(lens), heads, head_dim) for _ in range(3))
    cu, mx = cu_seqlens(lens, "cuda"), max(lens)
    calls = {"ours varlen": (lambda: cute_flash.attention_varlen(q, k, v, cu, cu, mx, mx, causal=causal), (q, k, v))}
    fa4 = fa4_function("flash_attn_varlen_func") if peers else None
    if fa4 is not None:
        run = lambda: first_output(  # noqa: E731
            fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx, causal=causal)
        )
        calls["FA4 varlen"] = (run, (q, k, v))
    if dense:
        batch, seqlen = equal_work_dense(lens)
        dq, dk, dv = (make(batch, seqlen, heads, head_dim) for _ in range(3))
        calls[f"ours dense {batch}x{seqlen}"] = (lambda: cute_flash.attention(dq, dk, dv, causal=causal), (dq, dk, dv))
        fa4_dense = fa4_function("flash_attn_func") if peers else None
        if fa4_dense is not None:
            run = lambda: first_output(fa4_dense(dq, dk, dv, causal=causal))  # noqa: E731
            calls[f"FA4 dense {batch}x{seqlen}"] = (run, (dq, dk, dv))
    return calls


KERNELS: List[str] = []  # --kernels: per-kernel device time of each timed call, printed after the tables


def _fwd_bwd_ms(run: Callable[[], torch.Tensor], leaves, name: str = "") -> tuple:
    """(forward ms, backward ms): the backward alone, timed on a graph kept for replay with a fixed dout."""
    fwd = _bench_ms(lambda: run())
    out = run()
    dout = torch.randn_like(out)

    def backward():
        torch.autograd.grad(out, leaves, dout, retain_graph=True)

    if KERNELS:
        from .bwd_breakdown import kernel_times

        for direction, fn in (("fwd", run), ("bwd", backward)):
            parts = sorted(kernel_times(fn, 5).items(), key=lambda kv: -kv[1])
            KERNELS.append(f"{name:<40} {direction}: " + ", ".join(f"{k} {us:.0f}" for k, us in parts))
    return fwd, _bench_ms(backward)


class _Row(NamedTuple):
    """One timed row of `bench`: family "sm80" / None (the router's choice) for ours, "peer" for FA4's (its failure
    becomes a note), "note" for a peer that does not import (nothing to time)."""

    name: str
    family: Optional[str]
    fn: Optional[Callable[[], torch.Tensor]] = None
    leaves: tuple = ()
    flops: float = 0.0
    label: str = ""


def rotated(items: list, turn: int) -> list:
    """`items` starting from item `turn` (mod their number), the ones before it last: the order one round times its
    rows in. A row timed for 200 ms inherits the power state the rows before it left (at the power cap a few percent
    of clock, docs/performance.md session 28), so successive rounds start at successive rows instead of always
    timing the same row first."""
    if not items:
        return []
    k = turn % len(items)
    return items[k:] + items[:k]


def bench(
    lens: List[int],
    heads: int,
    head_dim: int,
    causal: bool,
    seed: int = 0,
    sm80: bool = True,
    peers: bool = True,
    turn: int = 0,
) -> List[dict]:
    """One round: every row's forward and backward times, the rows timed in the order `rotated(rows, turn)` and
    returned in their usual order."""
    import cute_flash

    dtype, dev = torch.bfloat16, "cuda"
    total = sum(lens)
    g = torch.Generator(device=dev).manual_seed(seed)

    def make(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32).to(dtype).requires_grad_(True)

    cu = cu_seqlens(lens, dev)
    q, k, v = make(total, heads, head_dim), make(total, heads, head_dim), make(total, heads, head_dim)
    fwd_flops = sum(4 * heads * head_dim * s * s for s in lens) * (0.5 if causal else 1.0)
    jobs: List[_Row] = []
    mx = max(lens)
    varlen = lambda: cute_flash.attention_varlen(q, k, v, cu, cu, mx, mx, causal=causal)  # noqa: E731
    hopper = torch.cuda.get_device_capability() == (9, 0)  # the router's choice: the sm90 packed kernels
    if sm80:
        jobs.append(_Row("cute-flash varlen sm80", "sm80", varlen, (q, k, v), fwd_flops, "varlen sm80"))
    if hopper:
        jobs.append(_Row("cute-flash varlen default", None, varlen, (q, k, v), fwd_flops, "varlen"))
    if peers:
        # Dense at equal tokens and (nearly) equal work: batch x L with L = sum(s^2) / sum(s).
        batch, seqlen = equal_work_dense(lens)
        dq, dk, dv = (make(batch, seqlen, heads, head_dim) for _ in range(3))
        dense_flops = 4 * heads * head_dim * batch * seqlen * seqlen * (0.5 if causal else 1.0)
        dense = lambda: cute_flash.attention(dq, dk, dv, causal=causal)  # noqa: E731
        shape = f"({batch}x{seqlen})"
        if sm80:
            jobs.append(_Row(f"cute-flash dense sm80 {shape}", "sm80", dense, (dq, dk, dv), dense_flops, "dense sm80"))
        if hopper:
            jobs.append(_Row(f"cute-flash dense default {shape}", None, dense, (dq, dk, dv), dense_flops, "dense"))
        fa4 = fa4_function("flash_attn_varlen_func")
        if fa4 is not None:

            def fa4_run():
                return first_output(
                    fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx, causal=causal)
                )

            jobs.append(_Row("FA4 varlen", "peer", fa4_run, (q, k, v), fwd_flops, "FA4 varlen"))
        else:
            jobs.append(_Row("FA4 varlen: flash_attn.cute does not import", "note"))
        fa4_dense = fa4_function("flash_attn_func")
        if fa4_dense is not None:  # separates our dense kernels' distance to FA4 from what packing costs
            run = lambda: first_output(fa4_dense(dq, dk, dv, causal=causal))  # noqa: E731
            jobs.append(_Row(f"FA4 dense {shape}", "peer", run, (dq, dk, dv), dense_flops, "FA4 dense"))

    rows = {}
    for name, family, fn, leaves, flops, label in rotated([j for j in jobs if j.family != "note"], turn):
        try:
            if family == "peer":
                fwd_ms, bwd_ms = _fwd_bwd_ms(fn, leaves, label)
            else:
                with _family(family):
                    fwd_ms, bwd_ms = _fwd_bwd_ms(fn, leaves, label)
        except Exception as e:  # noqa: BLE001
            if family != "peer":
                raise
            rows[name] = {"impl": f"{name}: failed ({type(e).__name__}: {e})"[:120]}
            continue
        rows[name] = {
            "impl": name, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "fwd_tflops": flops / fwd_ms / 1e9,
            "bwd_tflops": 2.5 * flops / bwd_ms / 1e9 if bwd_ms else None,
        }  # fmt: skip
    return [{"impl": j.name} if j.family == "note" else rows[j.name] for j in jobs]


def median_rows(rounds: List[List[dict]]) -> List[dict]:
    """The rows of one `bench` call, each timing the median over `rounds` (the same rows, timed in turn)."""
    import statistics

    out = []
    for rows in zip(*rounds):
        row = dict(rows[0])
        if "fwd_ms" in row:
            for key, flops_key in (("fwd_ms", "fwd_tflops"), ("bwd_ms", "bwd_tflops")):
                if row[key]:
                    ms = statistics.median(r[key] for r in rows)
                    row[flops_key] = row[flops_key] * row[key] / ms
                    row[key] = ms
        out.append(row)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--min-len", type=int, default=MIN_LEN)
    ap.add_argument("--max-len", type=int, default=MAX_LEN)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lengths", help="these sequence lengths (comma-separated, LxN: N of length L), not a draw")
    ap.add_argument("--order", choices=("drawn", "longest-first", "shortest-first"), default="drawn",
                    help="order of the sequences in cu_seqlens")  # fmt: skip
    ap.add_argument("--no-sm80", action="store_true", help="skip the sm80 family (Hopper: time the sm90 kernels only)")
    ap.add_argument("--kernels", action="store_true", help="also print each call's device time per kernel (µs)")
    ap.add_argument("--rounds", type=int, default=1, help="time every row this many times in turn (ours and FA4 "
                    "alternating in one process, each round starting one row later: `rotated`) and print the "
                    "medians; single runs move by a few percent")  # fmt: skip
    ap.add_argument("--settle", type=float, default=0.0, help="run each timed call untimed for this many seconds "
                    "first (its own power state under the cap, not the previous row's)")  # fmt: skip
    ap.add_argument("--no-peers", action="store_true", help="only cute-flash's packed call (no dense, no FA4)")
    args = ap.parse_args(argv)
    SETTLE_S[0] = args.settle

    if args.lengths:
        lens = parse_lengths(args.lengths)
    else:
        lens = draw_lengths(args.tokens, args.min_len, args.max_len, args.seed)
    if args.order != "drawn":
        lens.sort(reverse=args.order == "longest-first")
    print(f"{torch.cuda.get_device_name()}: {len(lens)} sequences, {sum(lens)} tokens, lengths {min(lens)}..{max(lens)}"
          f", h{args.heads} d{args.head_dim} bf16")  # fmt: skip
    if args.kernels:
        KERNELS.append("")
    for causal in {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]:
        print(f"\n{'causal' if causal else 'non-causal'}")
        print(f"{'impl':<44}{'fwd ms':>9}{'fwd TF/s':>10}{'bwd ms':>9}{'bwd TF/s':>10}")
        rounds = [
            bench(lens, args.heads, args.head_dim, causal, args.seed, not args.no_sm80, not args.no_peers, turn)
            for turn in range(max(1, args.rounds))
        ]
        for r in median_rows(rounds):
            if "fwd_ms" not in r:
                print(r["impl"])
                continue
            print(
                f"{r['impl']:<44}{r['fwd_ms']:>9.3f}{r['fwd_tflops']:>10.1f}{r['bwd_ms']:>9.3f}{r['bwd_tflops']:>10.1f}"
            )
        if KERNELS:
            print("per-kernel device time (µs, mean of 5 calls under torch.profiler):", *KERNELS[1:], sep="\n  ")
            del KERNELS[1:]


if __name__ == "__main__":
    main()

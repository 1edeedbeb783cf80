"""Inputs and acceptance checks shared by the GPU tests and the benchmark.

The rule is FlashAttention's: a kernel's error against the float64 reference may be at most twice the error of the
same computation done by plain torch in the input dtype, plus 1e-5. It applies to outputs, lse and each gradient (dq,
dk, dv and, with learnable sinks, dsink). Softcap and sinks reach the references through the checks' keyword
arguments (`softcap=`, `learnable_sink=`), as they reach `cute_flash.attention`. KV-cache calls are checked by
`check_kvcache` (out / lse by the rule, the updated caches exactly), with page tables from `random_page_table`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from .arch.base import BwdTensors, Grads
from .reference import attention_reference, expand_kv, kvcache_reference, visible_keys
from .spec import normalize_mask

ABS_SLACK = 1e-5
# FP8's max-error rule (docs/fp8.md, "Error budget"): 2x the error of an emulation of the FP8 recipe plus this.
FP8_ABS_SLACK = 2e-3

# The correctness matrix every family's GPU tests run (with the head dims that family builds).
MATRIX_SEQLENS = [(1, 1), (113, 203), (128, 128), (239, 1), (1023, 1024), (2048, 2048)]
MATRIX_HEADS = [(8, 8), (8, 2), (8, 1)]
MATRIX_MASKS = {"full": {}, "causal": {"causal": True}, "window64_0": {"window_size": (64, 0)}}
MATRIX_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ErrorReport:
    name: str
    err: float  # max |kernel - reference|
    baseline_err: float  # max |plain torch in the input dtype - reference|
    abs_slack: float = ABS_SLACK

    @property
    def bound(self) -> float:
        return 2.0 * self.baseline_err + self.abs_slack

    @property
    def ok(self) -> bool:
        return self.err <= self.bound

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        return f"{self.name}: err {self.err:.3e} vs bound {self.bound:.3e} (torch {self.baseline_err:.3e}) {verdict}"


def random_qkv(
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    nheads: int,
    nheads_kv: int,
    head_dim: int,
    head_dim_v: Optional[int] = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
    seed: Optional[int] = None,
    requires_grad: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh N(0, 1) inputs; never zeros, which hide unwritten outputs and indexing errors."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else torch.seed() % (2**31))
    dv = head_dim if head_dim_v is None else head_dim_v

    def make(*shape):
        return (
            torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
            .to(dtype)
            .requires_grad_(requires_grad)
        )

    q = make(batch, seqlen_q, nheads, head_dim)
    k = make(batch, seqlen_k, nheads_kv, head_dim)
    v = make(batch, seqlen_k, nheads_kv, dv)
    return q, k, v


def matrix_inputs(head_dim: int, seqlens: Tuple[int, int], heads: Tuple[int, int], dtype: str):
    """Inputs of one matrix case; two batch entries unless the float64 reference would get large."""
    seqlen_q, seqlen_k = seqlens
    batch = 2 if seqlen_q * seqlen_k <= (1 << 20) else 1
    return random_qkv(batch, seqlen_q, seqlen_k, *heads, head_dim, dtype=MATRIX_DTYPES[dtype], seed=seqlen_q + head_dim)


def attention_and_check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **attn_kwargs) -> Sequence["ErrorReport"]:
    """Runs `cute_flash.attention` and checks out and lse against the reference (raises AssertionError)."""
    from .interface import attention

    out, lse = attention(q, k, v, return_lse=True, **attn_kwargs)
    return check_forward(q, k, v, out, lse, **attn_kwargs)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def check_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: Optional[torch.Tensor] = None,
    **attn_kwargs,
) -> Sequence[ErrorReport]:
    """Error reports for out (and lse when given); raises AssertionError when any breaks the rule or is not finite.

    attn_kwargs: causal, softmax_scale, window_size, softcap, learnable_sink — as passed to cute_flash.attention.
    """
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **attn_kwargs)
    low, low_lse = attention_reference(q, k, v, compute_dtype=q.dtype, return_lse=True, **attn_kwargs)
    reports = [ErrorReport("out", _max_abs(out, ref), _max_abs(low, ref))]
    if lse is not None:
        reports.append(_lse_report(lse, ref_lse, low_lse))
    _assert_all(reports, finite=[("out", out)])
    return reports


def _lse_report(lse: torch.Tensor, ref_lse: torch.Tensor, low_lse: torch.Tensor) -> ErrorReport:
    """LSE rows that see no key must be -inf exactly; the rest follow the rule (with an fp32 floor on the baseline)."""
    masked = torch.isinf(ref_lse)
    if not torch.equal(torch.isinf(lse) & (lse < 0), masked):
        return ErrorReport("lse(-inf rows)", float("inf"), 0.0)
    keep = ~masked
    err = _max_abs(lse[keep], ref_lse[keep])
    baseline = max(_max_abs(low_lse[keep], ref_lse[keep]), 1e-4)
    return ErrorReport("lse", err, baseline)


def check_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    grads: Tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    dlse: Optional[torch.Tensor] = None,
    dsink: Optional[torch.Tensor] = None,
    **attn_kwargs,
) -> Sequence[ErrorReport]:
    """Error reports for (dq, dk, dv) against float64 autograd through the reference, with the same rule; dlse: the
    loss's gradient of lse too (the reference's lse takes it); dsink: the kernel's (h,) sink gradient, checked the
    same way when attn_kwargs holds `learnable_sink`."""
    sink = attn_kwargs.pop("learnable_sink", None)
    _check_dsink_request(sink, dsink)

    def reference_grads(compute_dtype):
        leaves, kw = _reference_leaves((q, k, v), sink, compute_dtype)
        out, lse = attention_reference(*leaves[:3], compute_dtype=compute_dtype, return_lse=True, **kw, **attn_kwargs)
        outputs, grads_in = (out,), (dout.to(compute_dtype),)
        if dlse is not None:
            outputs, grads_in = (out, lse), (dout.to(compute_dtype), dlse.to(lse.dtype))
        got = torch.autograd.grad(outputs, leaves, grads_in, allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, got)]

    names, kernel_grads = _grad_names(grads, dsink)
    ref = reference_grads(torch.float64)
    low = reference_grads(q.dtype)
    reports = [ErrorReport(n, _max_abs(g, r), _max_abs(lo, r)) for n, g, r, lo in zip(names, kernel_grads, ref, low)]
    _assert_all(reports, finite=list(zip(names, kernel_grads)))
    return reports


def _check_dsink_request(sink: Optional[torch.Tensor], dsink: Optional[torch.Tensor]) -> None:
    if dsink is not None and sink is None:
        raise ValueError("dsink is checked against the reference's sink gradient: pass learnable_sink= as well")


def _reference_leaves(tensors, sink: Optional[torch.Tensor], compute_dtype: torch.dtype):
    """Detached leaves of q, k, v (and the sink, last) in compute_dtype, and the reference's sink keyword."""
    leaves = [t.detach().to(compute_dtype).requires_grad_(True) for t in tensors]
    if sink is None:
        return leaves, {}
    s = sink.detach().to(compute_dtype).requires_grad_(True)
    return leaves + [s], {"learnable_sink": s}


def _grad_names(grads, dsink: Optional[torch.Tensor]):
    names = ("dq", "dk", "dv") + (("dsink",) if dsink is not None else ())
    return names, tuple(grads) + ((dsink,) if dsink is not None else ())


def check_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: Optional[torch.Tensor] = None,
    grads: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    dlse: Optional[torch.Tensor] = None,
    dsink: Optional[torch.Tensor] = None,
    **attn_kwargs,
) -> Sequence[ErrorReport]:
    """`attention_varlen`'s out, lse and (with grads) dq, dk, dv (and dsink, with `learnable_sink`) against the
    per-sequence float64 reference, by the same rule; dlse: the loss's gradient of lse too. A row that sees no key
    must give out 0 and dq 0 exactly, not merely small. attn_kwargs: causal, softmax_scale, window_size, seqused_k,
    seqused_q, softcap, learnable_sink."""
    from .reference import attention_varlen_reference

    sink = attn_kwargs.pop("learnable_sink", None)
    _check_dsink_request(sink, dsink)
    seqs = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)

    def reference(compute_dtype):
        leaves, kw = _reference_leaves((q, k, v), sink, compute_dtype)
        o, l_ = attention_varlen_reference(
            *leaves[:3], *seqs, compute_dtype=compute_dtype, return_lse=True, **kw, **attn_kwargs
        )
        gs = None
        if grads is not None:
            outs, grads_in = (o,), (dout.to(compute_dtype),)
            if dlse is not None:
                outs, grads_in = (o, l_), (dout.to(compute_dtype), dlse.to(l_.dtype))
            gs = [None] * len(leaves)
            if o.requires_grad:  # not when no sequence has a query and a key: then every gradient is 0
                gs = torch.autograd.grad(outs, leaves, grads_in, allow_unused=True)
            gs = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, gs)]
        return o, l_, gs

    ref, ref_lse, ref_g = reference(torch.float64)
    low, low_lse, low_g = reference(q.dtype)
    # Rows that see no key: lse -inf without sinks; with sinks their lse is the sink, so ask the reference without.
    no_key_lse = ref_lse
    if sink is not None:
        with torch.no_grad():
            _, no_key_lse = attention_varlen_reference(q, k, v, *seqs, return_lse=True, **attn_kwargs)
    empty = torch.isneginf(no_key_lse).transpose(0, 1)  # (total_q, h)
    assert torch.count_nonzero(out[empty]) == 0, "rows without keys must give out 0"
    if grads is not None:
        assert torch.count_nonzero(grads[0][empty]) == 0, "rows without keys must give dq 0"
    reports = [ErrorReport("out", _max_abs(out, ref), _max_abs(low, ref)), _lse_report(lse, ref_lse, low_lse)]
    finite = [("out", out)]
    if grads is not None:
        names, kernel_grads = _grad_names(grads, dsink)
        reports += [
            ErrorReport(n, _max_abs(g, r), _max_abs(lo, r)) for n, g, r, lo in zip(names, kernel_grads, ref_g, low_g)
        ]
        finite += list(zip(names, kernel_grads))
    _assert_all(reports, finite)
    return reports


# --- KV-cache calls (serving) -----------------------------------------------------------------------------------
def check_hard_max(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, causal: bool = False,
                   window_size=(None, None)) -> None:  # fmt: skip
    """For a softmax_scale so large that the softmax is a hard max (scale x score overflows fp32, where FlashAttention's
    rule has no finite baseline): each row's output must be v at its best visible key (0 for a row without keys).
    q (b, sq, h, d), k / v (b, sk, h_kv, d) dense (dequantise an fp8 cache first). Rows whose two best scores are
    within 1e-3 (relative) are skipped: fp32 scores may order those differently from float64."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), expand_kv(k.double(), h))
    hidden = ~visible_keys(sq, sk, normalize_mask(causal, window_size), device=q.device)
    scores = scores.masked_fill(hidden, float("-inf"))
    top = scores.topk(min(2, sk), dim=-1)
    best = top.indices[..., 0]  # (b, h, sq)
    vx = expand_kv(v.double(), h)  # (b, sk, h, dv)
    expect = torch.gather(vx.permute(0, 2, 1, 3), 2, best.unsqueeze(-1).expand(-1, -1, -1, v.shape[-1]))
    expect = expect.permute(0, 2, 1, 3)  # (b, sq, h, dv)
    empty = torch.isneginf(top.values[..., 0]).permute(0, 2, 1)  # (b, sq, h)
    expect[empty] = 0
    clear = torch.ones_like(empty)
    if sk > 1:
        m1, m2 = top.values[..., 0], top.values[..., 1]
        clear = ((m1 - m2) > 1e-3 * m1.abs().clamp_min(1.0)) | torch.isneginf(m2) | torch.isneginf(m1)
        clear = clear.permute(0, 2, 1)
    assert clear.float().mean() > 0.9, "test inputs have too many near-ties"
    assert torch.isfinite(out).all()
    # P is rounded to the input dtype for the P·V product and out once more: each costs up to 2^-9 relative in bf16.
    err = ((out.double() - expect).abs() / (1.0 + expect.abs())).amax(dim=-1)[clear].max().item()
    assert err <= 1e-2, f"hard-max error {err} (relative to 1 + |v|)"


def capture_graph(fn):
    """(graph, result): `fn` warmed once on a side stream (as torch's CUDA-graph docs do: kernels compiled and loaded
    outside the capture), then one call captured in a new torch.cuda.CUDAGraph; replay it after writing new values
    into the tensors `fn` reads."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def random_page_table(
    batch: int,
    pages_per_seq: int,
    *,
    num_pages: Optional[int] = None,
    shared_pages: int = 0,
    device: str = "cuda",
    seed: Optional[int] = None,
) -> torch.Tensor:
    """A (batch, pages_per_seq) int32 page table over a pool of `num_pages` pages in random order: the first
    `shared_pages` entries of every row are the same pages (a prefix the sequences share), the others are distinct
    pages of each sequence. num_pages defaults to exactly the pages used; a larger pool leaves some pages unused."""
    if not 0 <= shared_pages <= pages_per_seq:
        raise ValueError(f"shared_pages must be within [0, pages_per_seq = {pages_per_seq}], got {shared_pages}")
    needed = shared_pages + batch * (pages_per_seq - shared_pages)
    num_pages = needed if num_pages is None else num_pages
    if num_pages < needed:
        raise ValueError(f"the table needs {needed} distinct pages, the pool has {num_pages}")
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % (2**31))
    pool = torch.randperm(num_pages, generator=gen)[:needed]
    shared, own = pool[:shared_pages], pool[shared_pages:].view(batch, pages_per_seq - shared_pages)
    table = torch.cat([shared.expand(batch, shared_pages), own], dim=1)
    return table.to(device=device, dtype=torch.int32)


def check_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    lse: Optional[torch.Tensor],
    k_cache_after: Optional[torch.Tensor] = None,
    v_cache_after: Optional[torch.Tensor] = None,
    **kvcache_kwargs,
) -> Sequence[ErrorReport]:
    """A KV-cache call's out (and lse) against `kvcache_reference` by the rule (float64, and the baseline computed in
    q's dtype from the same dequantised keys), and its caches after the call: `k_cache_after` / `v_cache_after` must
    equal the reference's updated caches bit for bit (the new tokens in their slots, every other slot unchanged).
    k_cache / v_cache: the caches as they were before the call (clone them first: the call writes in place).
    kvcache_kwargs: those of `kvcache_reference` (cache_seqlens, page_table, k_new, ...)."""
    ref = kvcache_reference(q, k_cache, v_cache, return_lse=True, **kvcache_kwargs)
    low = kvcache_reference(q, k_cache, v_cache, return_lse=True, compute_dtype=q.dtype, **kvcache_kwargs)
    reports = [ErrorReport("out", _max_abs(out, ref.out), _max_abs(low.out, ref.out))]
    if lse is not None:
        reports.append(_lse_report(lse, ref.lse, low.lse))
    for name, got, want in (("k_cache", k_cache_after, ref.k_cache), ("v_cache", v_cache_after, ref.v_cache)):
        if got is None:
            continue
        if got.shape != want.shape or not torch.equal(_bits(got), _bits(want)):
            changed = (
                (_bits(got) != _bits(want)).flatten(2).any(-1).nonzero().tolist() if got.shape == want.shape else []
            )
            raise AssertionError(
                f"{name} after the call differs from the reference's at (page or batch, row) {changed[:8]}"
            )
    _assert_all(reports, finite=[("out", out)])
    return reports


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers: equality of bits (NaN == NaN, fp8 compared without arithmetic)."""
    return t.contiguous().view(torch.uint8)


def _assert_all(reports: Sequence[ErrorReport], finite) -> None:
    for name, t in finite:
        if not torch.isfinite(t).all():
            raise AssertionError(f"{name} has non-finite values")
    bad = [str(r) for r in reports if not r.ok]
    if bad:
        raise AssertionError("; ".join(bad))


def summarize(reports: Sequence[ErrorReport]) -> Dict[str, float]:
    return {r.name: r.err for r in reports}


def stable_seed(*params) -> int:
    """A seed derived from a test's parameters (the same case draws the same inputs in every process)."""
    return sum((i + 1) * ord(c) for i, c in enumerate(repr(params))) % (2**31)


def backward_inputs(
    dtype: torch.dtype,
    head_dim: int,
    seqlen_q: int,
    seqlen_k: int,
    nheads: int,
    nheads_kv: int,
    seed: int,
    batch: Optional[int] = None,
    head_dim_v: Optional[int] = None,
):
    """q, k, v (requiring grad) and an output gradient dout, all fresh N(0, 1); two batch entries for small cases.
    head_dim_v: v's and dout's (head_dim by default)."""
    b = batch or (2 if seqlen_q * seqlen_k <= 256 * 256 else 1)
    dv = head_dim if head_dim_v is None else head_dim_v
    q, k, v = random_qkv(
        b, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dv, dtype=dtype, seed=seed, requires_grad=True
    )
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed + 1)
    dout = torch.randn(b, seqlen_q, nheads, dv, generator=gen, device="cuda").to(dtype)
    return q, k, v, dout


def backward_kernel_grads(run_backward, q, k, v, dout, causal: bool, window_size, **kwargs):
    """A family's backward kernels alone (`run_backward`), fed out / lse from the reference forward (out rounded to
    the input dtype), so that a backward failure is told apart from a forward one. Gradients start as NaN."""
    from .validation import validate

    problem = validate(q, k, v, causal=causal, softmax_scale=None, window_size=window_size, dtype=None)
    with torch.no_grad():
        out, lse = attention_reference(
            q, k, v, causal=causal, window_size=window_size, compute_dtype=torch.float32, return_lse=True
        )
    out = out.to(q.dtype)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    run_backward(BwdTensors(dout, q.detach(), k.detach(), v.detach(), out, lse), Grads(*grads), problem, **kwargs)
    return grads

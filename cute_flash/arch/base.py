"""The contract between the torch front end and a kernel family.

The front end (the call core, `cute_flash.core`) validates every input before it reaches a backend, allocates the
outputs and normalises the mask; a backend only checks what its kernels support (`unsupported_reason`), compiles through
`cute_flash.compile_cache`, and launches on torch's current stream.

Tensor conventions handed to a backend (all on one CUDA device, last dimension contiguous, other strides arbitrary):
  q (b, sq, h, d), k (b, sk, h_kv, d), v (b, sk, h_kv, dv), out (b, sq, h, dv) in the input dtype,
  lse (b, h, sq) float32 contiguous, natural log; -inf for a row that sees no key (its out row is 0).
  GQA: query head i reads kv head i // (h // h_kv).
  sink (spec.sink): fp32 logits as a (rows, h) view, read as sink[row, head] for query row `row` (within its
  sequence) of head `head`: the (h,) learnable sinks expanded along the rows (row stride 0), or, where decoding packs
  a KV head's query heads as the rows of one problem (decode.py), the view that maps each packed row to its query
  head's sink. Only the forward reads it; the backward's sink gradient needs lse and D alone (`sink_grad`).
  softcap (spec.softcap): `Problem.softcap` > 0, the value of the cap.

Kernels built for spec.softcap or spec.sink take two more arguments after the window bounds (common/entries.py,
"feature" entries): softcap (Float32, 0.0 when unused) and the sink view (None when unused); the backward main
kernels take softcap only. Builds without these features keep the plain entries, so their generated code and
calling convention do not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, NamedTuple, Optional, Protocol, Tuple

import torch

from .. import compile_cache
from ..kernel_layout import kernel_view
from ..problem import KvCacheProblem, PackedSeqs, Problem, VarlenProblem  # noqa: F401  (part of this contract)
from ..spec import AttentionSpec


@dataclass
class KernelArtifact:
    """One compiled kernel as the `compile` command reports it."""

    kernel: str  # a short role name: "fwd", "bwd_preprocess", "bwd", ...
    ptx: str
    cubin: bytes
    config: Dict[str, object] = field(default_factory=dict)  # tile sizes etc., for the report


class FwdTensors(NamedTuple):
    """What a forward reads (q, k, v) and fills (out, lse); conventions above."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    sink: Optional[torch.Tensor] = None  # spec.sink: the (rows, h) fp32 view of the conventions above


class BwdTensors(NamedTuple):
    """What a backward reads: the output's gradient and the forward's inputs and outputs (conventions above; dout
    like out), and the gradient of lse when the loss uses lse (None otherwise; like lse, any strides)."""

    dout: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    dlse: Optional[torch.Tensor] = None
    sink: Optional[torch.Tensor] = None  # spec.sink: the (h,) fp32 sink logits


class Grads(NamedTuple):
    """What a backward fills: dq, dk, dv, shaped and typed like q, k, v; with spec.sink, dsink (h,) fp32 as well."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dsink: Optional[torch.Tensor] = None


class KvCacheTensors(NamedTuple):
    """What a KV-cache forward (spec.kvcache, `ArchBackend.forward_kvcache`) reads and fills.

    q (b, sq, h, d), or packed (total_q, h, d) with cu_seqlens_q; k_cache (num_pages, page_size, h_kv, d) and
    v_cache (num_pages, page_size, h_kv, dv), a dense cache being (b, seqlen_cache, h_kv, d) read as one page per
    sequence (page_table None); out like q with dv; lse (b, h, sq) or (h, total_q) fp32; seqlens_k (b,) int32, the
    keys of each sequence (new tokens already appended); page_table (b, max_pages) int32: page i of sequence b holds
    its keys [i * page_size, (i + 1) * page_size); sink (h,) fp32 (the kernel maps its packed rows to query heads);
    k_descale / v_descale (b, h_kv) fp32 for an fp8 cache (spec.kv_fp8). Query heads g * group .. g * group +
    group - 1 (group = h // h_kv) of a KV head g are the rows of its tiles, (query token, head) pairs; page indices
    are trusted (the front end documents the contract: every page a sequence's length reaches is a valid page)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    seqlens_k: torch.Tensor
    page_table: Optional[torch.Tensor] = None
    cu_seqlens_q: Optional[torch.Tensor] = None
    sink: Optional[torch.Tensor] = None
    k_descale: Optional[torch.Tensor] = None
    v_descale: Optional[torch.Tensor] = None


# forward_launcher's result: (q, k, v, out, lse[, sink]) -> None, the tensors as FwdTensors holds them (the sink view
# passed only with spec.sink).
ForwardLauncher = Callable[..., None]
# backward_launcher's result: (BwdTensors, Grads) -> None.
BackwardLauncher = Callable[[BwdTensors, Grads], None]


class ArchBackend(Protocol):
    """Every attribute and method the front end uses (tests/test_backend_protocol.py checks each family against all
    of it). A family implements what it has kernels for and inherits the rest from `BackendBase`, whose defaults
    raise NotImplementedError naming the family and the missing kernel (the router asks `unsupported_reason` and
    the `varlen` flag first, so a call reaches them only when a family claims what it lacks)."""

    name: str  # "sm80" | "sm90" | "sm100"
    cute_arch: str  # default CuTe DSL target when cross-compiling: "sm_80" | "sm_90a" | "sm_100a"
    split_keys: bool  # forward_launcher splits the keys of calls with few query tiles over CTAs (decoding)
    varlen: bool  # has packed-sequence kernels (forward_varlen / backward_varlen): the router sends spec.varlen here
    kvcache: bool  # has a KV-cache forward (kvcache_splits / forward_kvcache): the router sends spec.kvcache here

    def unsupported_reason(self, spec: AttentionSpec, backward: bool, deterministic: bool = False) -> Optional[str]:
        """None when this family has kernels for `spec` (with `backward`: the backward's, deterministic if asked; the
        router picks each direction's family separately), else what is missing."""

    def fp8_kv_scale_block(self, spec: AttentionSpec) -> int:
        """Keys per K/V descale that this family's FP8 kernel reads for `spec` (cute_flash.fp8.prepare)."""

    def backward_head_dims(self, spec: AttentionSpec) -> Tuple[int, int]:
        """The (head_dim, head_dim_v) this family's backward kernels for `spec` are built for (where it serves
        `spec`): wider than the call's own where they run on zero-padded operands (arch/padded_head_dims.py);
        `explain` reports it."""

    def forward(self, t: FwdTensors, problem: Problem, descale: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """Fills `t.out` and `t.lse` for the validated call `problem` (its spec, scale and mask); descale: the FP8
        path's factors."""

    def forward_launcher(self, problem: Problem, device: torch.device) -> ForwardLauncher:
        """`forward` of one fp16/bf16 `problem` on `device` as a callable (q, k, v, out, lse[, sink]) -> None, with
        what depends only on them settled once: the eager call cache keeps it per call signature, so that a warm call
        neither looks its kernel up nor converts its scalars again."""

    def backward(self, t: BwdTensors, grads: Grads, problem: Problem, deterministic: bool = False) -> None:
        """Fills `grads` for the validated call `problem` (its spec, scale and mask); deterministic: bitwise-
        reproducible sums."""

    def backward_launcher(
        self, problem: Problem, device: torch.device, deterministic: bool = False
    ) -> BackwardLauncher:
        """`backward` of one fp16/bf16 `problem` on `device` as a callable (t, grads) -> None, with what depends only
        on them settled once (kept by the eager call cache, like forward_launcher's). Its tensors must already be in
        the kernels' layout (the eager path guarantees it; a launcher need not check it again)."""

    def forward_varlen(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        seqs: PackedSeqs, problem: VarlenProblem, sink: Optional[torch.Tensor] = None,
    ) -> None:  # fmt: skip
        """Packed forward (`varlen` families): q (total_q, h, d), k / v (total_k, h_kv, d / dv), out (total_q, h, dv),
        lse (h, total_q); sink (spec.sink): the (total_q, h) fp32 view of the conventions above (passed only then)."""

    def backward_varlen(
        self, t: BwdTensors, grads: Grads, seqs: PackedSeqs, problem: VarlenProblem, deterministic: bool = False
    ) -> None:
        """Packed backward (`varlen` families): tensors as in forward_varlen, dq / dk / dv shaped like q / k / v (and
        dsink with spec.sink)."""

    def kvcache_splits(self, problem: KvCacheProblem, sm_count: int) -> int:
        """How many CTAs share each query tile's keys in `forward_kvcache` (1: unsplit), from the problem's host-side
        shapes only (no device lengths): what `attention_with_kvcache(num_splits=0)` runs."""

    def forward_kvcache(self, t: KvCacheTensors, problem: KvCacheProblem, num_splits: int) -> None:
        """Fills `t.out` and `t.lse` of a KV-cache forward (spec.kvcache; conventions at KvCacheTensors), its keys
        split over `num_splits` CTAs per query tile (combined exactly, deterministic for a given split). No host
        synchronisation and nothing data-dependent on the host, so that a decoding step captures in a CUDA graph."""

    def kvcache_launcher(
        self, problem: KvCacheProblem, device: torch.device, num_splits: int
    ) -> Callable[[KvCacheTensors], None]:
        """`forward_kvcache` of one problem on `device` with `num_splits` as a callable (t) -> None, what depends only
        on them settled once (the front end keeps it per call signature); `launcher_through_kvcache` for a family
        without a faster bound form."""

    def forward_mods(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        problem: Problem, tables: List[torch.Tensor], blocks: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        seqs: Optional[PackedSeqs] = None,
    ) -> None:  # fmt: skip
        """Forward of a spec.ModsSpec (score_mod / mask_mod, cute_flash/mods): out / lse as `forward`'s; tables:
        the callables' captured tensors as the kernel stores them (mods/call.py), score_mod's first; blocks (with
        spec.block_sparse): the key-tile lists of the family's tiles (`mods_key_tiles`); seqs (spec.varlen): packed
        sequences, tensors as `forward_varlen`'s."""

    def mods_key_tiles(self, spec: AttentionSpec) -> Optional[Tuple[int, int]]:
        """(tile_m, tile_n) of the block-sparse score_mod / mask_mod forward, or None where the family visits every
        tile (a block mask then changes nothing)."""

    def mods_query_tiles(self, spec: AttentionSpec) -> Optional[Tuple[int, int]]:
        """(tile_m, tile_n) of the block-sparse score_mod / mask_mod backward, or None where the family's backward
        visits every tile of its mask range (a block mask then changes nothing there)."""

    def backward_mods(
        self, t: BwdTensors, grads: Grads, problem: Problem, tables: List[torch.Tensor], blocks: Optional[tuple] = None,
        seqs: Optional[PackedSeqs] = None,
    ) -> None:  # fmt: skip
        """The backward of `forward_mods`, with the same tables (dq / dk / dv as `backward`'s); blocks (with
        spec.block_sparse): the query-tile lists of the family's tiles (`mods_query_tiles`); seqs: as forward_mods'."""

    def compile_artifacts(self, spec: AttentionSpec, backward: bool, target: str) -> List[KernelArtifact]:
        """Compiles the kernels that serve `spec` for CuTe DSL target `target` with fake tensors (no GPU needed): the
        forward, and with `backward` the backward's (not the split-key decoding pair: tests/test_split_kv.py). A
        family whose backward serves a spec its forward does not (sm90: d72, on zero-padded operands) builds the
        backward alone."""

    def warm(
        self, spec: AttentionSpec, target: str, *, backward: bool, gqa: bool = False, deterministic: bool = False
    ) -> None:
        """Gets (from the compile cache, building on a miss) every kernel that a forward call of `spec` on a GPU of
        `target` launches, or with `backward` its backward call (with GQA/MQA heads if `gqa`, deterministic if
        asked), through the same cache keys as the launch path: `python -m cute_flash warmup` fills the disk cache
        with this, also without a GPU."""


class BackendBase:
    """What a family inherits for the parts of `ArchBackend` it has no kernels for (`class _Backend(BackendBase)`):
    no split-key decoding, no packed-sequence kernels, no KV-cache forward, each missing kernel a NotImplementedError
    that names the family. A family overrides what it implements."""

    split_keys = False
    varlen = False
    kvcache = False

    def _missing(self, kernel: str) -> NotImplementedError:
        return NotImplementedError(f"the {self.name} family has no {kernel} kernel")

    def forward_varlen(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        seqs: PackedSeqs, problem: VarlenProblem, sink: Optional[torch.Tensor] = None,
    ) -> None:  # fmt: skip
        raise self._missing("varlen (packed sequences) forward")

    def backward_varlen(
        self, t: BwdTensors, grads: Grads, seqs: PackedSeqs, problem: VarlenProblem, deterministic: bool = False
    ) -> None:
        raise self._missing("varlen (packed sequences) backward")

    def kvcache_splits(self, problem: KvCacheProblem, sm_count: int) -> int:
        raise self._missing("KV-cache forward")

    def forward_kvcache(self, t: KvCacheTensors, problem: KvCacheProblem, num_splits: int) -> None:
        raise self._missing("KV-cache forward")

    def kvcache_launcher(
        self, problem: KvCacheProblem, device: torch.device, num_splits: int
    ) -> Callable[[KvCacheTensors], None]:
        return launcher_through_kvcache(self, problem, num_splits)

    def forward_mods(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        problem: Problem, tables: List[torch.Tensor], blocks: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        seqs: Optional[PackedSeqs] = None,
    ) -> None:  # fmt: skip
        raise self._missing("score_mod / mask_mod forward")

    def mods_key_tiles(self, spec: AttentionSpec) -> Optional[Tuple[int, int]]:
        return None

    def mods_query_tiles(self, spec: AttentionSpec) -> Optional[Tuple[int, int]]:
        return None

    def backward_mods(
        self, t: BwdTensors, grads: Grads, problem: Problem, tables: List[torch.Tensor], blocks: Optional[tuple] = None,
        seqs: Optional[PackedSeqs] = None,
    ) -> None:  # fmt: skip
        raise self._missing("score_mod / mask_mod backward")


def launch_mods_forward(
    kernel: Callable, q, k, v, out, lse, problem: Problem, tables: List[torch.Tensor], blocks: Optional[tuple] = None,
    seqs: Optional[PackedSeqs] = None,
) -> None:  # fmt: skip
    """A compiled score_mod / mask_mod forward (the `mods` entry, common/entries.ModsFwdEntry) on a call's tensors,
    the graphs' tables (None past them) and the block lists of a block-sparse build (else None); packed sequences
    (seqs, a spec.varlen build): the `packed_mods` entry, tensors as `launch_packed_forward`'s."""
    from ..mods.graph import MAX_TABLES

    q, k, v, out = (kernel_view(t, copy=False, name=n) for n, t in (("q", q), ("k", k), ("v", v), ("out", out)))
    scalars = (float(problem.softmax_scale), int(problem.mask.left), int(problem.mask.right))
    slots = (*tables, *([None] * (MAX_TABLES - len(tables))))
    if seqs is not None:
        assert blocks is None, "packed builds take no block lists"
        kernel(q, k, v, out, lse, *scalars, *slots, seqs.cu_seqlens_q, seqs.cu_seqlens_k, seqs.seqused_k,
               int(seqs.max_seqlen_q))  # fmt: skip
        return
    kernel(q, k, v, out, lse, *scalars, *slots, *(blocks or (None,) * 4))


class BoundForward:
    """The `forward_launcher` of a compiled fp16/bf16 forward kernel (q, k, v, out, lse, softmax_scale, window_left,
    window_right): the scalars converted once; its tensors are in the kernel's layout (the eager path's guarantee).
    Its parts are public: the eager path hands them to the C++ call path (cute_flash/native.py)."""

    __slots__ = ("kernel", "scale", "left", "right", "softcap", "features")

    def __init__(self, kernel: Callable, problem: Problem):
        self.kernel = kernel
        self.scale, self.left, self.right = (
            float(problem.softmax_scale), int(problem.mask.left), int(problem.mask.right)
        )  # fmt: skip
        self.softcap = float(problem.softcap)
        # A build with softcap or sinks has the feature entry (common/entries.py): two more arguments.
        self.features = problem.spec.softcap or problem.spec.sink

    def __call__(self, q, k, v, out, lse, sink=None) -> None:
        if self.features:
            self.kernel(q, k, v, out, lse, self.scale, self.left, self.right, self.softcap, sink)
        else:
            self.kernel(q, k, v, out, lse, self.scale, self.left, self.right)


class SplitForward:
    """The `forward_launcher` of a split-key call (arch/split_kv.py): the split forward writes each split's
    partial O and LSE in fp32, the combine kernel merges them into out and lse. The partials are one allocation of
    torch's caching allocator per call, as the C++ call path makes them (nothing held between calls; CUDA-graph
    capture takes it from its pool). Its parts
    are public, as BoundForward's: the eager path hands them to the C++ call path."""

    __slots__ = ("kernel", "combine", "splits", "scale", "left", "right", "o_shape", "lse_shape", "o_elems")
    __slots__ += ("softcap", "features", "sink")

    def __init__(self, kernel: Callable, combine: Callable, problem: Problem, splits: int):
        p = problem
        self.kernel, self.combine, self.splits = kernel, combine, splits
        self.scale, self.left, self.right = float(p.softmax_scale), int(p.mask.left), int(p.mask.right)
        # The split kernel applies softcap (feature entry: softcap, and no sink: the partials leave the sink out);
        # the combine adds the sink once, to the merged rows (its build for spec.sink takes the sink view).
        self.softcap, self.features, self.sink = float(p.softcap), p.spec.softcap or p.spec.sink, p.spec.sink
        self.o_shape = (splits * p.batch, p.seqlen_q, p.nheads, p.head_dim_v)
        self.lse_shape = (splits * p.batch, p.nheads, p.seqlen_q)
        self.o_elems = splits * p.batch * p.seqlen_q * p.nheads * p.head_dim_v

    def __call__(self, q, k, v, out, lse, sink=None) -> None:
        # The combine waits (programmatic dependent launch) for the kernel launched just before it on this stream.
        block = torch.empty(self.o_elems + self.o_elems // self.o_shape[-1], dtype=torch.float32, device=q.device)
        o_part = block[: self.o_elems].view(self.o_shape)
        lse_part = block[self.o_elems :].view(self.lse_shape)
        if self.features:
            self.kernel(q, k, v, o_part, lse_part, self.scale, self.left, self.right, self.softcap, None)
        else:
            self.kernel(q, k, v, o_part, lse_part, self.scale, self.left, self.right)
        if self.sink:
            self.combine(o_part, lse_part, out, lse, sink)
        else:
            self.combine(o_part, lse_part, out, lse)


def launcher_through_forward(backend: ArchBackend, problem: Problem) -> ForwardLauncher:
    """The `forward_launcher` of a family without a faster bound form: every call goes through `forward`."""
    return lambda q, k, v, out, lse, sink=None: backend.forward(FwdTensors(q, k, v, out, lse, sink), problem)


class BoundKvCache:
    """A `kvcache_launcher` whose parts are public, as BoundForward's, for the C++ call path (cute_flash/native.py),
    which launches decoding calls of `cute_flash.attention` on it itself: the compiled kernel (q, k_cache, v_cache,
    out, lse, seqlens_k, page_table, cu_seqlens_q, k_descale, v_descale, *scalars, and with `features` softcap and
    the sink), the split count (> 1: into fp32 partials (splits * b, seqlen_q, h, dv) / (splits * b, h, seqlen_q)
    that `combine` merges), the scalars (seqlen_q, softmax_scale, window left, right), softcap, and whether q is
    packed."""

    __slots__ = ()
    kernel: Callable
    combine: Optional[Callable]
    splits: int
    scalars: tuple
    features: bool
    softcap: float
    packed: bool


def launcher_through_kvcache(backend: ArchBackend, problem: KvCacheProblem, num_splits: int):
    """The `kvcache_launcher` of a family without a faster bound form: every call goes through `forward_kvcache`."""
    return lambda t: backend.forward_kvcache(t, problem, num_splits)


def launcher_through_backward(backend: ArchBackend, problem: Problem, deterministic: bool) -> BackwardLauncher:
    """The `backward_launcher` of a family without a faster bound form: every call goes through `backward`."""
    return lambda t, grads: backend.backward(t, grads, problem, deterministic)


def prepare_build(
    backend: ArchBackend, spec: AttentionSpec, target: str, *, backward: bool, deterministic: bool = False,
    warming: bool = False,
) -> None:  # fmt: skip
    """What every family's `warm` (warming=True) and `compile_artifacts` do before they build: refuse a spec the
    family has no kernel for, with the router's own reason (NotImplementedError); refuse to warm the FP8 path (its
    pre-pass is not warmed yet); then point CuTe DSL at `target` before cutlass is imported (cross-compiling)."""
    reason = backend.unsupported_reason(spec, backward, deterministic)
    if reason is not None:
        raise NotImplementedError(reason)
    if warming and spec.dtype == "fp8":
        raise NotImplementedError("warming the FP8 path (its kernel and the pre-pass) is not supported yet")
    compile_cache.ensure_cute_dsl_arch(target)


def launch_packed_forward(kernel, q, k, v, out, lse, seqs: PackedSeqs, problem, sink=None) -> None:
    """Calls a compiled packed forward (the `packed` entry, common/entries.FwdEntries; `packed_features` for builds
    with softcap or sinks, sink: the (total_q, h) view) on packed tensors: q (total_q, h, d), k / v (total_k, h_kv,
    d / dv), out (total_q, h, dv), lse (h, total_q); seqs' cu_seqlens and seqused_k (or None) as the build expects.
    The one calling convention of every family's forward_varlen."""
    mask = problem.mask
    q, k, v, out = (kernel_view(t, copy=False, name=n) for n, t in (("q", q), ("k", k), ("v", v), ("out", out)))
    features = (float(problem.softcap), sink) if problem.spec.softcap or problem.spec.sink else ()
    kernel(
        q, k, v, out, lse, float(problem.softmax_scale), int(mask.left), int(mask.right), *features,
        seqs.cu_seqlens_q, seqs.cu_seqlens_k, seqs.seqused_k, int(seqs.max_seqlen_q),
    )  # fmt: skip


# A gradient of lse enters the backward through D. lse_i = log sum_j exp(s_ij), so d lse_i / d s_ij = P_ij and
# dS = P * (dP - D) + P * dlse = P * (dP - (D - dlse)): every family's kernels run unchanged on D - dlse, which these
# fold into the preprocess's D buffer before the main kernel reads it (FlashAttention-4 takes dlse in its
# preprocess). A row without keys (lse -inf) keeps D = 0: its P is 0, and a non-finite dlse there (the gradient of
# lse ** 2, or NaN through a torch.where) would otherwise make 0 * NaN in dS and spread to the head's dK / dV.
def finite_rows(dlse: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """lse's gradient as the backward folds it, float32: 0 on rows without keys (lse -inf), whatever it was there."""
    return torch.where(torch.isneginf(lse), 0.0, dlse).to(torch.float32)


def fold_lse_grad(dpsum: torch.Tensor, dlse: Optional[torch.Tensor], lse: torch.Tensor) -> None:
    """D -= dlse for a dense backward: dpsum (b, h, padded rows) as the preprocess wrote it, dlse and lse (b, h, sq)."""
    if dlse is not None:
        dpsum[..., : lse.shape[-1]].sub_(finite_rows(dlse, lse))


def fold_lse_grad_packed(
    dpsum: torch.Tensor, dlse: Optional[torch.Tensor], lse: torch.Tensor, cu_seqlens_q: torch.Tensor, pad: int
) -> None:
    """D -= dlse for a packed backward: dpsum (h, padded rows) in which sequence b starts at its padded offset
    (common/packed.py: cu_seqlens[b] + b * pad rounded down to a multiple of pad, each at least pad past the one
    before), dlse and lse (h, total_q). On the device and without reading cu_seqlens on the host: each column of the
    buffer finds its sequence by a sorted search of the padded offsets and gathers its row of dlse (a gather only, so
    deterministic and capturable in a CUDA graph); columns past a sequence's length keep their D."""
    if dlse is None:
        return
    cu = cu_seqlens_q.long()
    batch = cu.shape[0] - 1
    starts = torch.div(cu[:-1] + torch.arange(batch, device=cu.device) * pad, pad, rounding_mode="floor") * pad
    cols = torch.arange(dpsum.shape[-1], device=dpsum.device)
    seq = torch.searchsorted(starts, cols, right=True) - 1  # the last sequence starting at or before the column
    offset = cols - starts[seq]
    inside = offset < cu[seq + 1] - cu[seq]
    rows = (cu[seq] + offset).clamp(0, lse.shape[-1] - 1)
    dpsum.sub_(torch.where(inside, finite_rows(dlse, lse)[:, rows], 0.0))


def sink_grad(dsink: torch.Tensor, sink: torch.Tensor, lse: torch.Tensor, d_minus_dlse: torch.Tensor) -> None:
    """Fills dsink (h,) fp32 with the gradient of the learnable sinks: lse_i includes the sink, so with
    P_sink,i = exp(sink_h - lse_i), dL/dsink_h = sum over batch and rows of P_sink,i * (dlse_i - D_i), where
    D_i = rowsum(dO_i * O_i) (the key gradients keep dS = P * (dP - D): the sink's value is 0, so it adds nothing
    to dP or D). `d_minus_dlse`: D - dlse per row as the preprocess left it (dlse folded in, `fold_lse_grad`),
    shaped like lse: (b, h, sq) dense or (h, total_q) packed (h is the second-last dimension of both or the
    first of the packed one: `sink` broadcasts over the rest). Rows without keys or sink weight (lse -inf) add 0."""
    h_dim = lse.dim() - 2 if lse.dim() == 3 else 0
    shape = [1] * lse.dim()
    shape[h_dim] = sink.shape[0]
    p_sink = torch.exp(sink.view(shape).to(lse.dtype) - lse)  # (in lse's precision: float32, float64 on the ring's CPU)
    p_sink = torch.where(torch.isneginf(lse), 0.0, p_sink)
    dims = [i for i in range(lse.dim()) if i != h_dim]
    dsink.copy_(-(p_sink * d_minus_dlse).sum(dim=dims))

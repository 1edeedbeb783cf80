"""The one place that checks a call's inputs, before anything is compiled or launched, and the home of the one
layout normalisation for the kernels (`kernel_view`, in kernel_layout.py) and of the validated call types
(problem.py), which it re-exports.

Every message names the argument and what was expected: `ValueError` / `TypeError` for malformed input,
`NotImplementedError` for what no kernel offers. Backend-specific limits (head dims a family lacks, fp8 on a family
without an fp8 kernel) are asked of the backends by the router (`cute_flash.routing`) before any work starts, so that
they surface as `NotImplementedError` naming every family's reason; limits of a path rather than of a family (the FP8
path has neither soft-capping nor sinks) are checked here. `validate_reference` applies the same semantic checks to
the plain-torch reference.
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple, Optional, Sequence, Tuple, Union

import torch

from .kernel_layout import ALIGN_BYTES, is_kernel_layout, kernel_view  # noqa: F401  (re-exported: validation's own)
from .kernel_layout import round_up as _round_up  # noqa: F401  (arch/sm90/backward.py imports it from here)
from .problem import KVCACHE_MAX_SPLITS, MAX_SPLIT_SCALE, KvCacheProblem, PackedSeqs, Problem, Semantics, VarlenProblem  # noqa: F401  (re-exported)
from .spec import AttentionSpec, MaskBounds, normalize_mask, softcap_fields

INPUT_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
COMPUTE_DTYPES = (None, "fp8")
# Pre-quantised FP8 inputs (with descale factors) and the dtype their output is written in.
FP8_INPUT_DTYPE = torch.float8_e4m3fn
FP8_OUT_DTYPE = "bf16"
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
# Device types whose tensors reach the kernels (tests add "meta" to exercise validation without a GPU).
KERNEL_DEVICE_TYPES = ("cuda",)


def problem_of(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskBounds,
    softmax_scale: float,
    seqs: Optional[PackedSeqs] = None,
    softcap: float = 0.0,
    sink: bool = False,
) -> Union[Problem, VarlenProblem]:
    """The `Problem` of fp16/bf16 inputs that `validate` has already accepted (views of an accepted call, e.g. the
    packed problem of decoding under GQA or the ring's kernel blocks, are rebuilt from tensors and a normalised mask;
    nothing is checked again); with `seqs`, the `VarlenProblem` of packed inputs that `validate_varlen` accepted.
    softcap: the cap (0: none); sink: whether learnable sinks take part."""
    *_, nheads, head_dim = q.shape
    head_dim_v, nheads_kv = v.shape[-1], k.shape[-2]
    dtype = INPUT_DTYPES[q.dtype]
    spec = AttentionSpec(
        dtype, head_dim, head_dim_v, mask.kind, dtype, varlen=seqs is not None, **softcap_fields(softcap), sink=sink
    )
    if seqs is None:
        batch, seqlen_q = q.shape[:2]
        return Problem(
            batch, seqlen_q, k.shape[1], nheads, nheads_kv, head_dim, head_dim_v, mask, softmax_scale, spec, softcap
        )
    return VarlenProblem(
        seqs.cu_seqlens_q.shape[0] - 1, q.shape[0], k.shape[0], nheads, nheads_kv, head_dim, head_dim_v,
        seqs.max_seqlen_q, seqs.max_seqlen_k, spec, mask, softmax_scale, softcap,
    )  # fmt: skip


def _check_tensor(name: str, t: object, device: bool = True, layout: bool = True) -> torch.Tensor:
    """Type and rank of one input; with `device`, a device the kernels run on; with `layout`, a unit last stride."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if device and t.device.type not in KERNEL_DEVICE_TYPES:
        raise ValueError(
            f"{name} is on {t.device}; cute_flash kernels run on CUDA GPUs only. "
            f"For CPU tensors use cute_flash.reference.attention_reference (same semantics, plain torch)."
        )
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, nheads, head_dim), got shape {tuple(t.shape)}")
    if layout and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension (head_dim stride 1), got strides {tuple(t.stride())}"
        )
    return t


def _check_window(window_size: object) -> Tuple[Optional[int], Optional[int]]:
    """(left, right) of a window: each None (unlimited) or an int of any sign (a negative bound shifts the window off
    the diagonal, FlashAttention-4's convention: see spec.MaskBounds)."""
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        raise ValueError(f"window_size must be a pair (left, right) of None or ints, got {window_size!r}")
    out = []
    for side, w in zip(("left", "right"), window_size):
        if w is not None and (isinstance(w, bool) or not isinstance(w, int)):
            raise ValueError(f"window_size {side} must be None (unlimited) or an int, got {w!r}")
        out.append(w)
    return out[0], out[1]


FLOAT32_TINY = 1.1754943508222875e-38  # float32's smallest normal value (the kernels take softcap as float32)


def _finite(x) -> bool:
    """math.isfinite in comparisons, which torch.compile traces for the symbolic floats it makes of a float argument
    that changed between calls (math.isfinite on one fails the trace); an int past the float range is not finite
    (its float() would raise OverflowError)."""
    return x == x and abs(x) <= sys.float_info.max


def check_softcap(softcap: object) -> float:
    """softcap: 0 (off) or a finite cap > 0, as a float."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not _finite(softcap):
        raise ValueError(f"softcap must be a finite float >= 0 (0: no soft-capping), got {softcap!r}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0: no soft-capping), got {softcap}")
    if 0 < softcap < FLOAT32_TINY:
        raise ValueError(f"softcap {softcap!r} is below float32's range, in which the kernels divide by it")
    return float(softcap)


SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_learnable_sink(sink: object, nheads: int, device: torch.device) -> Optional[torch.Tensor]:
    """learnable_sink: None, or one logit per query head, a (nheads,) float32 / bfloat16 / float16 tensor on the
    inputs' device."""
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor):
        what = type(sink).__name__
        raise TypeError(f"learnable_sink must be a torch.Tensor of shape ({nheads},) or None, got {what}")
    if sink.dim() != 1 or sink.shape[0] != nheads:
        raise ValueError(f"learnable_sink must have shape (nheads,) = ({nheads},), got {tuple(sink.shape)}")
    if sink.dtype not in SINK_DTYPES:
        raise TypeError(f"learnable_sink has dtype {sink.dtype}; expected float32, bfloat16 or float16")
    if sink.device != device:
        raise ValueError(f"learnable_sink is on {sink.device} but q is on {device}; all inputs must share one device")
    return sink


def validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: Optional[float],
    window_size: Tuple[Optional[int], Optional[int]],
    dtype: Optional[str],
    descale: Optional[Sequence[torch.Tensor]] = None,
    fp8_rotate: bool = True,
    deterministic: bool = False,
    softcap: float = 0.0,
    learnable_sink: Optional[torch.Tensor] = None,
    any_device: bool = False,
) -> Problem:
    """Every check of a `cute_flash.attention` call; returns the validated problem (the spec a kernel compiles for).

    any_device: skip the device check only (`cute_flash.explain` for a given compute capability, on CPU tensors)."""
    q, k, v = (_check_tensor(n, t, device=not any_device) for n, t in (("q", q), ("k", k), ("v", v)))
    _check_same_device_and_dtype(q, k, v)
    prequantized = q.dtype == FP8_INPUT_DTYPE
    if prequantized and descale is None:
        raise ValueError(
            "q, k, v are float8_e4m3fn: pass descale=(q_descale, k_descale, v_descale), float32 tensors of shape "
            "(batch, nheads_kv) or per block (see cute_flash.fp8.prepare)"
        )
    if q.dtype not in INPUT_DTYPES and not prequantized:
        raise TypeError(
            f"q, k, v have dtype {q.dtype}; expected torch.float16 or torch.bfloat16 "
            f"(for FP8 compute pass fp16/bf16 inputs with dtype='fp8', or float8_e4m3fn inputs with descale=...)"
        )
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be None (compute in the inputs' dtype) or 'fp8', got {dtype!r}")
    if descale is not None and not prequantized:
        raise ValueError(f"descale is only for float8_e4m3fn inputs; q, k, v have dtype {q.dtype}")
    if not isinstance(fp8_rotate, bool):
        raise TypeError(f"fp8_rotate must be a bool, got {type(fp8_rotate).__name__}")
    if not fp8_rotate and (dtype != "fp8" or prequantized):
        # The rotation is part of quantising fp16/bf16 inputs; anywhere else the option would be silently ignored.
        raise ValueError("fp8_rotate=False applies only to dtype='fp8' with fp16/bf16 inputs (they are quantised here)")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    sem = _check_semantics(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size)
    softcap, sink = _check_features(softcap, learnable_sink, sem.nheads, q.device)
    fp8 = dtype == "fp8" or prequantized
    if deterministic and fp8:
        raise ValueError("deterministic=True concerns the backward, and the FP8 path has none (forward only)")
    if fp8 and (softcap or sink):
        # No family's FP8 kernel has these: a limit of the path, said here rather than by every family's router reason.
        what = " and ".join(w for w, on in (("soft-capping", softcap), ("learnable sinks", sink)) if on)
        raise NotImplementedError(f"the FP8 path (dtype='fp8' or float8_e4m3fn inputs) has no {what}")
    _check_launch_limits(sem)

    if prequantized:
        _check_descale(descale, q, k)
    # Pre-quantised inputs are written out in bf16; fp16/bf16 inputs keep their dtype on the FP8 path too.
    in_dtype = FP8_OUT_DTYPE if prequantized else INPUT_DTYPES[q.dtype]
    spec = AttentionSpec(
        dtype="fp8" if fp8 else in_dtype,
        head_dim=sem.head_dim,
        head_dim_v=sem.head_dim_v,
        mask=sem.mask.kind,
        out_dtype=in_dtype,
        **softcap_fields(softcap),
        sink=sink,
    )
    # Field by field: this runs under torch.compile, and torch 2.11's dynamo cannot trace vars() of a dataclass.
    s = sem
    return Problem(
        s.batch, s.seqlen_q, s.seqlen_k, s.nheads, s.nheads_kv, s.head_dim, s.head_dim_v, s.mask, s.softmax_scale, spec,
        softcap,
    )  # fmt: skip


def with_seqlen_k(problem: Problem, seqlen_k: int) -> Problem:
    """`validate`'s answer for a call that differs from the validated one only in its key count (and in strides that
    scale with it, keeping what `validate` reads of them: core/fields.decode_key): the problem with `seqlen_k`, after
    the one check that depends on it (the kernels' indexing limits)."""
    p = problem
    changed = Problem(
        p.batch,
        p.seqlen_q,
        seqlen_k,
        p.nheads,
        p.nheads_kv,
        p.head_dim,
        p.head_dim_v,
        p.mask,
        p.softmax_scale,
        p.spec,
        p.softcap,
    )  # fmt: skip  (field by field: dataclasses.replace costs more than the rest of the plan)
    _check_launch_limits(changed)
    return changed


def _check_features(softcap: object, learnable_sink: object, nheads: int, device) -> Tuple[float, bool]:
    """(the cap, whether sinks take part) of a call's soft-capping and learnable sinks (check_softcap,
    check_learnable_sink)."""
    return check_softcap(softcap), check_learnable_sink(learnable_sink, nheads, device) is not None


# Input dtypes of `cute_flash.reference` (it computes in a dtype of its own; fp8 inputs need their descales first).
REFERENCE_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def validate_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: Optional[float],
    window_size: Tuple[Optional[int], Optional[int]],
    softcap: float = 0.0,
    learnable_sink: Optional[torch.Tensor] = None,
) -> Semantics:
    """The checks of `validate` that define the semantics, for the plain-torch reference: the same shapes, heads,
    head dims, mask (negative window bounds included), softmax scale, softcap and learnable sinks are accepted and
    rejected, with the same messages. What only a kernel needs is not asked: any device, any strides, and
    float32/float64 inputs besides fp16/bf16. The softcap and sink values stay the caller's (they are not part of
    `Semantics`)."""
    q, k, v = (_check_tensor(n, t, device=False, layout=False) for n, t in (("q", q), ("k", k), ("v", v)))
    _check_same_device_and_dtype(q, k, v)
    if q.dtype not in REFERENCE_INPUT_DTYPES:
        raise TypeError(
            f"q, k, v have dtype {q.dtype}; the reference takes float16, bfloat16, float32 or float64 "
            f"(dequantise float8 inputs with their descales first)"
        )
    sem = _check_semantics(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size)
    # The checks every entry point shares (check_softcap, check_learnable_sink). The reference takes float64 sinks
    # too, as it takes float64 inputs: those are checked as a float32 stand-in of the same shape and device.
    check_softcap(softcap)
    if isinstance(learnable_sink, torch.Tensor) and learnable_sink.dtype == torch.float64:
        learnable_sink = learnable_sink.detach().float()
    check_learnable_sink(learnable_sink, sem.nheads, q.device)
    return sem


def _check_same_device_and_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all inputs must share one device")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k and v must share one dtype")


def _check_semantics(q, k, v, *, causal, softmax_scale, window_size) -> Semantics:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")

    batch, seqlen_q, nheads, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"batch sizes differ: q {batch}, k {k.shape[0]}, v {v.shape[0]}")
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if v.shape[1] != seqlen_k:
        raise ValueError(f"k and v must have the same seqlen (dim 1): k {seqlen_k}, v {v.shape[1]}")
    if v.shape[2] != nheads_kv:
        raise ValueError(f"k and v must have the same number of heads (dim 2): k {nheads_kv}, v {v.shape[2]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k head_dim {k.shape[3]} must equal q head_dim {head_dim}")
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(
            f"nheads of q ({nheads}) must be a multiple of nheads of k/v ({nheads_kv}) (GQA/MQA share each kv head "
            f"between nheads // nheads_kv query heads)"
        )
    head_dim_v = v.shape[3]
    for name, dim in (("head_dim of q/k", head_dim), ("head_dim of v", head_dim_v)):
        if dim <= 0 or dim > MAX_HEAD_DIM or dim % HEAD_DIM_MULTIPLE != 0:
            raise NotImplementedError(
                f"{name} is {dim}; cute_flash supports multiples of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM}"
            )

    left, right = _check_window(window_size)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not _finite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite float or None, got {softmax_scale!r}")
    elif softmax_scale < 0:
        # Malformed rather than missing: a negative scale reverses which keys a row attends to most (and every kernel
        # takes the running row max over raw scores, the max of the scaled ones only for a scale >= 0).
        raise ValueError(f"softmax_scale must be >= 0 (None: 1/sqrt(head_dim)), got {softmax_scale}")
    return Semantics(
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        nheads=nheads,
        nheads_kv=nheads_kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        mask=normalize_mask(causal, (left, right)),
        softmax_scale=float(softmax_scale),
    )


def _check_descale(descale: object, q: torch.Tensor, k: torch.Tensor) -> None:
    """descale = (q_descale, k_descale, v_descale) for float8_e4m3fn inputs: float32, on q's device, each either
    (batch, nheads_kv) or per block (batch, heads, blocks). The number of key blocks depends on the serving kernel's
    block (`ArchBackend.fp8_kv_scale_block`), which `fp8.prepare.check_prequantized` checks once it is known."""
    from .fp8.prepare import BLOCK_M, check_descales

    check_descales(descale, q, k, BLOCK_M, None, device_note="; all inputs must share one device")


# CUDA's limit on grid.y and grid.z: every kernel launches (tiles, heads, batch).
MAX_GRID_YZ = 65535
# Kernels index within one (batch, head) with Int32: a sequence times its head dim must stay below 2^31 elements.
MAX_ELEMENTS_PER_HEAD = 2**31 - 1


def packed_elements_per_head(rows: int, sequences: int, head_dim: int) -> int:
    """Elements per head a packed call of `rows` rows (the larger of q's and k's) over `sequences` sequences indexes
    in the backward's buffers, each sequence padded to a tile (at most 256 rows): within MAX_ELEMENTS_PER_HEAD (the
    kernels' Int32 indexing) or the call is refused."""
    return (rows + (sequences + 1) * 256) * head_dim


def _check_launch_limits(sem: Semantics) -> None:
    if sem.batch > MAX_GRID_YZ or sem.nheads > MAX_GRID_YZ:
        raise NotImplementedError(
            f"batch ({sem.batch}) and nheads ({sem.nheads}) must each be <= {MAX_GRID_YZ}: the kernels launch "
            f"them as CUDA grid dimensions"
        )
    # Padded to whole tiles (at most 256 rows) inside the kernels' buffers.
    longest = (max(sem.seqlen_q, sem.seqlen_k) + 256) * max(sem.head_dim, sem.head_dim_v)
    if longest > MAX_ELEMENTS_PER_HEAD:
        raise NotImplementedError(
            f"seqlen x head_dim = {longest} elements per head exceeds the kernels' Int32 indexing "
            f"({MAX_ELEMENTS_PER_HEAD}); split the sequence (e.g. ring attention over several calls)"
        )


def validate_varlen_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs) -> int:
    """The checks of a packed (variable-length) call that need no device-to-host copy: q (total_q, h, d), k / v
    (total_k, h_kv, d / dv) on one device, `cu_seqlens_*` int32 (batch + 1,) on that device, `max_seqlen_*` host
    ints >= 0, `seqused_k` int32 (batch,). Returns the batch size. What would need the values (starting at 0,
    non-decreasing, ending at total, lengths <= max_seqlen) is `varlen_offsets`'s, for the reference, which reads
    the values anyway."""
    cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k = seqs
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a packed (total, nheads, head_dim) tensor, got {shape}")
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must share total_k and nheads_kv")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or t.numel() < 1:
            what = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be an int32 tensor of shape (batch + 1,), got {what}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all inputs must share one device")
    batch = cu_seqlens_q.numel() - 1
    if cu_seqlens_k.numel() != batch + 1:
        raise ValueError(f"cu_seqlens_k has {cu_seqlens_k.numel()} entries, cu_seqlens_q {batch + 1}: one batch")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        # torch.SymInt: a host int that torch.compile traces symbolically (still no device-to-host copy)
        if isinstance(m, bool) or not isinstance(m, (int, torch.SymInt)) or m < 0:
            raise ValueError(f"{name} must be a host int >= 0 (no device-to-host copy inside the call), got {m!r}")
    for name, total, longest in (("q", q.shape[0], max_seqlen_q), ("k", k.shape[0], max_seqlen_k)):
        if total > batch * longest:  # (cu_seqlens end at the total: some sequence would be longer than its bound)
            raise ValueError(
                f"{name} has {total} rows but {batch} sequences of at most max_seqlen_{name}={longest} rows: a "
                f"sequence is longer than its max_seqlen"
            )
    validate_seqused("seqused_k", seqused_k, batch, q)
    return batch


def validate_seqused(name: str, used: Optional[torch.Tensor], batch: int, q: torch.Tensor) -> None:
    """seqused_k / seqused_q: None or an int32 (batch,) tensor on q's device (its values are not read)."""
    if used is None:
        return
    if not isinstance(used, torch.Tensor) or used.dtype != torch.int32 or used.shape != (batch,):
        raise ValueError(f"{name} must be an int32 tensor of shape (batch,) = ({batch},)")
    if used.device != q.device:
        raise ValueError(f"{name} is on {used.device} but q is on {q.device}")


def varlen_offsets(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs) -> Tuple[list, list]:
    """`validate_varlen_layout`'s checks, then those that read cu_seqlens on the host (the reference does; the
    kernels' path never copies them): each starts at 0, never decreases, ends at its total (rows past the last
    sequence would be rows the kernels never write), and no sequence is longer than its max_seqlen. Returns the
    offsets (cu_seqlens_q, cu_seqlens_k) as lists."""
    validate_varlen_layout(q, k, v, seqs)
    cq, ck = seqs.cu_seqlens_q.tolist(), seqs.cu_seqlens_k.tolist()
    for name, cu, total, longest in (
        ("cu_seqlens_q", cq, q.shape[0], seqs.max_seqlen_q),
        ("cu_seqlens_k", ck, k.shape[0], seqs.max_seqlen_k),
    ):
        if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] != total:
            raise ValueError(
                f"{name} must start at 0, never decrease and end at {total} (the packed rows; padding belongs in a "
                f"sequence of its own), got {cu}"
            )
        if any(b - a > longest for a, b in zip(cu, cu[1:])):
            raise ValueError(f"a sequence of {name} is longer than its max_seqlen {longest}: {cu}")
    return cq, ck


def validate_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqs: PackedSeqs,
    *,
    causal: bool,
    softmax_scale: Optional[float],
    window_size: Tuple[Optional[int], Optional[int]],
    deterministic: bool = False,
    softcap: float = 0.0,
    learnable_sink: Optional[torch.Tensor] = None,
    any_device: bool = False,
) -> VarlenProblem:
    """Every check of a `cute_flash.attention_varlen` call that needs no device-to-host copy (so that the call can
    be captured in a CUDA graph): the layout checks of `validate_varlen_layout` (ranks, int32 (batch + 1,)
    cu_seqlens and int32 (batch,) seqused_k on q's device, host-int max_seqlen >= 0), then what `validate` checks of
    a dense call (CUDA device, unit last stride, one dtype fp16/bf16, heads and head dims, mask, softmax_scale,
    softcap, learnable sinks). Not checked (they would need the values on the host): cu_seqlens starting at 0,
    non-decreasing and ending at total; each length <= its max_seqlen; seqused_k[b] <= that sequence's keys. The
    kernels trust them.

    any_device: skip the device check only (`explain_varlen` for a given compute capability)."""
    batch = validate_varlen_layout(q, k, v, seqs)
    max_seqlen_q, max_seqlen_k = seqs.max_seqlen_q, seqs.max_seqlen_k
    # The dense checks on (1, total, h, d) views: the same messages for devices, strides, heads and head dims.
    q4, k4, v4 = (_check_tensor(n, t.unsqueeze(0), device=not any_device) for n, t in (("q", q), ("k", k), ("v", v)))
    _check_same_device_and_dtype(q4, k4, v4)
    if q.dtype not in INPUT_DTYPES:
        raise TypeError(f"q, k, v have dtype {q.dtype}; attention_varlen takes torch.float16 or torch.bfloat16")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    sem = _check_semantics(q4, k4, v4, causal=causal, softmax_scale=softmax_scale, window_size=window_size)
    softcap, sink = _check_features(softcap, learnable_sink, sem.nheads, q.device)
    _check_launch_limits(
        Semantics(batch, max_seqlen_q, max_seqlen_k, sem.nheads, sem.nheads_kv, sem.head_dim, sem.head_dim_v,
                  sem.mask, sem.softmax_scale)
    )  # fmt: skip
    longest = packed_elements_per_head(max(q.shape[0], k.shape[0]), batch, max(sem.head_dim, sem.head_dim_v))
    if longest > MAX_ELEMENTS_PER_HEAD:
        raise NotImplementedError(
            f"total rows x head_dim = {longest} elements per head (with one padding tile per sequence) exceeds the "
            f"kernels' Int32 indexing ({MAX_ELEMENTS_PER_HEAD}); split the batch into several calls"
        )
    dtype = INPUT_DTYPES[q.dtype]
    spec = AttentionSpec(
        dtype, sem.head_dim, sem.head_dim_v, sem.mask.kind, dtype, varlen=True, **softcap_fields(softcap), sink=sink
    )
    return VarlenProblem(
        batch=batch,
        total_q=q.shape[0],
        total_k=k.shape[0],
        nheads=sem.nheads,
        nheads_kv=sem.nheads_kv,
        head_dim=sem.head_dim,
        head_dim_v=sem.head_dim_v,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        spec=spec,
        mask=sem.mask,
        softmax_scale=sem.softmax_scale,
        softcap=softcap,
    )


class KvCacheArgs(NamedTuple):
    """The tensors of an `attention_with_kvcache` call as `validate_kvcache` accepted them (None where absent)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    page_table: Optional[torch.Tensor]
    k_new: Optional[torch.Tensor]
    v_new: Optional[torch.Tensor]
    cu_seqlens_q: Optional[torch.Tensor]
    learnable_sink: Optional[torch.Tensor]
    k_descale: Optional[torch.Tensor]
    v_descale: Optional[torch.Tensor]
    out: Optional[torch.Tensor]


def _check_int32_vector(name: str, t: object, shape: tuple, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != shape:
        what = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be an int32 tensor of shape {shape}, got {what}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; all inputs must share one device")
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:  # (the kernels index it with a unit last stride)
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(t.stride())}")
    return t


def _self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of t share memory (a written tensor's rows must not): each stride, innermost first,
    must clear the extent of the dimensions inside it."""
    extent = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride < extent:
            return True
        extent = stride * (size - 1) + extent
    return False


_KVCACHE_READS = ("q", "k_cache", "v_cache", "cache_seqlens", "page_table", "k_new", "v_new", "cu_seqlens_q")
_KVCACHE_READS += ("learnable_sink", "k_descale", "v_descale")


def check_kvcache_addresses(args: "KvCacheArgs") -> None:
    """The checks of a KV-cache call that depend on addresses, on every call (addresses are in no plan key), after
    the cached checks of the layouts: out shares no memory with anything the kernels read, and with appended tokens
    k_cache and v_cache share no element (the append writes both)."""
    if torch.compiler.is_compiling():
        return
    out = args.out
    if out is not None:
        out_span = _span(out)
        for name in _KVCACHE_READS:
            t = getattr(args, name)
            if t is not None and _overlaps(out, t, out_span):
                raise ValueError(f"out overlaps {name} in memory: the kernels read {name} while they write out")
    if args.k_new is not None and _share_elements(args.k_cache, args.v_cache):
        raise ValueError(
            "k_cache and v_cache share elements (e.g. one tensor passed twice): appending k_new / v_new would write "
            "one over the other"
        )


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors address a common element. Views of one layout (shape, strides, dtype: a combined cache's
    K and V halves) are tested exactly: the offset between them, decomposed over the strides largest first (exact
    for strides that nest, as torch's contiguous and sliced layouts do), must be an index of the view; others by
    their byte spans (conservative)."""
    if not _overlaps(a, b):
        return False
    if a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype:
        return True
    delta, elem = abs(b.data_ptr() - a.data_ptr()), a.element_size()
    if delta % elem:
        return True  # (bytes of one element in both)
    delta //= elem
    for stride, size in sorted(((st, n) for n, st in zip(a.shape, a.stride()) if n > 1 and st > 0), reverse=True):
        delta -= min(delta // stride, size - 1) * stride
    return delta == 0


def _span(t: torch.Tensor) -> Tuple[int, int]:
    """The byte range [start, end) that t's elements lie in (contiguous tensors without a walk over the strides)."""
    start, elem = t.data_ptr(), t.element_size()
    if t.is_contiguous():
        return start, start + t.numel() * elem
    return start, start + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st > 0) * elem + elem


def _overlaps(a: torch.Tensor, b: torch.Tensor, a_span: Optional[Tuple[int, int]] = None) -> bool:
    """Whether two tensors' byte ranges intersect (a conservative test: their spans, not elements). Addresses alone
    decide on one device (distinct storages never share one), with no storage lookup: this runs on every warm
    KV-cache call that passes out= or appends (a_span: a's `_span`, when the caller tests a against several)."""
    if a.device.type == "meta" or a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = a_span or _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _check_in_kernel_layout(name: str, t: torch.Tensor) -> None:
    """Tensors the kernels read or write in place (a cache, a given `out`) cannot be copied into the kernels' layout.
    While torch.compile traces (fake tensors, no address) the strides alone are checked; the op's run-time call
    (kvcache.py) checks the address too."""
    if not is_kernel_layout(t, address=not torch.compiler.is_compiling()):
        raise ValueError(
            f"{name} (shape {tuple(t.shape)}, strides {tuple(t.stride())}) must have a unit last stride, outer "
            f"strides of whole {ALIGN_BYTES}-byte units and a {ALIGN_BYTES}-byte aligned base: the kernels use it in "
            f"place"
        )


def validate_kvcache(
    args: KvCacheArgs,
    *,
    max_seqlen_q: Optional[int],
    causal: bool,
    softmax_scale: Optional[float],
    window_size: Tuple[Optional[int], Optional[int]],
    softcap: float,
    num_splits: int,
) -> KvCacheProblem:
    """Every check of an `attention_with_kvcache` call that needs no device-to-host copy (a decoding step must
    capture in a CUDA graph). Not checked (they would need the values): cache_seqlens[b] plus the new tokens within
    the cache's capacity, page indices in [0, num_pages), cu_seqlens_q starting at 0 and non-decreasing. The kernels
    never read or write outside the cache for any of these values (the results of such a call are undefined)."""
    q, k_cache, v_cache = args.q, args.k_cache, args.v_cache
    packed = args.cu_seqlens_q is not None
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != (3 if packed else 4):
        want = "(total_q, nheads, head_dim) with cu_seqlens_q" if packed else "(batch, seqlen_q, nheads, head_dim)"
        raise ValueError(f"q must be {want}, got shape {tuple(q.shape)}")
    q4 = q.unsqueeze(0) if packed else q
    _check_tensor("q", q4)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, t)
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all inputs must share one device")
    if q.dtype not in INPUT_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; attention_with_kvcache takes torch.float16 or torch.bfloat16 queries")
    kv_fp8 = k_cache.dtype == FP8_INPUT_DTYPE
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype and t.dtype != FP8_INPUT_DTYPE:
            raise TypeError(f"{name} has dtype {t.dtype}; expected q's dtype ({q.dtype}) or torch.float8_e4m3fn")
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must share one dtype")
    if tuple(k_cache.shape[:3]) != tuple(v_cache.shape[:3]):
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ before head_dim")

    if packed:
        total_q, nheads, head_dim = q.shape
        if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, (int, torch.SymInt)) or max_seqlen_q < 0:
            raise ValueError(f"max_seqlen_q must be a host int >= 0 with cu_seqlens_q, got {max_seqlen_q!r}")
        cu = args.cu_seqlens_q
        batch = cu.shape[0] - 1 if isinstance(cu, torch.Tensor) and cu.dim() == 1 else -1
        if batch < 0:
            raise ValueError("cu_seqlens_q must be an int32 tensor of shape (batch + 1,)")
        _check_int32_vector("cu_seqlens_q", args.cu_seqlens_q, (batch + 1,), q.device)
        seqlen_q = int(max_seqlen_q)
        if total_q > batch * seqlen_q:  # (some sequence would have more rows than max_seqlen_q: rows left unwritten)
            raise ValueError(f"q has {total_q} rows but {batch} sequences of at most max_seqlen_q={seqlen_q} rows")
    else:
        if max_seqlen_q is not None:
            raise ValueError("max_seqlen_q belongs to packed queries (cu_seqlens_q); dense q has its own seqlen_q")
        batch, seqlen_q, nheads, head_dim = q.shape
        total_q = batch * seqlen_q
    _check_int32_vector("cache_seqlens", args.cache_seqlens, (batch,), q.device)

    nheads_kv, head_dim_v = k_cache.shape[2], v_cache.shape[3]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head_dim {k_cache.shape[3]} must equal q head_dim {head_dim}")
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(f"nheads of q ({nheads}) must be a multiple of nheads of the cache ({nheads_kv})")
    for name, dim in (("head_dim of q/k", head_dim), ("head_dim of v", head_dim_v)):
        if dim <= 0 or dim > MAX_HEAD_DIM or dim % HEAD_DIM_MULTIPLE != 0:
            raise NotImplementedError(
                f"{name} is {dim}; cute_flash supports multiples of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM}"
            )
        if kv_fp8 and dim % ALIGN_BYTES:
            raise NotImplementedError(
                f"{name} is {dim}; a float8_e4m3fn cache needs head dims that are multiples of {ALIGN_BYTES} (its rows "
                f"are read {ALIGN_BYTES} bytes at a time)"
            )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):  # (after the head dims: the likelier cause)
        _check_in_kernel_layout(name, t)

    page_table = args.page_table
    if page_table is not None:
        if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2:
            raise ValueError("page_table must be an int32 tensor of shape (batch, max_pages_per_sequence)")
        _check_int32_vector("page_table", page_table, (batch, page_table.shape[1]), q.device)
        if page_table.stride(-1) != 1:
            raise ValueError(f"page_table must be contiguous in its last dimension, got strides {page_table.stride()}")
        num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
        if page_size < 1:
            raise ValueError("a paged cache (num_pages, page_size, nheads_kv, head_dim) needs page_size >= 1")
        max_seqlen_k = page_table.shape[1] * page_size
    else:
        if k_cache.shape[0] != batch:
            raise ValueError(
                f"a dense cache (batch, seqlen_cache, nheads_kv, head_dim) needs batch {batch}, got k_cache "
                f"{tuple(k_cache.shape)} (a paged cache takes page_table)"
            )
        num_pages, page_size, max_seqlen_k = batch, 0, k_cache.shape[1]

    if (args.k_new is None) != (args.v_new is None):
        raise ValueError("k_new and v_new go together: pass both or neither")
    if args.k_new is not None:
        rows = (total_q,) if packed else (batch, args.k_new.shape[1] if args.k_new.dim() == 4 else -1)
        for name, t, d in (("k_new", args.k_new, head_dim), ("v_new", args.v_new, head_dim_v)):
            want = (*rows, nheads_kv, d)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                note = " (packed like q: sequence b appends its query rows' tokens)" if packed else ""
                raise ValueError(f"{name} must have shape {want}{note}, got {got}")
            if t.dtype != q.dtype or t.device != q.device:
                raise ValueError(f"{name} must have q's dtype and device ({q.dtype}, {q.device})")
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(t.stride())}")
            if not torch.compiler.is_compiling() and t.numel() and t.data_ptr() % ALIGN_BYTES:
                raise ValueError(f"{name} must start at a {ALIGN_BYTES}-byte aligned address (the append copies whole "
                                 "16-byte vectors)")  # fmt: skip
        if not packed and args.k_new.shape[1] > max_seqlen_k:
            raise ValueError(f"k_new has {args.k_new.shape[1]} tokens per sequence, more than the cache holds "
                             f"({max_seqlen_k})")  # fmt: skip

    if kv_fp8:
        for name, t in (("k_descale", args.k_descale), ("v_descale", args.v_descale)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (batch, nheads_kv):
                raise ValueError(
                    f"an fp8 cache needs {name}: a float32 tensor of shape (batch, nheads_kv) = ({batch}, {nheads_kv})"
                )
            if nheads_kv > 1 and t.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(t.stride())}")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    elif args.k_descale is not None or args.v_descale is not None:
        raise ValueError("k_descale / v_descale belong to a float8_e4m3fn cache; this cache is " + str(k_cache.dtype))

    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    left, right = _check_window(window_size)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise ValueError(f"softmax_scale must be a finite float >= 0 or None, got {softmax_scale!r}")
    elif not _finite(softmax_scale) or softmax_scale < 0:
        raise ValueError(f"softmax_scale must be a finite float >= 0 or None, got {softmax_scale!r}")
    softcap = check_softcap(softcap)
    check_learnable_sink(args.learnable_sink, nheads, q.device)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= KVCACHE_MAX_SPLITS:
        raise ValueError(
            f"num_splits must be an int in [0, {KVCACHE_MAX_SPLITS}] (0: chosen from the shapes), got {num_splits!r}"
        )
    if num_splits > 1 and softmax_scale > MAX_SPLIT_SCALE:
        raise ValueError(
            f"num_splits={num_splits} with softmax_scale={softmax_scale:g}: above {MAX_SPLIT_SCALE:g} the scaled "
            "scores may overflow fp32 (a hard max), which the split combine cannot weigh; use num_splits=0 or 1"
        )

    out_shape = (total_q, nheads, head_dim_v) if packed else (batch, seqlen_q, nheads, head_dim_v)
    if args.out is not None:
        o = args.out
        if not isinstance(o, torch.Tensor) or tuple(o.shape) != out_shape or o.dtype != q.dtype:
            got = f"{o.dtype} {tuple(o.shape)}" if isinstance(o, torch.Tensor) else type(o).__name__
            raise ValueError(f"out must be a {q.dtype} tensor of shape {out_shape}, got {got}")
        if o.device != q.device:
            raise ValueError(f"out is on {o.device} but q is on {q.device}")
        _check_in_kernel_layout("out", o)
        if _self_overlapping(o):
            raise ValueError(f"out (strides {tuple(o.stride())}) has elements that share memory: each written once")
    check_kvcache_addresses(args)
    if batch > MAX_GRID_YZ or nheads > MAX_GRID_YZ:
        raise NotImplementedError(f"batch ({batch}) and nheads ({nheads}) must each be <= {MAX_GRID_YZ}")

    mask = normalize_mask(causal, (left, right))
    dtype = INPUT_DTYPES[q.dtype]
    spec = AttentionSpec(
        dtype, head_dim, head_dim_v, mask.kind, dtype, **softcap_fields(softcap), sink=args.learnable_sink is not None,
        kvcache=True, page_size=page_size, kv_fp8=kv_fp8,
    )  # fmt: skip
    return KvCacheProblem(
        batch, seqlen_q, total_q, nheads, nheads_kv, head_dim, head_dim_v, max_seqlen_k, num_pages, spec, mask,
        float(softmax_scale), softcap, packed,
    )  # fmt: skip

"""The benchmark grid: which (dtype, shape, mask, direction) cases one run measures.

The default grid holds the token count (batch · seqlen) and the model width (heads · head_dim) fixed while the
sequence length sweeps, so every point does comparable work per token and the curves show how each implementation
scales with seqlen rather than with problem size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, List, Optional, Sequence

from .flops import attention_flops, direction_factor

DTYPES = ("bf16", "fp16", "fp8")
HEAD_DIMS = (64, 128, 256)
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DIRECTIONS = ("fwd", "bwd", "fwdbwd")  # fwdbwd: one forward and its backward, timed together
DEFAULT_DIRECTIONS = ("fwd", "bwd")
DEFAULT_TOKENS = 16384  # batch · seqlen
DEFAULT_HIDDEN = 2048  # heads · head_dim


@dataclass(frozen=True)
class Shape:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_kv: int
    head_dim: int
    head_dim_v: int

    def __post_init__(self) -> None:
        if min(self.extents()) < 1:
            raise ValueError(f"every extent of a shape must be positive: {self}")
        if self.heads % self.heads_kv:
            raise ValueError(f"heads ({self.heads}) must be a multiple of heads_kv ({self.heads_kv})")

    def extents(self) -> tuple:
        """(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, head_dim_v)."""
        return (self.batch, self.seqlen_q, self.seqlen_k, self.heads, self.heads_kv, self.head_dim, self.head_dim_v)


@dataclass(frozen=True)
class Case:
    """One measured configuration; every implementation runs it on the same inputs."""

    dtype: str  # "bf16" | "fp16" | "fp8"
    direction: str  # "fwd" | "bwd" | "fwdbwd"
    causal: bool
    shape: Shape

    @property
    def mask(self) -> str:
        return "causal" if self.causal else "none"

    @property
    def flops(self) -> float:
        s = self.shape
        return attention_flops(
            s.batch,
            s.heads,
            s.seqlen_q,
            s.seqlen_k,
            s.head_dim,
            s.head_dim_v,
            causal=self.causal,
        ) * direction_factor(self.direction)

    def label(self) -> str:
        s = self.shape
        seq = f"s{s.seqlen_q}" if s.seqlen_q == s.seqlen_k else f"sq{s.seqlen_q}-sk{s.seqlen_k}"
        heads = f"h{s.heads}" if s.heads == s.heads_kv else f"h{s.heads}-kv{s.heads_kv}"
        dims = f"d{s.head_dim}" if s.head_dim == s.head_dim_v else f"d{s.head_dim}-dv{s.head_dim_v}"
        return f"{self.dtype} {self.direction} {self.mask} b{s.batch} {seq} {heads} {dims}"

    def as_dict(self) -> dict:
        return {"dtype": self.dtype, "direction": self.direction, "mask": self.mask, **asdict(self.shape)}


def default_shape(seqlen: int, head_dim: int, tokens: int = DEFAULT_TOKENS, hidden: int = DEFAULT_HIDDEN) -> Shape:
    """Shape with batch · seqlen = tokens and heads · head_dim = hidden (each at least 1)."""
    batch = max(1, tokens // seqlen)
    heads = max(1, hidden // head_dim)
    return Shape(batch, seqlen, seqlen, heads, heads, head_dim, head_dim)


def parse_shape(text: str) -> Shape:
    """'B,SQ,SK,H,HKV,D[,DV]' -> Shape (the command line's --shape)."""
    try:
        parts = [int(p) for p in text.split(",")]
    except ValueError:
        raise ValueError(f"--shape {text!r}: expected comma-separated integers B,SQ,SK,H,HKV,D[,DV]") from None
    if len(parts) not in (6, 7):
        raise ValueError(f"--shape {text!r}: expected 6 or 7 integers B,SQ,SK,H,HKV,D[,DV], got {len(parts)}")
    b, sq, sk, h, hkv, d = parts[:6]
    dv = parts[6] if len(parts) == 7 else d
    return Shape(b, sq, sk, h, hkv, d, dv)


def build_grid(
    dtypes: Sequence[str] = DTYPES,
    head_dims: Sequence[int] = HEAD_DIMS,
    seqlens: Sequence[int] = SEQLENS,
    causals: Sequence[bool] = (False, True),
    directions: Sequence[str] = DEFAULT_DIRECTIONS,
    tokens: int = DEFAULT_TOKENS,
    hidden: int = DEFAULT_HIDDEN,
    shapes: Optional[Iterable[Shape]] = None,
) -> List[Case]:
    """All cases, ordered so that one dtype's curves complete before the next dtype starts.

    `shapes`, when given, replaces the (head_dims × seqlens) sweep. Within a dtype the order is direction, head dim,
    mask, seqlen: a run cut short by its time limit still holds whole curves.
    """
    for dt in dtypes:
        if dt not in DTYPES:
            raise ValueError(f"unknown dtype {dt!r}; expected one of {DTYPES}")
    for direction in directions:
        if direction not in DIRECTIONS:
            raise ValueError(f"unknown direction {direction!r}; expected one of {DIRECTIONS}")
    if shapes is not None:
        shape_list = list(shapes)
    else:
        shape_list = [default_shape(s, d, tokens, hidden) for d in head_dims for s in seqlens]
    cases = []
    head_dim_pairs = _unique((s.head_dim, s.head_dim_v) for s in shape_list)
    for dt in dtypes:
        for direction in directions:
            for dims in head_dim_pairs:
                for causal in causals:
                    cases.extend(
                        Case(dt, direction, causal, s) for s in shape_list if (s.head_dim, s.head_dim_v) == dims
                    )
    return cases


def _unique(items: Iterable) -> list:
    seen, out = set(), []
    for it in items:
        if it not in seen:
            seen.add(it)
            out.append(it)
    return out

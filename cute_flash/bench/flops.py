"""FLOP counts of one attention call, counting only the query/key pairs the mask leaves visible.

Forward: two matrix products per visible pair, QK^T (2·d FLOPs) and PV (2·dv FLOPs), so a dense call costs
2·b·h·sq·sk·(d + dv) = 4·b·h·sq·sk·d when dv = d. Backward is counted as 2.5 times the forward (five matrix products
against two), the convention FlashAttention's papers use, so forward and backward TFLOP/s are comparable.
Causal and local masks are bottom-right aligned (see `cute_flash.spec`): with off = sk - sq, query i sees key j iff
i + off - left <= j <= i + off + right. A plain causal call is counted as exactly half of the dense call
(4·b·h·sq·sk·d / 2), the convention FlashAttention, FA3/FA4 and cuDNN publish with, so our numbers compare with theirs;
windows count the pairs they actually leave visible.
"""

from __future__ import annotations

from typing import Optional

BACKWARD_FLOP_FACTOR = 2.5


def _sum_linear(first: int, last: int, offset: int) -> int:
    """sum of (i + offset) for i in [first, last]; 0 for an empty range."""
    n = last - first + 1
    if n <= 0:
        return 0
    return n * (first + last) // 2 + n * offset


def _sum_min(first: int, last: int, offset: int, cap: int) -> int:
    """sum of min(i + offset, cap) for i in [first, last]."""
    if last < first:
        return 0
    split = min(last, cap - offset)  # rows up to `split` stay under the cap
    below = _sum_linear(first, split, offset) if split >= first else 0
    return below + (last - max(split, first - 1)) * cap


def _sum_max(first: int, last: int, offset: int, floor: int) -> int:
    """sum of max(i + offset, floor) for i in [first, last]."""
    if last < first:
        return 0
    split = max(first, floor - offset)  # rows from `split` on stay over the floor
    above = _sum_linear(split, last, offset) if split <= last else 0
    return above + (min(split, last + 1) - first) * floor


def visible_pairs(seqlen_q: int, seqlen_k: int, left: Optional[int] = None, right: Optional[int] = None) -> int:
    """Number of (query, key) pairs inside the window; None means unbounded on that side.

    Causal is left=None, right=0. Row i sees keys [max(0, i + off - left), min(sk - 1, i + off + right)].
    """
    if seqlen_q <= 0 or seqlen_k <= 0:
        return 0
    off = seqlen_k - seqlen_q
    # An unbounded side behaves like a bound that reaches past every key.
    reach = seqlen_q + seqlen_k
    lo_off = off - (reach if left is None else left)
    hi_off = off + (reach if right is None else right)
    if hi_off < lo_off:  # left + right < 0: the window is empty on every row
        return 0
    # Rows whose window intersects [0, sk - 1]: i + hi_off >= 0 and i + lo_off <= sk - 1.
    first = max(0, -hi_off)
    last = min(seqlen_q - 1, seqlen_k - 1 - lo_off)
    if last < first:
        return 0
    rows = last - first + 1
    return _sum_min(first, last, hi_off, seqlen_k - 1) - _sum_max(first, last, lo_off, 0) + rows


def attention_flops(
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    head_dim_v: Optional[int] = None,
    *,
    causal: bool = False,
    window: tuple = (None, None),
    backward: bool = False,
) -> float:
    """FLOPs of one forward (or, with backward=True, one backward) attention call."""
    dv = head_dim if head_dim_v is None else head_dim_v
    left, right = window
    if causal:
        right = 0 if right is None else min(right, 0)
    if causal and left is None and right == 0:
        pairs = seqlen_q * seqlen_k / 2  # the published convention, see the module docstring
    else:
        pairs = visible_pairs(seqlen_q, seqlen_k, left, right)
    return pair_flops(pairs, batch, heads, head_dim, dv, direction="bwd" if backward else "fwd")


def direction_factor(direction: str) -> float:
    """FLOPs of a "fwd", "bwd" or "fwdbwd" (one training step's attention) call, in forwards."""
    return {"fwd": 1.0, "bwd": BACKWARD_FLOP_FACTOR, "fwdbwd": 1.0 + BACKWARD_FLOP_FACTOR}[direction]


def pair_flops(
    pairs: float, batch: int, heads: int, head_dim: int, head_dim_v: int, *, direction: str = "fwd"
) -> float:
    """FLOPs of `pairs` visible (query, key) pairs per (batch, head) in one `direction` call (direction_factor)."""
    fwd = 2.0 * batch * heads * pairs * (head_dim + head_dim_v)
    return fwd if direction == "fwd" else fwd * direction_factor(direction)


def tflops(flops: float, ms: Optional[float]) -> Optional[float]:
    """TFLOP/s of `flops` done in `ms` milliseconds; None when there is no time."""
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12

"""Randomised Hadamard transform along head_dim ("incoherent processing", FlashAttention-3 §3.3).

Q and K are both multiplied by the same orthogonal matrix R = D·H (D a diagonal of random signs, H the normalised
Walsh–Hadamard matrix). Then (Q R)(K R)ᵀ = Q Kᵀ exactly, while an outlier in one coordinate of a row is spread over
all coordinates of that row, so a per-block FP8 scale is no longer dictated by a few large entries and the
coordinate-wise products q_d·k_d that dominate the FP8 rounding error shrink. V is not rotated.

H is the Sylvester-ordered Hadamard matrix H[i, j] = (-1)^popcount(i & j) / sqrt(n), which a butterfly over the bits of
the index computes in n log2(n) additions; the pre-pass kernel runs the same butterflies (low index bits inside a
thread, high bits across lanes by shuffles), so this module is its reference.

Head dims that are not a power of two are transformed block-diagonally: blocks of `hadamard_block_size(d)` (the
largest power of two dividing d, at least 8 since head dims are multiples of 8). The result is still orthogonal; the
spreading then only reaches within a block.
"""

from __future__ import annotations

import math

import torch

DEFAULT_SEED = 0x5EED


def hadamard_block_size(head_dim: int) -> int:
    """Size of the Hadamard blocks for `head_dim`: the largest power of two that divides it."""
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    return head_dim & -head_dim


def hadamard_signs(head_dim: int, seed: int = DEFAULT_SEED, device=None) -> torch.Tensor:
    """The diagonal D: `head_dim` values in {-1, +1} (float32), a pure function of (head_dim, seed) on every device."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    bits = torch.randint(0, 2, (head_dim,), generator=gen, dtype=torch.int64)
    return (bits * 2 - 1).to(torch.float32).to(device)


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh–Hadamard transform of the last dimension, block-diagonal per `hadamard_block_size`.

    Computes in float32 (float64 stays float64). The matrix is symmetric and orthonormal: applying it twice is the
    identity.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    d = x.shape[-1]
    n = hadamard_block_size(d)
    y = x.to(compute).reshape(*x.shape[:-1], d // n, n)
    h = 1
    while h < n:
        # Pair index bit log2(h): (a, b) -> (a + b, a - b).
        y = y.reshape(*y.shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*x.shape[:-1], d // n, n)
        h *= 2
    return (y * (1.0 / math.sqrt(n))).reshape(*x.shape[:-1], d)


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """x R with R = D·H: sign flips, then the Hadamard transform of the last dimension (float32; float64 stays)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return walsh_hadamard(x.to(compute) * signs.to(device=x.device, dtype=compute))


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """y Rᵀ, the inverse of `rotate` (R is orthogonal): the Hadamard transform, then the same sign flips."""
    h = walsh_hadamard(y)
    return h * signs.to(device=h.device, dtype=h.dtype)

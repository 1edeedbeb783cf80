"""sm80 kernel family: FlashAttention-2's design (mma.sync, cp.async, ldmatrix). Serves Ampere and runs on Hopper."""

from .backend import BACKEND

__all__ = ["BACKEND"]

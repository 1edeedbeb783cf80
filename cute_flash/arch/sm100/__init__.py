"""sm100 kernel family: tcgen05 MMA with tensor-memory accumulators and 2-CTA MMA (Blackwell, capability 10.x)."""

from .backend import BACKEND

__all__ = ["BACKEND"]

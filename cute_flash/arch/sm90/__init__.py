"""sm90 kernel family: TMA, WGMMA and warp-specialised ping-pong consumers (Hopper, compute capability 9.0)."""

from .backend import BACKEND

__all__ = ["BACKEND"]

"""cute-flash: exact FlashAttention in CuTe DSL for Ampere, Hopper and Blackwell, behind one torch function."""

__version__ = "0.1.0"

from .interface import attention, backend  # noqa: E402

__all__ = ["attention", "backend", "__version__"]

"""cute-flash: exact FlashAttention in CuTe DSL for Ampere, Hopper and Blackwell, behind one torch function."""

__version__ = "0.1.0"

from . import reference  # noqa: E402  (plain torch: importing cute_flash never imports cutlass)
from .interface import attention, backend, explain  # noqa: E402
from .kvcache import attention_with_kvcache  # noqa: E402
from .reference import attention_reference  # noqa: E402
from .varlen import attention_varlen, explain_varlen  # noqa: E402

__all__ = [
    "attention",
    "attention_reference",
    "attention_varlen",
    "attention_with_kvcache",
    "backend",
    "explain",
    "explain_varlen",
    "reference",
    "__version__",
]

"""The implementations a benchmark run compares: cute-flash and every peer that imports on this machine.

Each one takes q (b, sq, h, d), k and v (b, sk, h_kv, d|dv) in the case's storage dtype and returns out
(b, sq, h, dv); backward goes through torch autograd on that output, so every implementation is timed on the same
`out.backward(dout)` call. Masks follow cute_flash's bottom-right alignment; a peer that cannot express a case says
why (`unsupported_reason`) and the run records "n/a" instead of a number.
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .grid import Case

CUTE_FLASH = "cute-flash"


class Impl:
    """One attention implementation. `unavailable_reason` is checked once per run, `unsupported_reason` per case."""

    name: str = ""
    # O(N^2) memory: the run may cap the seqlen it times these at (they are still in the memory sweep).
    quadratic_memory: bool = False

    def unavailable_reason(self) -> Optional[str]:
        return None

    def unsupported_reason(self, case: Case) -> Optional[str]:
        return None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case, scale: float) -> torch.Tensor:
        raise NotImplementedError

    def version(self) -> str:
        return ""


def _module_version(*distributions: str) -> str:
    """The installed version of the first distribution found ("" if none; informative only)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in distributions:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return ""


class CuteFlash(Impl):
    name = CUTE_FLASH

    def unavailable_reason(self) -> Optional[str]:
        try:
            from cute_flash.interface import backend

            self.arch = backend()
        except Exception as e:  # noqa: BLE001 - reported as the reason
            return f"cute_flash does not load here: {e}"
        return None

    def __call__(self, q, k, v, case, scale):
        import cute_flash

        return cute_flash.attention(
            q, k, v, causal=case.causal, softmax_scale=scale, dtype="fp8" if case.dtype == "fp8" else None
        )

    def version(self) -> str:
        import cute_flash

        return f"{cute_flash.__version__} ({getattr(self, 'arch', '?')} kernels)"


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


class Sdpa(Impl):
    """torch.nn.functional.scaled_dot_product_attention pinned to one backend."""

    def __init__(self, backend_name: str, label: str):
        self.backend_name = backend_name
        self.name = f"sdpa-{label}"
        self.quadratic_memory = backend_name == "MATH"

    def unavailable_reason(self) -> Optional[str]:
        try:
            from torch.nn.attention import SDPBackend
        except ImportError as e:
            return f"torch.nn.attention (SDPA backend selection) is missing: {e}"
        if not hasattr(SDPBackend, self.backend_name):
            return f"this torch has no SDPBackend.{self.backend_name}"
        return None

    def unsupported_reason(self, case: Case) -> Optional[str]:
        if case.dtype == "fp8":
            return "torch SDPA has no fp8 attention"
        return None

    def __call__(self, q, k, v, case, scale):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        s = case.shape
        kwargs = {"scale": scale, "enable_gqa": s.heads != s.heads_kv}
        if case.causal and s.seqlen_q != s.seqlen_k:
            # SDPA's is_causal is top-left aligned; cute_flash's causal is bottom-right.
            from torch.nn.attention.bias import causal_lower_right

            kwargs["attn_mask"] = causal_lower_right(s.seqlen_q, s.seqlen_k)
        else:
            kwargs["is_causal"] = case.causal
        with sdpa_kernel(getattr(SDPBackend, self.backend_name)):
            out = F.scaled_dot_product_attention(_bhsd(q), _bhsd(k), _bhsd(v), **kwargs)
        return _bhsd(out)

    def version(self) -> str:
        return torch.__version__


class _FlashAttnRelease(Impl):
    """A FlashAttention release: `unavailable_reason` binds its `flash_attn_func(q, k, v, softmax_scale=, causal=)`
    to `_fn`, which every release calls the same way. FA2 (>= 2.1), FA3 and FA4 align causal masks bottom-right,
    like cute_flash; some releases return (out, lse), of which out is kept."""

    def _bind(self, module: str, what: str) -> Optional[str]:
        try:
            self._fn = importlib.import_module(module).flash_attn_func
        except Exception as e:  # noqa: BLE001 - failing to import for any reason means "absent"
            return f"{what} does not import: {e}"
        return None

    def __call__(self, q, k, v, case, scale):
        result = self._fn(q, k, v, softmax_scale=scale, causal=case.causal)
        return result[0] if isinstance(result, tuple) else result


class FlashAttention4(_FlashAttnRelease):
    name = "fa4"

    def unavailable_reason(self) -> Optional[str]:
        return self._bind("flash_attn.cute", "flash_attn.cute")

    def unsupported_reason(self, case: Case) -> Optional[str]:
        if case.dtype == "fp8":
            if torch.cuda.get_device_capability()[0] != 10:
                return "FA4 runs fp8 on sm100 only"
            if case.direction != "fwd":
                return "FA4 has no fp8 backward"
        return None

    def __call__(self, q, k, v, case, scale):
        if case.dtype == "fp8":
            q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        return super().__call__(q, k, v, case, scale)

    def version(self) -> str:
        return _module_version("flash-attn-4", "flash_attn_4", "fa4")


class FlashAttention3(_FlashAttnRelease):
    name = "fa3"

    def unavailable_reason(self) -> Optional[str]:
        return self._bind("flash_attn_interface", "flash_attn_interface (FlashAttention-3)")

    def unsupported_reason(self, case: Case) -> Optional[str]:
        return "fp8 needs descale factors this benchmark does not pass to FA3" if case.dtype == "fp8" else None

    def version(self) -> str:
        return _module_version("flash_attn_3", "flash-attn-3")


class FlashAttention2(_FlashAttnRelease):
    name = "fa2"

    def unavailable_reason(self) -> Optional[str]:
        try:
            module = importlib.import_module("flash_attn")
            version = getattr(module, "__version__", "")
            if not version.startswith("2.") or not hasattr(module, "flash_attn_func"):
                # FA4's wheel provides flash_attn.cute inside a bare `flash_attn` package; that is not FA2.
                return "flash_attn (FlashAttention-2) is not installed"
            self._fn = module.flash_attn_func
        except Exception as e:  # noqa: BLE001
            return f"flash_attn (FlashAttention-2) does not import: {e}"
        return None

    def unsupported_reason(self, case: Case) -> Optional[str]:
        return "FlashAttention-2 has no fp8" if case.dtype == "fp8" else None

    def version(self) -> str:
        return _module_version("flash-attn")


class Naive(Impl):
    """softmax(q kᵀ · scale) v with the whole score matrix in memory: the O(N²) baseline."""

    name = "naive"
    quadratic_memory = True

    def unsupported_reason(self, case: Case) -> Optional[str]:
        return "the naive implementation has no fp8 path" if case.dtype == "fp8" else None

    def __call__(self, q, k, v, case, scale):
        s = case.shape
        group = s.heads // s.heads_kv
        qt = _bhsd(q)
        kt = _bhsd(k).repeat_interleave(group, dim=1) if group > 1 else _bhsd(k)
        vt = _bhsd(v).repeat_interleave(group, dim=1) if group > 1 else _bhsd(v)
        scores = torch.matmul(qt, kt.transpose(-1, -2)) * scale
        if case.causal:
            i = torch.arange(s.seqlen_q, device=q.device).unsqueeze(1)
            j = torch.arange(s.seqlen_k, device=q.device).unsqueeze(0)
            scores = scores.masked_fill(j > i + (s.seqlen_k - s.seqlen_q), float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return _bhsd(torch.matmul(probs, vt))


def all_impls() -> List[Impl]:
    return [
        CuteFlash(),
        FlashAttention4(),
        FlashAttention3(),
        FlashAttention2(),
        Sdpa("CUDNN_ATTENTION", "cudnn"),
        Sdpa("FLASH_ATTENTION", "flash"),
        Sdpa("EFFICIENT_ATTENTION", "efficient"),
        Sdpa("MATH", "math"),
        Naive(),
    ]


IMPL_NAMES = tuple(i.name for i in all_impls())


def select_impls(names: Optional[Sequence[str]], log: Callable[[str], None] = print) -> List[Impl]:
    """The requested implementations (all when `names` is None) that are available; logs why others are left out."""
    if names is not None:
        unknown = sorted(set(names) - set(IMPL_NAMES))
        if unknown:
            raise ValueError(f"unknown implementation(s) {unknown}; expected some of {list(IMPL_NAMES)}")
    chosen = []
    for impl in all_impls():
        if names is not None and impl.name not in names:
            continue
        reason = impl.unavailable_reason()
        if reason is None:
            chosen.append(impl)
        else:
            log(f"[bench] leaving out {impl.name}: {reason}")
    return chosen


def versions(impls: Sequence[Impl]) -> Dict[str, str]:
    return {i.name: i.version() for i in impls}

"""What the FP8 attention kernel reads, and the two ways to get it.

`Fp8Inputs` layout (all on the inputs' device):
  q          (b, sq, h, d)        float8_e4m3fn  Q·R (R the randomised Hadamard rotation, or the identity), scaled
  k          (b, sk, h_kv, d)     float8_e4m3fn  K·R, scaled
  v_t        (b, h_kv, dv, sk_pad) float8_e4m3fn V transposed, sequence contiguous; sk_pad = sk rounded up to 16,
                                                 columns >= sk unspecified (never read)
  q_descale  (b, h, ceil(sq / BLOCK_M))    float32  Q rows [i·BLOCK_M, (i+1)·BLOCK_M) of a head share q_descale[.., i]
  k_descale  (b, h_kv, ceil(sk / BLOCK_N)) float32  one per key block
  v_descale  (b, h_kv, ceil(sk / BLOCK_N)) float32  one per key block
so that Q·Kᵀ ≈ (q · q_descale)(k · k_descale)ᵀ and V ≈ v_t · v_descale, block by block. BLOCK_M = 64 is one consumer
warpgroup's query rows. The key block is the serving kernel's (`ArchBackend.fp8_kv_scale_block(spec)`): a multiple
of its key tile, so that every tile has one K and one V factor — 384 keys for the sm90 kernel at head dims up to 128
(two 192-key tiles), BLOCK_N = 128 otherwise (sm90 at d > 128, sm100).

- `prepare_fp8_inputs(q, k, v)`: fp16/bf16 inputs -> rotate (optional), block-scale and quantise. On CUDA it runs
  the CuTe DSL pre-pass (`prepass_kernel`: three launches, each one read of its input and one write); on CPU the torch
  reference (`quantize`), which is the same arithmetic.
- `check_prequantized(q8, k8, v8, descale)`: the caller's own e4m3 tensors (FP8 activations, an FP8 KV cache) with
  descales per (batch, kv_head) — FlashAttention-3's convention — or per block in the layout above. V arrives in the
  usual (b, sk, h_kv, dv) layout and is transposed here (one copy of V, in e4m3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from .. import compile_cache
from .hadamard import DEFAULT_SEED, hadamard_signs
from .quantize import FP8_DTYPE, num_blocks, padded_seqlen, quantize_blocks, quantize_v_transposed, transpose_v

BLOCK_M = 64  # query rows per Q scale
BLOCK_N = 128  # keys per K and V scale unless the kernel asks for another block (see the module docstring)
INPUT_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass
class Fp8Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v_t: torch.Tensor
    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor
    rotated: bool
    block_m: int = BLOCK_M
    block_n: int = BLOCK_N

    @property
    def seqlen_k(self) -> int:
        return self.k.shape[1]

    def descales(self) -> Dict[str, torch.Tensor]:
        return {"q": self.q_descale, "k": self.k_descale, "v": self.v_descale}


# ---------------------------------------------------------------------------------------------------------------------
# fp16/bf16 inputs
# ---------------------------------------------------------------------------------------------------------------------
_signs_cache: Dict[Tuple[int, int, str], torch.Tensor] = {}


def _signs(head_dim: int, seed: int, device: torch.device) -> torch.Tensor:
    key = (head_dim, seed, str(device))
    if key not in _signs_cache:
        _signs_cache[key] = hadamard_signs(head_dim, seed, device)
    return _signs_cache[key]


def prepare_fp8_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    rotate: bool = True,
    seed: int = DEFAULT_SEED,
) -> Fp8Inputs:
    """Quantises fp16/bf16 q (b, sq, h, d), k (b, sk, h_kv, d), v (b, sk, h_kv, dv) into `Fp8Inputs`."""
    if q.is_cuda:
        return _prepare_on_gpu(q, k, v, block_m, block_n, rotate, seed)
    signs = _signs(q.shape[-1], seed, q.device) if rotate else None
    q8, qd = quantize_blocks(q, block_m, signs)
    k8, kd = quantize_blocks(k, block_n, signs)
    vt8, vd = quantize_v_transposed(v, block_n)
    return Fp8Inputs(q8, k8, vt8, qd, kd, vd, rotate, block_m, block_n)


def _prepass(dtype_name: str, head_dim: int, block: int, rotate: bool, transpose: bool, target: str):
    key = ("fp8", target, "prepass", dtype_name, head_dim, block, rotate, transpose)

    def build():
        from .prepass_kernel import build_prepass

        return build_prepass(dtype_name, head_dim, block, rotate, transpose, compile_cache.compile_options(target))

    return compile_cache.get_or_compile(key, build)


def _prepare_on_gpu(q, k, v, block_m, block_n, rotate, seed) -> Fp8Inputs:
    dev = q.device
    # The device's own target: this pre-pass also feeds the sm100 FP8 kernel on Blackwell.
    target = compile_cache.runtime_target(dev)
    dtype_name = INPUT_DTYPES[q.dtype]
    b, sq, h, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    signs = _signs(d, seed, dev)
    q8 = torch.empty(b, sq, h, d, dtype=FP8_DTYPE, device=dev)
    k8 = torch.empty(b, sk, hkv, d, dtype=FP8_DTYPE, device=dev)
    vt8 = torch.empty(b, hkv, dv, padded_seqlen(sk), dtype=FP8_DTYPE, device=dev)
    qd = torch.empty(b, h, num_blocks(sq, block_m), dtype=torch.float32, device=dev)
    kd = torch.empty(b, hkv, num_blocks(sk, block_n), dtype=torch.float32, device=dev)
    vd = torch.empty_like(kd)
    with torch.cuda.device(dev):
        _prepass(dtype_name, d, block_m, rotate, False, target)(q, signs, q8, qd)
        _prepass(dtype_name, d, block_n, rotate, False, target)(k, signs, k8, kd)
        # V is not rotated; the kernel's signature still takes a (dv,) sign vector, which it does not read.
        _prepass(dtype_name, dv, block_n, False, True, target)(v, _signs(dv, seed, dev), vt8, vd)
    return Fp8Inputs(q8, k8, vt8, qd, kd, vd, rotate, block_m, block_n)


# ---------------------------------------------------------------------------------------------------------------------
# Pre-quantised inputs
# ---------------------------------------------------------------------------------------------------------------------
def descale_problem(
    name: str, t: object, batch: int, heads: int, kv_heads: int, seqlen: int, block: Optional[int]
) -> Optional[str]:
    """A sentence saying what is wrong with one descale tensor, or None.

    Accepted: float32 (batch, kv_heads) — one factor per (batch, kv head), FlashAttention-3's convention — or
    (batch, heads, ceil(seqlen / block)) — one per block (`heads` is h for q, h_kv for k and v). With block None
    (the serving kernel's block is not known yet) any positive number of blocks passes.
    """
    if not isinstance(t, torch.Tensor):
        return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if t.dtype != torch.float32:
        return f"{name} must be float32, got {t.dtype}"
    per_head = (batch, kv_heads)
    shape = tuple(t.shape)
    if block is None:
        if shape == per_head or (len(shape) == 3 and shape[:2] == (batch, heads) and shape[2] > 0):
            return None
        return f"{name} has shape {shape}; expected {per_head} (per batch and kv head) or ({batch}, {heads}, blocks)"
    per_block = (batch, heads, num_blocks(seqlen, block))
    if shape not in (per_head, per_block):
        return (
            f"{name} has shape {tuple(t.shape)}; expected {per_head} (per batch and kv head) or {per_block} "
            f"(per block of {block} rows)"
        )
    return None


def check_descales(
    descale: object, q: torch.Tensor, k: torch.Tensor, block_m: Optional[int], block_n: Optional[int],
    device_note: str = "",
) -> None:  # fmt: skip
    """Raises ValueError for the first thing wrong with descale = (q_descale, k_descale, v_descale) of e4m3 q, k:
    not such a triple, a dtype or shape `descale_problem` refuses (per block of block_m query rows / block_n keys;
    None: any number of blocks), or another device than q's (`device_note` ends that message). The front end's
    validation (blocks not known yet) and `check_prequantized` (blocks known) both check through here."""
    if not (isinstance(descale, (tuple, list)) and len(descale) == 3):
        raise ValueError("descale must be a tuple (q_descale, k_descale, v_descale) of float32 tensors")
    b, sq, h, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    for name, t, heads, seqlen, block in (
        ("q_descale", descale[0], h, sq, block_m),
        ("k_descale", descale[1], hkv, sk, block_n),
        ("v_descale", descale[2], hkv, sk, block_n),
    ):
        problem = descale_problem(name, t, b, heads, hkv, seqlen, block)
        if problem is not None:
            raise ValueError(problem)
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}{device_note}")


def _per_block(t: torch.Tensor, batch: int, heads: int, kv_heads: int, seqlen: int, block: int) -> torch.Tensor:
    nb = num_blocks(seqlen, block)
    if t.dim() == 3:
        return t.contiguous()
    per_head = t.repeat_interleave(heads // kv_heads, dim=1)  # (b, heads)
    return per_head.unsqueeze(-1).expand(batch, heads, nb).contiguous()


def check_prequantized(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    descale: Sequence[torch.Tensor],
    *,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
) -> Fp8Inputs:
    """`Fp8Inputs` from the caller's e4m3 q (b, sq, h, d), k (b, sk, h_kv, d), v (b, sk, h_kv, dv) and
    descale = (q_descale, k_descale, v_descale); shapes as in `descale_problem`. Validation of everything else is done
    by `cute_flash.validation` before this is called; this raises ValueError on a bad descale all the same.
    """
    check_descales(descale, q, k, block_m, block_n)
    b, sq, h, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qd = _per_block(descale[0], b, h, hkv, sq, block_m)
    kd = _per_block(descale[1], b, hkv, hkv, sk, block_n)
    vd = _per_block(descale[2], b, hkv, hkv, sk, block_n)
    return Fp8Inputs(q, k, transpose_v(v), qd, kd, vd, rotated=False, block_m=block_m, block_n=block_n)

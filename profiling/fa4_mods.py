"""FlashAttention-4 (`flash_attn.cute`) for profiling/mods_benchmark.py: the benchmark's seven score_mod / mask_mod
examples as FA4 callbacks, and FA4's block-sparse tensors taken from torch's FlexAttention BlockMask.

    fn = fa4_call(name, q, k, v, tables, flex_block_mask)   # a zero-argument callable: FA4's forward, out only

Nothing here imports flash_attn or cutlass until a function is called, so the benchmark imports without FA4 and
shows `n/a` where FA4 is absent or raises (`unavailable()`, exceptions of `fa4_call` and of its callable).

Written against flash_attn/cute at the FlashAttention repository's commit 0251105a (2026-08; read its
interface.py, block_sparsity.py, mask.py, softmax.py and tests/cute/test_score_mod.py, test_mask_mod.py):

- Entry: `flash_attn.cute.flash_attn_func(q, k, v, softcap=, score_mod=, mask_mod=, aux_tensors=,
  block_sparse_tensors=)` -> (out, lse); q / k / v (batch, seqlen, heads, dim), as cute-flash takes them.
- score_mod(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors) -> scores, every argument a TensorSSA. The scores
  already carry softmax_scale (FlexAttention's convention, and cute-flash's). With aux_tensors FA4 passes one score
  at a time (vector size 1), so a callback may read its indices' element 0.
- mask_mod(b, h, q_idx, kv_idx, seqlen_info, aux_tensors) -> Boolean TensorSSA, True where the key is kept; the sm90
  kernel calls it one score at a time (q_idx / kv_idx are positions within the sequence).
- aux_tensors: the example's tables (slopes, T5 table, document ids, prefix lengths) as cute-flash reads them, the
  document ids as an int32 copy (the values of the int64 tensor cute-flash gets; FA4's mask tests use int32 ids).
- Block sparsity: `BlockSparseTensorsTorch(mask_block_cnt / idx = the BlockMask's kv_num_blocks / kv_indices (key
  blocks that need the mask_mod), full_block_cnt / idx = full_kv_num_blocks / full_kv_indices (blocks kept whole:
  FA4 skips the mask_mod there), block_size=BLOCK_SIZE)`, as FA4's tests/cute/test_mask_mod.py builds it. FA4's sm90
  forward at head dim 128 runs 128 x 128 tiles with q_stage 1 (interface._tile_size_fwd_sm90, _get_fwd_config), and
  takes a query block size that is a multiple of 128 and a key block size equal to tile_n, so the BlockMask must be
  made with BLOCK_SIZE=(128, 128), FlexAttention's default. Elsewhere FA4 wants other blocks (sm100: 256-row query
  blocks for its q_stage 2) and raises, which the benchmark shows as n/a.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Optional

BLOCK_SIZE = (128, 128)  # (query rows, key columns) of a block: FA4's sm90 forward tile at head dim 128 (see above)
MASK_EXAMPLES = ("causal", "sliding", "document", "prefix_lm")  # the rest are score_mods: alibi, t5_bias, softcap


def unavailable() -> Optional[str]:
    """None where FA4's mod path imports, else a one-line reason. Needs flash_attn.cute's interface and its
    block_sparsity module: this repository's stand-in (profiling/fa4_shim, cute-flash under FA4's names) has no
    block_sparsity, so it is reported absent rather than timed against itself."""
    try:
        import flash_attn.cute.block_sparsity  # noqa: F401
        from flash_attn.cute.interface import flash_attn_func  # noqa: F401
    except Exception as e:  # noqa: BLE001 - absent, a stand-in, or a broken install: all mean "not timed"
        return f"flash_attn.cute does not import ({type(e).__name__}: {_line(e)})"
    return None


def version() -> str:
    """flash_attn.cute's version string (its package metadata; "0.0.0" for a source tree)."""
    import flash_attn.cute

    return str(getattr(flash_attn.cute, "__version__", "?"))


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else ""


def reason(e: BaseException) -> str:
    """One line for stderr: FA4's exception, its first line."""
    return f"{type(e).__name__}: {_line(e)}"


# --- the callbacks (CuTe DSL, built on first use; each name one function object, so FA4 compiles it once) ---


@functools.lru_cache(maxsize=None)
def _score_mod(name: str, max_distance: int = 128) -> Callable:
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils  # (a module, not its function: FA4 hashes a callback's closure by repr)

    if name == "alibi":

        @cute.jit
        def alibi(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
            # scores - slopes[h] * (q_idx - kv_idx); aux_tensors[0] = slopes, (heads,) float32
            slope = utils.scalar_to_ssa(aux_tensors[0][h[0]], cutlass.Float32)
            return scores - slope * (q_idx - kv_idx).to(cutlass.Float32)

        fn = alibi
    elif name == "t5_bias":

        @cute.jit
        def t5_bias(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
            # scores + table[h, clamp(kv_idx - q_idx, -max_distance, max_distance) + max_distance];
            # aux_tensors[0] = table, (heads, 2 * max_distance + 1) float32
            rel = cutlass.max(cutlass.min(kv_idx[0] - q_idx[0], max_distance), -max_distance)
            bias = utils.scalar_to_ssa(aux_tensors[0][h[0], rel + max_distance], cutlass.Float32)
            return scores + bias

        fn = t5_bias
    else:
        raise ValueError(f"no FA4 score_mod for {name!r}")
    # One score per call: the element-0 reads above rely on it (FA4's default with aux_tensors; set to be explicit,
    # it is part of FA4's compile key).
    fn.__vec_size__ = 1
    return fn


@functools.lru_cache(maxsize=None)
def _mask_mod(name: str, window: int = 1024) -> Callable:
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils  # (a module, not its function: FA4 hashes a callback's closure by repr)

    if name == "causal":

        @cute.jit
        def causal(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
            return q_idx >= kv_idx

        return causal
    if name == "sliding":

        @cute.jit
        def sliding(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
            # (q_idx >= kv_idx) & (q_idx - kv_idx < window)
            return (q_idx >= kv_idx) & (q_idx - kv_idx < utils.scalar_to_ssa(window, cutlass.Int32))

        return sliding
    if name == "document":

        @cute.jit
        def document(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
            # (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx); aux_tensors[0] = doc, (batch, seqlen) int32
            doc = aux_tensors[0]
            q_doc = utils.scalar_to_ssa(doc[b[0], q_idx[0]], cutlass.Int32)
            kv_doc = utils.scalar_to_ssa(doc[b[0], kv_idx[0]], cutlass.Int32)
            return (q_doc == kv_doc) & (q_idx >= kv_idx)

        return document
    if name == "prefix_lm":

        @cute.jit
        def prefix_lm(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
            # (kv_idx < prefix[b]) | (q_idx >= kv_idx); aux_tensors[0] = prefix, (batch,) int32
            prefix = utils.scalar_to_ssa(aux_tensors[0][b[0]], cutlass.Int32)
            return (kv_idx < prefix) | (q_idx >= kv_idx)

        return prefix_lm
    raise ValueError(f"no FA4 mask_mod for {name!r}")


def block_sparse_tensors(flex_block_mask):
    """FA4's BlockSparseTensorsTorch of a FlexAttention BlockMask made at BLOCK_SIZE (forward: key blocks by query
    block). Batch / head extents of 1 (create_block_mask's B=None / H=None) broadcast in FA4."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    got = tuple(flex_block_mask.BLOCK_SIZE)
    if got != BLOCK_SIZE:
        raise ValueError(f"the BlockMask's BLOCK_SIZE is {got}; FA4's sm90 d128 tiles need {BLOCK_SIZE}")
    return BlockSparseTensorsTorch(
        mask_block_cnt=flex_block_mask.kv_num_blocks,
        mask_block_idx=flex_block_mask.kv_indices,
        full_block_cnt=flex_block_mask.full_kv_num_blocks,
        full_block_idx=flex_block_mask.full_kv_indices,
        block_size=BLOCK_SIZE,
    )


def fa4_call(name: str, q, k, v, tables: Dict[str, object], flex_block_mask=None) -> Callable[[], object]:
    """A zero-argument callable running FA4's forward for example `name` of mods_benchmark (its output only), with
    that example's tables (`tables`, from mods_benchmark._callables) and, for the mask examples, its FlexAttention
    BlockMask at BLOCK_SIZE. Raises where FA4 does not import or the example cannot be set up; the callable raises
    what FA4 raises (compiling on its first call)."""
    why = unavailable()
    if why is not None:
        raise ImportError(why)
    import torch
    from flash_attn.cute.interface import flash_attn_func

    kw: Dict[str, object] = {}
    if name == "softcap":
        # FA4's own softcap argument: FA4 applies it as a score_mod (utils.create_softcap_scoremod: cap *
        # tanh(score / cap) on the scaled score), the benchmark's 30 * tanh(score / 30); its tanh is the fast one.
        kw["softcap"] = 30.0
    elif name == "alibi":
        kw.update(score_mod=_score_mod("alibi"), aux_tensors=[tables["slopes"]])
    elif name == "t5_bias":
        kw.update(score_mod=_score_mod("t5_bias", int(tables["max_distance"])), aux_tensors=[tables["table"]])
    elif name in MASK_EXAMPLES:
        if flex_block_mask is None:
            raise ValueError(f"{name}: FA4 is run with block sparsity, a FlexAttention BlockMask is needed")
        if name == "sliding":
            kw["mask_mod"] = _mask_mod("sliding", int(tables["window"]))
        else:
            kw["mask_mod"] = _mask_mod(name)
        if name == "document":
            kw["aux_tensors"] = [tables["doc"].to(torch.int32).contiguous()]
        elif name == "prefix_lm":
            kw["aux_tensors"] = [tables["prefix"].to(torch.int32).contiguous()]
        kw["block_sparse_tensors"] = block_sparse_tensors(flex_block_mask)
    else:
        raise ValueError(f"unknown example {name!r}")
    return lambda: flash_attn_func(q, k, v, **kw)[0]

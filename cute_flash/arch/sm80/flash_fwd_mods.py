"""The sm80 forward with a score_mod and / or a mask_mod (cute_flash/mods): `Sm80ModsForward`, the forward
whose `modify_scores` hook applies the traced callables to every score of every key tile (codegen.emit, one scalar
expression per element), before the kernel's own causal / window / sequence-end masks.

Per score: s = S * softmax_scale; s = score_mod(s, b, h, q_idx, kv_idx); s = -inf where not mask_mod(b, h, q_idx,
kv_idx). The softmax then runs with log2(e) as its scale (the scores are scaled already). q_idx / kv_idx are the
positions within the sequence, clamped to the last row / key before the callables read their tables (positions past
the sequence are masked by the kernel anyway), h the query head, b the batch index. Every key tile the causal /
window range leaves is visited (no block mask yet), and the build is unsplit (its backward: flash_bwd_mods.py).
Packed sequences (spec.varlen, the `packed_mods` entry of common/entries.ModsFwdEntry, the plain packed forward's
tensors and sequences): b is the sequence, q_idx / kv_idx positions within it, the kernel's per-sequence tiles.

The captured tensors are the `mods` entry's a0 .. a3 (None past the graphs' tables), stored as the graphs read them
(float32, int32, or uint8 for booleans: mods/call.py converts them), score_mod's tables first, then mask_mod's.
"""

from __future__ import annotations


import cutlass.cute as cute
from cutlass import Int32

from ...common.entries import ModsFwdEntry
from ...common.mods_scores import ModsGraphs
from ...spec import ModsSpec
from .flash_fwd import FwdFeatures, Sm80FlashForward
from .tile_config import FwdTileConfig


class Sm80ModsForward(ModsGraphs, ModsFwdEntry, Sm80FlashForward):
    def __init__(self, spec: ModsSpec, tile: FwdTileConfig):
        super().__init__(spec, tile)
        self.init_graphs(spec)

    def _feature_args(self, softmax_scale, features):
        scale, a0, a1, a2, a3 = features[:5]  # (no block lists: this kernel visits every tile)
        return self.mods_scale_log2(softmax_scale), FwdFeatures(None, None, (scale, a0, a1, a2, a3))

    def score_context(self, features, head, seq):
        scale, *tables = features.mods
        return self.mods_context(scale, tables, head, seq.batch, seq.seqlen_q, seq.seqlen_k)

    def modify_scores(self, acc_S: cute.Tensor, n_block: Int32, step):
        self.apply_mods(acc_S, step.tScS_rc, step.m_block * self.tile_m, n_block * self.tile_n, step.score_ctx)

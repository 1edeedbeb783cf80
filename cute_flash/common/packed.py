"""Packed (variable-length) batches inside kernels: where one sequence's rows lie, and per-(sequence, head) views.

A packed operand is (total, h, d): sequence b owns rows [cu_seqlens[b], cu_seqlens[b+1]). Kernels compiled for
packed inputs read those offsets (and `seqused_k`, which overrides the number of valid keys) once per CTA, then work
on a view whose row 0 is the sequence's first row, predicating on the sequence's own lengths exactly as the dense
kernels predicate on seqlen_q / seqlen_k.

Buffers of whole tiles (the backward's fp32 accumulators and row statistics) cannot share rows between sequences, so
sequence b's padded rows start at `padded_offset` = (cu_seqlens[b] + b * pad) rounded down to a multiple of pad: with
pad >= the tile, a sequence's last (partial) tile ends before the next sequence's first row, and every sequence
starts on a whole pad, which TMA loads of the fp32 statistics need (an sm90 TMA load from an fp32 row that is not
16-byte aligned is an illegal instruction). Such buffers have total + batch * pad rows (`padded_rows`): the next
start, floor((x + len + pad) / pad) * pad for x = cu_seqlens[b] + b * pad, is at least this one plus len rounded up.

Dense kernels pass offset None to the helpers, which then index the batch mode exactly as before (the same IR).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

Int = Any  # a cutlass.Int32 inside kernels


@dataclass(frozen=True)
class SeqRows:
    """One sequence of a batch: row offsets of its queries and keys (None in a dense batch), and its lengths."""

    offset_q: Int
    offset_k: Int
    seqlen_q: Int
    seqlen_k: Int  # seqused_k[b] when given, else cu_seqlens_k[b + 1] - cu_seqlens_k[b]
    batch: Int

    def padded_offset_q(self, pad: int) -> Optional[Int]:
        return None if self.offset_q is None else (self.offset_q + self.batch * pad) // pad * pad

    def padded_offset_k(self, pad: int) -> Optional[Int]:
        return None if self.offset_k is None else (self.offset_k + self.batch * pad) // pad * pad


def seq_rows(batch: Int, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK=None) -> SeqRows:
    """Reads sequence `batch`'s offsets and lengths (inside a kernel)."""
    offset_q = mCuSeqlensQ[batch]
    offset_k = mCuSeqlensK[batch]
    seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
    if mSeqUsedK is None:
        seqlen_k = mCuSeqlensK[batch + 1] - offset_k
    else:
        seqlen_k = mSeqUsedK[batch]
    return SeqRows(offset_q, offset_k, seqlen_q, seqlen_k, batch)


def dense_seq(batch: Int, seqlen_q: Int, seqlen_k: Optional[Int] = None) -> SeqRows:
    """Sequence `batch` of a dense (b, s, ...) batch: no row offsets (None, and None padded offsets), so that one
    CTA body serves both layouts and the helpers below index the batch mode."""
    return SeqRows(None, None, seqlen_q, seqlen_k, batch)


def cta_sequence(varlen: bool, batch: Int, head: Int, mQ, mK, cu_seqlens_q, cu_seqlens_k, seqused_k):
    """The sequence a CTA of batch index `batch` works on, and the KV head that query head `head` reads: from
    cu_seqlens (and seqused_k) for packed (total, h, d) q / k, else the dense (b, s, h, d) batch entry."""
    if varlen:
        return seq_rows(batch, cu_seqlens_q, cu_seqlens_k, seqused_k), head // (mQ.shape[1] // mK.shape[1])
    return dense_seq(batch, mQ.shape[1], mK.shape[1]), head // (mQ.shape[2] // mK.shape[2])


def head_rows(mX, batch: Int, head: Int, offset: Optional[Int] = None):
    """The (rows, d) view of one (sequence, head): mX[batch, :, head, :] of a dense (b, s, h, d) tensor, or the rows
    from `offset` of a packed (total, h, d) one."""
    if offset is None:
        return mX[batch, None, head, None]
    import cutlass.cute as cute

    return cute.domain_offset((offset, 0), mX[None, head, None])


def head_stats(mX, batch: Int, head: Int, offset: Optional[Int] = None):
    """The (rows,) view of one (sequence, head) of a row statistic: mX[batch, head, :] of a dense (b, h, s) tensor,
    or the entries from `offset` of a packed (h, total) one."""
    if offset is None:
        return mX[batch, head, None]
    import cutlass.cute as cute

    return cute.domain_offset((offset,), mX[head, None])


# Rows per CTA of the backward's pre- / postprocess kernels (the sm80 family's, which the sm90 backward launches too).
PRE_POST_ROWS = 64


def packed_pads(tile_m: int, tile_n: int) -> Tuple[int, int]:
    """(pad_q, pad_k) of the packed backward's padded buffers for main-kernel tiles of tile_m queries and tile_n keys
    (both families): whole main-kernel tiles and whole PRE_POST_ROWS-row pre- / postprocess blocks fit, so no
    sequence's tiles reach the next sequence's rows."""
    return math.lcm(tile_m, PRE_POST_ROWS), math.lcm(tile_n, PRE_POST_ROWS)


def padded_rows(total: int, batch: int, pad: int) -> int:
    """Rows of a buffer in which sequence b starts at its padded offset (host side)."""
    return total + batch * pad

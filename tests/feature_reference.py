"""Soft-capping and learnable sinks in float64, as the kernels' contract states them (arch/base.py), for the test
doubles of the CPU tests (a fake backend that computes what a kernel would, with the sink view it is handed)."""

from __future__ import annotations

import torch

from cute_flash.reference import visible_keys


def featured_reference(q, k, v, softmax_scale, mask, softcap=0.0, sink_rows=None):
    """(out, lse) in float64 with soft-capping and learnable sinks, as the kernels' contract states them
    (arch/base.py): sink_rows is the (rows, h) view a kernel reads, sink_rows[i, h] for query row i of head h.
    Differentiable through autograd (the sink too, when its tensor requires grad)."""
    b, sq, h, _ = q.shape
    rep = h // k.shape[2]
    kx, vx = (t.double().repeat_interleave(rep, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kx) * softmax_scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible_keys(sq, k.shape[1], mask), float("-inf"))
    if sink_rows is not None:  # one more logit per row, attending to no value
        sink = sink_rows.double().t().reshape(1, h, sq, 1).expand(b, h, sq, 1)
        s = torch.cat([s, sink], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    if sink_rows is not None:
        p = p[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, vx), lse

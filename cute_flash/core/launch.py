"""The one forward launcher and the one backward launcher of a planned call (core/plan.py): eager calls, the custom
ops under torch.compile, the ring's kernel blocks and the SDPA plug-in all launch through `forward` and `backward`.

They allocate the outputs (unless given views), answer calls without work (no key anywhere: out 0, lse -inf, or the
sink), run FP8 calls' pre-pass, pack decoding under GQA (decode.py), make the learnable sinks' views
(arch/base.FwdTensors.sink), bind the backends' launchers on first use and launch under the device guard.

`PlanRun` is what the autograd node (core/autograd.py) runs for a planned call.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import decode
from ..arch.base import BwdTensors, FwdTensors, Grads, KvCacheTensors, finite_rows, sink_grad
from ..kernel_layout import kernel_view
from ..problem import PackedSeqs
from . import device
from .plan import Plan, decode_kvcache, packed_decode_plan


def kernel_inputs(plan: Plan, q, k, v) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v in the kernels' layout (`kernel_view`), for a plan whose inputs need it."""
    if plan.copies:
        return kernel_view(q), kernel_view(k), kernel_view(v)
    return q, k, v


def kernel_seqs(plan: Plan, seqs: PackedSeqs) -> PackedSeqs:
    """A packed call's offsets with the unit stride the kernels read them with (a no-op for the usual vectors)."""
    if not plan.copy_seqs:
        return seqs
    used = seqs.seqused_k
    return seqs._replace(
        cu_seqlens_q=seqs.cu_seqlens_q.contiguous(),
        cu_seqlens_k=seqs.cu_seqlens_k.contiguous(),
        seqused_k=None if used is None else used.contiguous(),
    )


def _sinks(sink: torch.Tensor) -> torch.Tensor:
    return sink.float().contiguous()


def _no_keys(out: torch.Tensor, lse: torch.Tensor, sink: Optional[torch.Tensor]) -> None:
    """A call in which no row sees a key: out 0, lse -inf, or each head's sink (lse (.., h, rows): h second-last)."""
    out.zero_()
    if sink is None:
        lse.fill_(float("-inf"))
    else:
        shape = [1] * lse.dim()
        shape[-2] = sink.shape[0]
        lse.copy_(_sinks(sink).view(shape).expand_as(lse))


def forward(plan: Plan, q, k, v, sink=None, seqs: Optional[PackedSeqs] = None, out=None, lse=None):
    """out, lse of a planned call; q, k, v (and seqs) already in the kernels' layout (`kernel_inputs`,
    `kernel_seqs`); sink: the call's (h,) learnable sinks or None; out, lse: views to fill, else new."""
    if out is None:
        out = torch.empty(plan.out_shape, dtype=plan.out_dtype, device=plan.device)
        lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=plan.device)
    if plan.empty:
        _no_keys(out, lse, sink)
        return out, lse
    if plan.fp8 is not None:
        _fp8_forward(plan, q, k, v, out, lse)
        return out, lse
    if sink is not None:
        sink = _sinks(sink)
    if plan.decode_keys is not None:
        # One query row under GQA: the KV-cache forward, which packs the query heads of a KV head into one tile and
        # splits the keys (the same kernels as attention_with_kvcache); else the query heads as the rows of one
        # packed problem over the keys the row sees (decode.py).
        kv = plan.decode_kvcache
        if kv is None:
            with device.guard(q):
                kv = decode_kvcache(plan, q)
            if not device.capturing(q):  # (its lengths' fill, recorded in a capture, never ran outside it)
                plan.decode_kvcache = kv
        if kv:
            launcher, seqlens = kv
            lo, hi = plan.decode_keys
            if (lo, hi) != (0, k.shape[1]):
                k, v = k[:, lo:hi], v[:, lo:hi]
            with device.guard(q):
                launcher(KvCacheTensors(q, k, v, out, lse, seqlens, None, None, sink, None, None))
            return out, lse
        nheads_kv = plan.problem.nheads_kv
        q, k, v, out_rows, lse_rows = decode.pack_gqa(q, k, v, out, lse, nheads_kv, plan.decode_keys)
        packed = plan.decode_plan
        if packed is None:
            packed = plan.decode_plan = packed_decode_plan(plan, q, k, v)
        _launch(packed, q, k, v, out_rows, lse_rows, None if sink is None else decode.sink_rows(sink, nheads_kv))
        return out, lse
    launch = plan.launch
    if launch is not None and sink is None and seqs is None and plan.device_index is not None:
        if torch.cuda.current_device() == plan.device_index:  # the common case: one call, nothing to guard
            launch(q, k, v, out, lse)
            return out, lse
    # The sinks as the (rows, h) view the kernels read: the (h,) logits with row stride 0.
    _launch(plan, q, k, v, out, lse, None if sink is None else sink.expand(plan.rows, sink.shape[0]), seqs)
    return out, lse


class _PackedLauncher:
    """A varlen family's forward_varlen bound to one packed problem, called as the dense launchers are (plus seqs)."""

    __slots__ = ("backend", "problem")

    def __init__(self, backend, problem):
        self.backend, self.problem = backend, problem

    def __call__(self, q, k, v, out, lse, sink, seqs) -> None:
        if sink is None:
            self.backend.forward_varlen(q, k, v, out, lse, seqs, self.problem)
        else:
            self.backend.forward_varlen(q, k, v, out, lse, seqs, self.problem, sink=sink)


def _bind_forward(plan: Plan):
    if plan.problem.spec.varlen:
        return _PackedLauncher(plan.forward, plan.problem)
    return plan.forward.forward_launcher(plan.problem, plan.device)


def _launch(plan: Plan, q, k, v, out, lse, sink_view=None, seqs=None) -> None:
    """Binds the plan's launcher on first use and launches under the device guard (`forward` takes the common case,
    a bound dense launcher on the current device, without it)."""
    with device.guard(q):
        launch = plan.launch
        if launch is None:
            launch = plan.launch = _bind_forward(plan)
        if seqs is not None:
            launch(q, k, v, out, lse, sink_view, seqs)
        elif sink_view is None:
            launch(q, k, v, out, lse)
        else:
            launch(q, k, v, out, lse, sink_view)


def _fp8_forward(plan: Plan, q, k, v, out, lse) -> None:
    """FP8: q, k e4m3 (b, s, h, d); v transposed e4m3 (b, h_kv, dv, sk_pad); block descales (fp8/prepare.Fp8Inputs),
    made on the GPU by the pre-pass (fp16/bf16 inputs) or from the caller's e4m3 tensors and descales."""
    from ..fp8.prepare import check_prequantized, prepare_fp8_inputs

    descale, rotate = plan.fp8
    arch, problem = plan.forward, plan.problem
    block_n = arch.fp8_kv_scale_block(problem.spec)
    with device.guard(q):
        if descale is not None:
            f = check_prequantized(q, k, v, descale, block_n=block_n)
        else:
            f = prepare_fp8_inputs(q, k, v, rotate=rotate, block_n=block_n)
        arch.forward(FwdTensors(f.q, f.k, f.v_t, out, lse), problem, descale=f.descales())


def backward(plan: Plan, dout, q, k, v, out, lse, dlse=None, sink=None, seqs: Optional[PackedSeqs] = None):
    """(dq, dk, dv, dsink) of a planned call from the saved tensors (q, k, v, out in the kernels' layout); dout may
    have any layout autograd hands over; dlse: lse's gradient, or None; sink: the call's (h,) sinks (dsink: (h,)
    float32, else None)."""
    arch = plan.backward_backend(q)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dsink = None
    if sink is not None:
        sink = _sinks(sink)
        dsink = torch.full_like(sink, float("nan"))  # (a backend that fills nothing leaves NaN, not a plausible value)
    if plan.empty:
        for g in (dq, dk, dv):
            g.zero_()
        if sink is not None:  # out 0, so D = 0: the sink's gradient is dlse's sum (sink_grad with D - dlse = -dlse)
            sink_grad(dsink, sink, lse, torch.zeros_like(lse) if dlse is None else -finite_rows(dlse, lse))
        return dq, dk, dv, dsink
    t = BwdTensors(kernel_view(dout), q, k, v, out, lse, dlse, sink)
    grads = Grads(dq, dk, dv, dsink)
    if seqs is not None:
        with device.guard(q):
            arch.backward_varlen(t, grads, seqs, plan.problem, plan.deterministic)
        return dq, dk, dv, dsink
    launch = plan.backward_launch
    if launch is None:
        with device.guard(q):
            launch = plan.backward_launch = arch.backward_launcher(plan.problem, plan.device, plan.deterministic)
    if plan.device_index is not None and torch.cuda.current_device() == plan.device_index:
        launch(t, grads)
    else:
        with device.guard(q):
            launch(t, grads)
    return dq, dk, dv, dsink


class PlanRun:
    """What the autograd node (core/autograd.py) asks of its `run`, for a planned call: one per plan (`run_of`)."""

    __slots__ = ("plan",)

    def __init__(self, plan: Plan):
        self.plan = plan

    def forward_saving(self, q, k, v, sink, seqs):
        """(q, k, v in the kernels' layout, out, lse): what the node saves, and the outputs."""
        p = self.plan
        if p.copies:
            q, k, v = kernel_view(q), kernel_view(k), kernel_view(v)
        out, lse = forward(p, q, k, v, sink, seqs)
        return q, k, v, out, lse

    def backward(self, dout, q, k, v, out, lse, dlse, sink, seqs):
        return backward(self.plan, dout, q, k, v, out, lse, dlse, sink, seqs)


def run_of(plan: Plan) -> PlanRun:
    """The plan's `PlanRun`, made once."""
    run = plan.run
    if run is None:
        run = plan.run = PlanRun(plan)
    return run

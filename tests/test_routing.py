"""Per-call routing to the kernel family that has a kernel (cute_flash.routing), with fake compute capabilities:
no GPU needed. The real backends' `unsupported_reason` runs (it imports no cutlass); no kernel is compiled."""

import contextlib
import dataclasses

import pytest
import torch

import cute_flash
from cute_flash.arch.base import BackendBase, launcher_through_backward, launcher_through_forward
from cute_flash import routing, validation
from cute_flash.core import device
from cute_flash.spec import AttentionSpec

HOPPER, AMPERE, ADA, BLACKWELL = (9, 0), (8, 0), (8, 9), (10, 0)


@pytest.fixture(autouse=True)
def _no_forced_family(monkeypatch):
    monkeypatch.delenv("CUTE_FLASH_ARCH", raising=False)
    routing.clear_cache()
    yield
    routing.clear_cache()


def spec(d, dv=None, dtype="bf16", mask="none"):
    dv = d if dv is None else dv
    return AttentionSpec(
        dtype=dtype, head_dim=d, head_dim_v=dv, mask=mask, out_dtype="bf16" if dtype == "fp8" else dtype
    )


@pytest.mark.parametrize(
    "cap, families",
    [
        (HOPPER, ("sm90", "sm80")),
        (AMPERE, ("sm80",)),
        ((8, 6), ("sm80",)),
        (ADA, ("sm80",)),
        (BLACKWELL, ("sm100", "sm80")),
    ],
)
def test_candidate_families(cap, families):
    assert routing.candidate_families(cap) == families


def test_forced_family_is_the_only_candidate():
    assert routing.candidate_families(HOPPER, forced="sm80") == ("sm80",)
    assert routing.candidate_families(None, forced="sm90") == ("sm90",)
    with pytest.raises(ValueError, match="CUTE_FLASH_ARCH='sm70'"):
        routing.candidate_families(HOPPER, forced="sm70")
    with pytest.raises(NotImplementedError, match="compute capability 7.5"):
        routing.candidate_families((7, 5))


# (spec, forward family on Hopper, backward family on Hopper): every head dim the README documents gets a forward.
HOPPER_ROUTES = [
    (spec(64), "sm90", "sm90"),
    (spec(128, mask="causal"), "sm90", "sm90"),
    (spec(256, mask="local"), "sm90", "sm90"),
    # Head dims without an sm90 backward tile of their own run the narrowest wider one on zero-padded operands
    # (sm90.backward.kernel_dims): d160 the d192 kernels, d16 / d32 the d64 ones, d72 the d96 ones, d224 the d256
    # ones; (192, 128) has its own.
    (spec(192, mask="causal"), "sm90", "sm90"),
    (spec(96, mask="causal"), "sm90", "sm90"),
    (spec(16), "sm80", "sm90"),
    (spec(32), "sm80", "sm90"),
    (spec(72), "sm80", "sm90"),
    (spec(160), "sm80", "sm90"),
    (spec(224), "sm80", "sm90"),
    # head_dim != head_dim_v: the sm90 forward where both are sm90 head dims; the sm90 backward, padded.
    (spec(192, 128), "sm90", "sm90"),
    (spec(192, 128, dtype="fp16", mask="causal"), "sm90", "sm90"),
    (spec(128, 64), "sm90", "sm90"),
    (spec(64, 256, mask="local"), "sm90", "sm90"),
    (spec(128, 80), "sm80", "sm90"),
    (spec(8, 256), "sm80", "sm90"),
    (spec(72, 64), "sm80", "sm90"),
    (spec(128, dtype="fp8"), "sm90", None),
]


@pytest.mark.parametrize(
    "s, fwd, bwd",
    HOPPER_ROUTES,
    ids=lambda x: str(x) if not isinstance(x, AttentionSpec) else f"d{x.head_dim}_dv{x.head_dim_v}_{x.dtype}_{x.mask}",
)
def test_hopper_routes(s, fwd, bwd):
    assert routing.route(s, HOPPER).family == fwd
    assert routing.route(s, HOPPER, backward=True).family == bwd


def test_deterministic_backward_routes_to_a_family_that_has_one():
    assert routing.route(spec(128, mask="causal"), HOPPER, backward=True, deterministic=True).family == "sm90"
    # Padded head dims have the mode too (the sm90 backward's own kernels, wider).
    assert routing.route(spec(192, 128), HOPPER, backward=True, deterministic=True).family == "sm90"
    none = routing.route(spec(128), AMPERE, backward=True, deterministic=True)
    assert none.family is None and [f for f, _ in none.skipped] == ["sm80"]
    assert "deterministic" in none.skipped[0][1]
    assert routing.route(spec(128), AMPERE, backward=True).family == "sm80"


def test_every_head_dim_trains_on_hopper():
    for d in range(8, 257, 8):
        for dv in (8, d, 256):
            assert routing.route(spec(d, dv), HOPPER, backward=True).family == "sm90", (d, dv)


def test_every_documented_head_dim_has_a_forward_on_hopper_and_ampere():
    for cap in (HOPPER, AMPERE):
        for d in range(8, 257, 8):
            for dv in (8, d, 256):
                for dtype in ("fp16", "bf16"):
                    assert routing.route(spec(d, dv, dtype=dtype), cap).family is not None, (cap, d, dv, dtype)


def test_skipped_families_say_why():
    r = routing.route(spec(72), HOPPER)
    assert r.family == "sm80" and [f for f, _ in r.skipped] == ["sm90"]
    assert "72" in r.skipped[0][1]
    assert routing.route(spec(72), HOPPER, backward=True).family == "sm90"  # its d96 kernels, padded
    assert routing.route(spec(72), AMPERE, backward=True).family == "sm80"  # its d96 kernels, padded
    fp8 = routing.route(spec(128, dtype="fp8"), HOPPER, backward=True)
    assert fp8.family is None and "forward-only" in fp8.skipped[0][1]
    with pytest.raises(NotImplementedError, match=r"no backward kernel"):
        fp8.backend


def test_fp8_without_a_family_that_has_it():
    r = routing.route(spec(72, dtype="fp8"), HOPPER)
    assert r.family is None
    with pytest.raises(NotImplementedError, match=r"no forward kernel.*sm90: .*sm80: .*fp8"):
        r.backend


def test_forcing_a_family_disables_the_fallback(monkeypatch):
    monkeypatch.setenv("CUTE_FLASH_ARCH", "sm90")
    r = routing.route(spec(72), HOPPER)
    assert r.family is None and [f for f, _ in r.skipped] == ["sm90"]
    monkeypatch.setenv("CUTE_FLASH_ARCH", "sm80")
    assert routing.route(spec(64), HOPPER).family == "sm80"


def test_blackwell_prefers_its_own_family_then_the_sm80_kernels():
    assert routing.route(spec(128), BLACKWELL).family == "sm100"
    r = routing.route(spec(72), BLACKWELL)  # no sm100 forward at d72: the sm80 kernels, compiled for sm_100a
    assert r.family == "sm80" and [f for f, _ in r.skipped] == ["sm100"]
    # The sm100 backward serves d <= 128 (d72 on the d128 kernel's zero-padded operands), deterministic ones too, not
    # d192.
    for d in (32, 64, 72, 128):
        assert routing.route(spec(d), BLACKWELL, backward=True).family == "sm100", d
        assert routing.route(spec(d), BLACKWELL, backward=True, deterministic=True).family == "sm100", d
    assert routing.route(spec(192), BLACKWELL, backward=True).family == "sm80"
    packed = dataclasses.replace(spec(128), varlen=True)  # packed sequences: both on sm100 (no fp8 packed forward)
    assert routing.route(packed, BLACKWELL).family == "sm100"
    assert routing.route(packed, BLACKWELL, backward=True).family == "sm100"
    r = routing.route(dataclasses.replace(spec(128, dtype="fp8"), varlen=True), BLACKWELL)
    assert r.family is None and "varlen" in dict(r.skipped)["sm100"]


class _Fake(BackendBase):
    """A family whose forward / backward support is given; counts how often it is asked."""

    def __init__(self, name, forward, backward):
        self.name, self.fwd, self.bwd = name, forward, backward
        self.asked = 0
        self.calls = []

    def unsupported_reason(self, s, backward, deterministic=False):
        self.asked += 1
        if not self.fwd:
            return f"{self.name} has no forward"
        if backward and not self.bwd:
            return f"{self.name} has no backward"
        return None

    def forward_launcher(self, problem, device):
        return launcher_through_forward(self, problem)

    def backward_launcher(self, problem, device, deterministic=False):
        return launcher_through_backward(self, problem, deterministic)

    def forward(self, t, problem, descale=None):
        self.calls.append("forward")
        t.out.zero_()
        t.lse.zero_()

    def backward(self, t, grads, problem, deterministic=False):
        self.calls.append("backward")
        for g in grads[:3]:
            g.fill_(1.0)


@pytest.fixture
def fakes(monkeypatch):
    fam = {"sm90": _Fake("sm90", True, False), "sm80": _Fake("sm80", True, True)}
    monkeypatch.setattr(routing, "get_backend", lambda name: fam[name])
    return fam


def test_forward_and_backward_are_routed_separately(fakes):
    s = spec(64)
    assert routing.route(s, HOPPER).family == "sm90"
    assert routing.route(s, HOPPER, backward=True).family == "sm80"


def test_decisions_are_cached(fakes):
    s = spec(64)
    first = routing.route(s, HOPPER)
    asked = fakes["sm90"].asked
    for _ in range(100):
        assert routing.route(s, HOPPER) is first
    assert fakes["sm90"].asked == asked


def test_attention_runs_each_direction_on_its_family(fakes, monkeypatch):
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(device, "capability", lambda t: HOPPER)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    q, k, v = (torch.randn(1, 8, 2, 64).to(torch.bfloat16).requires_grad_(True) for _ in range(3))
    cute_flash.attention(q, k, v).sum().backward()
    assert fakes["sm90"].calls == ["forward"] and fakes["sm80"].calls == ["backward"]
    assert torch.all(q.grad == 1)


def test_backward_without_a_kernel_raises_naming_every_family(fakes, monkeypatch):
    fakes["sm80"].bwd = False
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(device, "capability", lambda t: HOPPER)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    q, k, v = (torch.randn(1, 8, 2, 64).to(torch.bfloat16).requires_grad_(True) for _ in range(3))
    out = cute_flash.attention(q, k, v)
    with pytest.raises(NotImplementedError, match="sm90 has no backward; sm80: sm80 has no backward"):
        out.sum().backward()


# --- explain -------------------------------------------------------------------------------------------------------
def _meta(d=64, dv=None, dtype=torch.bfloat16):
    dv = d if dv is None else dv
    return (
        torch.empty(2, 16, 4, d, dtype=dtype, device="meta"),
        torch.empty(2, 16, 4, d, dtype=dtype, device="meta"),
        torch.empty(2, 16, 4, dv, dtype=dtype, device="meta"),
    )


def test_explain_for_a_given_capability():
    e = cute_flash.explain(*_meta(72), causal=True, capability=HOPPER)
    assert e.forward_family == "sm80" and e.backward_family == "sm90"
    text = str(e)
    assert "compute capability 9.0" in text and "forward: sm80 (skipped sm90:" in text and "backward: sm90" in text
    e = cute_flash.explain(*_meta(72), causal=True, capability=AMPERE)
    assert e.backward_family == "sm80" and e.backward_padded_to == 96 and "backward: sm80" in str(e)
    e = cute_flash.explain(*_meta(128), capability=HOPPER)
    assert (e.forward_family, e.backward_family) == ("sm90", "sm90")
    assert cute_flash.explain(*_meta(128), capability=AMPERE).forward_family == "sm80"
    assert cute_flash.explain(*_meta(128, 80), capability=HOPPER).forward_family == "sm80"


def test_explain_dv_differs_on_hopper():
    # DeepSeek-style (192, 128): the sm90 forward and the sm90 backward (a tile of its own, nothing padded); (160, 128)
    # runs the d192 kernels on zero-padded operands.
    e = cute_flash.explain(*_meta(192, 128), causal=True, capability=HOPPER)
    assert (e.forward_family, e.backward_family) == ("sm90", "sm90")
    assert not e.forward.skipped and not e.backward.skipped
    assert e.backward_padded_to is None and "zero-padded" not in str(e)
    e = cute_flash.explain(*_meta(160, 128), capability=HOPPER)
    assert e.backward_padded_to == 192 and "head dim 192 kernels, on operands zero-padded" in str(e)
    assert cute_flash.explain(*_meta(192), capability=HOPPER).backward_padded_to is None  # its own tile
    assert cute_flash.explain(*_meta(192, 128), capability=AMPERE).backward_padded_to == 192
    assert cute_flash.explain(*_meta(128), capability=HOPPER).backward_padded_to is None
    assert cute_flash.explain(*_meta(72), capability=HOPPER).backward_padded_to == 96
    assert cute_flash.explain(*_meta(160), capability=HOPPER).backward_padded_to == 192
    for dims in ((128, 64), (64, 128), (96, 256), (72, 64)):
        assert cute_flash.explain(*_meta(*dims), capability=HOPPER).backward_family == "sm90", dims
        # Ampere (and Blackwell's fallback): the sm80 backward at the wider head dim rounded up to a multiple of 32.
        e = cute_flash.explain(*_meta(*dims), capability=AMPERE)
        assert e.backward_family == "sm80", dims
    assert cute_flash.explain(*_meta(72, 64), capability=AMPERE).backward_padded_to == 96
    e = cute_flash.explain(*_meta(80), capability=(10, 0))
    assert e.backward_family == "sm100" and e.backward_padded_to == 128
    assert cute_flash.explain(*_meta(160), capability=(10, 0)).backward_family == "sm80"


def test_explain_validates_like_attention():
    with pytest.raises(ValueError, match="window_size"):
        cute_flash.explain(*_meta(), window_size=(1.5, 0), capability=HOPPER)
    with pytest.raises(NotImplementedError, match="head_dim of q/k is 12"):
        cute_flash.explain(*_meta(12), capability=HOPPER)
    q, k, v = (torch.empty(t.shape, dtype=t.dtype) for t in _meta())  # on the CPU
    with pytest.raises(ValueError, match=r"q is on cpu.*cute_flash\.reference"):
        cute_flash.explain(q, k, v)  # no capability: q's own GPU, and a CPU tensor has none


def test_explain_uses_the_device_of_q(monkeypatch):
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "meta"))
    monkeypatch.setattr(device, "capability", lambda t: HOPPER)
    assert cute_flash.explain(*_meta(160)).forward_family == "sm80"


def test_attention_with_no_forward_kernel_names_every_family(monkeypatch):
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "meta"))
    monkeypatch.setattr(device, "capability", lambda t: HOPPER)
    with pytest.raises(NotImplementedError, match=r"no forward kernel.*sm90: .*sm80: .*fp8"):
        cute_flash.attention(*_meta(72), dtype="fp8")


@pytest.mark.parametrize("given", [(9, 0), [9, 0], "9.0", "sm90", "sm_90a", " SM90 "])
def test_explain_takes_a_capability_as_a_pair_or_a_name(given):
    e = cute_flash.explain(*_meta(72), causal=True, capability=given)
    assert e.capability == HOPPER and e.forward_family == "sm80" and e.backward_family == "sm90"
    assert routing.parse_capability("sm100") == (10, 0) and routing.parse_capability("8.6") == (8, 6)


@pytest.mark.parametrize("bad", ["9", "hopper", "sm9", (9,), (9, 0, 0), ("9", "0"), (True, 0), 9.0])
def test_explain_refuses_a_capability_it_cannot_read(bad):
    with pytest.raises(ValueError, match="capability must be"):
        cute_flash.explain(*_meta(), capability=bad)
    q, k, v = (t.flatten(0, 1) for t in _meta())
    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="capability must be"):
        cute_flash.explain_varlen(q, k, v, cu, cu, 16, 16, capability=bad)


def test_explain_reports_the_window_softcap_and_sinks():
    e = cute_flash.explain(*_meta(), window_size=(-2, 7), capability=HOPPER)
    assert (e.mask, e.window, e.softcap, e.sink) == ("local", (-2, 7), 0.0, False)
    assert "window (-2, 7)" in str(e) and "softcap" not in str(e) and "sinks" not in str(e)
    sink = torch.zeros(4, device="meta")
    e = cute_flash.explain(*_meta(), causal=True, softcap=30.0, learnable_sink=sink, capability="sm90")
    assert (e.mask, e.window, e.softcap, e.sink) == ("causal", (None, 0), 30.0, True)
    assert "mask causal, window (None, 0), softcap 30, learnable sinks" in str(e)
    q, k, v = (t.flatten(0, 1) for t in _meta())
    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    e = cute_flash.explain_varlen(q, k, v, cu, cu, 16, 16, softcap=5.0, learnable_sink=sink, capability="sm80")
    assert (e.softcap, e.sink, e.capability) == (5.0, True, AMPERE)

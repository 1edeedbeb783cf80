"""Every registered kernel family implements the whole of `cute_flash.arch.base.ArchBackend`, the contract the front
end calls: the attributes with their types, every method with the protocol's own signature (the same parameters,
kinds, defaults and annotations). A family without some kernels (varlen, the KV-cache forward) inherits
`BackendBase`'s defaults, which raise NotImplementedError naming the family and the missing kernel."""

from __future__ import annotations

import inspect
import typing

import pytest
import torch

from cute_flash.arch import ARCH_PACKAGES, CUTE_DSL_ARCH, get_backend
from cute_flash.arch.base import ArchBackend, BackendBase

METHODS = [
    name for name, member in vars(ArchBackend).items() if inspect.isfunction(member) and not name.startswith("_")
]
ATTRIBUTES = typing.get_type_hints(ArchBackend)

# Parts of the contract a family does not meet yet, each named with what is missing and whose work adds it. Strict:
# when the family meets it, the test fails until the entry is removed here.
PENDING = {}


def _hints(fn) -> dict:
    return typing.get_type_hints(fn)


def test_the_protocol_declares_every_method_the_front_end_calls():
    assert set(METHODS) >= {
        "unsupported_reason", "fp8_kv_scale_block", "backward_head_dims", "forward", "forward_launcher", "backward",
        "backward_launcher", "forward_varlen", "backward_varlen", "kvcache_splits", "forward_kvcache",
        "kvcache_launcher", "compile_artifacts", "warm", "forward_mods", "backward_mods",
    }  # fmt: skip
    assert ATTRIBUTES == {"name": str, "cute_arch": str, "split_keys": bool, "varlen": bool, "kvcache": bool}
    # The base class has a default for every method a family may lack, with the protocol's signature.
    defaults = ("forward_varlen", "backward_varlen", "kvcache_splits", "forward_kvcache", "kvcache_launcher")
    for name in defaults + ("forward_mods", "backward_mods"):
        assert inspect.signature(getattr(BackendBase, name)) == inspect.signature(getattr(ArchBackend, name)), name
        assert _hints(getattr(BackendBase, name)) == _hints(getattr(ArchBackend, name)), name


def _cases():
    for family in sorted(ARCH_PACKAGES):
        for name in METHODS:
            reason = PENDING.get((family, name))
            marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
            yield pytest.param(family, name, marks=marks, id=f"{family}-{name}")


@pytest.mark.parametrize("family", sorted(ARCH_PACKAGES))
def test_family_has_the_attributes(family):
    backend = get_backend(family)
    assert isinstance(backend, BackendBase), f"{family}: class _Backend(BackendBase) opts in to the defaults"
    assert backend.name == family
    assert backend.cute_arch == CUTE_DSL_ARCH[family]
    for attr, kind in ATTRIBUTES.items():
        assert isinstance(getattr(backend, attr), kind), f"{family}.{attr}"


@pytest.mark.parametrize("family,name", list(_cases()))
def test_family_implements_each_method(family, name):
    backend = get_backend(family)
    expected = inspect.signature(getattr(ArchBackend, name))
    actual = inspect.signature(getattr(type(backend), name))
    assert [(p.name, p.kind, p.default) for p in actual.parameters.values()] == [
        (p.name, p.kind, p.default) for p in expected.parameters.values()
    ], f"{family}.{name}{actual} differs from ArchBackend.{name}{expected}"
    assert _hints(getattr(type(backend), name)) == _hints(getattr(ArchBackend, name)), f"{family}.{name} types"


def test_a_family_without_a_kernel_says_which_one():
    class Bare(BackendBase):
        name = "smXY"

    t = torch.empty(0)
    with pytest.raises(NotImplementedError, match="smXY family has no varlen .*forward kernel"):
        Bare().forward_varlen(t, t, t, t, t, None, None)
    with pytest.raises(NotImplementedError, match="smXY family has no varlen .*backward kernel"):
        Bare().backward_varlen(None, None, None, None)
    for call in (lambda: Bare().kvcache_splits(None, 132), lambda: Bare().forward_kvcache(None, None, 1)):
        with pytest.raises(NotImplementedError, match="smXY family has no KV-cache forward kernel"):
            call()
    with pytest.raises(NotImplementedError, match="smXY family has no score_mod / mask_mod forward kernel"):
        Bare().forward_mods(t, t, t, t, t, None, [])
    assert not Bare.varlen and not Bare.split_keys and not Bare.kvcache
    if not get_backend("sm100").varlen:  # sm100 has no varlen kernels yet: the defaults answer
        with pytest.raises(NotImplementedError, match="sm100 family has no varlen"):
            get_backend("sm100").forward_varlen(t, t, t, t, t, None, None)

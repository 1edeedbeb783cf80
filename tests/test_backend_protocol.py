"""Every registered kernel family implements `cute_flash.arch.base.ArchBackend` with the protocol's own signatures
(the same parameters, kinds, defaults and annotations), so the front end can call any of them the same way."""

from __future__ import annotations

import inspect
import typing

import pytest

from cute_flash.arch import ARCH_PACKAGES, CUTE_DSL_ARCH, get_backend
from cute_flash.arch.base import ArchBackend

METHODS = [
    name for name, member in vars(ArchBackend).items() if inspect.isfunction(member) and not name.startswith("_")
]


def _hints(fn) -> dict:
    return typing.get_type_hints(fn)


def test_the_protocol_has_the_methods_the_front_end_calls():
    assert set(METHODS) >= {"unsupported_reason", "fp8_kv_scale_block", "forward", "backward", "compile_artifacts"}


@pytest.mark.parametrize("family", sorted(ARCH_PACKAGES))
def test_family_implements_the_protocol(family):
    backend = get_backend(family)
    assert backend.name == family
    assert backend.cute_arch == CUTE_DSL_ARCH[family]
    for name in METHODS:
        expected = inspect.signature(getattr(ArchBackend, name))
        actual = inspect.signature(getattr(type(backend), name))
        assert [(p.name, p.kind, p.default) for p in actual.parameters.values()] == [
            (p.name, p.kind, p.default) for p in expected.parameters.values()
        ], f"{family}.{name}{actual} differs from ArchBackend.{name}{expected}"
        assert _hints(getattr(type(backend), name)) == _hints(getattr(ArchBackend, name)), f"{family}.{name} types"

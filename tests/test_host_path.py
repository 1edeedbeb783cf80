"""The eager host path's plan cache (interface._plan): a warm call skips validation and routing, but never accepts
what a cold call rejects, and sees a changed CUTE_FLASH_ARCH."""

import pytest
import torch

import cute_flash
from cute_flash import interface, validation


@pytest.fixture(autouse=True)
def meta_is_gpu(monkeypatch):
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda", "meta"))
    monkeypatch.setattr(interface, "_device_capability", lambda t: (9, 0))


def _qkv():
    return tuple(torch.empty(1, 16, 2, 64, device="meta", dtype=torch.bfloat16) for _ in range(3))


def test_a_cached_signature_never_accepts_a_rejected_argument():
    q, k, v = _qkv()
    a = interface._plan(q, k, v, True, 0.5, (3, None), False)
    assert interface._plan(q, k, v, True, 0.5, (3, None), False) is a  # one lookup when warm
    with pytest.raises(TypeError, match="causal must be a bool"):
        interface._plan(q, k, v, 1, 0.5, (3, None), False)  # 1 == True, but it is not a bool
    with pytest.raises(ValueError, match="window_size left"):
        interface._plan(q, k, v, True, 0.5, (True, None), False)
    with pytest.raises(ValueError, match="window_size"):
        cute_flash.attention(q, k, v, window_size=[3])  # unhashable, validated the slow way


def test_cute_flash_arch_is_part_of_the_signature(monkeypatch):
    q, k, v = _qkv()
    assert interface._plan(q, k, v, True, None, (None, None), False).forward.name == "sm90"
    monkeypatch.setenv("CUTE_FLASH_ARCH", "sm80")
    assert interface._plan(q, k, v, True, None, (None, None), False).forward.name == "sm80"


def test_device_check_is_part_of_the_signature(monkeypatch):
    q, k, v = _qkv()
    interface._plan(q, k, v, False, None, (None, None), False)
    monkeypatch.setattr(validation, "KERNEL_DEVICE_TYPES", ("cuda",))
    with pytest.raises(ValueError, match="CUDA GPUs only"):
        interface._plan(q, k, v, False, None, (None, None), False)

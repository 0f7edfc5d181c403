"""Pure logic + CPU: `KernelConfig` validation and fingerprint, and ops dispatching through the registry."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from miles_kernels import (
    KernelConfig,
    available_backends,
    describe_kernel,
    kernel_fingerprint,
    native,
    register_backend,
    resolved_backends,
)
from miles_kernels import registry as registry_module
from miles_kernels.ops.attention import _sdpa_attention
from miles_kernels.testing import packed_logits, random_model, tiny_config


def test_fingerprint_tracks_every_field() -> None:
    base = KernelConfig()
    assert kernel_fingerprint(base) == kernel_fingerprint(KernelConfig())
    for change in ({"dtype": "bfloat16"}, {"mode": "fast"}, {"linear_tile": 32}, {"page_size": 128},
                   {"attention_query_tile": 16}, {"moe_tile": 8}):  # fmt: skip
        assert kernel_fingerprint(KernelConfig(**change)) != kernel_fingerprint(base), change
    described = describe_kernel(base)
    assert described["fingerprint"] == kernel_fingerprint(base) and described["torch"] == torch.__version__
    # The kind of device is part of the identity (CUDA runs other code paths); the CPU's is the default.
    assert described["device_type"] == "cpu" and kernel_fingerprint(base, "cpu") == kernel_fingerprint(base)
    assert kernel_fingerprint(base, "cuda") != kernel_fingerprint(base)
    assert describe_kernel(base, "cuda")["fingerprint"] == kernel_fingerprint(base, "cuda")
    # auto: the native kernels where they built (they do on CI's machines), else the torch forms
    native_built = native.status() is True
    assert described["attention"] == ("native" if native_built else "torch-blocked")
    assert described["linear"] == ("native" if native_built else "torch-tiled")


def test_bad_values_name_the_field() -> None:
    with pytest.raises(ValidationError, match="page_size=24 must be a power of two"):
        KernelConfig(page_size=24)
    with pytest.raises(ValidationError, match="mode"):
        KernelConfig(mode="exact")
    with pytest.raises(ValidationError, match="tile_size"):
        KernelConfig(tile_size=3)


@pytest.fixture
def clean_registry(monkeypatch):
    """Register test backends on a copy of the registry, restored afterwards."""
    monkeypatch.setattr(registry_module, "_BACKENDS", {op: dict(e) for op, e in registry_module._BACKENDS.items()})
    monkeypatch.setattr(registry_module, "_AVAILABILITY", dict(registry_module._AVAILABILITY))
    monkeypatch.setattr(registry_module, "_LOGGED_CHOICES", set(registry_module._LOGGED_CHOICES))


def test_model_uses_a_registered_backend_and_auto_prefers_it(clean_registry) -> None:
    calls = []

    def counting_sdpa(*args):
        calls.append(1)
        return _sdpa_attention(*args)

    register_backend("attention:fast", "fake-fused", counting_sdpa, priority=10)
    register_backend("attention:fast", "fake-gpu", counting_sdpa, is_available=lambda: "needs CUDA", priority=20)
    assert available_backends("attention:fast")["fake-gpu"] == "needs CUDA"
    kernel = KernelConfig(mode="fast", page_size=8)
    model = random_model(tiny_config("dense"), kernel)
    reference = random_model(tiny_config("dense"), kernel.model_copy(update={"attention_backend": "torch-sdpa"}))
    seq = [torch.arange(12)]
    assert torch.equal(packed_logits(model, seq)[0], packed_logits(reference, seq)[0])
    assert len(calls) == model.config.num_hidden_layers  # auto picked fake-fused, once per layer
    assert resolved_backends(kernel)["attention"] == "fake-fused"
    with pytest.raises(RuntimeError, match="needs CUDA"):
        kernel_fingerprint(KernelConfig(mode="fast", attention_backend="fake-gpu"))

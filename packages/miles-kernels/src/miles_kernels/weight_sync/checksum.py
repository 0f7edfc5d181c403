"""The weight checksum both sides report: equal checksums mean the engine holds bit for bit the weights the trainer
sent (the orchestrator's true on-policy guard after the version-0 sync; docs/architecture.md, "Weight sync")."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 of a full set of weights: independent of order and of how they were split into buckets.

    Each tensor contributes its name, dtype, shape and raw bytes (as the engine holds them); the trainer hashes
    what it would send and the engine what it holds, so equal checksums mean bit-identical weights (the
    orchestrator's true on-policy guard after the version-0 sync). Streams: one tensor's bytes at a time.
    """
    digests = weight_digests(named_tensors)
    total = hashlib.sha256()
    for name in sorted(digests):
        total.update(f"{name}={digests[name]};".encode())
    return total.hexdigest()


def weight_digests(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """{name: sha256 of the tensor's dtype, shape and raw bytes}, one tensor at a time: equal digests mean
    bit-identical tensors, and the names of unequal ones say where two sets of weights differ."""
    digests = {}
    for name, tensor in named_tensors:
        # A private copy: `.numpy()` on the caller's tensor would pin its storage (no resize / offload after).
        data = tensor.detach().to("cpu", copy=True).contiguous().view(torch.uint8).numpy().tobytes()
        digests[name] = hashlib.sha256(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode() + data).hexdigest()
    return digests

"""CPU numerics tier: the offload manager moves tagged storages out and back bit for bit, shares nothing twice,
offloads partially (largest first, only what is asked), drops tags that keep no contents, refuses an onload
that would overrun its budget with a `torch.OutOfMemoryError` that reports by tag, and streams a disk offload so
the live tensor bytes never rise above the resident bytes (its one chunk buffer is allocated once, with the store)."""

from __future__ import annotations

import pytest
import torch

from miles_memory import (
    CHUNK_BYTES,
    FileStore,
    HostStore,
    MemoryBudget,
    OffloadManager,
    PeakMeter,
    live_tensor_bytes,
    storage_bytes,
)


def _model() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(300, 64), torch.nn.Linear(64, 128), torch.nn.Linear(128, 300))
    model[2].weight = torch.nn.Parameter(torch.randn(300, 128))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.arange(10)).sum().backward()
    optimizer.step()
    state = {f"{i}.{k}": v for i, s in enumerate(optimizer.state.values()) for k, v in s.items()}
    return model, state


@pytest.mark.parametrize("store_kind", ["disk", "host"])
def test_round_trip_is_bit_exact_per_tag(tmp_path, store_kind: str) -> None:
    model, state = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()} | {k: v.clone() for k, v in state.items()}
    store = FileStore(tmp_path) if store_kind == "disk" else HostStore()
    manager = OffloadManager(store)
    manager.add("weights", model.parameters)
    manager.add("optimizer", lambda: state.values())
    resident = manager.resident_bytes()
    assert resident["weights"] == storage_bytes(model.parameters()) > 0
    plan = manager.offload(["optimizer"])
    assert plan.moved_bytes == {"optimizer": resident["optimizer"]}
    assert all(v.untyped_storage().nbytes() == 0 for v in state.values())
    assert manager.is_offloaded("optimizer") and not manager.is_offloaded("weights")
    manager.offload(["weights"])
    assert manager.resident_bytes() == {"weights": 0, "optimizer": 0}
    assert manager.onload(["weights"]) == resident["weights"]
    assert manager.onload() == resident["optimizer"]
    after = {n: p.detach() for n, p in model.named_parameters()} | state
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


def test_shared_storages_belong_to_the_first_tag(tmp_path) -> None:
    weight = torch.randn(50, 8)
    manager = OffloadManager(FileStore(tmp_path))
    manager.add("weights", lambda: [weight])
    manager.add("mtp", lambda: [weight[:10], torch.ones(3)])  # a view of a weight: already the weights tag's
    assert manager.resident_bytes() == {"weights": weight.nbytes, "mtp": 12}


def test_partial_offload_moves_the_largest_storages_until_enough_is_free(tmp_path) -> None:
    tensors = [torch.ones(n) for n in (10, 1000, 100, 500)]
    manager = OffloadManager(FileStore(tmp_path))
    manager.add("weights", lambda: tensors)
    plan = manager.offload(need_bytes=1200 * 4)  # more than the largest (4000 B): the two largest move
    assert plan.freed_bytes == 1500 * 4 and plan.num_storages == 2
    assert [t.untyped_storage().nbytes() for t in tensors] == [40, 0, 400, 0]
    assert plan.resident_bytes == {"weights": 440}
    assert "room for" in plan.summary()
    manager.onload()
    assert all(torch.equal(t, torch.ones_like(t)) for t in tensors)


def test_a_dropped_tag_comes_back_allocated_but_not_saved(tmp_path) -> None:
    kv = torch.full((256,), 7.0)
    store = HostStore()
    manager = OffloadManager(store)
    manager.add("kv_cache", lambda: [kv], keep_contents=False)
    assert manager.offload().freed_bytes == 1024
    assert store.held_bytes == 0  # nothing saved
    assert manager.onload() == 1024 and kv.numel() == 256


def test_an_onload_over_budget_raises_the_oom_type_with_a_report(tmp_path) -> None:
    weights, optimizer = torch.ones(1000), torch.ones(2000)
    manager = OffloadManager(FileStore(tmp_path), budget=MemoryBudget(limit_bytes=10_000, headroom_bytes=1_000))
    manager.add("weights", lambda: [weights])
    manager.add("optimizer", lambda: [optimizer])
    manager.offload(["optimizer"])
    with pytest.raises(torch.OutOfMemoryError, match=r"tried to allocate 7\.8 KiB") as caught:
        manager.onload()
    report = caught.value.report  # type: ignore[attr-defined]
    assert report.held_bytes == {"weights": 4000, "optimizer": 0} and report.requested_bytes == 8000
    assert "memory.limit_bytes" in str(caught.value) and "weights 3.9 KiB" in str(caught.value)
    assert manager.is_offloaded("optimizer")  # nothing was allocated: the state waits, intact
    manager.budget = MemoryBudget(limit_bytes=13_000)
    manager.onload()
    assert torch.equal(optimizer, torch.ones(2000))


def test_unknown_tags_are_named(tmp_path) -> None:
    manager = OffloadManager(FileStore(tmp_path), name="engine")
    manager.add("weights", lambda: [])
    with pytest.raises(ValueError, match=r"unknown memory tag\(s\) \['kv'\] for engine; it has \['weights'\]"):
        manager.offload(["kv"])
    with pytest.raises(ValueError, match="registered twice"):
        manager.add("weights", lambda: [])


def test_a_disk_offload_streams_within_one_chunk_of_the_resident_bytes(tmp_path) -> None:
    """Live tensor bytes, counted from the tensors, sampled after every storage moves: they never exceed what was
    resident before plus the store's one chunk buffer (the bound the docs state)."""
    tensors = [torch.randn(n) for n in (3 * CHUNK_BYTES // 4, CHUNK_BYTES // 2, 1000)]  # 12 MiB and 8 MiB + ...
    store = FileStore(tmp_path)
    manager = OffloadManager(store)
    manager.add("weights", lambda: tensors)
    meter = PeakMeter()
    manager.progress = meter.sample
    manager.offload()
    assert meter.num_samples == 4 and meter.peak == meter.baseline  # the chunk buffer exists already: no growth
    assert live_tensor_bytes() <= meter.baseline - sum(t.nbytes for t in tensors) + store.buffer_bytes
    meter = PeakMeter()
    manager.progress = meter.sample
    manager.onload()
    resident = sum(t.nbytes for t in tensors)
    assert meter.peak <= meter.baseline + resident  # what comes back, nothing more: no staging copy

"""CPU numerics tier. FileStore, the CPU offload store: byte-exact round trips through its one scratch file,
which later cycles overwrite in place (no truncation); a file cut short is reported, never read as zeros."""

from __future__ import annotations

import os

import pytest
import torch

from miles_memory import CHUNK_BYTES, FileStore


def test_file_store_round_trips_and_reuses_its_file(tmp_path) -> None:
    store = FileStore(tmp_path)
    generator = torch.Generator().manual_seed(0)
    cycles = ([10, CHUNK_BYTES + 5, 3], [7, 2])  # more than one chunk; then a smaller state over the old bytes
    for sizes in cycles:
        data = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator) for n in sizes]
        for index, tensor in enumerate(data):
            store.put(index, tensor)
        for index, tensor in enumerate(data):
            out = torch.empty_like(tensor)
            store.get(index, out)
            assert torch.equal(out, tensor), (sizes, index)
            store.drop(index)
    assert store.path.stat().st_size == sum(cycles[0])  # the largest state's size: kept, overwritten in place
    path = store.path
    del store
    assert not path.exists()


def test_a_truncated_offload_file_is_an_error(tmp_path) -> None:
    store = FileStore(tmp_path)
    store.put(0, torch.arange(100, dtype=torch.uint8))
    os.truncate(store.path, 50)
    with pytest.raises(OSError, match="truncated"):
        store.get(0, torch.empty(100, dtype=torch.uint8))

"""`MappedSafetensors` / `load_mapped`: a weight file kept mapped between loads. Loads are bit-exact, see bytes
written in place by another mapping, follow a file that was replaced or re-laid out, and decline (changing
nothing) any file that is not exactly the model's checkpoint."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save, save_file

from miles_kernels import (
    KernelConfig,
    MappedSafetensors,
    checkpoint_tensors,
    in_shared_memory,
    load_mapped,
    save_model,
)
from miles_kernels.testing import random_model, tiny_config


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in checkpoint_tensors(model).items()}


def assert_holds(model, tensors: dict[str, torch.Tensor]) -> None:
    current = checkpoint_tensors(model)
    assert current.keys() == tensors.keys()
    assert all(torch.equal(current[name], tensor) for name, tensor in tensors.items())


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_matching_checkpoint_is_copied_bit_exactly(tmp_path, kind: str) -> None:
    save_model(random_model(tiny_config(kind), KernelConfig(), seed=1), tmp_path)
    model = random_model(tiny_config(kind), KernelConfig(), seed=2)
    assert load_mapped(model, MappedSafetensors(), tmp_path)
    assert_holds(model, load_file(str(tmp_path / "model.safetensors")))


def test_in_place_writes_and_replaced_files_are_seen(tmp_path) -> None:
    config = tiny_config("dense")
    save_model(random_model(config, KernelConfig(), seed=1), tmp_path)
    file = tmp_path / "model.safetensors"
    model = random_model(config, KernelConfig(), seed=0)
    reader = MappedSafetensors()
    assert load_mapped(model, reader, tmp_path)

    # Another process's kept mapping overwrites the bytes in place (the trainer's weight sync).
    new = snapshot(random_model(config, KernelConfig(), seed=3))
    inode = file.stat().st_ino
    for name, (_, data) in MappedSafetensors().slots(file).items():
        data.copy_(new[name].reshape(-1).view(torch.uint8))
    assert file.stat().st_ino == inode
    assert load_mapped(model, reader, tmp_path)
    assert_holds(model, new)

    # The file is replaced (a new inode): the reader maps the new one instead of reading stale pages.
    newer = snapshot(random_model(config, KernelConfig(), seed=4))
    save_file(newer, str(tmp_path / "staging"))
    os.replace(tmp_path / "staging", file)
    assert file.stat().st_ino != inode
    assert load_mapped(model, reader, tmp_path)
    assert_holds(model, newer)

    # Rewritten in place (same inode) with a longer header: every tensor moved. The header is re-read on each
    # load, so the reader maps the file again and reads the tensors at their new offsets.
    newest = snapshot(random_model(config, KernelConfig(), seed=5))
    with open(file, "r+b") as f:
        f.write(save(newest, metadata={"note": "x" * 100}))
    assert load_mapped(model, reader, tmp_path)
    assert_holds(model, newest)


def test_other_files_are_declined_and_change_nothing(tmp_path) -> None:
    config = tiny_config("dense")
    model = random_model(config, KernelConfig(), seed=0)
    before = snapshot(model)
    reader = MappedSafetensors()
    assert not load_mapped(model, reader, tmp_path)  # no model.safetensors at all

    tensors = snapshot(random_model(config, KernelConfig(), seed=1))
    file = tmp_path / "model.safetensors"
    missing = dict(list(tensors.items())[1:])
    save_file(missing, str(file))
    assert not load_mapped(model, reader, tmp_path)
    save_file({**tensors, "extra.weight": torch.zeros(2)}, str(file))
    assert not load_mapped(model, reader, tmp_path)
    save_file({name: t.to(torch.bfloat16) for name, t in tensors.items()}, str(file))  # another dtype
    assert not load_mapped(model, reader, tmp_path)
    name = next(iter(tensors))
    save_file({**tensors, name: tensors[name][:1].clone()}, str(file))  # another shape
    assert not load_mapped(model, reader, tmp_path)
    file.write_bytes(b"not a safetensors file")
    assert not load_mapped(model, reader, tmp_path)
    assert_holds(model, before)


def test_a_bad_file_is_a_value_error(tmp_path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a safetensors file"):
        MappedSafetensors().slots(file)


def test_shared_memory_paths(tmp_path) -> None:
    assert in_shared_memory("/dev/shm/miles-sync/model.safetensors")
    assert not in_shared_memory(tmp_path / "model.safetensors")
    assert not in_shared_memory("/dev/shmother/model.safetensors")

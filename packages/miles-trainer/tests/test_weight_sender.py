"""CPU numerics tier (one process): `write_weights_file`, the engine's weight file, created whole, then overwritten in
place while its layout holds (checked against safetensors' own reader), and rewritten whole when the layout changes;
`WeightSender`, a backend's weights as the engine receives them, from an FSDP2 model or Megatron's full tensors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_kernels import KernelConfig, safetensors_layout
from miles_kernels.testing import random_model, tiny_config
from miles_trainer.weight_sender import WeightSender, export_tensors, write_weights_file


def expected(model) -> dict[str, torch.Tensor]:
    return dict(export_tensors(model))


def assert_file_holds(file, tensors: dict[str, torch.Tensor]) -> None:
    loaded = load_file(str(file))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())


def test_later_writes_overwrite_the_same_file_in_place(tmp_path) -> None:
    model = random_model(tiny_config("moe"), KernelConfig(), seed=1)
    file = tmp_path / "model.safetensors"
    num_bytes = write_weights_file(model, file)
    assert_file_holds(file, expected(model))
    assert num_bytes == sum(t.numel() * t.element_size() for t in expected(model).values())
    inode = file.stat().st_ino
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param))
    write_weights_file(model, file)
    assert file.stat().st_ino == inode  # the bytes were overwritten, no new file
    assert_file_holds(file, expected(model))  # and they are the new weights, bit for bit
    slots = safetensors_layout(file)
    assert slots.keys() == expected(model).keys() and all(s.end > s.begin for s in slots.values())


def test_a_file_with_another_layout_is_rewritten_whole(tmp_path) -> None:
    model = random_model(tiny_config("dense"), KernelConfig(), seed=2)
    file = tmp_path / "model.safetensors"
    save_file({"something.else": torch.zeros(3)}, str(file))  # e.g. left by another model
    inode = file.stat().st_ino
    write_weights_file(model, file)
    assert file.stat().st_ino != inode
    assert_file_holds(file, expected(model))
    file.write_bytes(b"not a safetensors file")
    write_weights_file(model, file)
    assert_file_holds(file, expected(model))


def test_bf16_weights_are_written_in_the_kernel_dtype(tmp_path) -> None:
    model = random_model(tiny_config("dense"), KernelConfig(dtype="bfloat16"), seed=3)
    file = tmp_path / "model.safetensors"
    for _ in range(2):  # created, then overwritten in place
        write_weights_file(model, file)
        tensors = expected(model)
        assert all(t.dtype == torch.bfloat16 for t in tensors.values())
        assert_file_holds(file, tensors)


def test_a_kept_mapping_is_kept_only_for_a_shared_memory_file(tmp_path) -> None:
    """A caller's mapping stays open between writes to a /dev/shm file (the engine sync: no page faults next time)
    and is closed after a write anywhere else (a mapping would keep a deleted file's disk space in use). Checked in
    the process's own memory map; every write lands, bit for bit."""
    import shutil
    import tempfile
    from pathlib import Path

    from miles_kernels import MappedSafetensors

    maps = Path("/proc/self/maps")
    if not maps.exists() or not Path("/dev/shm").is_dir():
        pytest.skip("needs /proc/self/maps and /dev/shm (Linux)")
    model = random_model(tiny_config("dense"), KernelConfig(), seed=4)
    shm = Path(tempfile.mkdtemp(prefix="miles-test-", dir="/dev/shm"))
    try:
        for directory in (shm, tmp_path):
            file = directory / "model.safetensors"
            mapping = MappedSafetensors()
            for _ in range(2):  # created, then overwritten in place through the mapping
                write_weights_file(model, file, mapping=mapping)
                assert_file_holds(file, expected(model))
            assert (str(file.resolve()) in maps.read_text()) == (directory == shm), directory
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_glm_router_bias_is_sent_in_float32_and_the_engine_loads_it(tmp_path) -> None:
    """GLM-4.5's e_score_correction_bias (a float32 buffer) is a weight of the sync: in the file, the buckets and the
    checksum, in float32 while the parameters go in bf16; an engine model loads the file (mapped, in place) and then
    holds the trainer's bits, checksum included."""
    from miles_kernels import (
        MappedSafetensors,
        checkpoint_tensors,
        decode_bucket,
        load_mapped,
        weights_checksum,
    )
    from miles_trainer.weight_sender import iter_weight_buckets

    trainer = random_model(tiny_config("glm"), KernelConfig(dtype="bfloat16"), seed=7)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    tensors = expected(trainer)
    assert tensors[bias].dtype == torch.float32 and tensors[bias].abs().sum() > 0
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    file = tmp_path / "model.safetensors"
    write_weights_file(trainer, file)
    assert_file_holds(file, tensors)
    buckets = {}
    for data in iter_weight_buckets(trainer, version=1, bucket_bytes=4096):
        buckets |= decode_bucket(data).tensors
    assert buckets.keys() == tensors.keys() and torch.equal(buckets[bias], tensors[bias])
    engine = random_model(tiny_config("glm"), KernelConfig(dtype="bfloat16"), seed=8)
    assert load_mapped(engine, MappedSafetensors(), tmp_path)
    assert torch.equal(engine.get_buffer(bias), tensors[bias])
    engine_side = weights_checksum(checkpoint_tensors(engine, mtp_copies=False).items())
    assert engine_side == weights_checksum(export_tensors(trainer))


def test_the_sender_sends_what_the_export_model_holds_and_asks_for_it_every_call(tmp_path) -> None:
    """Over a `CausalLM` (FSDP2's export model): the buckets, the file, the tensors and the checksum are the free
    functions' own; the model is asked for on every call (an offloaded trainer refuses at once, not mid-stream)."""
    from miles_kernels import decode_bucket, weights_checksum
    from miles_trainer.weight_sender import iter_tensor_buckets, iter_weight_buckets

    model = random_model(tiny_config("moe"), KernelConfig(dtype="bfloat16"), seed=5)
    is_offloaded = [False]

    def export_model():  # type: ignore[no-untyped-def]
        if is_offloaded[0]:
            raise RuntimeError("the trainer is offloaded")
        return model

    def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    sender = WeightSender(export_model)
    sent, want = sender.iter_weight_buckets(3, 4096), iter_weight_buckets(model, version=3, bucket_bytes=4096)
    for data, expected_data in zip(sent, want, strict=True):  # the header's key order is the encoder's own
        got, bucket = decode_bucket(data), decode_bucket(expected_data)
        assert (got.version, got.index, got.count) == (bucket.version, bucket.index, bucket.count)
        assert same(got.tensors, bucket.tensors)
    pairs = zip(sender.iter_tensor_buckets(4096), iter_tensor_buckets(model, bucket_bytes=4096), strict=True)
    assert all(same(a, b) for a, b in pairs)
    tensors = sender.export_weights()
    assert tensors.keys() == expected(model).keys()
    assert all(torch.equal(tensors[k], v) for k, v in expected(model).items())
    assert sender.checksum() == weights_checksum(expected(model).items())
    file = tmp_path / "model.safetensors"
    assert sender.write_weights(file) == sum(t.numel() * t.element_size() for t in tensors.values())
    assert_file_holds(file, expected(model))
    is_offloaded[0] = True
    with pytest.raises(RuntimeError, match="offloaded"):
        sender.iter_weight_buckets(4, 4096)  # before any bucket is gathered


def test_megatron_full_tensors_are_sent_each_in_its_dtype_of() -> None:
    """Over Megatron's `ExportedWeights` (full float32 tensors): every tensor in `dtype_of` its name (the kernel dtype,
    float32 for GLM-4.5's router bias), whichever way it is sent."""
    from miles_kernels import checkpoint_tensors, decode_bucket, weights_checksum
    from miles_trainer.megatron_state import ExportedWeights

    model = random_model(tiny_config("glm"), KernelConfig(), seed=6)
    exported = ExportedWeights(checkpoint_tensors(model, mtp_copies=False), KernelConfig(dtype="bfloat16"))
    want = {name: tensor.detach().to(exported.dtype_of(name)) for name, tensor in exported.tensors.items()}
    assert {t.dtype for t in want.values()} == {torch.bfloat16, torch.float32}
    sender = WeightSender(lambda: exported)
    tensors = sender.export_weights()
    assert tensors.keys() == want.keys() and all(torch.equal(tensors[k], v) for k, v in want.items())
    assert sender.checksum() == weights_checksum(want.items())
    buckets = {}
    for data in sender.iter_weight_buckets(1, 4096):
        buckets |= decode_bucket(data).tensors
    assert buckets.keys() == want.keys() and all(torch.equal(buckets[k], v) for k, v in want.items())

"""The trainer's side of weight sync (step 7 of the data path; docs/architecture.md, "Weight sync"): its sharded
parameters as a stream of buckets, as one safetensors file, or as plain tensors.

Each bucket is a safetensors byte string in the `miles_kernels` format (Hugging Face names, tied embeddings once,
version and bucket index/count in the metadata), encoded by `miles_kernels.encode_bucket` so the engine decodes
it with the same codec. The plan is made from the parameters' global shapes, then each bucket's tensors are
gathered from the shards (`DTensor.full_tensor()`, a collective: every rank iterates), cast to the kernel dtype
the engine computes in, encoded, and dropped before the next bucket is gathered. Peak extra host memory is
therefore a few buckets, whatever the model size: the bucket the caller is still sending, the next one's gathered
tensors, and its encoding (safetensors' buffer plus the Python `bytes` copied from it) -- measured at about four
times the largest bucket in `tests/test_fsdp.py`. For an engine on the same node, `write_weights_file` writes the
whole model as one safetensors file instead (the orchestrator puts it in /dev/shm): serialized whole the first time,
then streamed into the same file one gathered tensor at a time.

For an engine that stores low-precision weights (`rollout.engine.weight_dtype`; miles_kernels/quantization.py), a
`WeightQuantizer` turns each quantized layer's gathered weight, already in the kernel dtype, into the parts the
engine stores (FP8 and its scales, packed INT4 and its scales) before it is sent: the engine loads them as they are,
and the bytes on the wire drop with the format. The plan, the file layout and the checksum all follow the sent parts.

A backend exposes all of this as one `WeightSender` (`backend.weights`), built from its export model: FSDP2's
`CausalLM` (its sharded parameters), Megatron's `ExportedWeights` (full tensors gathered over its model-parallel
groups). The orchestrator's weight transports (`miles_orchestrator/cluster/transport/`) call nothing else.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save_file

from miles_kernels import (
    KernelConfig,
    MappedSafetensors,
    WeightQuantizer,
    encode_bucket,
    in_shared_memory,
    plan_buckets,
    weight_digests,
    weights_checksum,
)

DEFAULT_BUCKET_BYTES = 512 * 1024**2


class ExportModel(Protocol):
    """What the sender reads from a model: its kernel config (the engine's dtype), its parameters (sharded or whole)
    and buffers under HF names. `miles_kernels.CausalLM` is one; Megatron's `ExportedWeights` another."""

    @property
    def kernel(self) -> KernelConfig: ...
    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...
    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def export_names(model: ExportModel) -> list[tuple[str, torch.Tensor]]:
    """(HF checkpoint name, tensor) for every weight to send: the parameters (tied ones once, under the embedding's
    name, as the HF checkpoint stores them), then the buffers the checkpoint holds (GLM-4.5's float32
    `e_score_correction_bias`: frozen, but synced, saved and checksummed like a weight)."""
    # named_parameters drops the tied duplicate (lm_head.weight)
    return [*model.named_parameters(), *model.named_buffers()]


def export_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor is sent in: the engine's for parameters; a buffer keeps its own (the router bias stays
    float32 on both sides)."""
    return dtype if isinstance(tensor, torch.nn.Parameter) else tensor.dtype


def _gathered(param: torch.Tensor, dtype: torch.dtype, fresh: bool = True) -> torch.Tensor:
    value = param.detach()
    if hasattr(value, "device_mesh") and value.device.type != value.device_mesh.device_type:
        value = value.to(value.device_mesh.device_type)  # shards in host memory (offload=moments_and_master): NCCL
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    out = full.to(device="cpu", dtype=dtype)
    # Unless the caller only reads it at once (`fresh=False`), never hand out the parameter's own storage (one rank,
    # same dtype): the encoders must not touch, and pin via numpy, the storage that offload later frees. A gathered
    # or cast tensor is already a fresh one.
    local = value.to_local() if hasattr(value, "to_local") else value
    if fresh and out.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        out = out.clone()
    return out


def export_tensors(
    model: ExportModel, dtype: torch.dtype | None = None, fresh: bool = True, quant: WeightQuantizer | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor on CPU in the engine's dtype), gathered one tensor at a time (every rank iterates).
    `fresh=False`: a CPU parameter already in `dtype` comes back as itself, for a caller that only reads it.
    `quant`: the layers the engine stores quantized come as their parts."""
    dtype = dtype or model.kernel.torch_dtype
    for name, param in export_names(model):
        tensor = _gathered(param, export_dtype(param, dtype), fresh)
        yield from [(name, tensor)] if quant is None else quant.parts(name, tensor)


def export_layout(
    model: ExportModel, dtype: torch.dtype, quant: WeightQuantizer | None = None
) -> list[tuple[str, str, tuple[int, ...], torch.dtype]]:
    """(sent name, the parameter it comes from, shape, dtype) of every tensor a sync sends, in order."""
    out: list[tuple[str, str, tuple[int, ...], torch.dtype]] = []
    for name, param in export_names(model):
        shape, sent_dtype = tuple(param.shape), export_dtype(param, dtype)
        parts = [(name, shape, sent_dtype)] if quant is None else quant.layout(name, shape, sent_dtype)
        out.extend((part, name, part_shape, part_dtype) for part, part_shape, part_dtype in parts)
    return out


def iter_weight_buckets(
    model: ExportModel, *, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None,
    quant: WeightQuantizer | None = None,
) -> Iterator[bytes]:  # fmt: skip
    """Yield the model's full weights as encoded buckets of about `bucket_bytes` each (a tensor larger than that
    gets a bucket of its own). `dtype`: what the engine runs in (default: the model's kernel dtype).

    Every rank of a sharded model must consume the iterator to the end (the gathers are collectives); every rank
    gets the same bytes, so any of them can send to its engine.
    """
    plan = bucket_plan(model, bucket_bytes, dtype, quant)
    for index, tensors in enumerate(iter_tensor_buckets(model, bucket_bytes=bucket_bytes, dtype=dtype, quant=quant)):
        data = encode_bucket(tensors, version=version, index=index, count=len(plan))
        del tensors
        yield data


def bucket_plan(
    model: ExportModel, bucket_bytes: int, dtype: torch.dtype | None = None, quant: WeightQuantizer | None = None
) -> list[list[str]]:
    """The HF names of each bucket of a weight sync (`miles_kernels.plan_buckets` over the export sizes)."""
    return _plan(export_layout(model, dtype or model.kernel.torch_dtype, quant), bucket_bytes)


def _plan(layout: list[tuple[str, str, tuple[int, ...], torch.dtype]], bucket_bytes: int) -> list[list[str]]:
    return plan_buckets([(name, math.prod(shape) * d.itemsize) for name, _, shape, d in layout], bucket_bytes)


def iter_tensor_buckets(
    model: ExportModel, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None,
    quant: WeightQuantizer | None = None,
) -> Iterator[dict[str, torch.Tensor]]:  # fmt: skip
    """The model's full weights bucket by bucket (`bucket_plan`), each as {HF name: full CPU tensor in the engine's
    dtype}: what a broadcast over a weight-update group sends, one bucket gathered at a time. Every rank of a
    sharded model must consume the iterator to the end (the gathers are collectives). A quantized layer's parts
    come from one gather, whichever buckets they fall in."""
    dtype = dtype or model.kernel.torch_dtype
    params = dict(export_names(model))
    layout = export_layout(model, dtype, quant)
    source = {name: param_name for name, param_name, _, _ in layout}
    last: tuple[str, dict[str, torch.Tensor]] = ("", {})  # the latest gathered parameter, as sent

    def sent(name: str) -> torch.Tensor:
        nonlocal last
        param_name = source[name]
        if last[0] != param_name:
            tensor = _gathered(params[param_name], export_dtype(params[param_name], dtype))
            last = (param_name, dict([(param_name, tensor)] if quant is None else quant.parts(param_name, tensor)))
        return last[1][name]

    plan = _plan(layout, bucket_bytes)
    for index, names in enumerate(plan):
        bucket = {name: sent(name) for name in names}
        if index + 1 == len(plan) or source[plan[index + 1][0]] != last[0]:
            last = ("", {})  # kept only for parts that the next bucket carries
        yield bucket


def write_weights_file(
    model: ExportModel,
    file: str | os.PathLike[str],
    write: bool = True,
    mapping: MappedSafetensors | None = None,
    quant: WeightQuantizer | None = None,
) -> int:
    """The model's full weights (HF names, kernel dtype) as one safetensors file: what an engine on the same node
    loads with `/update_weights_from_disk`. Every rank of a sharded model calls it (the gathers are collectives);
    ranks with `write=False` only join them. Returns the bytes.

    The first write creates the file atomically (a temp file, then a rename). When the file already holds the same
    tensors (names, dtypes, shapes), later writes overwrite their bytes in place through `mapping` (kept mapped
    between writes by the caller when the file is in /dev/shm, closed after the write elsewhere; a fresh one if
    None): no serialization, no new file, and with a kept mapping no page faults (12.6 MB on 2 CPU cores: 3.3 ms a
    write, against 8.6 ms through a new mapping each time and ~18 ms serialized). The caller owns the protocol that
    makes this safe: the engine reads the file only when told to, after this returns; a write cut short is made
    whole by the next one.
    """
    dtype = model.kernel.torch_dtype
    named = export_names(model)
    layout = {
        name: torch.empty(shape, dtype=sent_dtype, device="meta")
        for name, _, shape, sent_dtype in export_layout(model, dtype, quant)
    }
    mapping = mapping or MappedSafetensors()
    views = _in_place_views(Path(file), layout, mapping) if write else None
    if views is not None or not write:
        # Streamed: one gathered tensor at a time is copied into its slot and dropped (docs/memory.md, "Host
        # peak memory"); ranks that do not write only join the gathers.
        for name, param in named:
            tensor = _gathered(param, export_dtype(param, dtype), fresh=False)  # only read, before the next one
            if views is not None:
                _copy_into(views, [(name, tensor)] if quant is None else quant.parts(name, tensor))
            del tensor
    else:  # the first write: serialized whole (one full copy in host memory, once)
        tensors = dict(export_tensors(model, fresh=False, quant=quant))
        staging = f"{os.fspath(file)}.tmp{os.getpid()}"
        save_file(tensors, staging)
        os.replace(staging, file)
        del tensors
    if write and not in_shared_memory(file):  # only /dev/shm files stay mapped: a deleted file must free its space
        mapping.close()
    return sum(t.numel() * t.element_size() for t in layout.values()) if write else 0


def _copy_into(views: dict[str, torch.Tensor], tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Copy each tensor's bytes into its slot of the mapped file (a function: its tensors are gone when it returns,
    before the next one is gathered)."""
    for name, tensor in tensors:
        views[name].copy_(tensor.contiguous().reshape(-1).view(torch.uint8))


def _in_place_views(
    file: Path, layout: dict[str, torch.Tensor], mapping: MappedSafetensors
) -> dict[str, torch.Tensor] | None:
    """Name -> uint8 view of its slot in an existing safetensors file with this layout (names, dtypes, shapes);
    None when there is no such file (it is then written whole)."""
    if not file.is_file():
        return None
    try:
        return mapping.views_for(file, layout)  # None (mapping dropped) for another layout
    except (ValueError, OSError):  # not a readable safetensors file: rewrite it whole
        mapping.close()
        return None


class WeightSender:
    """A backend's weights as an engine receives them (HF names, kernel dtype; `backend.weights`): buckets, tensor
    buckets for a broadcast, the engine's weight file, plain tensors, their checksum. `model` returns the export
    model when asked (and raises while the trainer is offloaded). Every call is collective: every rank makes it and
    consumes an iterator to the end (the gathers)."""

    def __init__(
        self, model: Callable[[], ExportModel], checksum_model: Callable[[], ExportModel] | None = None,
        quant: WeightQuantizer | None = None,
    ) -> None:  # fmt: skip
        """`quant`: the engine stores these layers quantized; their weights are sent as its parts."""
        self._model = model
        self.quant = quant
        # what `checksum` covers: every weight the engine holds (a LoRA run sends only its adapters, yet the engine's
        # base must match too)
        self._checksum_model = checksum_model or model
        self._weights_file = MappedSafetensors()  # the engine's weight file, kept mapped between syncs

    def iter_weight_buckets(self, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[bytes]:
        """The full weights as weight buckets (docs/architecture.md, "Weight sync"), a few buckets of extra host
        memory at a time."""
        return iter_weight_buckets(self._model(), version=version, bucket_bytes=bucket_bytes, quant=self.quant)

    def iter_tensor_buckets(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[dict[str, torch.Tensor]]:
        """The full weights bucket by bucket as {HF name: full CPU tensor in the kernel dtype}, for a broadcast to
        engines over a weight-update group."""
        return iter_tensor_buckets(self._model(), bucket_bytes=bucket_bytes, quant=self.quant)

    def write_weights(self, file: str | os.PathLike[str], write: bool = True) -> int:
        """Write the weights an engine loads as one safetensors file (created atomically, then overwritten in place:
        `write_weights_file`); returns its tensor bytes. Ranks with `write=False` only join the gathers. The first
        write holds one full copy of the weights in host memory; later ones stream one gathered tensor at a time
        into the file. A file in /dev/shm stays mapped between calls (no page faults)."""
        return write_weights_file(self._model(), file, write, self._weights_file, self.quant)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The weights an engine receives, full tensors on the CPU, for an engine in this process to copy
        (`miles_rollout.Engine.weights.load_tensors`): no file, no bucket, one copy. A tensor that needs no gather
        or cast comes back as itself: read it, never write it."""
        return dict(export_tensors(self._model(), fresh=False, quant=self.quant))

    def checksum(self) -> str:
        """`miles_kernels.weights_checksum` of the weights an engine holds after a sync (with LoRA: the base and the
        adapters, though only the adapters are sent); equal to the engine's when the bits match."""
        return weights_checksum(export_tensors(self._checksum_model(), fresh=False, quant=self.quant))

    def digests(self) -> dict[str, str]:
        """{HF name: sha256} of every weight the trainer holds, each gathered in its own dtype (a change below the
        engine's precision shows): what a replayed train step is compared with (`miles-orchestrator replay`)."""
        named = export_names(self._checksum_model())
        return weight_digests((name, _gathered(tensor, tensor.dtype, fresh=False)) for name, tensor in named)

"""The weight-bucket codec that the trainer and the rollout engine share (step 7 of the RL data path: weight sync).

After an optimizer step the trainer streams its weights to every engine in *buckets*. A bucket is one safetensors
byte string:

- its tensors carry Hugging Face checkpoint names (tied embeddings are sent once, under the name the HF checkpoint
  stores), so any engine that loads HF checkpoints can map them;
- its safetensors metadata (str -> str) holds ``format="miles-bucket"``, ``version`` (the weight version, which the
  trainer owns: its policy step), ``bucket_index`` and ``bucket_count``.

The same bytes travel over HTTP, shared memory, a ``torch.distributed`` broadcast or a file, so the transport never
has to know about tensors. Decoding never unpickles: safetensors is a JSON header plus raw buffers, and this module
reads nothing else (docs/architecture.md, "Weight sync").

Sender::

    for data in iter_buckets(list(model.state_dict().items()), version=step, bucket_bytes=512 << 20):
        transport.send(data)  # only this bucket's bytes are alive here

Receiver::

    assembler = BucketAssembler()
    while not assembler.is_complete:
        assembler.add(decode_bucket(transport.recv()))
    model.load_state_dict(assembler.tensors, strict=False)
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load as _safetensors_load
from safetensors.torch import save as _safetensors_save

BUCKET_FORMAT = "miles-bucket"
_METADATA_KEYS = ("format", "version", "bucket_index", "bucket_count")
# safetensors reserves this header key for the metadata; a tensor with this name would corrupt the header.
_RESERVED_NAME = "__metadata__"


@dataclass(frozen=True)
class Bucket:
    """One decoded bucket: CPU tensors by HF name, the weight version, and this bucket's place in the sync."""

    tensors: dict[str, torch.Tensor]
    version: int
    index: int
    count: int


def _check_position(*, version: int, index: int, count: int) -> None:
    for field, value in (("version", version), ("index", index), ("count", count)):
        # bool is an int subclass; a True version is a bug at the call site, not version 1.
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"bucket {field} must be an int, got {type(value).__name__} {value!r}")
    if version < 0:
        raise ValueError(f"bucket version must be >= 0 (the trainer's policy step), got {version}")
    if count < 1:
        raise ValueError(f"bucket count must be >= 1, got {count}")
    if not 0 <= index < count:
        raise ValueError(f"bucket index must satisfy 0 <= index < count, got index={index}, count={count}")


def encode_bucket(tensors: Mapping[str, torch.Tensor], *, version: int, index: int, count: int) -> bytes:
    """Encode one bucket of named tensors as safetensors bytes with the version and position in the metadata.

    Tensors may live on any device and have any strides: they are copied to CPU and made contiguous first (a
    no-op for tensors that already are). Two names for one tensor (tied weights) are refused: the HF checkpoint
    stores a tied weight once, and so does the bucket.
    """
    _check_position(version=version, index=index, count=count)
    if not tensors:
        raise ValueError("a bucket needs at least one tensor; plan_buckets never makes an empty one")

    aliases: dict[tuple[str, int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    cpu_tensors: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str (HF checkpoint names), got {type(name).__name__} {name!r}")
        if not name or name == _RESERVED_NAME:
            raise ValueError(f"tensor name {name!r} is not allowed: use the HF checkpoint name of the weight")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"bucket tensor {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.numel() > 0:
            # Same memory, same view: a tied weight under two names. Check before the CPU copy, which would hide it.
            view = (str(tensor.device), tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
            if view in aliases:
                raise ValueError(
                    f"tensors {aliases[view]!r} and {name!r} are the same tensor (tied weights?); send a tied weight "
                    "once, under the name the Hugging Face checkpoint stores it"
                )
            aliases[view] = name
        cpu_tensors[name] = tensor.detach().to("cpu").contiguous()

    metadata = {
        "format": BUCKET_FORMAT,
        "version": str(version),
        "bucket_index": str(index),
        "bucket_count": str(count),
    }
    try:
        return _safetensors_save(cpu_tensors, metadata=metadata)
    except KeyError as exc:  # safetensors raises KeyError(dtype) for a dtype it cannot store, e.g. complex128
        raise TypeError(f"safetensors cannot store dtype {exc.args[0]}; cast the tensor before sending it") from exc


def _read_metadata(data: bytes) -> dict[str, str]:
    # Layout (safetensors spec): 8-byte little-endian header length, then a UTF-8 JSON header. safetensors.load has
    # already validated both by the time this runs; it just does not return the metadata from bytes.
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    metadata = header.get("__metadata__") or {}
    assert isinstance(metadata, dict)
    return metadata


def decode_bucket(data: bytes | bytearray | memoryview) -> Bucket:
    """Decode bytes made by `encode_bucket` into a `Bucket` of CPU tensors (bit-exact, writable, never unpickled)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"decode_bucket takes the bucket's bytes, got {type(data).__name__}")
    data = bytes(data)  # safetensors' loader takes only `bytes`; no copy when it already is
    try:
        tensors = _safetensors_load(data)
    except SafetensorError as exc:
        raise ValueError(f"not a weight bucket: the bytes are not a valid safetensors file ({exc})") from exc

    metadata = _read_metadata(data)
    missing = [key for key in _METADATA_KEYS if key not in metadata]
    if missing:
        raise ValueError(
            f"not a miles weight bucket: safetensors metadata lacks {missing} (has {sorted(metadata)}); "
            "encode buckets with miles_kernels.encode_bucket"
        )
    if metadata["format"] != BUCKET_FORMAT:
        raise ValueError(
            f"not a miles weight bucket: metadata format is {metadata['format']!r}, not {BUCKET_FORMAT!r}"
        )
    position: dict[str, int] = {}
    for key in ("version", "bucket_index", "bucket_count"):
        try:
            position[key] = int(metadata[key])
        except ValueError:
            raise ValueError(f"corrupt weight bucket: metadata {key}={metadata[key]!r} is not an integer") from None
    version, index, count = position["version"], position["bucket_index"], position["bucket_count"]
    try:
        _check_position(version=version, index=index, count=count)
    except ValueError as exc:
        raise ValueError(f"corrupt weight bucket: {exc}") from None
    return Bucket(tensors=tensors, version=version, index=index, count=count)


def plan_buckets(sizes: Sequence[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Group tensor names, in order, into buckets of at most `bucket_bytes` bytes each.

    Greedy: a name joins the current bucket while it fits, else starts the next one. A tensor larger than
    `bucket_bytes` cannot be split (the receiver loads whole tensors), so it gets a bucket of its own. Keeping the
    order keeps a sync reproducible and lets the receiver see tensors in state-dict order.
    """
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    seen: set[str] = set()
    plan: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, num_bytes in sizes:
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice; each weight is sent once per sync")
        if num_bytes < 0:
            raise ValueError(f"tensor {name!r} has a negative size ({num_bytes} bytes)")
        seen.add(name)
        if current and current_bytes + num_bytes > bucket_bytes:
            plan.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += num_bytes
    if current:
        plan.append(current)
    return plan


def iter_buckets(
    named_tensors: Sequence[tuple[str, torch.Tensor]], *, version: int, bucket_bytes: int
) -> Iterator[bytes]:
    """Plan the buckets for `named_tensors`, then encode and yield them one at a time.

    Arguments are checked now, not at the first `next()`. Consumed lazily, only one bucket's bytes (and the CPU
    copies of its tensors, for tensors that were not already contiguous on the CPU) are alive at a time, so a sync
    needs a few buckets' worth of host memory however large the model is.
    """
    named = dict(named_tensors)
    if len(named) != len(named_tensors):
        names = [name for name, _ in named_tensors]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        raise ValueError(f"tensor names appear more than once: {duplicates}; each weight is sent once per sync")
    if not named:
        raise ValueError("iter_buckets got no tensors; a weight sync needs at least one")
    plan = plan_buckets([(name, t.numel() * t.element_size()) for name, t in named.items()], bucket_bytes)
    _check_position(version=version, index=0, count=len(plan))

    def _encode_each() -> Iterator[bytes]:
        for index, names in enumerate(plan):
            # Yield the call's result directly: no local keeps the previous bucket's bytes alive while the caller
            # sends them.
            yield encode_bucket({name: named[name] for name in names}, version=version, index=index, count=len(plan))

    return _encode_each()


class BucketAssembler:
    """Collects the buckets of one weight version, in any order, and merges them once all have arrived.

    The version and bucket count are taken from the first bucket unless `version` is given. A bucket of another
    version, a repeated index, a different count, or a tensor name already received is a ValueError: each means the
    sender and the receiver disagree about which sync this is, and loading a mix would corrupt the weights.
    """

    def __init__(self, version: int | None = None) -> None:
        self._version = version
        self._count: int | None = None
        self._received: dict[int, dict[str, torch.Tensor]] = {}
        self._names: set[str] = set()

    @property
    def version(self) -> int | None:
        """The weight version being assembled, or None before the first bucket when none was given."""
        return self._version

    @property
    def missing(self) -> list[int]:
        """Indices not received yet; empty before the first bucket, since the count is not known then."""
        if self._count is None:
            return []
        return [i for i in range(self._count) if i not in self._received]

    @property
    def is_complete(self) -> bool:
        """True once every bucket of the version has arrived."""
        return self._count is not None and len(self._received) == self._count

    def add(self, bucket: Bucket | bytes) -> None:
        """Add one bucket, decoded or as its bytes."""
        if not isinstance(bucket, Bucket):
            bucket = decode_bucket(bucket)
        if self._version is not None and bucket.version != self._version:
            raise ValueError(f"bucket {bucket.index} is of weight version {bucket.version}, expected {self._version}")
        if self._count is not None and bucket.count != self._count:
            raise ValueError(
                f"bucket {bucket.index} says the sync has {bucket.count} buckets, earlier ones {self._count}"
            )
        if bucket.index in self._received:
            raise ValueError(f"bucket {bucket.index} of version {bucket.version} arrived twice")
        repeated = sorted(self._names.intersection(bucket.tensors))
        if repeated:
            raise ValueError(f"bucket {bucket.index} repeats tensors already received: {repeated}")
        self._version, self._count = bucket.version, bucket.count
        self._received[bucket.index] = bucket.tensors
        self._names.update(bucket.tensors)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """All tensors of the version, merged in bucket order; a ValueError until `is_complete`."""
        if not self.is_complete:
            waiting = self.missing if self._count is not None else "all (none received yet)"
            raise ValueError(f"weight version {self._version} is incomplete: waiting for buckets {waiting}")
        merged: dict[str, torch.Tensor] = {}
        for index in range(len(self._received)):
            merged.update(self._received[index])
        return merged

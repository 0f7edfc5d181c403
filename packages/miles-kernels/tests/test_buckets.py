"""CPU numerics: the weight-bucket codec round-trips tensors bit for bit, plans buckets within the byte limit, and
assembles a version from buckets in any order. It never unpickles.

The reference for "bit-exact" is the tensors' raw bytes (`view(torch.uint8)`), which also covers NaN payloads and
-0.0 that `torch.equal` cannot see.
"""

from __future__ import annotations

import itertools
import json
import pickle
import struct

import pytest
import torch
from safetensors.torch import save as safetensors_save

from miles_kernels.weight_sync.buckets import (
    BUCKET_FORMAT,
    Bucket,
    BucketAssembler,
    decode_bucket,
    encode_bucket,
    iter_buckets,
    plan_buckets,
)


def _raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def _special_floats(dtype: torch.dtype) -> torch.Tensor:
    """Values whose bits `==` cannot check: NaNs with payloads and either sign, -0.0, infinities, subnormals."""
    bits = {
        torch.float32: [
            0x7FC00001,
            0xFFC12345 - (1 << 32),
            0x80000000 - (1 << 32),
            0x7F800000,
            0x00000001,
            0x3F800000,
        ],
        torch.float16: [0x7E01, 0xFE42 - (1 << 16), 0x8000 - (1 << 16), 0x7C00, 0x0001, 0x3C00],
        torch.bfloat16: [0x7FC1, 0xFFC3 - (1 << 16), 0x8000 - (1 << 16), 0x7F80, 0x0001, 0x3F80],
    }[dtype]
    int_dtype = torch.int32 if dtype == torch.float32 else torch.int16
    return torch.tensor(bits, dtype=int_dtype).view(dtype)


def _roundtrip(tensors: dict[str, torch.Tensor]) -> Bucket:
    return decode_bucket(encode_bucket(tensors, version=3, index=1, count=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float_roundtrip_is_bit_exact(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    random = torch.randn(5, 7, generator=g).to(dtype)
    special = _special_floats(dtype)
    assert torch.isnan(special).any() and torch.signbit(special).any()  # the payloads really are NaN / -0.0

    out = _roundtrip({"model.w": random, "model.special": special}).tensors

    assert out["model.w"].dtype == dtype and out["model.w"].shape == random.shape
    assert torch.equal(out["model.w"], random)
    assert _raw_bytes(out["model.w"]) == _raw_bytes(random)
    assert _raw_bytes(out["model.special"]) == _raw_bytes(special)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(-6, 6, dtype=torch.int64).reshape(3, 4) * (1 << 40),
        torch.tensor([True, False, True]),
        torch.tensor(2.5),  # shape ()
        torch.empty(0, 3),  # no elements
        torch.empty(4, 0, dtype=torch.bfloat16),
    ],
    ids=["int64", "bool", "scalar", "empty-f32", "empty-bf16"],
)
def test_other_tensors_roundtrip(tensor: torch.Tensor) -> None:
    out = _roundtrip({"t": tensor}).tensors["t"]
    assert out.dtype == tensor.dtype and out.shape == tensor.shape
    assert torch.equal(out, tensor)
    assert _raw_bytes(out) == _raw_bytes(tensor)


def test_non_contiguous_tensors_roundtrip_contiguous() -> None:
    base = torch.randn(6, 8).to(torch.bfloat16)
    views = {"transposed": base.t(), "strided": base[:, ::3], "expanded": torch.randn(1, 4).expand(3, 4)}
    assert not any(v.is_contiguous() for v in views.values())

    out = _roundtrip(views).tensors

    for name, view in views.items():
        assert out[name].is_contiguous()
        assert torch.equal(out[name], view)
        assert _raw_bytes(out[name]) == _raw_bytes(view)


def test_contiguous_slices_of_one_tensor_encode() -> None:
    # A fused weight split into row blocks shares one storage without overlapping; that is fine to send.
    fused = torch.randn(6, 4)
    out = _roundtrip({"q": fused[:2], "k": fused[2:4], "v": fused[4:]}).tensors
    assert torch.equal(torch.cat([out["q"], out["k"], out["v"]]), fused)


def test_decoded_tensors_are_writable_and_independent_of_the_input() -> None:
    weight = torch.zeros(3)
    out = _roundtrip({"w": weight}).tensors["w"]
    out += 1  # the engine copies into its parameters in place; that must not touch the sender's tensor
    assert torch.equal(weight, torch.zeros(3))


def test_metadata_roundtrip() -> None:
    data = encode_bucket({"w": torch.ones(2)}, version=41, index=2, count=5)
    bucket = decode_bucket(data)
    assert (bucket.version, bucket.index, bucket.count) == (41, 2, 5)

    # The metadata is plain safetensors metadata, readable by any safetensors reader.
    (header_len,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8 : 8 + header_len])["__metadata__"]
    assert metadata == {"format": BUCKET_FORMAT, "version": "41", "bucket_index": "2", "bucket_count": "5"}


def test_decode_accepts_bytearray_and_memoryview() -> None:
    data = encode_bucket({"w": torch.arange(3)}, version=0, index=0, count=1)
    for view in (bytearray(data), memoryview(data)):
        assert torch.equal(decode_bucket(view).tensors["w"], torch.arange(3))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"version": -1, "index": 0, "count": 1}, "version must be >= 0"),
        ({"version": 0, "index": 1, "count": 1}, "0 <= index < count"),
        ({"version": 0, "index": -1, "count": 2}, "0 <= index < count"),
        ({"version": 0, "index": 0, "count": 0}, "count must be >= 1"),
    ],
)
def test_encode_rejects_bad_positions(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        encode_bucket({"w": torch.ones(1)}, **kwargs)


def test_encode_rejects_user_mistakes() -> None:
    with pytest.raises(ValueError, match="at least one tensor"):
        encode_bucket({}, version=0, index=0, count=1)
    with pytest.raises(TypeError, match="must be an int"):
        encode_bucket({"w": torch.ones(1)}, version=True, index=0, count=1)
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        encode_bucket({"w": [1.0]}, version=0, index=0, count=1)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="not allowed"):
        encode_bucket({"__metadata__": torch.ones(1)}, version=0, index=0, count=1)
    with pytest.raises(TypeError, match="cannot store dtype"):
        encode_bucket({"w": torch.ones(2, dtype=torch.complex128)}, version=0, index=0, count=1)
    embed = torch.randn(4, 3)
    with pytest.raises(ValueError, match="tied weights"):
        encode_bucket({"model.embed_tokens.weight": embed, "lm_head.weight": embed}, version=0, index=0, count=1)


@pytest.mark.parametrize(
    "data",
    [b"", b"garbage", b"\x00" * 7, b"\xff" * 64, b"{}" * 10],
    ids=["empty", "text", "short", "huge-header", "json"],
)
def test_garbage_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        decode_bucket(data)


def test_truncated_bucket_is_a_value_error() -> None:
    data = encode_bucket({"w": torch.ones(16)}, version=0, index=0, count=1)
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        decode_bucket(data[:-1])


def test_decode_wants_bytes() -> None:
    with pytest.raises(TypeError, match="bytes"):
        decode_bucket("not bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        (None, r"lacks \['format', 'version', 'bucket_index', 'bucket_count'\]"),
        ({"format": BUCKET_FORMAT, "version": "1", "bucket_index": "0"}, r"lacks \['bucket_count'\]"),
        ({"format": "pt", "version": "1", "bucket_index": "0", "bucket_count": "1"}, "format is 'pt'"),
        ({"format": BUCKET_FORMAT, "version": "x", "bucket_index": "0", "bucket_count": "1"}, "version='x'"),
        ({"format": BUCKET_FORMAT, "version": "1", "bucket_index": "3", "bucket_count": "2"}, "corrupt"),
    ],
)
def test_wrong_metadata_names_the_problem(metadata: dict[str, str] | None, match: str) -> None:
    data = safetensors_save({"w": torch.ones(1)}, metadata=metadata)
    with pytest.raises(ValueError, match=match):
        decode_bucket(data)


unpickled: list[str] = []


def _record_unpickling(tag: str) -> str:
    unpickled.append(tag)
    return tag


class _Payload:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (_record_unpickling, ("executed",))


def test_pickle_payload_is_rejected_and_not_executed() -> None:
    payload = pickle.dumps({"w": _Payload()})
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        decode_bucket(payload)
    assert unpickled == []


def test_decode_never_calls_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("decode_bucket must not unpickle")

    data = encode_bucket({"w": torch.randn(3), "b": torch.arange(2)}, version=1, index=0, count=1)
    for target in (pickle, torch.serialization):
        for attr in ("load", "loads", "Unpickler"):
            if hasattr(target, attr):
                monkeypatch.setattr(target, attr, forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    assert set(decode_bucket(data).tensors) == {"w", "b"}


# --- planning -------------------------------------------------------------------------------------------------


def _check_plan(sizes: list[tuple[str, int]], limit: int) -> list[list[str]]:
    plan = plan_buckets(sizes, limit)
    size_of = dict(sizes)
    assert [name for bucket in plan for name in bucket] == [name for name, _ in sizes]  # each once, in order
    for bucket in plan:
        assert bucket, "no empty buckets"
        total = sum(size_of[name] for name in bucket)
        assert total <= limit or (len(bucket) == 1 and total > limit), (bucket, total)
    # Greedy: the next bucket's first tensor would not have fitted into the previous bucket.
    for prev, nxt in itertools.pairwise(plan):
        assert sum(size_of[n] for n in prev) + size_of[nxt[0]] > limit
    return plan


def test_plan_examples() -> None:
    assert _check_plan([("a", 4), ("b", 4), ("c", 4)], 8) == [["a", "b"], ["c"]]
    assert _check_plan([("a", 3), ("big", 20), ("b", 3), ("c", 3)], 8) == [["a"], ["big"], ["b", "c"]]
    assert _check_plan([("a", 8), ("b", 0), ("c", 1)], 8) == [["a", "b"], ["c"]]
    assert _check_plan([("huge", 100)], 8) == [["huge"]]
    assert plan_buckets([], 8) == []


def test_plan_limits_on_random_sizes() -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        n = int(torch.randint(1, 40, (1,), generator=g))
        sizes = [(f"t{trial}.{i}", int(s)) for i, s in enumerate(torch.randint(0, 300, (n,), generator=g))]
        _check_plan(sizes, limit=int(torch.randint(1, 400, (1,), generator=g)))


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="positive int"):
        plan_buckets([("a", 1)], 0)
    with pytest.raises(ValueError, match="appears twice"):
        plan_buckets([("a", 1), ("a", 1)], 8)
    with pytest.raises(ValueError, match="negative size"):
        plan_buckets([("a", -1)], 8)


def test_iter_buckets_covers_every_tensor_within_the_limit() -> None:
    named = [(f"layers.{i}.w", torch.randn(i + 1, 16)) for i in range(8)]  # 64 * (i + 1) bytes each
    limit = 64 * 5

    datas = list(iter_buckets(named, version=7, bucket_bytes=limit))
    buckets = [decode_bucket(d) for d in datas]

    assert len(buckets) > 1
    assert [b.index for b in buckets] == list(range(len(buckets)))
    assert {b.count for b in buckets} == {len(buckets)} and {b.version for b in buckets} == {7}
    for b in buckets:
        nbytes = sum(t.numel() * t.element_size() for t in b.tensors.values())
        assert nbytes <= limit or len(b.tensors) == 1
    received = {name: t for b in buckets for name, t in b.tensors.items()}
    assert list(received) != [] and set(received) == {name for name, _ in named}
    for name, tensor in named:
        assert torch.equal(received[name], tensor)


def test_iter_buckets_is_lazy_and_checks_arguments_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="more than once"):
        iter_buckets([("w", torch.ones(1)), ("w", torch.ones(1))], version=0, bucket_bytes=8)
    with pytest.raises(ValueError, match="no tensors"):
        iter_buckets([], version=0, bucket_bytes=8)
    with pytest.raises(ValueError, match="version"):
        iter_buckets([("w", torch.ones(1))], version=-2, bucket_bytes=8)

    import miles_kernels.weight_sync.buckets as buckets_module

    calls: list[int] = []
    real_encode = buckets_module.encode_bucket

    def counting_encode(*args: object, **kwargs: object) -> bytes:
        calls.append(1)
        return real_encode(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(buckets_module, "encode_bucket", counting_encode)
    it = iter_buckets([(f"w{i}", torch.ones(4)) for i in range(3)], version=0, bucket_bytes=16)
    assert calls == []
    next(it)
    assert len(calls) == 1  # the second bucket is not encoded before the caller asks for it


# --- assembly -------------------------------------------------------------------------------------------------


def _version_buckets(version: int, count: int = 3) -> list[bytes]:
    return [
        encode_bucket({f"w{i}": torch.full((2,), float(i))}, version=version, index=i, count=count)
        for i in range(count)
    ]


def test_assembler_completes_out_of_order() -> None:
    datas = _version_buckets(version=5)
    assembler = BucketAssembler()
    assert not assembler.is_complete and assembler.version is None
    for i in (2, 0):
        assembler.add(decode_bucket(datas[i]))
        assert not assembler.is_complete
    assert assembler.missing == [1]
    with pytest.raises(ValueError, match=r"waiting for buckets \[1\]"):
        _ = assembler.tensors
    assembler.add(datas[1])  # bytes work too
    assert assembler.is_complete and assembler.version == 5 and assembler.missing == []
    assert list(assembler.tensors) == ["w0", "w1", "w2"]
    for i in range(3):
        assert torch.equal(assembler.tensors[f"w{i}"], torch.full((2,), float(i)))


def test_assembler_rejects_another_version() -> None:
    assembler = BucketAssembler()
    assembler.add(_version_buckets(version=5)[0])
    with pytest.raises(ValueError, match="version 6, expected 5"):
        assembler.add(_version_buckets(version=6)[1])

    expecting = BucketAssembler(version=9)
    with pytest.raises(ValueError, match="version 5, expected 9"):
        expecting.add(_version_buckets(version=5)[0])


def test_assembler_rejects_duplicate_index() -> None:
    datas = _version_buckets(version=1)
    assembler = BucketAssembler()
    assembler.add(datas[0])
    with pytest.raises(ValueError, match="arrived twice"):
        assembler.add(datas[0])


def test_assembler_rejects_count_mismatch() -> None:
    assembler = BucketAssembler()
    assembler.add(_version_buckets(version=1, count=3)[0])
    with pytest.raises(ValueError, match="has 4 buckets, earlier ones 3"):
        assembler.add(_version_buckets(version=1, count=4)[1])


def test_assembler_rejects_a_tensor_sent_twice() -> None:
    assembler = BucketAssembler()
    assembler.add(encode_bucket({"w": torch.ones(1)}, version=0, index=0, count=2))
    with pytest.raises(ValueError, match=r"repeats tensors already received: \['w'\]"):
        assembler.add(encode_bucket({"w": torch.ones(1)}, version=0, index=1, count=2))


def test_assembler_tensors_before_any_bucket() -> None:
    with pytest.raises(ValueError, match="none received yet"):
        _ = BucketAssembler().tensors


def test_rejected_bucket_leaves_the_assembler_unchanged() -> None:
    assembler = BucketAssembler()
    assembler.add(_version_buckets(version=2)[0])
    with pytest.raises(ValueError):
        assembler.add(_version_buckets(version=2, count=4)[1])
    for data in _version_buckets(version=2)[1:]:
        assembler.add(data)
    assert assembler.is_complete

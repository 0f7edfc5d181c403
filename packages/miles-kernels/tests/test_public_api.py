"""The package's public surface: the engine/trainer API at `miles_kernels`, test scaffolding only at
`miles_kernels.testing` (docs/architecture.md, "Packages")."""

from __future__ import annotations

import miles_kernels
import miles_kernels.testing


def test_scaffolding_lives_in_testing_only() -> None:
    scaffolding = set(miles_kernels.testing.__all__)
    assert all(getattr(miles_kernels.testing, name) is not None for name in scaffolding)
    assert not scaffolding & set(miles_kernels.__all__), "test scaffolding leaked into the package's API"


def test_weight_sync_formats_are_public() -> None:
    for name in ("encode_bucket", "decode_bucket", "BucketAssembler", "MappedSafetensors", "load_mapped",
                 "init_weight_update_group", "weights_checksum", "KVStore"):  # fmt: skip
        assert getattr(miles_kernels, name).__module__.startswith(("miles_kernels.weight_sync", "miles_kernels.kv"))

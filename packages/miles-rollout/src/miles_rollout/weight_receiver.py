"""The engine's side of weight sync: every way new weights reach a running engine (docs/architecture.md, "Weight
sync"), each applied between engine steps once no request is running, so no request mixes two weight versions.

- `load_from_disk` (`/update_weights_from_disk`): a checkpoint directory; the same-node /dev/shm file is copied
  through a mapping kept between syncs;
- `add_bucket` (`/update_weights_from_tensor`): one bucket of a version (the `miles_kernels` codec); the version is
  applied when its last bucket arrives;
- `init_group`, `receive_broadcast` (`/init_weights_update_group`, `/update_weights_from_distributed`): tensors
  the trainer broadcasts as rank 0 of a `torch.distributed` group of their own, received off the engine thread;
- `load_tensors` (no endpoint: the local cluster): a complete set of tensors from this process.

Each path loads Hugging Face names into the served model and then calls `commit(version)` (the engine's
`commit_weights`: the scheduler serves the new version and flushes its radix cache, since cached K/V came from the old
weights). The receiver holds the model and that callback, not the engine. `checksum` is what the orchestrator
compares with the trainer's after the version-0 sync. The trainer's side is `miles_trainer/weight_sender.py`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from miles_contracts import WeightVersion
from miles_kernels import (
    BucketAssembler,
    CausalLM,
    MappedSafetensors,
    broadcast_tensors,
    checkpoint_tensors,
    decode_bucket,
    destroy_weight_update_group,
    encode_bucket,
    fold_adapters,
    folded_weights,
    hold_packed_weights,
    in_shared_memory,
    init_weight_update_group,
    iter_checkpoint,
    load_mapped,
    load_state,
    parse_dtype,
    plan_buckets,
    read_model_config,
    read_quantization,
    weights_checksum,
)
from miles_rollout.engine_error import EngineError


class WeightReceiver:
    """Receives weights into `model` and hands each new set to `commit(version) -> served version`; `version()` is the
    served version, `check_resident()` raises (a 409) while the weights' memory is released, `device` is where
    broadcast tensors land. An engine's `weights` attribute: the loading methods run on the engine thread (call them
    through `Engine.control(..., needs_idle=True)`); the `torch.distributed` ones are coroutines."""

    def __init__(
        self, model: CausalLM, commit: Callable[[WeightVersion], WeightVersion], *,
        version: Callable[[], WeightVersion], check_resident: Callable[[], None], device: str,
    ) -> None:  # fmt: skip
        self.model = model
        self.commit = commit
        self.version = version
        self.check_resident = check_resident
        self.device = device
        self._assemblers: dict[int, BucketAssembler] = {}
        self._groups: dict[str, Any] = {}
        # The weight file a trainer on this node rewrites in place before every `/update_weights_from_disk` (in
        # /dev/shm): kept mapped, so each update is one copy into the parameters with no page faults. A checkpoint
        # anywhere else is unmapped after loading: a mapping would keep a deleted file's disk space in use.
        self._weights_file = MappedSafetensors()

    # ------------------------------------------------------------------ engine thread

    def load_from_disk(self, model_path: str, version: WeightVersion) -> WeightVersion:
        """Load a Hugging Face checkpoint directory of the served architecture; returns the weight version."""
        path = Path(model_path)
        if not path.is_dir():
            raise EngineError(f"model_path {model_path!r} is not a directory on the server: give a Hugging Face "
                              "checkpoint directory (config.json + safetensors) the server can read")  # fmt: skip
        try:
            new_config = read_model_config(path)
        except (FileNotFoundError, ValueError) as error:
            raise EngineError(f"model_path {model_path!r}: {error}") from error
        if new_config.to_hf() != self.model.config.to_hf():
            raise EngineError(f"{model_path} holds a different architecture than the served model; cannot update")
        self.check_resident()
        if not load_mapped(self.model, self._weights_file, path):
            self._weights_file.close()  # not a file laid out like the model: read it the general way
            try:
                load_state(self.model, dict(iter_checkpoint(path)), read_quantization(path))
            except (FileNotFoundError, ValueError) as error:
                raise EngineError(f"model_path {model_path!r}: {error}") from error
        if not in_shared_memory(path):
            self._weights_file.close()
        return self._commit(version)

    def add_bucket(self, data: bytes) -> dict[str, Any]:
        """Take one weight bucket; apply its version when the last bucket arrives."""
        try:
            bucket = decode_bucket(data)
        except ValueError as error:
            raise EngineError(f"invalid weight bucket: {error}") from error
        if bucket.index == 0:  # a sender (re)starting this version: what an interrupted attempt left is dropped
            self._assemblers.pop(bucket.version, None)
        assembler = self._assemblers.setdefault(bucket.version, BucketAssembler(version=bucket.version))
        try:
            assembler.add(bucket)
        except ValueError as error:
            del self._assemblers[bucket.version]
            raise EngineError(f"weight bucket rejected: {error}") from error
        if not assembler.is_complete:
            return {
                "complete": False,
                "weight_version": self.version(),
                "missing": sorted(assembler.missing),
            }
        del self._assemblers[bucket.version]
        return {"complete": True, "weight_version": self.load_tensors(assembler.tensors, bucket.version)}

    def load_tensors(
        self, tensors: dict[str, torch.Tensor], version: WeightVersion, partial: bool = False
    ) -> WeightVersion:
        """Load a complete set of HF-named tensors (`partial`: any subset, one bucket of a larger update); returns
        the weight version."""
        self.check_resident()
        try:
            load_state(self.model, iter(tensors.items()) if partial else tensors)
        except ValueError as error:
            raise EngineError(f"weight update rejected: {error}") from error
        return self._commit(version)

    def _commit(self, version: WeightVersion) -> WeightVersion:
        """Serve what was just loaded: a LoRA policy's adapters are merged into the base first (the trainer's merge,
        bit for bit; miles_kernels.lora), then the version is committed. The merged weights are new tensors: the
        native CPU linear keeps them packed too, as the engine's other weights (miles_kernels.hold_packed_weights)."""
        if fold_adapters(self.model):
            hold_packed_weights(folded_weights(self.model))
        return self.commit(version)

    def bucket(self, index: int, bucket_bytes: int) -> tuple[bytes, int]:
        """Bucket `index` of the served weights (HF names, every tensor once, as weight sync sends them) under the
        served version, and how many buckets there are: what a restarted engine copies from a healthy one
        (`GET /weight_buckets`). The plan depends only on the model's tensors and `bucket_bytes`, so the buckets of
        one version fit together whichever call encodes them."""
        self.check_resident()
        version = self.version()
        if version is None:
            raise EngineError("the served weights have no version yet (no weight update so far): nothing to copy", 409)
        if isinstance(version, str):  # the bucket format carries the orchestrator's integer steps
            raise EngineError(f"the served weights are labelled {version!r}, not a policy step: nothing to copy", 409)
        tensors = checkpoint_tensors(self.model, mtp_copies=False)
        try:
            plan = plan_buckets([(name, t.numel() * t.element_size()) for name, t in tensors.items()], bucket_bytes)
        except ValueError as error:
            raise EngineError(str(error)) from error
        if not 0 <= index < len(plan):
            raise EngineError(f"bucket index {index} out of range: the weights make {len(plan)} bucket(s)")
        data = encode_bucket({name: tensors[name] for name in plan[index]}, version=version, index=index,
                             count=len(plan))  # fmt: skip
        return data, len(plan)

    def checksum(self) -> str:
        """`miles_kernels.weights_checksum` of the served weights (HF names, the engine's dtype; every tensor once,
        as weight sync sends them: an MTP module's copies of the trunk's tensors are not counted twice)."""
        self.check_resident()
        return weights_checksum(checkpoint_tensors(self.model, mtp_copies=False).items())

    # ------------------------------------------------------------------ torch.distributed (asyncio side)

    async def init_group(
        self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str
    ) -> None:
        """Join the trainer's weight-update group `group_name` as `rank` (blocks a worker thread until all joined)."""
        if group_name in self._groups:
            raise EngineError(f"weight update group {group_name!r} already exists on this server")
        try:
            self._groups[group_name] = await asyncio.to_thread(
                init_weight_update_group, master_address, master_port, rank, world_size, group_name, backend
            )
        except (ValueError, RuntimeError) as error:
            raise EngineError(f"could not join weight update group {group_name!r}: {error}") from error

    async def destroy_group(self, group_name: str) -> None:
        """Leave the weight-update group `group_name` (SGLang's `/destroy_weights_update_group`)."""
        group = self._groups.pop(group_name, None)
        if group is None:
            raise EngineError(f"no weight update group {group_name!r} on this server")
        await asyncio.to_thread(destroy_weight_update_group, group)

    async def receive_broadcast(
        self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]
    ) -> dict[str, torch.Tensor]:
        """Receive one broadcast of `names` into fresh buffers, off the engine thread; the engine then loads them
        between steps (`Engine.update_weights_from_distributed`)."""
        group = self._groups.get(group_name)
        if group is None:
            raise EngineError(f"no weight update group {group_name!r}; call /init_weights_update_group first")
        try:
            buffers = [
                torch.empty(shape, dtype=parse_dtype(dtype), device=self.device)
                for dtype, shape in zip(dtypes, shapes, strict=True)
            ]
        except ValueError as error:
            raise EngineError(str(error)) from error
        await asyncio.to_thread(broadcast_tensors, group, buffers, 0)
        return dict(zip(names, buffers, strict=True))

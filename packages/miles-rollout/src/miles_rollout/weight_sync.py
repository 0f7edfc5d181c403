"""Receiving weights over `torch.distributed` (SGLang's `/init_weights_update_group` and
`/update_weights_from_distributed`): the trainer is rank 0 of a dedicated group and broadcasts tensors by HF
name; the engine receives them into fresh buffers off the engine thread, then applies the complete set between
engine steps (no request mixes two versions)."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from miles_kernels import broadcast_tensors, init_weight_update_group, parse_dtype
from miles_rollout.engine import Engine
from miles_rollout.engine_error import EngineError


class DistributedReceiver:
    """The engine's side of weight-update groups, by group name."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.groups: dict[str, Any] = {}

    async def init_group(
        self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str
    ) -> None:
        if group_name in self.groups:
            raise EngineError(f"weight update group {group_name!r} already exists on this server")
        try:
            self.groups[group_name] = await asyncio.to_thread(
                init_weight_update_group, master_address, master_port, rank, world_size, group_name, backend
            )
        except (ValueError, RuntimeError) as error:
            raise EngineError(f"could not join weight update group {group_name!r}: {error}") from error

    async def receive(
        self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int | None
    ) -> int:
        group = self.groups.get(group_name)
        if group is None:
            raise EngineError(f"no weight update group {group_name!r}; call /init_weights_update_group first")
        try:
            buffers = [
                torch.empty(shape, dtype=parse_dtype(dtype), device=self.engine.config.device)
                for dtype, shape in zip(dtypes, shapes, strict=True)
            ]
        except ValueError as error:
            raise EngineError(str(error)) from error
        await asyncio.to_thread(broadcast_tensors, group, buffers, 0)
        tensors = dict(zip(names, buffers, strict=True))
        version_applied: int = await self.engine.control(
            lambda: self.engine.apply_named_tensors(tensors, version), needs_idle=True
        )
        return version_applied

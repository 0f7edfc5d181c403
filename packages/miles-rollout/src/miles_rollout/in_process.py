"""`InProcessClient`: `miles_rollout.Client`'s interface over an `Engine` in the same process.

The orchestrator and tests use it when the engine runs inside the caller (no HTTP hop); the rollout function
cannot tell the difference. Engine errors surface as `RolloutClientError` with the HTTP status the server
would have answered, as over HTTP.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from miles_contracts import GenerateRequest, GenerateResponse, SamplingParams, WeightVersion
from miles_rollout.client import RolloutClientError
from miles_rollout.engine import Engine
from miles_rollout.engine_error import EngineError
from miles_rollout.profiling import ProfileRequest

T = TypeVar("T")


class InProcessClient:
    """Drives an in-process `Engine` with the same async methods as the HTTP `Client`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def __aenter__(self) -> InProcessClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Nothing to close: the engine's owner shuts it down."""

    async def _call(self, endpoint: str, fn: Callable[[], Awaitable[T]]) -> T:
        try:
            return await fn()
        except EngineError as error:
            raise RolloutClientError(error.message, endpoint=endpoint, status_code=error.status_code) from error

    async def generate(self, request: GenerateRequest) -> list[GenerateResponse]:
        return await self._call("/generate", lambda: self.engine.generate(request))

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> dict[str, Any]:
        await self.engine.abort(None if abort_all else rid)
        return {"success": True, "message": "abort requested"}

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> dict[str, Any]:
        version = await self._call(
            "/update_weights_from_disk",
            lambda: self.engine.control(
                lambda: self.engine.weights.load_from_disk(model_path, weight_version), needs_idle=True
            ),
        )
        return {"success": True, "message": f"loaded {model_path}", "weight_version": version}

    async def update_weights_from_tensor(self, bucket: bytes) -> dict[str, Any]:
        result = await self._call(
            "/update_weights_from_tensor",
            lambda: self.engine.control(lambda: self.engine.weights.add_bucket(bucket), needs_idle=True),
        )
        return {"success": True, "message": "bucket received", **result}

    async def update_weights_from_buckets(self, buckets: Iterable[bytes]) -> dict[str, Any]:
        last: dict[str, Any] | None = None
        for bucket in buckets:
            last = await self.update_weights_from_tensor(bucket)
        if last is None:
            raise ValueError("update_weights_from_buckets got no buckets")
        return last

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str = "weight_update_group", backend: str = "gloo",
    ) -> dict[str, Any]:  # fmt: skip
        await self._call(
            "/init_weights_update_group",
            lambda: self.engine.weights.init_group(
                master_address, master_port, rank_offset, world_size, group_name, backend
            ),
        )
        return {"success": True, "message": f"joined group {group_name!r}"}

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]],
        group_name: str = "weight_update_group", weight_version: int | None = None, flush_cache: bool = True,
    ) -> dict[str, Any]:  # fmt: skip
        version = await self._call(
            "/update_weights_from_distributed",
            lambda: self.engine.update_weights_from_distributed(group_name, names, dtypes, shapes, weight_version),
        )
        return {"success": True, "message": f"received {len(names)} tensors", "weight_version": version}

    async def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        released = await self._call(
            "/release_memory_occupation",
            lambda: self.engine.control(lambda: self.engine.release_memory(tags), needs_idle=True),
        )
        return {"success": True, "message": "released", "released": released}

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        released = await self._call(
            "/resume_memory_occupation",
            lambda: self.engine.control(lambda: self.engine.resume_memory(tags), needs_idle=True),
        )
        return {"success": True, "message": "resumed", "released": released}

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        def pause() -> int:
            return self.engine.pause_generation(mode)

        count = await self._call("/pause_generation", lambda: self.engine.control(pause, needs_idle=False))
        return {"status": "ok", "mode": mode, "num_paused_requests": count}

    async def continue_generation(self) -> dict[str, Any]:
        await self.engine.control(self.engine.continue_generation, needs_idle=False)
        return {"status": "ok"}

    async def start_profile(self, output_dir: str, profile_id: str | None = None) -> dict[str, Any]:
        """/start_profile: the engine thread's ops recorded until `stop_profile` (miles_rollout/profiling.py)."""
        request = ProfileRequest(output_dir=output_dir, profile_id=profile_id)
        start = functools.partial(self.engine.profiler.start_request, request)
        path = await self._call("/start_profile", lambda: self.engine.control(start, needs_idle=False))
        return {"message": "Start profiling.", "trace": str(path)}

    async def stop_profile(self) -> dict[str, Any]:
        """/stop_profile: the trace written."""
        stop = self.engine.profiler.stop
        path = await self._call("/stop_profile", lambda: self.engine.control(stop, needs_idle=False))
        return {"message": "Stop profiling.", "trace": str(path)}

    async def flush_cache(self) -> dict[str, Any]:
        await self.engine.control(self.engine.flush_cache, needs_idle=False)
        return {"success": True, "message": "cache flushed"}

    async def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, Any]:
        loaded = await self._call(
            "/load_lora_adapter", lambda: self.engine.load_lora_adapter(lora_name, lora_path, pinned)
        )
        return {"success": True, "error_message": "", "loaded_adapters": loaded}

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        loaded = await self._call("/unload_lora_adapter", lambda: self.engine.unload_lora_adapter(lora_name))
        return {"success": True, "error_message": "", "loaded_adapters": loaded}

    async def get_model_info(self) -> dict[str, Any]:
        return self.engine.model_info()

    async def get_server_info(self) -> dict[str, Any]:
        return self.engine.server_info()

    async def weights_checksum(self) -> str:
        result: str = await self._call(
            "/weights_checksum", lambda: self.engine.control(self.engine.weights.checksum, needs_idle=False)
        )
        return result

    async def get_weight_version(self) -> WeightVersion:
        return self.engine.weight_version

    async def health(self) -> bool:
        return self.engine.is_alive()

    async def health_generate(self) -> bool:
        probe = GenerateRequest(input_ids=[0], sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
        try:
            await self.engine.generate(probe)
        except EngineError:
            return False
        return True

    async def wait_until_healthy(self, timeout: float = 60.0, interval: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while not await self.health():
            if time.monotonic() > deadline:
                raise RolloutClientError(f"engine not healthy after {timeout}s", endpoint="/health")
            await asyncio.sleep(interval)

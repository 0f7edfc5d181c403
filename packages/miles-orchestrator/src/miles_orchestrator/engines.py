"""The loop's one client of several rollout engines: `EngineFleet` (docs/architecture.md, "Cluster").

Generation goes through sglang-router (`Router`, cache-aware by default), which spreads requests over the engines
as it does in front of SGLang servers; every other call the loop makes (memory release and resume, pause and
continue, weight updates, checksums, server info) goes to each engine, and the fleet checks that they agree. With
one engine there is no router: the fleet is that engine's client, so a one-engine run is unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from miles_contracts import GenerateRequest, GenerateResponse
from miles_rollout import Client, free_port, router_command

ROUTER_STARTUP_S = 60.0


class Router:
    """sglang-router in front of `worker_urls`, a subprocess of the driver listening on 127.0.0.1 (its log in
    `log_path`); `url` is where generation goes."""

    def __init__(self, worker_urls: list[str], policy: str, log_path: Path) -> None:
        try:
            import sglang_router  # noqa: F401  (run as a subprocess below)
        except ImportError as error:
            raise RuntimeError(
                "rollout.num_engines > 1 puts sglang-router in front of the engines: pip install sglang-router"
            ) from error
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                router_command(worker_urls, "127.0.0.1", port, policy), stdout=log, stderr=subprocess.STDOUT
            )

    async def wait_until_healthy(self) -> None:
        deadline = time.monotonic() + ROUTER_STARTUP_S
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"sglang-router exited during start-up:\n{self.log_path.read_text()[-2000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{self.url}/health")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"sglang-router not healthy after {ROUTER_STARTUP_S:.0f} s (log: {self.log_path})"
                    )
                await asyncio.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()


class EngineFleet:
    """Every engine's admin client (`members`, in engine order) and the client generation goes through: the
    router's, or the only engine's."""

    def __init__(self, members: list[Client], generator: Client) -> None:
        if not members:
            raise ValueError("an engine fleet needs at least one engine")
        self.members, self.generator = members, generator

    def __len__(self) -> int:
        return len(self.members)

    async def _each(self, method: str, *args: Any) -> list[Any]:
        return list(await asyncio.gather(*(getattr(member, method)(*args) for member in self.members)))

    async def generate(self, request: GenerateRequest) -> list[GenerateResponse]:
        return await self.generator.generate(request)

    async def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        result: dict[str, Any] = (await self._each("release_memory_occupation", tags))[0]
        return result

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        result: dict[str, Any] = (await self._each("resume_memory_occupation", tags))[0]
        return result

    async def pause_generation(self, mode: str) -> int:
        """Pause every engine in `mode`; the number of requests paused (aborted for abort) over all of them."""
        return sum(int(reply.get("num_paused_requests", 0)) for reply in await self._each("pause_generation", mode))

    async def continue_generation(self) -> None:
        await self._each("continue_generation")

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> dict[str, Any]:
        replies = await self._each("update_weights_from_disk", model_path, weight_version)
        return dict(replies[0])

    async def get_server_info(self) -> dict[str, Any]:
        """The first engine's server info, its `memory_bytes` summed over every engine (the room they take back
        together); a RuntimeError if the engines run different kernels."""
        infos = await self._each("get_server_info")
        fingerprints = [info.get("kernel_config", {}).get("fingerprint") for info in infos]
        if len(set(fingerprints)) > 1:
            raise RuntimeError(f"the rollout engines run different kernel configs (fingerprints {fingerprints})")
        merged: dict[str, Any] = dict(infos[0])
        tags = {tag for info in infos for tag in info.get("memory_bytes", {})}
        merged["memory_bytes"] = {tag: sum(info.get("memory_bytes", {}).get(tag, 0) for info in infos) for tag in tags}
        return merged

    async def weights_checksum(self) -> str:
        """The engines' weight checksum; a RuntimeError naming the engines that hold other weights."""
        checksums = await self._each("weights_checksum")
        differing = [i for i, checksum in enumerate(checksums) if checksum != checksums[0]]
        if differing:
            raise RuntimeError(
                f"weight sync check failed: engines {differing} hold {[checksums[i][:16] for i in differing]}, engine "
                f"0 holds {checksums[0][:16]}"
            )
        return str(checksums[0])

    async def get_weight_versions(self) -> list[int | None]:
        return await self._each("get_weight_version")

    async def aclose(self) -> None:
        for client in {id(c): c for c in [*self.members, self.generator]}.values():
            with contextlib.suppress(Exception):
                await client.aclose()

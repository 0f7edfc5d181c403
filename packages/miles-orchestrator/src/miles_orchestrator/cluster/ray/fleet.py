"""The loop's one client of several rollout engines: `EngineFleet` (docs/architecture.md, "Cluster").

Generation goes through sglang-router (`Router`, cache-aware by default), which spreads requests over the engines
as it does in front of SGLang servers; every other call the loop makes (memory release and resume, pause and
continue, weight updates, checksums, server info) goes to each engine, and the fleet checks that they agree. With
one engine there is no router: the fleet is that engine's client, so a one-engine run is unchanged.

With an `EngineSupervisor` (engine_health.py; run.cluster=ray), a call that fails for an engine's sake (no
connection, HTTP 5xx) checks every engine, waits for the failed ones' restarts, and is re-issued unchanged (a
/generate with the same seeds) up to `retries` times; a restarted engine replaces its member (`replace`).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from miles_contracts import GenerateRequest, GenerateResponse, WeightVersion
from miles_orchestrator.cluster.ray.engine_health import EngineSupervisor, is_engine_failure
from miles_rollout import Client, RolloutClientError, free_port, router_command

ROUTER_STARTUP_S = 60.0
ROUTER_WORKER_S = 60.0  # how long a worker added to (removed from) the router may take to be listed healthy (gone)


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

    async def add_worker(self, url: str) -> None:
        """Register `url` (POST /workers) and wait until the router lists it healthy."""
        async with httpx.AsyncClient(timeout=10.0) as http:
            response = await http.post(f"{self.url}/workers", json={"url": url})
            if response.is_error:
                raise RuntimeError(f"sglang-router refused worker {url}: HTTP {response.status_code} {response.text}")
            await self._wait_for(http, lambda workers: workers.get(url, False), f"add {url}")

    async def remove_worker(self, url: str) -> None:
        """Unregister `url` (DELETE /workers/{id}) and wait until the router no longer lists it; nothing if it is not
        listed."""
        async with httpx.AsyncClient(timeout=10.0) as http:
            listed = (await http.get(f"{self.url}/workers")).json().get("workers", [])
            for worker in listed:
                if worker.get("url") == url:
                    (await http.delete(f"{self.url}/workers/{worker['id']}")).raise_for_status()
            await self._wait_for(http, lambda workers: url not in workers, f"remove {url}")

    async def _wait_for(self, http: httpx.AsyncClient, done: Callable[[dict[str, bool]], bool], what: str) -> None:
        deadline = time.monotonic() + ROUTER_WORKER_S
        while True:
            listed = (await http.get(f"{self.url}/workers")).json().get("workers", [])
            if done({worker.get("url"): bool(worker.get("is_healthy")) for worker in listed}):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"sglang-router did not {what} within {ROUTER_WORKER_S:.0f} s (log: {self.log_path})"
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

    def __init__(
        self, members: list[Client], generator: Client, supervisor: EngineSupervisor | None = None, retries: int = 0
    ) -> None:
        if not members:
            raise ValueError("an engine fleet needs at least one engine")
        self.members, self.generator = members, generator
        self.supervisor, self.retries = supervisor, retries
        self.released = False  # every engine's memory is released (a restarted engine is brought to this state)
        self.paused: str | None = None  # the mode generation is paused in, if it is
        self.loading = False  # weights are loading (`loading_weights`): the engines' schedulers are busy
        self.reissued = 0  # calls re-issued after an engine failure, since the last `take_reissued`

    def __len__(self) -> int:
        return len(self.members)

    def take_reissued(self) -> int:
        """Calls re-issued since the last call."""
        count, self.reissued = self.reissued, 0
        return count

    def replace(self, engine: int, client: Client) -> None:
        """A restarted engine's client takes its place (and generation's, when there is no router)."""
        if self.generator is self.members[engine]:
            self.generator = client
        self.members[engine] = client

    async def _each(self, method: str, *args: Any) -> list[Any]:
        return list(await asyncio.gather(*(self._call(i, method, *args) for i in range(len(self.members)))))

    async def _call(self, engine: int | None, method: str, *args: Any) -> Any:
        """`method` on engine `engine` (None: the generator), re-issued after the engines recover from a failure."""
        attempt = 0
        while True:
            if self.supervisor is not None:
                self.supervisor.raise_if_failed()
            client = self.generator if engine is None else self.members[engine]
            try:
                return await getattr(client, method)(*args)
            except RolloutClientError as error:
                if self.supervisor is None or attempt >= self.retries or not is_engine_failure(error):
                    raise
                attempt += 1
                await self.supervisor.check_now()
                self.reissued += 1

    async def start_profile(self, output_dir: str) -> None:
        """Each engine records a torch.profiler trace (`/start_profile`) into `output_dir`, as engine{i}."""
        await asyncio.gather(*(self._call(i, "start_profile", output_dir, f"engine{i}")
                               for i in range(len(self.members))))  # fmt: skip

    async def stop_profile(self) -> None:
        await self._each("stop_profile")

    async def generate(self, request: GenerateRequest) -> list[GenerateResponse]:
        responses: list[GenerateResponse] = await self._call(None, "generate", request)
        return responses

    async def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        self._update_serving(switching=True)
        result: dict[str, Any] = (await self._each("release_memory_occupation", tags))[0]
        self.released = True
        self._update_serving()
        return result

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        result: dict[str, Any] = (await self._each("resume_memory_occupation", tags))[0]
        self.released = False
        self._update_serving()
        return result

    async def pause_generation(self, mode: str) -> int:
        """Pause every engine in `mode`; the number of requests paused (aborted for abort) over all of them."""
        self._update_serving(switching=True)
        replies = await self._each("pause_generation", mode)
        self.paused = mode
        self._update_serving()
        return sum(int(reply.get("num_paused_requests", 0)) for reply in replies)

    async def continue_generation(self) -> None:
        await self._each("continue_generation")
        self.paused = None
        self._update_serving()

    @contextlib.contextmanager
    def loading_weights(self) -> Iterator[None]:
        """Around a weight sync: the engines' schedulers are busy loading, so the health checks ask `/health` only."""
        self.loading = True
        self._update_serving()
        try:
            yield
        finally:
            self.loading = False
            self._update_serving()

    def _update_serving(self, switching: bool = False) -> None:
        """The supervisor probes with a generation only while the engines serve: not released, not paused, no
        weights loading, and no release or pause under way (`switching`)."""
        if self.supervisor is not None:
            self.supervisor.serving = not (switching or self.released or self.paused is not None or self.loading)

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

    async def get_weight_versions(self) -> list[WeightVersion]:
        return await self._each("get_weight_version")

    async def get_weight_version(self) -> WeightVersion:
        """The weight version every engine serves; a RuntimeError naming the engines that serve another."""
        versions = await self.get_weight_versions()
        differing = [i for i, version in enumerate(versions) if version != versions[0]]
        if differing:
            raise RuntimeError(f"engines {differing} serve weight versions {[versions[i] for i in differing]}, "
                               f"engine 0 serves {versions[0]}")  # fmt: skip
        return versions[0]

    async def aclose(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.stop()
        for client in {id(c): c for c in [*self.members, self.generator]}.values():
            with contextlib.suppress(Exception):
                await client.aclose()

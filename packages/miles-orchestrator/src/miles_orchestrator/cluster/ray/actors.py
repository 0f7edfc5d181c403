"""The Ray actors of `RayCluster`: the rollout engine (an embedded `miles-rollout` server) and the trainer ranks.

Each actor holds one process's share of the job; the driver (`loop.py`) talks to the engine over HTTP with
`miles_rollout.Client`, exactly as it would talk to a standalone `miles-rollout serve` or an SGLang server, and to
the trainer ranks through Ray calls that every rank receives together (their work is collective). Samples cross
to the trainer as JSON dicts (`Sample.model_dump(mode="json")`); weights go from trainer rank 0 to the engine as a
safetensors file in a shared-memory directory that the driver then tells the engine to load, when both are on one
node (`run.sync_transport`), else as DESIGN.md buckets that rank 0 posts with its own `miles_rollout.Client`;
never pickled by Miles.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import socket
import threading
from pathlib import Path
from typing import Any

import torch

from miles_contracts import Sample
from miles_kernels import KernelConfig, WeightUpdateGroup, rendezvous_store
from miles_orchestrator.cluster.protocol import CriticTargets
from miles_orchestrator.cluster.settings import TrainerSettings
from miles_orchestrator.cluster.trainer_rank import TrainerRank
from miles_orchestrator.cluster.weight_transport import broadcast_buckets, post_buckets, write_shared_file
from miles_rollout import Client, EngineConfig


def ray_node_id() -> str:
    """The Ray node this actor runs on."""
    import ray  # inside a Ray worker: ray is imported already

    return str(ray.get_runtime_context().get_node_id())


def set_threads(num_threads: int) -> None:
    torch.set_num_threads(max(1, num_threads))
    os.environ["OMP_NUM_THREADS"] = str(max(1, num_threads))


def pin_cpus(cpus: list[int] | None) -> None:
    """Run this process on `cpus` only (`run.pin_cpus`), where the OS allows it."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


def node_address(host: str) -> str:
    """The address other processes reach a server bound to `host` at: loopback as is, else this node's IP."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return host
    if host not in ("0.0.0.0", "::"):
        return host
    import ray

    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


def _loopback_interface() -> str | None:
    """The loopback network interface's name (Linux: lo, macOS: lo0), where there is one."""
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


class RolloutEngineActor:
    """An embedded engine served over HTTP on `host` inside this actor (uvicorn in a thread); every route but
    health needs the run's key."""

    def __init__(
        self, model_dir: str, kernel: KernelConfig, engine: EngineConfig, admin_key: str, num_threads: int,
        host: str = "127.0.0.1", cpus: list[int] | None = None,
    ) -> None:  # fmt: skip
        import uvicorn

        from miles_rollout import KEEP_ALIVE_S, Engine, create_app, free_port

        pin_cpus(cpus)
        set_threads(num_threads)
        self.engine = Engine(model_dir, kernel, engine)
        port = free_port()
        app = create_app(self.engine, api_key=admin_key, admin_key=admin_key, host=host)  # the run's key, for all
        self.server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)
        )
        threading.Thread(target=self.server.run, daemon=True, name="miles-rollout-http").start()
        self.url = f"http://{node_address(host)}:{port}"
        asyncio.run(_wait_until_healthy(self.url))

    def get_url(self) -> str:
        return self.url

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return ray_node_id()

    def shutdown(self) -> None:
        self.server.should_exit = True
        self.engine.shutdown()


async def _wait_until_healthy(url: str) -> None:
    async with Client(url) as client:
        await client.wait_until_healthy(timeout=60, interval=0.1)


class TrainerRankActor:
    """One FSDP2 rank. `setup` must be called on every rank at once (it joins the gloo/NCCL group)."""

    def __init__(self, rank: int, world_size: int, num_threads: int, cpus: list[int] | None = None) -> None:
        pin_cpus(cpus)
        set_threads(num_threads)
        self.rank, self.world_size = rank, world_size
        self.trainer: TrainerRank | None = None
        # Rank 0's clients of the engines for bucket and broadcast syncs, kept across syncs on one event loop of
        # this actor's thread (a new connection per sync costs ~30 ms).
        self._loop = asyncio.new_event_loop()
        self._clients: list[Client] = []
        self._group: WeightUpdateGroup | None = None  # rank 0: the weight-update group it hosts (distributed)

    def node_id(self) -> str:
        return ray_node_id()

    def pid(self) -> int:
        return os.getpid()

    def ping(self) -> bool:
        """The heartbeat (rank_health.py): called in its own concurrency group, it answers while the rank works."""
        return True

    def address(self, loopback: bool) -> tuple[str, int]:
        """Where the ranks meet (MASTER_ADDR, MASTER_PORT), on rank 0: its loopback (`loopback`: every rank is on
        its node and run.bind_host is loopback), else its node's IP; a free port."""
        return ("127.0.0.1" if loopback else node_address("0.0.0.0")), self.free_port()

    def free_port(self) -> int:
        from miles_rollout import free_port

        return free_port()

    def setup(self, master: tuple[str, int], model_dir: str, settings: TrainerSettings) -> str:
        import torch.distributed as dist

        host, port = master
        os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size))  # fmt: skip
        if ipaddress.ip_address(host).is_loopback and (interface := _loopback_interface()):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)  # gloo's pairs listen there too, not on the LAN
        # A short timeout: a rank lost to an OOM or a crash ends its peers' collectives in seconds, not 30 minutes
        timeout = datetime.timedelta(seconds=settings.memory.collective_timeout_s)
        # rank 0's store listens on MASTER_ADDR only (torch's own, made from the environment, on every interface)
        store = rendezvous_store(host, port, self.world_size, is_host=self.rank == 0, timeout=timeout)
        on_cuda = settings.backend.device.startswith("cuda")  # CUDA tensors need NCCL; host ones stay on gloo
        dist.init_process_group("cpu:gloo,cuda:nccl" if on_cuda else "gloo", store=store, rank=self.rank,
                                world_size=self.world_size, timeout=timeout)  # fmt: skip
        self.trainer = TrainerRank(model_dir, settings)
        return self.trainer.fingerprint()

    def data_parallel(self) -> tuple[int, int]:
        return self._trainer.data_parallel()

    @property
    def _trainer(self) -> TrainerRank:
        assert self.trainer is not None, "setup() first"
        return self.trainer

    def train(
        self, samples: list[dict[str, Any]], advantages: list[list[float]], old_logprobs: Any, measure_mismatch: bool,
        critic: CriticTargets | None = None,
    ) -> dict[str, float]:  # fmt: skip
        batch = [Sample.model_validate(s) for s in samples]
        return self._trainer.train(batch, advantages, old_logprobs, measure_mismatch, critic)

    def compute_logprobs(self, samples: list[dict[str, Any]]) -> list[list[float]]:
        return self._trainer.compute_logprobs([Sample.model_validate(s) for s in samples])

    def compute_values(self, samples: list[dict[str, Any]]) -> list[list[float]]:
        return self._trainer.compute_values([Sample.model_validate(s) for s in samples])

    def write_weights(self, directory: str) -> int:
        """`weight_transport.write_shared_file` on this rank (rank 0 writes)."""
        return write_shared_file(self._trainer, Path(directory), is_writer=self.rank == 0)

    def connect_engines(self, urls: list[str], admin_key: str) -> None:
        """Rank 0 keeps a client of every engine (http and distributed syncs); other ranks only join the gathers."""
        if self.rank == 0:
            self._clients = [Client(url, api_key=admin_key, admin_key=admin_key, timeout=600) for url in urls]

    def host_weight_group(self, address: str, port: int, world_size: int, group_name: str, backend: str) -> None:
        """Rank 0: host the weight-update group at address:port as its rank 0 (blocks until every engine joined)."""
        from miles_kernels import init_weight_update_group

        self._group = init_weight_update_group(address, port, 0, world_size, group_name, backend)

    def leave_weight_group(self) -> None:
        """Rank 0: leave the weight-update group it hosts (an engine of it was restarted; a new group follows)."""
        from miles_kernels import destroy_weight_update_group

        if self._group is not None:
            destroy_weight_update_group(self._group)
            self._group = None

    def reachable_address(self, host: str) -> str:
        """The address the engines reach this rank at: loopback when they bind loopback, else this node's IP."""
        return node_address("0.0.0.0" if host != "127.0.0.1" else host)

    def send_weight_buckets(self, version: int, bucket_bytes: int) -> dict[str, Any]:
        """`weight_transport.post_buckets` on this rank (rank 0 posts to every engine)."""
        return post_buckets(self._trainer, self._clients, self._loop, version, bucket_bytes)

    def broadcast_weights(self, version: int, bucket_bytes: int, sglang: bool) -> dict[str, Any]:
        """`weight_transport.broadcast_buckets` on this rank (rank 0 broadcasts to every engine)."""
        return broadcast_buckets(self._trainer, self._group, self._clients, self._loop, version, bucket_bytes, sglang)

    def weights_checksum(self) -> str:
        return self._trainer.weights_checksum()

    def offload(self, room_for: int | None = None) -> int:
        return self._trainer.offload(room_for)

    def onload(self) -> int:
        return self._trainer.onload()

    def save(self, directory: str, extra: dict[str, Any]) -> None:
        self._trainer.save(directory, extra)

    def load(self, directory: str) -> dict[str, Any]:
        return self._trainer.load(directory)

    def export(self, directory: str, tokenizer_dir: str) -> None:
        self._trainer.export(directory, tokenizer_dir)

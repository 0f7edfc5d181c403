"""The Ray actors of `RayCluster`: the rollout engine (an embedded `miles-rollout` server) and the trainer ranks.

Each actor holds one process's share of the job; the driver (`loop.py`) talks to the engine over HTTP with
`miles_rollout.Client`, exactly as it would talk to a standalone `miles-rollout serve` or an SGLang server, and to
the trainer ranks through Ray calls that every rank receives together (their work is collective). Samples cross
to the trainer as JSON dicts (`Sample.model_dump(mode="json")`); weights go from trainer rank 0 to the engines by the
run's transport (cluster/transport/, `run.sync_transport`), whose part in each rank `weight_sync` calls: a file the
engines load, buckets rank 0 posts with its own `miles_rollout.Client`s, or a broadcast; never pickled by Miles.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import socket
import threading
from typing import Any

import torch

from miles_contracts import Sample
from miles_kernels import KernelConfig, rendezvous_store
from miles_orchestrator.cluster.protocol import CriticTargets
from miles_orchestrator.cluster.settings import TrainerSettings
from miles_orchestrator.cluster.trainer_rank import TrainerRank
from miles_orchestrator.cluster.transport import RankSide, rank_side
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
        self._weight_sync: RankSide | None = None  # this rank's part in the run's weight transport

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

    def open_weight_sync(self, transport: str) -> None:
        """This rank's part in the run's weight transport (`run.sync_transport`, resolved; cluster/transport/), which
        `weight_sync` calls from then on."""
        trainer = self._trainer
        self._weight_sync = rank_side(transport)(trainer.backend.weights, trainer.model_dir, self.rank)

    def weight_sync(self, call: str, *args: Any) -> Any:
        """`call` on this rank's part in the weight transport: one of the calls its class declares (`CALLS`)."""
        side = self._weight_sync
        assert side is not None, "open_weight_sync() first"
        if call not in side.CALLS:
            raise ValueError(
                f"{type(side).__name__} takes no weight-sync call {call!r}: it takes {', '.join(side.CALLS)}"
            )
        return getattr(side, call)(*args)

    def reachable_address(self, host: str) -> str:
        """The address the engines reach this rank at: loopback when they bind loopback, else this node's IP."""
        return node_address("0.0.0.0" if host != "127.0.0.1" else host)

    def weights_checksum(self) -> str:
        return self._trainer.weights_checksum()

    def weights_digests(self) -> dict[str, str]:
        return self._trainer.weights_digests()

    def start_profile(self, directory: str) -> None:
        self._trainer.start_profile(directory)

    def stop_profile(self) -> str:
        return self._trainer.stop_profile()

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

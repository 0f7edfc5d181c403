"""`RayCluster` (`run.cluster=ray`): the engine actors and the trainer rank actors, on a local Ray (started for the
run) or an existing cluster (`run.ray_address`). Colocated, all in one placement group; disaggregated
(`run.colocate=false`), the ranks in one and the engines in another, each bundle with the resources the config
gives (`trainer.rank_resources`, `rollout.engine_resources`). The loop's one client of the engines is an
`EngineFleet` (fleet.py): generation through sglang-router when there are several, admin calls to each engine over
HTTP, exactly as it would talk to `miles-rollout serve` or SGLang servers. See cluster/protocol.py for the interface.

Weight sync is the run's one `WeightTransport` (cluster/transport/, `run.sync_transport` resolved from where the
engines landed): the cluster prepares it, sends through it, retrying a sync an engine failure interrupted, and
never asks which one it is.

Engine failures (`rollout.fault_tolerance`, docs/fault-tolerance.md): an `EngineSupervisor` (engine_health.py)
watches the engines; `restart_engine` replaces a dead or hung one on its bundle, has the transport load it with the
last synced weights (`after_restart`: from the weight file, or copied from a healthy engine, the next sync
reconnecting to it), checks them against a healthy engine, brings it to the fleet's state (memory released,
generation paused) and re-adds it to the router. Trainer ranks that die or hang stop the run naming them
(rank_health.py). `RUN_DIR/actors.json` lists each engine's URL, process id and node, and each trainer rank's process
id and node.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import math
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group

from miles_contracts import Sample
from miles_orchestrator.cluster.protocol import CriticTargets
from miles_orchestrator.cluster.ray.actors import RolloutEngineActor, TrainerRankActor
from miles_orchestrator.cluster.ray.engine_health import EngineSupervisor
from miles_orchestrator.cluster.ray.fleet import EngineFleet, Router
from miles_orchestrator.cluster.ray.placement import actor_class, cpu_sets, place, start_ray, where
from miles_orchestrator.cluster.ray.rank_health import HEALTH_GROUP, collective
from miles_orchestrator.cluster.ray.sglang import SGLangEngineActor
from miles_orchestrator.cluster.settings import num_threads, trainer_settings
from miles_orchestrator.cluster.transport import SyncContext, WeightTransport, make_transport
from miles_orchestrator.config import RunConfig
from miles_rollout import Client, RolloutClientError

ENGINE_START_S = 300.0  # a restarted engine's actor must be placed and serving within this
SYNC_ATTEMPTS = 3  # a weight sync interrupted by engine failures is sent this many times at most


class RayCluster:
    """The engine actors, the trainer rank actors, their placement groups and, for several engines, the router."""

    def __init__(self) -> None:
        self.engine: EngineFleet
        self.trainer_fingerprint = ""
        self.data_parallel: list[tuple[int, int]] = []  # each rank's (data-parallel rank, size)
        self.transport: WeightTransport | None = None
        self.groups: list[Any] = []
        self.engine_actors: list[Any] = []
        self.trainers: list[Any] = []
        self.router: Router | None = None
        self.supervisor: EngineSupervisor | None = None
        self.last_version: int | None = None  # the weights the engines hold
        self.log: Callable[[str], None] = print

    @property
    def sync_method(self) -> str:
        """How weights reach the engines, for the log: the transport's description."""
        return self._transport.description

    @property
    def _transport(self) -> WeightTransport:
        assert self.transport is not None, "start() first"
        return self.transport

    @classmethod
    async def start(
        cls, cfg: RunConfig, model_dir: str, run_dir: Path, log: Callable[[str], None] = print
    ) -> RayCluster:
        self = cls()
        self.log = log
        try:
            await self._start(cfg, model_dir, run_dir)
        except BaseException:
            await self.shutdown()
            raise
        return self

    async def _start(self, cfg: RunConfig, model_dir: str, run_dir: Path) -> None:
        num_ranks, num_engines, threads = cfg.trainer.num_ranks, cfg.rollout.num_engines, num_threads(cfg)
        rank_bundle, engine_bundle = dict(cfg.trainer.rank_resources), dict(cfg.rollout.engine_resources)
        needed_cpus = num_ranks * rank_bundle.get("CPU", 0) + num_engines * engine_bundle.get("CPU", 0)
        start_ray(cfg.run.ray_address, run_dir, max(threads, math.ceil(needed_cpus)), cfg.run.bind_host)
        # The run's key: embedded engines require it on every route but health, generation included (the router
        # passes a client's Authorization on); held in memory and given to the actors, never on a command line.
        self.admin_key = secrets.token_hex(16)
        strategies = await place(
            self.groups, cfg.run.colocate, [rank_bundle] * num_ranks, [engine_bundle] * num_engines
        )
        cpus = cpu_sets(cfg, threads) if cfg.run.pin_cpus else None
        engine_threads = threads if num_engines == 1 else max(1, threads // num_engines)

        def new_engine(i: int) -> Any:
            rollout = cfg.rollout
            if rollout.backend == "sglang":
                return actor_class(SGLangEngineActor, engine_bundle, strategies[num_ranks + i]).remote(
                    model_dir, cfg.kernel, rollout.engine, rollout.sglang, self.admin_key, rollout.engine_host,
                    cfg.run.colocate, str(run_dir),
                )  # fmt: skip
            return actor_class(RolloutEngineActor, engine_bundle, strategies[num_ranks + i]).remote(
                model_dir, cfg.kernel, rollout.engine, self.admin_key, engine_threads, rollout.engine_host,
                None if cpus is None else cpus[num_ranks + i],
            )  # fmt: skip

        self.new_engine, self.run_dir, self.backend = new_engine, run_dir, cfg.rollout.backend
        # an SGLang server may take its start-up timeout to load (a large checkpoint), plus the actor's placement
        loading = cfg.rollout.sglang.startup_timeout_s if self.backend == "sglang" else 0.0
        self.engine_start_s = ENGINE_START_S + loading
        self.engine_actors = [new_engine(i) for i in range(num_engines)]
        self.hang_timeout_s = cfg.trainer.hang_timeout_s
        self.trainers = [
            actor_class(TrainerRankActor, rank_bundle, strategies[rank], {HEALTH_GROUP: 1}).remote(
                rank, num_ranks, max(1, threads // num_ranks), None if cpus is None else cpus[rank]
            )
            for rank in range(num_ranks)
        ]
        rank_nodes = await asyncio.gather(*(t.node_id.remote() for t in self.trainers))
        one_node = len(set(rank_nodes)) == 1
        master = await self.trainers[0].address.remote(
            one_node and ipaddress.ip_address(cfg.run.bind_host).is_loopback
        )
        fingerprints = await self._all("setup", master, model_dir, trainer_settings(cfg, run_dir))
        self.trainer_fingerprint = fingerprints[0]
        self.data_parallel = [tuple(dp) for dp in await self._all("data_parallel")]
        self.urls = [str(url) for url in await asyncio.gather(*(a.get_url.remote() for a in self.engine_actors))]
        self.engine_where = list(await asyncio.gather(*(where(a) for a in self.engine_actors)))
        self.rank_where = list(await asyncio.gather(*(where(t) for t in self.trainers)))
        self._write_actor_list()
        members = [Client(url, api_key=self.admin_key, admin_key=self.admin_key, timeout=600) for url in self.urls]
        generator = members[0]
        if num_engines > 1:
            self.router = Router(self.urls, cfg.rollout.router_policy, run_dir / "router.log")
            await self.router.wait_until_healthy()
            generator = Client(self.router.url, api_key=self.admin_key, timeout=600)  # the router forwards it
        faults = cfg.rollout.fault_tolerance
        if faults.enabled:
            self.supervisor = EngineSupervisor(lambda: list(self.urls), self.restart_engine, faults, self.log,
                                               admin_key=self.admin_key)  # fmt: skip
        self.engine = EngineFleet(members, generator, self.supervisor, faults.generate_retries)
        await self._setup_sync(cfg, model_dir, run_dir)
        if self.supervisor is not None:
            self.supervisor.start()

    async def restart_engine(self, engine: int, cause: str) -> None:
        """Replace engine `engine` (dead or hung: `cause`) by a new actor on its bundle holding the weights the others
        hold, in the fleet's state, back behind the router."""
        old_url = self.urls[engine]
        if self.router is not None:
            await self.router.remove_worker(old_url)
        with contextlib.suppress(Exception):
            ray.kill(self.engine_actors[engine], no_restart=True)
        actor = self.new_engine(engine)
        url = str(await asyncio.wait_for(actor.get_url.remote(), timeout=self.engine_start_s))
        client = Client(url, api_key=self.admin_key, admin_key=self.admin_key, timeout=600)
        if self.last_version is None or await self._transport.after_restart(engine, client):
            await self._check_restarted_weights(engine, client)
        if self.engine.released:
            await client.release_memory_occupation()
        if self.engine.paused is not None:
            await client.pause_generation(self.engine.paused)
        self.engine_actors[engine], self.urls[engine] = actor, url
        self.engine_where[engine] = await where(actor)
        self.engine.replace(engine, client)
        self._write_actor_list()
        if self.router is not None:
            await self.router.add_worker(url)

    def _healthy_peer(self, engine: int) -> Client | None:
        """An engine other than `engine` that is not being restarted (None: there is none)."""
        assert self.supervisor is not None
        restarting = self.supervisor.recovering() | {engine}
        healthy = [member for i, member in enumerate(self.engine.members) if i not in restarting]
        return healthy[0] if healthy else None

    async def _check_restarted_weights(self, engine: int, client: Client) -> None:
        """The restarted engine must hold what a healthy engine holds (one not being restarted itself) when both serve
        the same version. With none healthy, their memory released (or being released), or a sync under way (the peer
        serves another version), there is nothing to compare with: the weight file they all load (or the next sync)
        is trusted, and the next sync's own check compares every engine with the trainer (loop.py)."""
        assert self.supervisor is not None
        peer = self._healthy_peer(engine)
        if peer is None or self.engine.released:  # no engine holds weights to compare with
            return
        timeout = self.supervisor.settings.check_timeout_s
        want_version = await asyncio.wait_for(peer.get_weight_version(), timeout)
        if (got_version := await client.get_weight_version()) != want_version:
            if self.engine.loading:  # a sync is loading a new version: it sends this engine the same
                return
            raise RuntimeError(f"the restarted engine serves weights v{got_version}, a healthy one v{want_version}")
        if self.backend == "sglang":  # SGLang reports no checksum of HF tensors: the weight versions must agree
            return
        try:
            want = await asyncio.wait_for(peer.weights_checksum(), timeout)
        except RolloutClientError as error:
            if error.status_code == HTTPStatus.CONFLICT:  # the peer released its weights since (trainer's turn)
                return
            raise
        got = await client.weights_checksum()
        if got != want:
            raise RuntimeError(f"the restarted engine holds weights {got[:16]}, a healthy one {want[:16]}")

    def fault_metrics(self) -> dict[str, float]:
        """Engine restarts since the last call (`engine_restarts`, `engine_recovery_s`) and the engine calls
        re-issued after a failure (`engine_calls_reissued`); {} when there were none."""
        if self.supervisor is None:
            return {}
        reissued = self.engine.take_reissued()
        return self.supervisor.take_metrics() | ({"engine_calls_reissued": float(reissued)} if reissued else {})

    def _write_actor_list(self) -> None:
        """RUN_DIR/actors.json: each engine's URL, process id and Ray node, each trainer rank's process id and node
        (for operators, and the fault tests)."""
        engines, ranks = self.engine_where, self.rank_where
        listing = {
            "engines": [
                {"engine": i, "url": url, **info} for i, (url, info) in enumerate(zip(self.urls, engines, strict=True))
            ],
            "trainer_ranks": [{"rank": rank, **info} for rank, info in enumerate(ranks)],
        }
        (self.run_dir / "actors.json").write_text(json.dumps(listing, indent=2) + "\n")

    async def _setup_sync(self, cfg: RunConfig, model_dir: str, run_dir: Path) -> None:
        """Pick the weight transport (`run.sync_transport`) from where the engines landed, open its side on every
        trainer rank, and set it up."""
        rank0_node = await self.trainers[0].node_id.remote()
        engine_nodes = await asyncio.gather(*(a.node_id.remote() for a in self.engine_actors))
        context = SyncContext(
            cfg, run_dir, RankCalls(self.trainers, self._collective), self.engine, lambda: list(self.urls),
            self.admin_key, self._healthy_peer, self.log, rank0_node, list(engine_nodes),
        )  # fmt: skip
        self.transport = make_transport(context, model_dir)
        await self._all("open_weight_sync", self.transport.name)
        await self.transport.prepare()

    async def _all(self, method: str, *args: Any) -> list[Any]:
        return await self._collective(method, [getattr(t, method).remote(*args) for t in self.trainers])

    async def _sharded(self, method: str, per_rank: list[Any], *args: Any) -> list[Any]:
        calls = [getattr(t, method).remote(share, *args) for t, share in zip(self.trainers, per_rank, strict=True)]
        return await self._collective(method, calls)

    async def _collective(self, method: str, refs: list[Any]) -> list[Any]:
        """Every rank's result; a rank that dies or hangs stops the run naming it (rank_health.py)."""
        hint = f"resume it from its last checkpoint: miles-orchestrator run --resume {self.run_dir}"
        return await collective(self.trainers, method, refs, self.hang_timeout_s, hint)

    def _rows(self) -> list[slice]:
        """Each rank's rows of a batch: every data-parallel share's (Megatron's TP / PP / CP peers share one)."""
        return [slice(dp_rank, None, dp_size) for dp_rank, dp_size in self.data_parallel]

    def _shares(self, samples: list[Sample]) -> list[list[dict[str, Any]]]:
        return [[s.model_dump(mode="json") for s in samples[rows]] for rows in self._rows()]

    async def train(
        self, samples: list[Sample], advantages: list[list[float]], old_logprobs: list[list[float]] | None,
        measure: bool, critic: CriticTargets | None = None,
    ) -> dict[str, float]:  # fmt: skip
        calls = [
            trainer.train.remote(
                share, advantages[rows], None if old_logprobs is None else old_logprobs[rows], measure,
                None if critic is None else critic.part(rows),
            )
            for trainer, share, rows in zip(self.trainers, self._shares(samples), self._rows(), strict=True)
        ]  # fmt: skip
        results: list[dict[str, float]] = await self._collective("train", calls)
        return results[0]

    async def compute_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        return await self._gathered("compute_logprobs", samples)

    async def compute_values(self, samples: list[Sample]) -> list[list[float]]:
        return await self._gathered("compute_values", samples)

    async def _gathered(self, method: str, samples: list[Sample]) -> list[list[float]]:
        """Per-sample rows each rank computes for its share, back in the batch's order (a share computed by several
        ranks, Megatron's TP peers, gives the same rows on each)."""
        shares = await self._sharded(method, self._shares(samples))
        out: list[list[float]] = [[] for _ in samples]
        for rows, share in zip(self._rows(), shares, strict=True):
            out[rows] = share
        return out

    async def sync_weights(self, version: int, bucket_bytes: int) -> dict[str, Any]:
        with self.engine.loading_weights():
            result = await self._sync_weights(version, bucket_bytes)
        self.last_version = version
        return result

    async def _sync_weights(self, version: int, bucket_bytes: int) -> dict[str, Any]:
        """Send the weights; a sync that fails while an engine fails is sent again once the engines are back (up to
        `SYNC_ATTEMPTS` times; an engine restarted meanwhile already holds the previous version)."""
        for attempt in range(1, SYNC_ATTEMPTS + 1):
            restarts = 0 if self.supervisor is None else len(self.supervisor.restarts)
            try:
                if self.supervisor is not None:
                    # An engine that died since the last check (the router may have hidden it, retrying its
                    # requests on the others) is restarted now, not found halfway through a sync.
                    await self.supervisor.check_now()
                return await self._transport.send(version, bucket_bytes)
            except Exception as error:
                if self.supervisor is None or attempt == SYNC_ATTEMPTS:
                    raise
                await self.supervisor.check_now()
                if len(self.supervisor.restarts) == restarts:
                    raise  # no engine failed: the sync's own error
                self.log(f"weight sync v{version} failed while an engine failed ({type(error).__name__}); the engines "
                         f"are back, sending again (attempt {attempt + 1})")  # fmt: skip
        raise AssertionError("unreachable")

    async def trainer_checksum(self) -> str:
        result: str = (await self._all("weights_checksum"))[0]
        return result

    async def start_profile(self, directory: Path) -> None:
        """Each trainer rank and each engine records a torch.profiler trace into `directory` (on its own node)."""
        await asyncio.gather(self._all("start_profile", str(directory)), self.engine.start_profile(str(directory)))

    async def stop_profile(self) -> None:
        await asyncio.gather(self._all("stop_profile"), self.engine.stop_profile())

    async def trainer_digests(self) -> dict[str, str]:
        result: dict[str, str] = (await self._all("weights_digests"))[0]
        return result

    async def offload_trainer(self, room_for: int | None = None) -> int:
        return sum(await self._all("offload", room_for))

    async def onload_trainer(self) -> int:
        return sum(await self._all("onload"))

    async def save(self, directory: Path, extra: dict[str, Any]) -> None:
        await self._all("save", str(directory), extra)

    async def load(self, directory: Path) -> dict[str, Any]:
        result: dict[str, Any] = (await self._all("load", str(directory)))[0]
        return result

    async def export(self, directory: Path, tokenizer_dir: str) -> None:
        await self._all("export", str(directory), tokenizer_dir)

    async def shutdown(self) -> None:
        """Stop the router and the engines, kill the actors, free the placement groups; never masks the run's own
        error."""
        if self.supervisor is not None:  # first: engines stopping below are not failures
            await self.supervisor.stop()
        if self.router is not None:
            self.router.stop()
        if getattr(self, "engine", None) is not None:
            await self.engine.aclose()
        stops = [asyncio.wait_for(a.shutdown.remote(), timeout=30) for a in self.engine_actors]
        await asyncio.gather(*stops, return_exceptions=True)  # an engine may be gone already
        for actor in [*self.engine_actors, *self.trainers]:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        for group in self.groups:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        if self.transport is not None:
            await self.transport.close()


@dataclass(frozen=True)
class RankCalls:
    """The trainer rank actors as a transport calls them (`TrainerRanks`): `TrainerRankActor.weight_sync` on every
    rank through `collective` (a rank that dies or hangs stops the run naming it), or on rank 0."""

    trainers: list[Any]
    collective: Callable[[str, list[Any]], Awaitable[list[Any]]]

    async def all(self, call: str, *args: Any) -> list[Any]:
        return await self.collective(call, [t.weight_sync.remote(call, *args) for t in self.trainers])

    async def first(self, call: str, *args: Any) -> Any:
        return await self.trainers[0].weight_sync.remote(call, *args)

    async def rank0_address(self, engine_host: str) -> tuple[str, int]:
        address = await self.trainers[0].reachable_address.remote(engine_host)
        port = await self.trainers[0].free_port.remote()
        return str(address), int(port)

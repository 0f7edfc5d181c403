"""Engine and trainer-rank failures, piece by piece (docs/fault-tolerance.md); the integration tier kills and stops
real engines and ranks on a real Ray cluster (tests/integration/test_fault_tolerance.py).

- `EngineSupervisor`: failed checks restart an engine after `failure_threshold` in a row (a healthy check resets the
  count); `check_now` restarts at once and is shared by concurrent callers; the restart limit per hour and a restart
  that fails stop the run with an error naming engines and causes; metrics count restarts once.
- `EngineFleet`: a call that failed for an engine's sake is re-issued unchanged after the check (same request
  object: same seeds), up to `retries`; a client error (4xx) is not; a replaced engine takes generation over when
  there is no router; the fleet's state (released, paused) follows the calls.
- `Router.add_worker` / `remove_worker` against the real sglang-router in front of two HTTP servers.
- `rank_health`: a dead rank and a hung rank are named (not the peer whose collective failed because of them); a
  rank that hangs with no peer is found by the heartbeat; an error of a live rank stays the call's own.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from ray.exceptions import RayActorError

from miles_contracts import GenerateRequest
from miles_orchestrator.cluster import EngineFailed
from miles_orchestrator.cluster.ray.engine_health import EngineSupervisor, is_engine_failure
from miles_orchestrator.cluster.ray.fleet import EngineFleet, Router
from miles_orchestrator.cluster.ray.rank_health import TrainerRankFailed, collective, diagnose
from miles_orchestrator.config.rollout import FaultToleranceSection
from miles_rollout import RolloutClientError, free_port


def settings(**overrides: Any) -> FaultToleranceSection:
    return FaultToleranceSection(check_interval_s=0.01, check_timeout_s=1.0, **overrides)


class Probes:
    """What each engine's health check answers (None: healthy), and the restarts asked for."""

    def __init__(self, num_engines: int) -> None:
        self.causes: list[str | None] = [None] * num_engines
        self.restarted: list[tuple[int, str]] = []
        self.fail_restart = False

    def supervisor(self, **overrides: Any) -> tuple[EngineSupervisor, list[str]]:
        logged: list[str] = []

        async def restart(engine: int, cause: str) -> None:
            await asyncio.sleep(0.01)
            if self.fail_restart:
                raise RuntimeError("no bundle to place it on")
            self.restarted.append((engine, cause))
            self.causes[engine] = None  # the new engine is healthy

        supervisor = EngineSupervisor(lambda: [f"http://engine{i}" for i in range(len(self.causes))], restart,
                                      settings(**overrides), logged.append)  # fmt: skip

        async def probe(url: str) -> str | None:
            return self.causes[int(url.removeprefix("http://engine"))]

        supervisor._probe = probe  # type: ignore[method-assign]  # the checks' answers, not real HTTP
        return supervisor, logged


def test_an_engine_is_restarted_after_threshold_failures_in_a_row() -> None:
    async def scenario() -> None:
        probes = Probes(2)
        supervisor, logged = probes.supervisor(failure_threshold=2)
        probes.causes[1] = "no answer within 1 s"
        await supervisor._check_all(2)
        assert probes.restarted == []  # one failure: not yet
        probes.causes[1] = None
        await supervisor._check_all(2)  # a healthy check resets the count
        probes.causes[1] = "no answer within 1 s"
        await supervisor._check_all(2)
        assert probes.restarted == []
        await supervisor._check_all(2)
        await supervisor.wait_recovered()
        assert probes.restarted == [(1, "no answer within 1 s")]
        assert "rollout engine 1 failed (no answer within 1 s); restarting it" in logged
        assert any(line.startswith("rollout engine 1 is back after") for line in logged)
        metrics = supervisor.take_metrics()
        assert metrics["engine_restarts"] == 1.0 and metrics["engine_recovery_s"] > 0
        assert supervisor.take_metrics() == {}  # counted once

    asyncio.run(scenario())


def test_the_background_watch_restarts_a_failed_engine() -> None:
    async def scenario() -> None:
        probes = Probes(1)
        supervisor, _ = probes.supervisor(failure_threshold=3)
        supervisor.start()
        probes.causes[0] = "connection refused"
        deadline = time.monotonic() + 10
        while not probes.restarted:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await supervisor.stop()
        assert probes.restarted == [(0, "connection refused")]

    asyncio.run(scenario())


def test_check_now_restarts_at_once_and_is_shared() -> None:
    async def scenario() -> None:
        probes = Probes(3)
        supervisor, _ = probes.supervisor(failure_threshold=5)
        probes.causes[2] = "connection refused"
        await asyncio.gather(*(supervisor.check_now() for _ in range(8)))  # 8 failed generates at once
        assert probes.restarted == [(2, "connection refused")]

    asyncio.run(scenario())


def test_a_probe_begun_before_a_restart_does_not_restart_the_new_engine() -> None:
    async def scenario() -> None:
        probes = Probes(1)
        supervisor, _ = probes.supervisor(failure_threshold=1)
        probes.causes[0] = "connection refused"
        fast = supervisor._probe

        async def slow(url: str) -> str | None:
            cause = await fast(url)  # answered now (the old engine), reported late
            await asyncio.sleep(0.2)
            return cause

        supervisor._probe = slow  # type: ignore[method-assign]
        stale = asyncio.create_task(supervisor._check_all(1))
        await asyncio.sleep(0.01)
        supervisor._probe = fast  # type: ignore[method-assign]
        await supervisor.check_now()  # restarts engine 0 while the slow round still waits
        await stale
        await supervisor.wait_recovered()
        assert probes.restarted == [(0, "connection refused")]

    asyncio.run(scenario())


def test_the_restart_limit_stops_the_run_naming_engines_and_causes() -> None:
    async def scenario() -> None:
        probes = Probes(2)
        supervisor, logged = probes.supervisor(max_restarts_per_hour=1)
        probes.causes[0] = "connection refused"
        await supervisor.check_now()
        probes.causes[1] = "no answer within 1 s"
        with pytest.raises(EngineFailed) as failed:
            await supervisor.check_now()
        message = str(failed.value)
        assert "rollout engine 1 failed (no answer within 1 s) after 1 restart(s) in the last hour" in message
        assert "max_restarts_per_hour=1" in message and "engine 0: connection refused" in message
        assert "resume it from its last checkpoint" in message
        assert probes.restarted == [(0, "connection refused")] and logged[-1].startswith("error: ")
        with pytest.raises(EngineFailed):
            supervisor.raise_if_failed()

    asyncio.run(scenario())


def test_zero_restarts_allowed_or_a_failed_restart_stops_the_run() -> None:
    async def scenario() -> None:
        probes = Probes(1)
        supervisor, _ = probes.supervisor(max_restarts_per_hour=0)
        probes.causes[0] = "connection refused"
        with pytest.raises(EngineFailed, match="after 0 restart"):
            await supervisor.check_now()
        probes = Probes(1)
        probes.fail_restart = True
        supervisor, _ = probes.supervisor()
        probes.causes[0] = "connection refused"
        with pytest.raises(EngineFailed, match="could not be restarted: no bundle to place it on"):
            await supervisor.check_now()

    asyncio.run(scenario())


class FakeEngine:
    """An engine client whose calls fail `failures` times with `error`, then answer; it records what it got."""

    def __init__(self, name: str, failures: int = 0, status: int | None = None) -> None:
        self.name, self.failures, self.status = name, failures, status
        self.requests: list[Any] = []

    async def generate(self, request: GenerateRequest) -> list[str]:
        self.requests.append(request)
        if self.failures:
            self.failures -= 1
            raise RolloutClientError("engine gone", endpoint="/generate", status_code=self.status)
        return [self.name]

    async def release_memory_occupation(self, tags: Any = None) -> dict[str, Any]:
        return {}

    async def resume_memory_occupation(self, tags: Any = None) -> dict[str, Any]:
        return {}

    async def pause_generation(self, mode: str) -> dict[str, Any]:
        return {"num_paused_requests": 2}

    async def continue_generation(self) -> dict[str, Any]:
        return {}


class CountingSupervisor:
    def __init__(self) -> None:
        self.checks = 0
        self.serving = True

    def raise_if_failed(self) -> None:
        pass

    async def check_now(self) -> None:
        self.checks += 1


def test_the_fleet_reissues_a_failed_generate_unchanged_and_follows_its_state() -> None:
    async def scenario() -> None:
        request = GenerateRequest(input_ids=[1, 2], sampling_params={"max_new_tokens": 2, "sampling_seed": 7})
        for status in (None, 502, 503):
            router = FakeEngine("router", failures=2, status=status)
            supervisor = CountingSupervisor()
            fleet = EngineFleet([FakeEngine("a"), FakeEngine("b")], router, supervisor, retries=3)  # type: ignore[arg-type]
            assert await fleet.generate(request) == ["router"]
            assert router.requests == [request] * 3 and supervisor.checks == 2 and fleet.take_reissued() == 2
        router = FakeEngine("router", failures=5, status=502)
        fleet = EngineFleet([FakeEngine("a")], router, CountingSupervisor(), retries=2)  # type: ignore[arg-type]
        with pytest.raises(RolloutClientError):
            await fleet.generate(request)
        assert len(router.requests) == 3  # the call and 2 retries
        bad_request = FakeEngine("router", failures=1, status=400)
        fleet = EngineFleet([FakeEngine("a")], bad_request, CountingSupervisor(), retries=3)  # type: ignore[arg-type]
        with pytest.raises(RolloutClientError):
            await fleet.generate(request)  # the request's own fault: never re-issued
        assert len(bad_request.requests) == 1

        only = FakeEngine("old")
        supervisor = CountingSupervisor()
        fleet = EngineFleet([only], only, supervisor)  # type: ignore[arg-type]  # no router
        fleet.replace(0, FakeEngine("new"))  # type: ignore[arg-type]
        assert await fleet.generate(request) == ["new"]
        await fleet.release_memory_occupation()
        assert fleet.released and not supervisor.serving
        await fleet.resume_memory_occupation()
        assert not fleet.released and supervisor.serving
        assert await fleet.pause_generation("abort") == 2 and fleet.paused == "abort" and not supervisor.serving
        await fleet.continue_generation()
        assert fleet.paused is None and supervisor.serving

    asyncio.run(scenario())


def test_which_engine_errors_are_worth_reissuing() -> None:
    assert is_engine_failure(RolloutClientError("refused", endpoint="/generate"))
    assert is_engine_failure(RolloutClientError("bad gateway", endpoint="/generate", status_code=502))
    assert not is_engine_failure(RolloutClientError("bad field", endpoint="/generate", status_code=400))
    assert not is_engine_failure(ValueError("not an engine error"))


def serve(port: int) -> uvicorn.Server:
    """A minimal worker the router accepts (health, model info, generate), in a thread."""
    app = FastAPI()

    @app.get("/health")
    @app.get("/health_generate")
    def health() -> dict[str, Any]:
        return {}

    @app.get("/get_model_info")
    @app.get("/model_info")
    @app.get("/get_server_info")
    @app.get("/server_info")
    def info() -> dict[str, Any]:
        return {"model_path": "tiny", "is_generation": True}

    @app.post("/generate")
    def generate(body: dict[str, Any]) -> dict[str, Any]:
        return {"text": str(port), "meta_info": {}}

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server


def test_router_workers_are_removed_and_added(tmp_path) -> None:
    pytest.importorskip("sglang_router")
    ports = [free_port(), free_port()]
    servers = [serve(port) for port in ports]
    urls = [f"http://127.0.0.1:{port}" for port in ports]

    async def scenario() -> None:
        router = Router(urls[:1], "round_robin", tmp_path / "router.log")
        try:
            await router.wait_until_healthy()
            await router.add_worker(urls[1])
            async with httpx.AsyncClient(timeout=10) as http:
                answers = {(await http.post(f"{router.url}/generate", json={"text": "x"})).json()["text"]
                           for _ in range(6)}  # fmt: skip
                assert answers == {str(p) for p in ports}
                await router.remove_worker(urls[0])
                answers = {(await http.post(f"{router.url}/generate", json={"text": "x"})).json()["text"]
                           for _ in range(4)}  # fmt: skip
                assert answers == {str(ports[1])}
            await router.remove_worker("http://127.0.0.1:1")  # not listed: nothing to do
        finally:
            router.stop()

    try:
        asyncio.run(scenario())
    finally:
        for server in servers:
            server.should_exit = True


class FakeRank:
    """A trainer rank actor: `ping` answers, never answers (hung), or raises RayActorError (dead)."""

    def __init__(self, state: str = "alive") -> None:
        self.state = state
        self.ping = self

    def options(self, **_: Any) -> FakeRank:
        return self

    async def remote(self) -> bool:
        if self.state == "dead":
            raise RayActorError()
        if self.state == "hung":
            await asyncio.sleep(3600)
        return True


def test_dead_and_hung_ranks_are_named_not_their_peers() -> None:
    async def scenario() -> None:
        async def peer_times_out() -> None:
            await asyncio.sleep(0.05)
            raise RuntimeError("gloo: Timed out waiting for rank 1")

        async def dies() -> None:
            raise RayActorError()

        ranks = [FakeRank(), FakeRank("hung")]
        with pytest.raises(TrainerRankFailed) as failed:
            await collective(ranks, "train", [peer_times_out(), asyncio.sleep(3600)], 0, "resume: --resume RUN")
        message = str(failed.value)
        assert message.startswith("trainer rank 1 is hung (no answer to a heartbeat within 5 s) during train")
        assert "the call failed with RuntimeError: gloo: Timed out waiting for rank 1" in message
        assert message.endswith("The run stops; resume: --resume RUN") and "rank 0" not in message

        ranks = [FakeRank("dead"), FakeRank()]
        with pytest.raises(TrainerRankFailed, match=r"^trainer rank 0 died \(its process exited: "):
            await collective(ranks, "onload", [dies(), asyncio.sleep(0)], 0, "resume")

        async def raises() -> None:
            raise ValueError("a bug in a loss")

        with pytest.raises(ValueError, match="a bug in a loss"):  # every rank alive: the call's own error
            await collective([FakeRank()], "train", [raises()], 0, "resume")
        assert await diagnose([FakeRank(), FakeRank()], "train", 0.1, "resume") is None

    asyncio.run(scenario())


def test_a_lone_hung_rank_is_found_by_the_heartbeat() -> None:
    async def scenario() -> None:
        began = time.monotonic()
        with pytest.raises(TrainerRankFailed, match=r"trainer rank 0 is hung .* within 0.1 s\) during save"):
            await collective([FakeRank("hung")], "save", [asyncio.sleep(3600)], 0.2, "resume")
        assert time.monotonic() - began < 5
        assert await collective([FakeRank(), FakeRank()], "load", [asyncio.sleep(0, 1), asyncio.sleep(0, 2)], 0.2,
                                "resume") == [1, 2]  # fmt: skip

    asyncio.run(scenario())


def test_a_batch_splits_over_data_parallel_shares_megatron_peers_share_one() -> None:
    """RayCluster's shares: FSDP2 ranks each get every world-th sample; Megatron's TP peers (same data-parallel
    rank) get the same share, and the per-sample results come back in batch order from each share once."""
    import asyncio

    from miles_contracts import Sample
    from miles_orchestrator.cluster.ray.cluster import RayCluster

    samples = [Sample(index=i, group_index=0, prompt="", prompt_tokens=[1], response_tokens=[2]) for i in range(6)]
    cluster = RayCluster()
    cluster.data_parallel = [(0, 2), (0, 2), (1, 2), (1, 2)]  # tp=2, dp=2: ranks 0, 1 and 2, 3 are TP peers
    shares = cluster._shares(samples)
    assert [[row["index"] for row in share] for share in shares] == [[0, 2, 4], [0, 2, 4], [1, 3, 5], [1, 3, 5]]

    async def sharded(method: str, per_rank: list, *args) -> list:
        return [[[float(row["index"])] for row in share] for share in per_rank]

    cluster._sharded = sharded  # type: ignore[method-assign]
    assert asyncio.run(cluster._gathered("compute_logprobs", samples)) == [[float(i)] for i in range(6)]

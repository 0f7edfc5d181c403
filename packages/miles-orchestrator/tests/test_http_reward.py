"""Multi-thread tier (no torch): the http reward (`reward.name=http`) against a real reward server on 127.0.0.1.

The server (the standard library's threaded HTTP server, on an ephemeral port) speaks the documented JSON contract
and misbehaves on purpose by path: it fails with 500 once per sample, always answers 503, refuses with 400, sleeps
past the timeout, or counts the requests it holds at once. A failure must mark only its own sample(s) `failed`
with reward 0.0, retries must follow the rules (connection errors, timeouts, 5xx; never another 4xx), and a bad or
unreachable server must be refused at start-up naming the field.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from miles_contracts import Sample, SampleStatus
from miles_orchestrator.config import RewardSection
from miles_orchestrator.reward.pool import RewardPool, check_reward

ROUTES = ("/reward", "/flaky", "/down", "/refuse", "/garbage", "/slow", "/busy", "/secure")


class RewardServer(ThreadingHTTPServer):
    daemon_threads = True  # a handler still sleeping on /slow does not hold up shutdown

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), RewardHandler)
        self.lock = threading.Lock()
        self.hits: Counter[tuple[str, int]] = Counter()  # (path, first sample index) -> requests received
        self.in_flight = self.most_in_flight = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up (the timeout test) closes the socket under a sleeping handler


class RewardHandler(BaseHTTPRequestHandler):
    server: RewardServer

    def do_GET(self) -> None:
        if self.path == "/health":
            self.answer(200, {"status": "ok"})
        elif self.path == "/sick":
            self.answer(500, {"status": "down"})
        else:
            self.answer(405 if self.path in ROUTES else 404, {"detail": "POST only"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        samples = body.get("samples") or [body["sample"]]
        server = self.server
        with server.lock:
            server.hits[(self.path, samples[0]["index"])] += 1
            attempt = server.hits[(self.path, samples[0]["index"])]
            server.in_flight += 1
            server.most_in_flight = max(server.most_in_flight, server.in_flight)
        try:
            self.route(body, samples, attempt)
        finally:
            with server.lock:
                server.in_flight -= 1

    def route(self, body: dict[str, Any], samples: list[dict[str, Any]], attempt: int) -> None:
        rewards = [float(len(s["response"])) for s in samples]  # the reward: the response's length
        ok = {"rewards": rewards} if "samples" in body else {"reward": rewards[0]}
        if self.path == "/flaky" and attempt == 1:
            self.answer(500, {"detail": "try again"})
        elif self.path == "/down":
            self.answer(503, {"detail": "overloaded"})
        elif self.path == "/refuse":
            self.answer(400, {"detail": "no label"})
        elif self.path == "/garbage":
            self.answer(200, {"score": 1.0})
        elif self.path == "/secure" and self.headers.get("Authorization") != "Bearer s3cret":
            self.answer(401, {"detail": "bad key"})
        else:
            time.sleep({"/slow": 2.0, "/busy": 0.15}.get(self.path, 0.0))
            self.answer(200, ok)

    def answer(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet


@pytest.fixture
def server() -> Iterator[RewardServer]:
    server = RewardServer()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def http_pool(url: str, **settings: Any) -> RewardPool:
    return RewardPool.from_config(RewardSection(name="http", url=url, backoff_s=0.01, **settings))


def make(k: int, group: int = 0) -> Sample:
    return Sample(index=k, group_index=group, prompt="q", label="x", response="a" * k, response_tokens=[1] * k)


async def test_rewards_come_back_from_the_server(server: RewardServer) -> None:
    samples = [make(k) for k in range(5)]
    with http_pool(f"{server.url}/reward") as pool:
        stats = await pool.score(samples)
    assert [s.reward for s in samples] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert stats.num_failed == 0 and stats.mean_reward == 2.0
    assert all(s.status is SampleStatus.PENDING for s in samples)
    groups = [make(k, group=k // 3) for k in range(6)]  # reward.is_group: one request per prompt group
    with http_pool(f"{server.url}/reward", is_group=True) as pool:
        await pool.score(groups)
    assert [s.reward for s in groups] == [float(k) for k in range(6)]
    assert server.hits[("/reward", 0)] == 2 and server.hits[("/reward", 3)] == 2  # once alone, once as a group


async def test_a_5xx_is_retried(server: RewardServer) -> None:
    samples = [make(k) for k in range(4)]
    with http_pool(f"{server.url}/flaky", max_retries=1) as pool:
        stats = await pool.score(samples)
    assert [s.reward for s in samples] == [0.0, 1.0, 2.0, 3.0] and stats.num_failed == 0
    assert [server.hits[("/flaky", k)] for k in range(4)] == [2, 2, 2, 2]  # a 500, then the answer


async def test_failures_mark_their_samples_failed_and_the_run_goes_on(server: RewardServer) -> None:
    with http_pool(f"{server.url}/down", max_retries=2) as pool:
        for _ in range(2):  # the pool keeps working after a failed step
            samples = [make(k) for k in range(3)]
            stats = await pool.score(samples)
            assert stats.num_failed == 3 and stats.num_timeouts == 0 and stats.mean_reward == 0.0
            assert all(s.status is SampleStatus.FAILED and s.reward == 0.0 for s in samples)
            assert "answered 503" in (samples[0].error or "") and "(3 attempt(s))" in (samples[0].error or "")
    assert server.hits[("/down", 0)] == 6  # 1 + max_retries attempts per call
    for path, expected in (("/refuse", "answered 400"), ("/garbage", r'expected a JSON object {"reward": ...}')):
        samples = [make(1)]
        with http_pool(f"{server.url}{path}", max_retries=2) as pool:
            stats = await pool.score(samples)
        assert stats.num_failed == 1 and expected in (samples[0].error or "")
        assert server.hits[(path, 1)] == 1  # a 4xx or a malformed answer is not asked again


async def test_a_slow_server_times_out(server: RewardServer) -> None:
    samples = [make(k) for k in range(2)]
    began = time.perf_counter()
    with http_pool(f"{server.url}/slow", timeout_s=0.2, max_retries=1) as pool:
        stats = await pool.score(samples)
    assert time.perf_counter() - began < 1.5  # two attempts of 0.2 s, not the server's 2 s
    assert stats.num_failed == stats.num_timeouts == 2
    assert all("timed out after 0.2s (2 attempt(s))" in (s.error or "") for s in samples)


async def test_concurrency_is_limited(server: RewardServer) -> None:
    samples = [make(k) for k in range(12)]
    with http_pool(f"{server.url}/busy", max_concurrency=3) as pool:
        stats = await pool.score(samples)
    assert stats.num_failed == 0 and [s.reward for s in samples] == [float(k) for k in range(12)]
    assert server.most_in_flight == 3


async def test_the_api_key_comes_from_the_environment(server: RewardServer, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"reward\.api_key_env='REWARD_KEY': that environment variable is not set"):
        http_pool(f"{server.url}/secure", api_key_env="REWARD_KEY")
    monkeypatch.setenv("REWARD_KEY", "s3cret")
    samples = [make(2)]
    with http_pool(f"{server.url}/secure", api_key_env="REWARD_KEY") as pool:
        await pool.score(samples)
    assert samples[0].reward == 2.0


def test_start_up_refuses_a_server_that_is_not_there(server: RewardServer) -> None:
    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}/reward"
    cases = {
        closed: r"reward\.url='http://127\.0\.0\.1:\d+/reward': no reward server answers there \(ConnectError",
        f"{server.url}/rewrad": r"reward\.url='.*/rewrad': the server answers 404 Not Found there; fix the path",
    }
    for url, expected in cases.items():
        with pytest.raises(ValueError, match=expected):
            http_pool(url, max_retries=1)
        with pytest.raises(ValueError, match=expected):
            check_reward(RewardSection(name="http", url=url, max_retries=0))
    with pytest.raises(ValueError, match=r"reward\.health_url='.*/sick' answered 500 Internal Server Error, not 2xx"):
        http_pool(f"{server.url}/reward", health_url=f"{server.url}/sick")
    http_pool(f"{server.url}/reward", health_url=f"{server.url}/health").close()

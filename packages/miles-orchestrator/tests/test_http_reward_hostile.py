"""Multi-thread tier (no torch): a hostile reward server cannot end the run.

A real server on 127.0.0.1 answers every call with one kind of bad answer, chosen by path: a 400-digit integer
(OverflowError when made a float), a reward nested 100,000 lists deep (RecursionError in the JSON parser), numbers
too large to be a reward (1e300, 1e999 = inf), and bodies past the size limit (declared in Content-Length, or
streamed without one, without end). Each must mark its own sample(s) `failed` with reward 0.0 and an error saying
why, and the pool must go on scoring the next batch.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from miles_contracts import Sample, SampleStatus
from miles_orchestrator.config import RewardSection
from miles_orchestrator.reward.http import MAX_ABS_REWARD, MAX_REPLY_BYTES
from miles_orchestrator.reward.pool import RewardPool

HOSTILE = {  # path -> (the answer's body, the error the sample must carry)
    "/huge-int": (b'{"reward": 1' + b"0" * 400 + b"}", "a reward must be a finite number of magnitude at most"),
    "/deep": (b'{"reward": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "RecursionError"),
    "/absurd": (b'{"reward": 1e300}', "a reward must be a finite number of magnitude at most"),
    "/infinite": (b'{"reward": 1e999}', "got inf"),
    "/declared-oversize": (json.dumps({"reward": 1.0, "pad": "x" * MAX_REPLY_BYTES}).encode(), "longer than"),
}
GROUP_HUGE_INT = b'{"rewards": [1.0, 1' + b"0" * 400 + b"]}"  # one bad reward of a group fails the group
CHUNK = b" " * 65536  # /endless streams these with no Content-Length until the client hangs up


class HostileServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), HostileHandler)
        self.bytes_sent = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # the client hangs up on /endless


class HostileHandler(BaseHTTPRequestHandler):
    server: HostileServer

    def do_GET(self) -> None:  # the start-up check
        self.send_response(405)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if self.path == "/endless":  # HTTP/1.0 without Content-Length: the body runs until the connection closes
            self.end_headers()
            self.wfile.write(b'{"reward": 1.0, "pad": "')
            for _ in range(1024):  # 64 MiB at most; the client must hang up long before
                self.wfile.write(CHUNK)
                self.server.bytes_sent += len(CHUNK)
            return
        if self.path == "/group-huge-int":
            data = GROUP_HUGE_INT
        elif self.path == "/good":
            data = json.dumps({"reward": float(len(body["sample"]["response"]))}).encode()
        else:
            data = HOSTILE[self.path][0]
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[HostileServer]:
    server = HostileServer()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def make(k: int, group: int = 0) -> Sample:
    return Sample(index=k, group_index=group, prompt="q", label="x", response="a" * k, response_tokens=[1] * k)


def http_pool(url: str, **settings: Any) -> RewardPool:
    return RewardPool.from_config(RewardSection(name="http", url=url, backoff_s=0.01, max_retries=1, **settings))


@pytest.mark.parametrize("path", sorted(HOSTILE))
async def test_a_hostile_answer_fails_its_sample_and_the_pool_goes_on(server: HostileServer, path: str) -> None:
    samples = [make(k) for k in range(1, 3)]
    with http_pool(f"{server.url}{path}") as pool:
        stats = await pool.score(samples)
        assert stats.num_failed == 2 and stats.mean_reward == 0.0
        for sample in samples:
            assert sample.status is SampleStatus.FAILED and sample.reward == 0.0
            assert HOSTILE[path][1] in (sample.error or "") and len(sample.error or "") < 500
        pool.remote.url = f"{server.url}/good"  # type: ignore[union-attr]  # the same pool, a good server
        good = [make(k) for k in range(1, 3)]
        assert (await pool.score(good)).num_failed == 0 and [s.reward for s in good] == [1.0, 2.0]


async def test_a_hostile_group_answer_fails_the_whole_group(server: HostileServer) -> None:
    samples = [make(k, group=0) for k in range(2)]
    with http_pool(f"{server.url}/group-huge-int", is_group=True) as pool:
        stats = await pool.score(samples)
    assert stats.num_failed == 2 and all(s.status is SampleStatus.FAILED and s.reward == 0.0 for s in samples)
    assert "magnitude at most" in (samples[0].error or "")


async def test_an_endless_answer_is_cut_off_at_the_limit(server: HostileServer) -> None:
    samples = [make(1)]
    began = time.perf_counter()
    with http_pool(f"{server.url}/endless", timeout_s=30.0) as pool:
        stats = await pool.score(samples)
    assert time.perf_counter() - began < 10.0  # well within the timeout: it stops reading, it does not wait
    assert stats.num_failed == 1 and f"the answer is longer than {MAX_REPLY_BYTES} bytes" in (samples[0].error or "")
    assert server.bytes_sent < 16 * MAX_REPLY_BYTES  # the server got stuck on a closed socket, not drained


def test_the_limits_are_generous_for_honest_servers() -> None:
    assert MAX_REPLY_BYTES >= 25 * 4096  # a group of 4096 samples' rewards fits
    assert MAX_ABS_REWARD >= 1e3

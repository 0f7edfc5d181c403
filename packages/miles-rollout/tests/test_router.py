"""Real processes over real HTTP: sglang-router (PyPI, the Rust router SGLang deployments and slime put in front of
their engines) in front of two `miles-rollout serve` processes. It registers them, checks their health, routes
`/generate` and the OpenAI routes (every request answered), fans `/flush_cache` out to both, and with the cache-aware
policy sends prompts that share a long prefix to the engine that holds it (`cached_tokens` shows it)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from miles_rollout import free_port

sglang_router = pytest.importorskip("sglang_router")  # a test dependency in uv.lock

PREFIXES = [[(7 * i + k) % 500 for i in range(96)] for k in (1, 2, 3, 4)]  # six 16-token pages each


@contextlib.contextmanager
def router(*workers: str, policy: str = "cache_aware") -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *workers, "--host", "127.0.0.1",
               "--port", str(port), "--policy", policy, "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port())]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, "sglang-router exited at start-up"
            with contextlib.suppress(httpx.HTTPError):
                workers_seen = httpx.get(f"{url}/workers", timeout=2).json()["workers"]
                if len(workers_seen) == len(workers) and all(w["is_healthy"] for w in workers_seen):
                    break
            assert time.monotonic() < deadline, "sglang-router did not register the workers"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_sglang_router_in_front_of_two_servers(dense_dir, start_server) -> None:
    with (
        start_server(dense_dir, "--deterministic") as first,
        start_server(dense_dir, "--deterministic") as second,
        router(first, second) as url,
    ):
        responses = []
        for i in range(104):
            body = {"input_ids": [*PREFIXES[i % 4], i], "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}  # fmt: skip
            response = httpx.post(f"{url}/generate", json=body, timeout=120)
            assert response.status_code == 200, response.text
            responses.append(response.json())
        # After its first request, every prompt of a prefix lands where the prefix is cached: 96 tokens reused.
        assert all(r["meta_info"]["cached_tokens"] == 96 for r in responses[4:])
        assert sum(generated(first, second)) == 104 * 3
        assert httpx.post(f"{url}/flush_cache", timeout=60).status_code == 200
        for worker in (first, second):
            assert httpx.get(f"{worker}/server_info", timeout=10).json()["num_cached_pages"] == 0
        with router(first, second, policy="round_robin") as spread:
            before = generated(first, second)
            for i in range(8):
                params = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
                body = {"input_ids": [i + 1, 2, 3], "sampling_params": params}
                assert httpx.post(f"{spread}/generate", json=body, timeout=120).status_code == 200
            assert [b - a for a, b in zip(before, generated(first, second), strict=True)] == [8, 8]  # 4 each
            # The OpenAI routes through the router, driven by the openai client: spread over both engines too.
            client = openai.OpenAI(base_url=f"{spread}/v1", api_key="unused", timeout=120, max_retries=0)
            served = httpx.get(f"{first}/v1/models", timeout=10).json()["data"][0]["id"]
            before = generated(first, second)
            for i in range(4):
                extra = {"ignore_eos": True}
                completion = client.completions.create(
                    model=served, prompt=f"{i} + 2 =", max_tokens=2, temperature=0, extra_body=extra
                )
                assert completion.choices[0].finish_reason == "length"
                chat = client.chat.completions.create(
                    model=served, messages=[{"role": "user", "content": f"{i} + 1 ="}], max_tokens=2, temperature=0,
                    extra_body=extra,
                )  # fmt: skip
                assert chat.choices[0].finish_reason == "length" and chat.usage is not None
            assert [b - a for a, b in zip(before, generated(first, second), strict=True)] == [8, 8]


def generated(*workers: str) -> list[int]:
    return [httpx.get(f"{w}/server_info", timeout=10).json()["num_generated_tokens"] for w in workers]


def test_one_command_starts_engines_behind_the_router(dense_dir) -> None:
    port = free_port()
    command = [sys.executable, "-m", "miles_rollout.cli", "serve", "--model-path", str(dense_dir), "--port", str(port),
               "--dp-size", "2", "--deterministic", "--page-size", "16", "--num-kv-pages", "256",
               "--log-level", "warning"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            with contextlib.suppress(httpx.HTTPError, KeyError):
                workers = httpx.get(f"{url}/workers", timeout=2).json()["workers"]
                if len(workers) == 2 and all(w["is_healthy"] for w in workers):
                    break
            assert time.monotonic() < deadline, "the router did not come up with two engines"
            time.sleep(0.3)
        engines = [w["url"] for w in workers]
        for i in range(6):
            body = {
                "input_ids": [*PREFIXES[i % 2], i],
                "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
            }
            assert httpx.post(f"{url}/generate", json=body, timeout=120).status_code == 200
        assert sum(generated(*engines)) == 12
    finally:
        process.terminate()
        process.wait(timeout=60)
    for engine in engines:  # stopping the command stopped its engines too
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{engine}/health", timeout=2)

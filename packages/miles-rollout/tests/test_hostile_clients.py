"""Multi-process tier (a real `miles-rollout serve` process, deterministic mode): one client cannot hurt another.
A victim request decodes while each kind of hostile request is sent; the victim finishes with all its tokens
and the same bits as alone, `/health` answers within 1 s throughout, and each hostile request gets a 4xx (or is
served safely). An abandoned request is gone from the scheduler within seconds."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

VICTIM = {
    "input_ids": [5, 6, 7, 8, 9, 10, 11, 12],
    "sampling_params": {"max_new_tokens": 300, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True},
    "return_logprob": True,
}
NESTED_LOOPS = "{% for a in range(10**6) %}{% for b in range(10**6) %}x{% endfor %}{% endfor %}"

# (what it is, method, path, keyword arguments of httpx's request, the statuses it may get)
HOSTILE: list[tuple[str, str, str, dict[str, Any], set[int]]] = [
    (
        "stop id outside the vocabulary",
        "POST",
        "/generate",
        {"json": {"input_ids": [1, 2, 3], "sampling_params": {"min_new_tokens": 1, "stop_token_ids": [100000]}}},
        {400},
    ),
    ("prompt id >= 2^63", "POST", "/generate", {"json": {"input_ids": [1, 2, 1 << 63]}}, {400}),
    (
        "catastrophic stop regex",
        "POST",
        "/generate",
        {
            "json": {
                "input_ids": [1, 2, 3],
                "sampling_params": {"max_new_tokens": 200, "ignore_eos": True, "stop_regex": r"([\s\S]+)+QQQQQ"},
            }
        },
        {200},
    ),
    (
        "backreference stop regex",
        "POST",
        "/generate",
        {"json": {"input_ids": [1, 2, 3], "sampling_params": {"stop_regex": r"(a+)\1"}}},
        {400},
    ),
    (
        "client chat template with nested loops",
        "POST",
        "/v1/chat/completions",
        {
            "json": {
                "messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": {"chat_template": NESTED_LOOPS},
            }
        },
        {400},
    ),
    (
        "unknown chat template kwarg",
        "POST",
        "/v1/chat/completions",
        {"json": {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": False}}},
        {400},
    ),
    (
        "5,000-digit number",
        "POST",
        "/generate",
        {"content": b"9" * 5000, "headers": {"content-type": "application/json"}},
        {400},
    ),
    (
        "deep nesting",
        "POST",
        "/generate",
        {"content": b"[" * 100_000 + b"]" * 100_000, "headers": {"content-type": "application/json"}},
        {400},
    ),
    (
        "admin POST as text/plain",
        "POST",
        "/abort_request",
        {"content": b'{"abort_all": true}', "headers": {"content-type": "text/plain"}},
        {415},
    ),
    ("DNS-rebound Host", "GET", "/weight_buckets", {"headers": {"host": "attacker.example"}}, {400, 421}),
    (
        "cross-site admin POST",
        "POST",
        "/pause_generation",
        {"json": {"mode": "abort"}, "headers": {"origin": "http://attacker.example", "sec-fetch-site": "cross-site"}},
        {403},
    ),
    (
        "oversize body",
        "POST",
        "/generate",
        {"content": b" " * (65 << 20), "headers": {"content-type": "application/json"}},
        {413},
    ),
]


def bits(body: dict[str, Any]) -> tuple[list[int], list[float]]:
    return body["output_ids"], [entry[0] for entry in body["meta_info"]["output_token_logprobs"]]


async def _health_latencies(url: str, stop: asyncio.Event, latencies: list[float]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not stop.is_set():
            start = time.perf_counter()
            assert (await client.get("/health")).status_code == 200
            latencies.append(time.perf_counter() - start)
            await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_a_victim_keeps_its_bits_while_hostile_requests_arrive(dense_server: str, wait_for_engine) -> None:
    async with httpx.AsyncClient(base_url=dense_server, timeout=120) as client:
        alone = bits((await client.post("/generate", json=VICTIM)).json())
        assert len(alone[0]) == 300
        stop, latencies = asyncio.Event(), []
        health = asyncio.create_task(_health_latencies(dense_server, stop, latencies))
        try:
            for name, method, path, kwargs, allowed in HOSTILE:
                before = (await client.get("/get_server_info")).json()["num_generated_tokens"]
                victim = asyncio.create_task(client.post("/generate", json=VICTIM))
                await wait_for_engine(dense_server, lambda s, b=before: s["num_generated_tokens"] > b + 5)
                answer = await client.request(method, path, **kwargs)
                assert answer.status_code in allowed, (name, answer.status_code, answer.text[:300])
                reply = await victim
                assert reply.status_code == 200, name
                assert bits(reply.json()) == alone, name  # all its tokens, the same bits as alone
        finally:
            stop.set()
            await health
        assert max(latencies) < 1.0, f"/health took {max(latencies):.2f} s"


async def test_an_abandoned_request_is_gone_within_seconds(dense_server: str, wait_for_engine) -> None:
    long = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=dense_server, timeout=60) as client:
        before = (await client.get("/get_server_info")).json()["num_generated_tokens"]
    async with httpx.AsyncClient(base_url=dense_server, timeout=60) as quitter:
        task = asyncio.create_task(quitter.post("/generate", json=long))
        await wait_for_engine(dense_server, lambda s: s["num_running"] == 1)
        task.cancel()  # the client gives up: its connection closes
    await wait_for_engine(dense_server, lambda s: s["num_running"] == 0 and s["num_waiting"] == 0, timeout=5)
    async with httpx.AsyncClient(base_url=dense_server, timeout=60) as client:
        generated = (await client.get("/get_server_info")).json()["num_generated_tokens"] - before
    assert generated < 480  # aborted, not generated to max_new_tokens for nobody

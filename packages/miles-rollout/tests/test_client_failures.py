"""`miles_rollout.client.Client` when things go wrong, against the fake SGLang-shaped server of conftest.py:
HTTP errors and their messages, timeouts, bounded retries of connection errors (never for weight updates), and
health checks."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI

from miles_contracts import GenerateRequest, SamplingParams
from miles_kernels import encode_bucket
from miles_rollout.client import Client, RolloutClientError

BASE_URL = "http://engine.test"


async def test_http_400_raises_with_the_servers_detail(client: Client) -> None:
    request = GenerateRequest(text="hi", sampling_params=SamplingParams(top_k=1000))
    with pytest.raises(RolloutClientError, match=r"sampling_params\.top_k") as info:
        await client.generate(request)
    assert info.value.status_code == 400
    assert info.value.endpoint == "/generate"
    assert info.value.message == "sampling_params.top_k: 1000 exceeds the vocabulary size 100"


async def test_http_500_error_message_is_parsed_and_not_retried(flaky_transport: Any) -> None:
    flaky = flaky_transport(0)
    async with Client(BASE_URL, transport=flaky, retry_backoff=0.001) as c:
        with pytest.raises(RolloutClientError, match="engine crashed") as info:
            await c.generate(GenerateRequest(text="boom"))
    assert info.value.status_code == 500
    assert flaky.num_attempts == 1


async def test_fastapi_validation_detail_names_the_field() -> None:
    app = FastAPI()

    @app.post("/update_weights_from_disk")
    async def update(model_path: int) -> dict[str, Any]:  # a query int: the JSON-bodied call fails validation
        return {}

    async with Client(BASE_URL, transport=httpx.ASGITransport(app=app)) as c:
        with pytest.raises(RolloutClientError, match=r"query\.model_path: Field required") as info:
            await c.update_weights_from_disk("/ckpt")
    assert info.value.status_code == 422


async def test_success_false_with_http_200_raises(client: Client) -> None:
    with pytest.raises(RolloutClientError, match="no checkpoint at /missing") as info:
        await client.update_weights_from_disk("/missing", weight_version=1)
    assert info.value.status_code == 200
    assert info.value.message == "x: no checkpoint at /missing"


async def test_timeout_names_the_endpoint(transport: httpx.ASGITransport, engine: Any) -> None:
    engine.generate_delay = 5.0
    async with Client(BASE_URL, timeout=0.05, transport=transport) as c:
        with pytest.raises(RolloutClientError, match=r"/generate timed out after 0\.05 s") as info:
            await c.generate(GenerateRequest(text="hi"))
    assert info.value.endpoint == "/generate"
    assert info.value.status_code is None


async def test_error_survives_pickling() -> None:
    error = RolloutClientError("bad top_k", endpoint="/generate", status_code=400)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.message, copy.endpoint, copy.status_code, str(copy)) == ("bad top_k", "/generate", 400, str(error))


# -- retries and health ------------------------------------------------------------------------------------------


async def test_generate_and_health_retry_connection_errors(engine: Any, flaky_transport: Any) -> None:
    flaky = flaky_transport(2)
    async with Client(BASE_URL, transport=flaky, connect_retries=3, retry_backoff=0.001) as c:
        responses = await c.generate(GenerateRequest(text="hi"))
        assert responses[0].text == "out0"
        assert flaky.num_attempts == 3
        flaky.num_attempts = 0
        assert await c.health() is True
        assert flaky.num_attempts == 3
    assert [r.path for r in engine.requests] == ["/generate", "/health"]  # each ran once


async def test_retries_are_bounded(flaky_transport: Any) -> None:
    flaky = flaky_transport(10)
    async with Client(BASE_URL, transport=flaky, connect_retries=2, retry_backoff=0.001) as c:
        with pytest.raises(RolloutClientError, match="after 3 attempt") as info:
            await c.generate(GenerateRequest(text="hi"))
    assert isinstance(info.value.__cause__, httpx.ConnectError)
    assert info.value.status_code is None
    assert flaky.num_attempts == 3


async def test_weight_updates_are_never_retried(engine: Any, flaky_transport: Any) -> None:
    flaky = flaky_transport(2)
    data = encode_bucket({"model.embed_tokens.weight": torch.randn(4, 3)}, version=3, index=0, count=1)
    async with Client(BASE_URL, transport=flaky, connect_retries=3, retry_backoff=0.001) as c:
        with pytest.raises(RolloutClientError, match="Connection refused") as info:
            await c.update_weights_from_tensor(data)
        assert isinstance(info.value.__cause__, httpx.ConnectError)
        assert info.value.endpoint == "/update_weights_from_tensor"
        assert flaky.num_attempts == 1
        with pytest.raises(RolloutClientError):
            await c.update_weights_from_disk("/ckpt", weight_version=1)
        assert flaky.num_attempts == 2
    assert engine.requests == []


async def test_health_is_false_when_unreachable_or_unhealthy(
    engine: Any, transport: httpx.ASGITransport, flaky_transport: Any
) -> None:
    dead = flaky_transport(10**9)
    async with Client(BASE_URL, transport=dead, connect_retries=1, retry_backoff=0.001) as c:
        assert await c.health() is False
        assert await c.health_generate() is False
    engine.is_healthy = False
    async with Client(BASE_URL, transport=transport) as c:
        assert await c.health() is False
        assert await c.health_generate() is False
        engine.is_healthy = True
        assert await c.health_generate() is True


async def test_wait_until_healthy_times_out(flaky_transport: Any) -> None:
    dead = flaky_transport(10**9)
    async with Client(BASE_URL, transport=dead, retry_backoff=0.001) as c:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(RolloutClientError, match=r"not healthy after 0\.2 s.*Connection refused") as info:
            await c.wait_until_healthy(timeout=0.2, interval=0.01)
        assert loop.time() - start < 2.0
    assert info.value.endpoint == "/health"
    assert dead.num_attempts > 1  # it polled


async def test_wait_until_healthy_returns_once_the_server_is_up(flaky_transport: Any) -> None:
    flaky = flaky_transport(3)
    async with Client(BASE_URL, transport=flaky, retry_backoff=0.001) as c:
        await c.wait_until_healthy(timeout=10.0, interval=0.001)
    assert flaky.num_attempts == 4

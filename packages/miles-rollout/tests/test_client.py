"""Pure logic + real HTTP over ASGI: `miles_rollout.client.Client` against a small fake SGLang-shaped server.

The fake server is a FastAPI app that records every request (method, path, headers, body) and answers with the JSON
shapes SGLang's native API uses. The client reaches it through `httpx.ASGITransport`, so requests go through real
HTTP encoding, routing and status codes; nothing inside the client is mocked. Connection failures are injected by a
transport that raises `httpx.ConnectError` before handing requests to the ASGI app.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from miles_contracts import GenerateClient, GenerateRequest, GenerateResponse, SamplingParams
from miles_kernels import BucketAssembler, decode_bucket, encode_bucket, iter_buckets
from miles_rollout.client import Client, RolloutClientError

BASE_URL = "http://engine.test"


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class FakeEngine:
    """State of the fake server, which tests read and steer."""

    requests: list[Recorded] = field(default_factory=list)
    weight_version: Any = "default"
    is_healthy: bool = True
    generate_delay: float = 0.0
    assembler: BucketAssembler = field(default_factory=BucketAssembler)

    def last(self, path: str) -> Recorded:
        return [r for r in self.requests if r.path == path][-1]


def _one_response(i: int, version: int | None = 7) -> dict[str, Any]:
    return {
        "text": f"out{i}",
        "output_ids": [10 + i, 11 + i],
        "meta_info": {
            "id": f"req-{i}",
            "finish_reason": {"type": "length", "length": 2},
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "weight_version": None if version is None else str(version),
            "output_token_logprobs": [[-0.5, 10 + i, None], [-0.25, 11 + i, None]],
            "e2e_latency": 0.01,  # servers add fields of their own
        },
    }


def make_app(engine: FakeEngine) -> FastAPI:
    app = FastAPI()

    async def record(request: Request) -> bytes:
        body = await request.body()
        engine.requests.append(Recorded(request.method, request.url.path, dict(request.headers), body))
        return body

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        await record(request)
        payload = await request.json()
        if engine.generate_delay:
            await asyncio.sleep(engine.generate_delay)
        params = payload.get("sampling_params", {})
        if params.get("top_k", -1) > 100:
            # A value the schema allows but this server refuses, in the shape FastAPI servers use.
            return JSONResponse({"detail": "sampling_params.top_k: 1000 exceeds the vocabulary size 100"}, 400)
        if payload.get("text") == "boom":
            return JSONResponse({"error": {"message": "engine crashed"}}, status_code=500)
        prompts = payload["input_ids"] if "input_ids" in payload else payload["text"]
        is_batch = isinstance(prompts, list) and not isinstance(prompts[0], int)
        num = (len(prompts) if is_batch else 1) * params.get("n", 1)
        if num == 1 and not is_batch:  # SGLang answers a single sequence with an object, anything else with a list
            return JSONResponse(_one_response(0))
        return JSONResponse([_one_response(i) for i in range(num)])

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> Response:
        body = await record(request)
        if request.headers.get("content-type") != "application/octet-stream":
            return JSONResponse({"detail": "expected application/octet-stream"}, status_code=415)
        bucket = decode_bucket(body)
        engine.assembler.add(bucket)
        return JSONResponse(
            {"success": True, "message": "ok", "bucket_index": bucket.index, "weight_version": str(bucket.version)}
        )

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        await record(request)
        payload = await request.json()
        if payload["model_path"] == "/missing":
            return JSONResponse({"success": False, "message": "x: no checkpoint at /missing"})
        engine.weight_version = payload["weight_version"]
        return JSONResponse(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

    async def succeed(request: Request) -> Response:
        await record(request)
        return JSONResponse({"success": True, "message": "done"})

    for path in (
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/release_memory_occupation",
        "/resume_memory_occupation",
    ):
        app.add_api_route(path, succeed, methods=["POST"])

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        await record(request)
        return PlainTextResponse("Cache flushed.\n")  # SGLang answers this one in plain text

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        await record(request)
        return Response(status_code=200)  # and this one with an empty body

    @app.get("/get_model_info")
    async def get_model_info(request: Request) -> Response:
        await record(request)
        return JSONResponse({"model_path": "/models/tiny", "is_generation": True})

    @app.get("/get_server_info")
    async def get_server_info(request: Request) -> Response:
        await record(request)
        return JSONResponse({"kernel_config_hash": "abc123", "version": "0.1.0"})

    @app.get("/get_weight_version")
    async def get_weight_version(request: Request) -> Response:
        await record(request)
        return JSONResponse({"weight_version": engine.weight_version})

    @app.get("/health")
    async def health(request: Request) -> Response:
        await record(request)
        return Response(status_code=200 if engine.is_healthy else 503)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        await record(request)
        return Response(status_code=200 if engine.is_healthy else 503)

    return app


class FlakyTransport(httpx.AsyncBaseTransport):
    """Raises ConnectError for the first `num_failures` requests, then hands them to `inner`."""

    def __init__(self, inner: httpx.AsyncBaseTransport, num_failures: int) -> None:
        self.inner = inner
        self.num_failures = num_failures
        self.num_attempts = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.num_attempts += 1
        if self.num_attempts <= self.num_failures:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        return await self.inner.handle_async_request(request)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def transport(engine: FakeEngine) -> httpx.ASGITransport:
    return httpx.ASGITransport(app=make_app(engine))


@pytest.fixture
async def client(transport: httpx.ASGITransport) -> AsyncIterator[Client]:
    async with Client(BASE_URL, api_key="user-key", admin_key="admin-key", transport=transport) as c:
        yield c


def _bucket(version: int = 3) -> tuple[bytes, dict[str, torch.Tensor]]:
    tensors = {"model.embed_tokens.weight": torch.randn(4, 3), "lm_head.bias": torch.arange(5, dtype=torch.int64)}
    return encode_bucket(tensors, version=version, index=0, count=1), tensors


# -- generate ----------------------------------------------------------------------------------------------------


async def test_generate_single_response_is_a_list_of_one(client: Client, engine: FakeEngine) -> None:
    request = GenerateRequest(
        input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=2), return_logprob=True
    )
    responses = await client.generate(request)
    assert len(responses) == 1
    (response,) = responses
    assert isinstance(response, GenerateResponse)
    assert response.output_ids == [10, 11]
    assert response.meta_info.weight_version == 7  # SGLang's string version parsed by the contract
    assert response.meta_info.output_token_logprobs == [(-0.5, 10, None), (-0.25, 11, None)]
    # The body is the request without None fields, in SGLang's field names.
    sent = engine.last("/generate")
    assert sent.method == "POST"
    assert b'"input_ids":[1,2,3]' in sent.body.replace(b" ", b"")
    assert b"rid" not in sent.body and b"stop_token_ids" not in sent.body


async def test_generate_list_response_for_n_and_batch(client: Client) -> None:
    n_request = GenerateRequest(text="hi", sampling_params=SamplingParams(n=3, sampling_seed=5))
    responses = await client.generate(n_request)
    assert [r.text for r in responses] == ["out0", "out1", "out2"]
    batch = GenerateRequest(input_ids=[[1], [2, 3]])
    responses = await client.generate(batch)
    assert [r.meta_info.id for r in responses] == ["req-0", "req-1"]


async def test_client_satisfies_the_generate_client_protocol(client: Client) -> None:
    assert isinstance(client, GenerateClient)


async def test_generate_refuses_streaming(client: Client, engine: FakeEngine) -> None:
    with pytest.raises(ValueError, match="stream=False"):
        await client.generate(GenerateRequest(text="hi", stream=True))
    assert engine.requests == []


# -- auth --------------------------------------------------------------------------------------------------------


async def test_api_key_on_every_request_and_admin_key_on_admin_endpoints(client: Client, engine: FakeEngine) -> None:
    await client.generate(GenerateRequest(text="hi"))
    await client.get_model_info()
    await client.health()
    await client.flush_cache()
    await client.update_weights_from_disk("/ckpt/step3", weight_version=3)
    await client.release_memory_occupation()
    await client.abort_request(abort_all=True)
    auth = {r.path: r.headers.get("authorization") for r in engine.requests}
    assert auth == {
        "/generate": "Bearer user-key",
        "/get_model_info": "Bearer user-key",
        "/health": "Bearer user-key",
        "/flush_cache": "Bearer admin-key",
        "/update_weights_from_disk": "Bearer admin-key",
        "/release_memory_occupation": "Bearer admin-key",
        "/abort_request": "Bearer admin-key",
    }


async def test_admin_endpoints_fall_back_to_api_key_and_no_key_sends_no_header(
    transport: httpx.ASGITransport, engine: FakeEngine
) -> None:
    async with Client(BASE_URL, api_key="only-key", transport=transport) as c:
        await c.flush_cache()
    assert engine.last("/flush_cache").headers["authorization"] == "Bearer only-key"
    async with Client(BASE_URL, transport=transport) as c:
        await c.flush_cache()
        await c.get_model_info()
    assert "authorization" not in engine.last("/flush_cache").headers
    assert "authorization" not in engine.last("/get_model_info").headers


# -- weights, memory, control ------------------------------------------------------------------------------------


async def test_bucket_upload_sends_the_exact_bytes_as_octet_stream(client: Client, engine: FakeEngine) -> None:
    data, tensors = _bucket(version=3)
    reply = await client.update_weights_from_tensor(data)
    assert reply["success"] is True
    sent = engine.last("/update_weights_from_tensor")
    assert sent.headers["content-type"] == "application/octet-stream"
    assert sent.body == data
    assert engine.assembler.is_complete and engine.assembler.version == 3
    for name, tensor in tensors.items():
        assert torch.equal(engine.assembler.tensors[name], tensor)


async def test_buckets_are_sent_in_order_and_the_last_reply_returned(client: Client, engine: FakeEngine) -> None:
    named = [(f"layers.{i}.weight", torch.full((8,), float(i))) for i in range(5)]
    reply = await client.update_weights_from_buckets(iter_buckets(named, version=4, bucket_bytes=64))
    indices = [decode_bucket(r.body).index for r in engine.requests]
    assert indices == list(range(len(indices))) and len(indices) > 1
    assert reply["bucket_index"] == indices[-1]
    assert engine.assembler.is_complete
    for name, tensor in named:
        assert torch.equal(engine.assembler.tensors[name], tensor)
    with pytest.raises(ValueError, match="no buckets"):
        await client.update_weights_from_buckets([])


async def test_bucket_upload_refuses_non_bytes(client: Client) -> None:
    with pytest.raises(TypeError, match="encode_bucket"):
        await client.update_weights_from_tensor({"w": torch.zeros(1)})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "path", "body"),
    [
        (
            lambda c: c.update_weights_from_disk("/ckpt/step3", weight_version=3),
            "/update_weights_from_disk",
            # A string: SGLang declares weight_version as Optional[str].
            {"model_path": "/ckpt/step3", "weight_version": "3"},
        ),
        (
            lambda c: c.update_weights_from_disk("/ckpt/next"),
            "/update_weights_from_disk",
            {"model_path": "/ckpt/next", "weight_version": None},
        ),
        (
            lambda c: c.init_weights_update_group("10.0.0.1", 29500, 1, 3),
            "/init_weights_update_group",
            {
                "master_address": "10.0.0.1",
                "master_port": 29500,
                "rank_offset": 1,
                "world_size": 3,
                "group_name": "weight_update_group",
                "backend": "gloo",
            },
        ),
        (
            lambda c: c.update_weights_from_distributed(["w"], ["bfloat16"], [[2, 4]], weight_version=5),
            "/update_weights_from_distributed",
            {
                "names": ["w"],
                "dtypes": ["bfloat16"],
                "shapes": [[2, 4]],
                "group_name": "weight_update_group",
                "weight_version": "5",
                "flush_cache": True,
            },
        ),
        (lambda c: c.release_memory_occupation(["kv_cache"]), "/release_memory_occupation", {"tags": ["kv_cache"]}),
        (lambda c: c.resume_memory_occupation(), "/resume_memory_occupation", {"tags": None}),
        (lambda c: c.abort_request("req-9"), "/abort_request", {"rid": "req-9", "abort_all": False}),
        (lambda c: c.abort_request(abort_all=True), "/abort_request", {"rid": "", "abort_all": True}),
    ],
)
async def test_admin_calls_send_sglang_bodies(
    client: Client, engine: FakeEngine, call: Any, path: str, body: dict[str, Any]
) -> None:
    await call(client)
    sent = engine.last(path)
    assert sent.method == "POST"
    assert httpx.Response(200, content=sent.body).json() == body
    assert sent.headers["authorization"] == "Bearer admin-key"


async def test_text_and_empty_replies_become_dicts(client: Client) -> None:
    assert await client.flush_cache() == {"message": "Cache flushed."}
    assert await client.abort_request(abort_all=True) == {}


async def test_bad_arguments_fail_before_sending(client: Client, engine: FakeEngine) -> None:
    with pytest.raises(ValueError, match="same tensors"):
        await client.update_weights_from_distributed(["a", "b"], ["float32"], [[1], [2]])
    with pytest.raises(ValueError, match="weight_version"):
        await client.update_weights_from_disk("/ckpt", weight_version=-1)
    assert engine.requests == []


async def test_info_endpoints(client: Client) -> None:
    assert (await client.get_model_info())["model_path"] == "/models/tiny"
    assert (await client.get_server_info())["kernel_config_hash"] == "abc123"


@pytest.mark.parametrize(
    ("reported", "expected"), [("default", None), ("12", 12), (4, 4), (None, None), ("v2", None), ("-1", None)]
)
async def test_get_weight_version_accepts_sglang_strings(
    client: Client, engine: FakeEngine, reported: Any, expected: int | None
) -> None:
    engine.weight_version = reported
    assert await client.get_weight_version() == expected


async def test_weight_version_round_trips_through_disk_update(client: Client) -> None:
    await client.update_weights_from_disk("/ckpt/step8", weight_version=8)
    assert await client.get_weight_version() == 8


# -- errors ------------------------------------------------------------------------------------------------------


async def test_http_400_raises_with_the_servers_detail(client: Client) -> None:
    request = GenerateRequest(text="hi", sampling_params=SamplingParams(top_k=1000))
    with pytest.raises(RolloutClientError, match=r"sampling_params\.top_k") as info:
        await client.generate(request)
    assert info.value.status_code == 400
    assert info.value.endpoint == "/generate"
    assert info.value.message == "sampling_params.top_k: 1000 exceeds the vocabulary size 100"


async def test_http_500_error_message_is_parsed_and_not_retried(engine: FakeEngine) -> None:
    flaky = FlakyTransport(httpx.ASGITransport(app=make_app(engine)), num_failures=0)
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


async def test_timeout_names_the_endpoint(transport: httpx.ASGITransport, engine: FakeEngine) -> None:
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


async def test_generate_and_health_retry_connection_errors(engine: FakeEngine) -> None:
    flaky = FlakyTransport(httpx.ASGITransport(app=make_app(engine)), num_failures=2)
    async with Client(BASE_URL, transport=flaky, connect_retries=3, retry_backoff=0.001) as c:
        responses = await c.generate(GenerateRequest(text="hi"))
        assert responses[0].text == "out0"
        assert flaky.num_attempts == 3
        flaky.num_attempts = 0
        assert await c.health() is True
        assert flaky.num_attempts == 3
    assert [r.path for r in engine.requests] == ["/generate", "/health"]  # each ran once


async def test_retries_are_bounded(engine: FakeEngine) -> None:
    flaky = FlakyTransport(httpx.ASGITransport(app=make_app(engine)), num_failures=10)
    async with Client(BASE_URL, transport=flaky, connect_retries=2, retry_backoff=0.001) as c:
        with pytest.raises(RolloutClientError, match="after 3 attempt") as info:
            await c.generate(GenerateRequest(text="hi"))
    assert isinstance(info.value.__cause__, httpx.ConnectError)
    assert info.value.status_code is None
    assert flaky.num_attempts == 3


async def test_weight_updates_are_never_retried(engine: FakeEngine) -> None:
    flaky = FlakyTransport(httpx.ASGITransport(app=make_app(engine)), num_failures=2)
    data, _ = _bucket()
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
    engine: FakeEngine, transport: httpx.ASGITransport
) -> None:
    dead = FlakyTransport(transport, num_failures=10**9)
    async with Client(BASE_URL, transport=dead, connect_retries=1, retry_backoff=0.001) as c:
        assert await c.health() is False
        assert await c.health_generate() is False
    engine.is_healthy = False
    async with Client(BASE_URL, transport=transport) as c:
        assert await c.health() is False
        assert await c.health_generate() is False
        engine.is_healthy = True
        assert await c.health_generate() is True


async def test_wait_until_healthy_times_out(transport: httpx.ASGITransport) -> None:
    dead = FlakyTransport(transport, num_failures=10**9)
    async with Client(BASE_URL, transport=dead, retry_backoff=0.001) as c:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(RolloutClientError, match=r"not healthy after 0\.2 s.*Connection refused") as info:
            await c.wait_until_healthy(timeout=0.2, interval=0.01)
        assert loop.time() - start < 2.0
    assert info.value.endpoint == "/health"
    assert dead.num_attempts > 1  # it polled


async def test_wait_until_healthy_returns_once_the_server_is_up(engine: FakeEngine) -> None:
    flaky = FlakyTransport(httpx.ASGITransport(app=make_app(engine)), num_failures=3)
    async with Client(BASE_URL, transport=flaky, retry_backoff=0.001) as c:
        await c.wait_until_healthy(timeout=10.0, interval=0.001)
    assert flaky.num_attempts == 4

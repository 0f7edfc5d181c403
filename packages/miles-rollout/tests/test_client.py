"""Real HTTP over ASGI: `miles_rollout.client.Client` against the fake SGLang-shaped server of conftest.py
(requests, keys, bodies, replies). Errors, retries and health checks: test_client_failures.py."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

from miles_contracts import GenerateClient, GenerateRequest, GenerateResponse, SamplingParams
from miles_kernels import decode_bucket, encode_bucket, iter_buckets
from miles_rollout.client import Client, RolloutClientError

BASE_URL = "http://engine.test"


def _bucket(version: int = 3) -> tuple[bytes, dict[str, torch.Tensor]]:
    tensors = {"model.embed_tokens.weight": torch.randn(4, 3), "lm_head.bias": torch.arange(5, dtype=torch.int64)}
    return encode_bucket(tensors, version=version, index=0, count=1), tensors


# -- generate ----------------------------------------------------------------------------------------------------


async def test_generate_single_response_is_a_list_of_one(client: Client, engine: Any) -> None:
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


async def test_generate_refuses_streaming(client: Client, engine: Any) -> None:
    with pytest.raises(ValueError, match="stream=False"):
        await client.generate(GenerateRequest(text="hi", stream=True))
    assert engine.requests == []


# -- auth --------------------------------------------------------------------------------------------------------


async def test_api_key_on_every_request_and_admin_key_on_admin_endpoints(client: Client, engine: Any) -> None:
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
        "/model_info": "Bearer user-key",
        "/health": "Bearer user-key",
        "/flush_cache": "Bearer admin-key",
        "/update_weights_from_disk": "Bearer admin-key",
        "/release_memory_occupation": "Bearer admin-key",
        "/abort_request": "Bearer admin-key",
    }


async def test_admin_endpoints_fall_back_to_api_key_and_no_key_sends_no_header(
    transport: httpx.ASGITransport, engine: Any
) -> None:
    async with Client(BASE_URL, api_key="only-key", transport=transport) as c:
        await c.flush_cache()
    assert engine.last("/flush_cache").headers["authorization"] == "Bearer only-key"
    async with Client(BASE_URL, transport=transport) as c:
        await c.flush_cache()
        await c.get_model_info()
    assert "authorization" not in engine.last("/flush_cache").headers
    assert "authorization" not in engine.last("/model_info").headers


# -- weights, memory, control ------------------------------------------------------------------------------------


async def test_bucket_upload_sends_the_exact_bytes_as_octet_stream(client: Client, engine: Any) -> None:
    data, tensors = _bucket(version=3)
    reply = await client.update_weights_from_tensor(data)
    assert reply["success"] is True
    sent = engine.last("/update_weights_from_tensor")
    assert sent.headers["content-type"] == "application/octet-stream"
    assert sent.body == data
    assert engine.assembler.is_complete and engine.assembler.version == 3
    for name, tensor in tensors.items():
        assert torch.equal(engine.assembler.tensors[name], tensor)


async def test_buckets_are_sent_in_order_and_the_last_reply_returned(client: Client, engine: Any) -> None:
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
            },  # no backend: the server chooses (SGLang: NCCL)
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
    client: Client, engine: Any, call: Any, path: str, body: dict[str, Any]
) -> None:
    await call(client)
    sent = engine.last(path)
    assert sent.method == "POST"
    assert httpx.Response(200, content=sent.body).json() == body
    assert sent.headers["authorization"] == "Bearer admin-key"


async def test_text_and_empty_replies_become_dicts(client: Client) -> None:
    assert await client.flush_cache() == {"message": "Cache flushed."}
    assert await client.abort_request(abort_all=True) == {}


async def test_a_busy_flush_is_a_client_error_with_sglangs_message(client: Client, engine: Any) -> None:
    engine.busy = True
    with pytest.raises(RolloutClientError, match=r"HTTP 400.*running requests"):
        await client.flush_cache(timeout=2.5)
    assert engine.requests[-1].path == "/flush_cache?timeout=2.5"


async def test_bad_arguments_fail_before_sending(client: Client, engine: Any) -> None:
    with pytest.raises(ValueError, match="same tensors"):
        await client.update_weights_from_distributed(["a", "b"], ["float32"], [[1], [2]])
    with pytest.raises(ValueError, match="weight_version"):
        await client.update_weights_from_disk("/ckpt", weight_version=-1)
    assert engine.requests == []


async def test_info_endpoints(client: Client) -> None:
    assert (await client.get_model_info())["model_path"] == "/models/tiny"
    assert (await client.get_server_info())["kernel_config_hash"] == "abc123"


@pytest.mark.parametrize(
    ("reported", "expected"), [("default", None), ("12", 12), (4, 4), (None, None), ("v2", "v2"), ("-1", "-1")]
)
async def test_get_weight_version_accepts_sglang_strings(
    client: Client, engine: Any, reported: Any, expected: int | str | None
) -> None:
    engine.weight_version = reported
    assert await client.get_weight_version() == expected


async def test_weight_version_round_trips_through_disk_update(client: Client) -> None:
    await client.update_weights_from_disk("/ckpt/step8", weight_version=8)
    assert await client.get_weight_version() == 8

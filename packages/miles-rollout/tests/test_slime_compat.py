"""Real server over real HTTP: the request bodies slime sends to SGLang work against `miles-rollout serve`
unchanged. The bodies are transcribed from THUDM/slime: `slime/rollout/sglang_rollout.py` at 0044b40 (the rollout
payload and `GenerateState.sampling_params`) and `slime/backends/sglang_utils/sglang_engine.py` at 03b32d8
(`pause_generation` / `continue_generation` with `json={}`, `update_weights_from_distributed`'s payload,
`init_weights_update_group`, `flush_cache` by GET, `/get_server_info` read for `tp_size` / `dp_size`,
`/get_weight_version`). Evaluation adds `repetition_penalty` and `min_new_tokens` to the sampling params."""

from __future__ import annotations

import httpx
import pytest

ROLLOUT_PARAMS = {  # GenerateState.sampling_params with slime's defaults
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "max_new_tokens": 24,
    "stop": None,
    "stop_token_ids": None,
    "skip_special_tokens": False,
    "no_stop_trim": True,
    "spaces_between_special_tokens": False,
}
PROMPT = [(13 * i + 5) % 500 for i in range(20)]


@pytest.fixture(scope="module")
def server(dense_dir, start_server):
    with start_server(dense_dir, "--deterministic") as url:
        yield url


def post(url: str, path: str, body: dict | None = None, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body if body is not None else {}, timeout=120, **kwargs)


def rollout(url: str, **extra) -> dict:
    payload = {"sampling_params": {**ROLLOUT_PARAMS, "sampling_seed": 7, **extra}, "return_logprob": True,
               "input_ids": PROMPT}  # fmt: skip
    response = post(url, "/generate", payload)
    assert response.status_code == 200, response.text
    return response.json()


def test_rollout_and_evaluation_requests(server) -> None:
    output = rollout(server)
    assert len(output["output_ids"]) >= 1 and isinstance(output["text"], str)
    entries = output["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == output["output_ids"]  # slime reads tokens and log-probs from here
    evaluation = rollout(server, temperature=0.0, repetition_penalty=1.1, min_new_tokens=4, ignore_eos=True)
    assert len(evaluation["output_ids"]) == 24


def test_startup_check_and_version(server) -> None:
    info = httpx.get(f"{server}/get_server_info", timeout=10).json()
    assert (info["tp_size"], info["dp_size"]) == (1, 1)  # what slime's external-engine check compares
    assert httpx.get(f"{server}/server_info", timeout=10).json()["tp_size"] == 1
    model = httpx.get(f"{server}/model_info", timeout=10).json()
    assert model["architectures"] == ["Qwen3ForCausalLM"] and model["is_generation"]
    assert "weight_version" in httpx.get(f"{server}/get_weight_version", timeout=10).json()
    assert httpx.get(f"{server}/flush_cache", timeout=30).status_code == 200


def test_weight_update_from_disk_between_pause_and_continue(server, dense_dir) -> None:
    before = rollout(server)
    assert post(server, "/pause_generation").json()["status"] == "ok"  # slime: json={}, SGLang's mode abort
    body = {"model_path": str(dense_dir), "load_format": None, "flush_cache": True, "weight_version": "3"}
    update = post(server, "/update_weights_from_disk", body)
    assert update.status_code == 200 and update.json()["success"], update.text
    assert post(server, "/continue_generation").json()["status"] == "ok"
    after = rollout(server)
    assert after["output_ids"] == before["output_ids"] and after["meta_info"]["weight_version"] == "3"


def test_bad_weight_update_bodies_are_named_4xx(server, tmp_path) -> None:
    missing = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path / "nope")})
    assert missing.status_code == 400 and str(tmp_path / "nope") in missing.json()["detail"]
    unknown_format = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path), "load_format": "gguf"})
    assert unknown_format.status_code == 400 and "load_format" in unknown_format.json()["detail"]
    assert post(server, "/pause_generation", {"mode": "sideways"}).status_code == 400
    assert post(server, "/end_weight_update").status_code == 409  # nothing open
    assert post(server, "/destroy_weights_update_group", {"group_name": "none"}).status_code == 400
    pickled = post(server, "/update_weights_from_tensor",  # slime's payload shape; never unpickled
                   {"serialized_named_tensors": ["gASV"], "load_format": None, "flush_cache": False})  # fmt: skip
    assert pickled.status_code == 400 and "never unpickles" in pickled.json()["detail"]
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200


def test_health_is_503_once_the_engine_thread_is_gone_and_needs_no_key(dense_dir) -> None:
    import asyncio

    from miles_kernels import KernelConfig
    from miles_rollout import Engine, EngineConfig, create_app

    engine = Engine(str(dense_dir), KernelConfig(page_size=16), EngineConfig(num_kv_pages=32))
    app = create_app(engine, api_key="user-key")

    async def probe() -> tuple[int, int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return (await client.get("/health")).status_code, (await client.get("/health_generate")).status_code

    try:
        assert asyncio.run(probe()) == (200, 200)  # a router probes without the API key
    finally:
        engine.shutdown()
    assert asyncio.run(probe()) == (503, 503)

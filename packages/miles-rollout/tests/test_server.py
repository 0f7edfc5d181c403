"""Multi-process tier: a real `miles-rollout serve` subprocess over real HTTP — generation, stop handling,
log-probs, bad input, security, cache and abort."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from miles_kernels.testing import build_tokenizer

JSON = {"Content-Type": "application/json"}  # a raw body needs it (a 415 otherwise)


def post(url: str, path: str, body: object, **kwargs: object) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120, **kwargs)  # type: ignore[arg-type]


def test_generate_text_and_ids(dense_server: str) -> None:
    text = post(
        dense_server,
        "/generate",
        {
            "text": "12 + 7 =",
            "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 3,
        },
    )
    assert text.status_code == 200, text.text
    body = text.json()
    meta = body["meta_info"]
    assert meta["completion_tokens"] == len(body["output_ids"]) == 6
    assert meta["finish_reason"]["type"] == "length" and meta["weight_version"] == "default"
    assert [entry[1] for entry in meta["output_token_logprobs"]] == body["output_ids"]
    assert meta["input_token_logprobs"][0][0] is None and len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert all(len(top) == 3 for top in meta["output_top_logprobs"])
    # The greedy token is the top-1 alternative, and its log-prob equals the top-1 log-prob.
    for (lp, token, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert top[0][1] == token and top[0][0] == lp
    ids = post(dense_server, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
    assert ids.status_code == 200 and len(ids.json()["output_ids"]) == 2


def test_batch_and_n_samples_return_lists(dense_server: str) -> None:
    batch = post(
        dense_server,
        "/generate",
        {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 3, "n": 2, "sampling_seed": 9}},
    )
    outputs = batch.json()
    assert len(outputs) == 4 and all(len(o["output_ids"]) == 3 for o in outputs)
    # n samples of one prompt: the prompt is prefilled once, each sample draws with seed + i.
    alone = post(
        dense_server,
        "/generate",
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "sampling_seed": 10}},
    )
    assert alone.json()["output_ids"] == outputs[1]["output_ids"]


def test_stop_handling(dense_server: str, dense_dir) -> None:
    tokenizer = build_tokenizer(save_dir=None)
    base = {"input_ids": [10, 11, 12], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    free_run = post(dense_server, "/generate", base).json()
    output = free_run["output_ids"]
    at = max(i for i, t in enumerate(output) if t not in output[:i])  # the last token that is new when it appears
    stop_token = output[at]
    stopped = post(
        dense_server,
        "/generate",
        {**base, "sampling_params": {**base["sampling_params"], "stop_token_ids": [stop_token]}},
    ).json()
    assert stopped["output_ids"] == output[: at + 1]  # the stop token is part of the output
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}  # SGLang's keys only
    stop_text = tokenizer.decode(free_run["output_ids"][2:4])
    if stop_text.strip():
        by_string = post(
            dense_server, "/generate", {**base, "sampling_params": {**base["sampling_params"], "stop": [stop_text]}}
        ).json()
        assert by_string["meta_info"]["finish_reason"]["matched"] == stop_text
        assert stop_text not in by_string["text"]  # trimmed as SGLang does
    zero = post(dense_server, "/generate", {**base, "sampling_params": {"max_new_tokens": 0}}).json()
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"]["type"] == "length"


def test_context_limits(dense_server: str) -> None:
    too_long = post(dense_server, "/generate", {"input_ids": [1] * 512})
    assert too_long.status_code == 400 and "context length is 512" in too_long.json()["detail"]
    near = post(
        dense_server,
        "/generate",
        {"input_ids": [1] * 508, "sampling_params": {"max_new_tokens": 50, "temperature": 0}},
    )
    assert near.status_code == 200
    assert len(near.json()["output_ids"]) == 4 and near.json()["meta_info"]["finish_reason"]["type"] == "length"


BAD_REQUESTS = [
    (b"{not json", "not valid JSON"),
    (json.dumps({"text": 5}), "text"),
    (json.dumps({"input_ids": []}), "input_ids"),
    (json.dumps({"input_ids": [1, 100000]}), "outside the vocabulary"),
    (json.dumps({"input_ids": [1, -2]}), "input_ids"),
    (json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": -1}}), "sampling_params.max_new_tokens"),
    (json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 10**9}}), "sampling_params.max_new_tokens"),
    (json.dumps({"text": "hi", "sampling_params": {"temperature": -1}}), "sampling_params.temperature"),
    (json.dumps({"text": "hi", "sampling_params": {"top_p": 0}}), "sampling_params.top_p"),
    (json.dumps({"text": "hi", "sampling_params": {"top_k": 0}}), "top_k must be -1"),
    (json.dumps({"text": "hi", "sampling_params": {"n": 1000}}), "n="),
    (json.dumps({"text": "hi", "logprob_start_len": 50}), "logprob_start_len"),
    (json.dumps({"text": "hi", "sampling_params": {"temprature": 1}}), "temprature"),  # SGLang refuses these too
    (json.dumps({"text": "hi", "image_data": "data:image/png;base64,AAAA"}), "image_data"),
    (json.dumps({"text": "hi", "lora_path": "adapter"}), "lora_path"),
    (json.dumps({"text": "hi", "return_routed_experts": True}), "has no MoE layer"),  # a dense model
    (json.dumps({"text": "hi", "routed_experts_start_len": -1}), "routed_experts_start_len"),
    (json.dumps({"text": "hi", "return_hidden_states": True}), "return_hidden_states"),
    (json.dumps({"text": "hi", "sampling_params": {"json_schema": "{not json"}}), "json_schema"),
    (json.dumps({"text": "hi", "sampling_params": {"regex": "([a-z"}}), "regex"),
    (json.dumps({"text": "hi", "sampling_params": {"repetition_penalty": 0}}), "repetition_penalty"),
    (json.dumps({"text": "hi", "sampling_params": {"frequency_penalty": 9}}), "frequency_penalty"),
    (json.dumps({"text": "hi", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 2}}), "min_new_tokens"),
    (json.dumps({"input_ids": [[1], [2]], "return_logprob": [True]}), "return_logprob"),
    (json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 500, "n": 200}}), "KV pages"),
]


def test_bad_input_is_a_named_400_and_the_server_is_unchanged(dense_server: str) -> None:
    probe = {"input_ids": [3, 1, 4, 1, 5], "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    before = post(dense_server, "/generate", probe).json()
    for body, needle in BAD_REQUESTS:
        response = httpx.post(f"{dense_server}/generate", content=body, headers=JSON, timeout=60)
        assert 400 <= response.status_code < 500, (body, response.text)
        assert needle in response.json()["detail"], (body, response.json())
    assert httpx.get(f"{dense_server}/health", timeout=10).status_code == 200
    assert httpx.get(f"{dense_server}/health_generate", timeout=60).status_code == 200
    # Keys SGLang does not know are ignored, as SGLang ignores them (sglang-router adds `model`, ...).
    routed = post(dense_server, "/generate", {**probe, "model": "default", "log_metrics": False, "anything": 1})
    assert routed.status_code == 200 and routed.json()["output_ids"] == before["output_ids"]
    after = post(dense_server, "/generate", probe).json()
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"].get("output_token_logprobs") == before["meta_info"].get("output_token_logprobs")


def test_info_endpoints(dense_server: str) -> None:
    info = httpx.get(f"{dense_server}/get_server_info", timeout=10).json()
    assert info["kernel_config"]["mode"] == "deterministic" and len(info["kernel_config"]["fingerprint"]) == 16
    model = httpx.get(f"{dense_server}/get_model_info", timeout=10).json()
    assert model["is_generation"] and model["architecture"] == "Qwen3ForCausalLM"
    assert httpx.get(f"{dense_server}/get_weight_version", timeout=10).json() == {"weight_version": "default"}


def test_prefix_cache_reuse_and_flush(dense_server: str) -> None:
    assert post(dense_server, "/flush_cache", {}).status_code == 200
    prompt = list(range(100, 150))
    first = post(
        dense_server, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    ).json()
    second = post(
        dense_server, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    ).json()
    assert first["meta_info"]["cached_tokens"] == 0 and second["meta_info"]["cached_tokens"] == 48  # 3 pages of 16
    assert second["output_ids"] == first["output_ids"]
    post(dense_server, "/flush_cache", {})
    third = post(
        dense_server, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    ).json()
    assert third["meta_info"]["cached_tokens"] == 0 and third["output_ids"] == first["output_ids"]


def test_abort_mid_generation(dense_server: str, wait_for_engine) -> None:
    async def scenario() -> tuple[dict, httpx.Response]:
        async with httpx.AsyncClient(base_url=dense_server, timeout=120) as client:
            before = (await client.get("/get_server_info")).json()["num_generated_tokens"]
            long = asyncio.create_task(
                client.post(
                    "/generate",
                    json={
                        "input_ids": [1, 2],
                        "rid": "long-one",
                        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
                    },
                )
            )
            # the request is decoding and has tokens: an abort now ends it part-way
            await wait_for_engine(dense_server, lambda s: s["num_running"] == 1 and s["num_generated_tokens"] > before)
            aborted = await client.post("/abort_request", json={"rid": "long-one"})
            return (await long).json(), aborted

    result, aborted = asyncio.run(scenario())
    assert aborted.json()["success"]
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(result["output_ids"]) < 400


def test_start_and_stop_profile_write_a_chrome_trace(dense_server: str, tmp_path) -> None:
    """SGLang's /start_profile and /stop_profile: a torch.profiler trace of the engine thread, SGLang's file name."""
    assert post(dense_server, "/start_profile", {"output_dir": str(tmp_path), "profile_id": "t"}).status_code == 200
    again = post(dense_server, "/start_profile", {"output_dir": str(tmp_path)})
    assert again.status_code == 400 and "already recording" in again.text
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}}
    assert post(dense_server, "/generate", body).status_code == 200
    stopped = post(dense_server, "/stop_profile", {})
    assert stopped.status_code == 200 and str(tmp_path / "t-TP-0.trace.json") in stopped.text
    events = json.loads((tmp_path / "t-TP-0.trace.json").read_text())["traceEvents"]
    gemms = ("aten::mm", "aten::bmm", "native::native_linear")  # the forward's GEMMs (torch or native kernels)
    assert any(e.get("ph") == "X" and e.get("name") in gemms for e in events)
    assert post(dense_server, "/stop_profile", {}).status_code == 400  # none is recording
    for refused, field in (({"num_steps": 3}, "num_steps"), ({"profile_id": "../x"}, "profile_id")):
        response = post(dense_server, "/start_profile", refused)
        assert response.status_code == 400 and field in response.text


def test_security_keys(dense_dir, start_server) -> None:
    with start_server(dense_dir, "--api-key", "user-key", "--admin-key", "admin-key") as url:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
        assert post(url, "/generate", body).status_code == 401
        assert post(url, "/generate", body, headers={"Authorization": "Bearer user-key"}).status_code == 200
        assert httpx.get(f"{url}/get_server_info", timeout=10).status_code == 401
        flush = {"Authorization": "Bearer user-key"}
        assert post(url, "/flush_cache", {}, headers=flush).status_code == 401  # the user key is not admin
        assert post(url, "/start_profile", {}, headers=flush).status_code == 401  # it writes files: admin only
        assert post(url, "/flush_cache", {}, headers={"Authorization": "Bearer admin-key"}).status_code == 200
        assert post(url, "/generate", body, headers={"Authorization": "Bearer admin-key"}).status_code == 200
        import openai

        with pytest.raises(openai.AuthenticationError, match="API key"):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=f"{url}/v1", api_key="user-key", max_retries=0).models.list().data


def test_non_loopback_bind_without_admin_key_is_refused(dense_dir) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "miles_rollout.cli", "serve", "--model", str(dense_dir), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "without --admin-key" in result.stderr


@pytest.mark.parametrize("argv", [["serve"], ["serve", "--model", "/nonexistent/model"]])
def test_cli_errors(argv: list[str]) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "miles_rollout.cli", *argv], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "--model" in result.stderr or "config.json not found" in result.stderr


def test_serve_flags_are_generated_from_the_config_models() -> None:
    """`miles-rollout serve --help` lists every field of ServeConfig and the models it nests (KernelConfig,
    EngineConfig), with defaults and allowed values; the short forms map onto the generated flags; a bad value or
    an unknown flag exits with 2 and says what to fix."""
    import subprocess
    import sys

    from pydantic import BaseModel

    from miles_rollout.cli import parse_serve
    from miles_rollout.config import ServeConfig

    def flags(model: type[BaseModel]) -> list[str]:
        out = []
        for name, info in model.model_fields.items():
            nested = isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)
            out += flags(info.annotation) if nested else ["--" + name.replace("_", "-")]  # type: ignore[arg-type]
        return out

    def serve(*argv: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "miles_rollout.cli", "serve", *argv]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    help_text = serve("--help").stdout
    for flag in flags(ServeConfig):
        assert flag in help_text, flag
    assert "{deterministic,fast}" in help_text and "(default: 256)" in help_text  # max_running_requests
    config = parse_serve(["--model", "m", "--deterministic", "--num-kv-pages", "64", "--dtype", "bfloat16"])
    assert config.model_path == "m" and config.kernel.mode == "deterministic" and config.kernel.dtype == "bfloat16"
    assert config.engine.num_kv_pages == 64 and parse_serve(["--model=m"]).kernel.mode == "fast"
    bad = serve("--model-path", "m", "--num-kv-pages", "1")
    assert bad.returncode == 2 and "num_kv_pages" in bad.stderr and "greater than or equal to 2" in bad.stderr
    typo = serve("--model-path", "m", "--kv-pages", "64")
    assert typo.returncode == 2 and "--num-kv-pages" in typo.stderr, typo.stderr

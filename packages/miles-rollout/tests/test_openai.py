"""The OpenAI routes (`/v1/models`, `/v1/completions`, `/v1/chat/completions`) of a real `miles-rollout serve`
process, driven by the official `openai` client: outputs equal the native `/generate` ones for the same request and
seed, and bad input is a 4xx in OpenAI's error body that leaves the server's outputs unchanged."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def client(dense_server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{dense_server}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def native(url: str, body: dict[str, object]) -> list[dict[str, object]]:
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    out = response.json()
    return out if isinstance(out, list) else [out]


def test_models_list_and_retrieve(client: openai.OpenAI, model_name: str, dense_dir: Path) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [str(dense_dir)] and models[0].owned_by == "miles"
    assert client.models.retrieve(model_name).id == model_name
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no-such-model")


def test_completions_equal_native_generate(client: openai.OpenAI, model_name: str, dense_server: str) -> None:
    completion = client.completions.create(
        model=model_name, prompt=["12 + 7 =", "3 * 4 ="], max_tokens=5, n=2, temperature=1.0, seed=11, logprobs=2,
        extra_body={"top_k": 50, "ignore_eos": True},
    )  # fmt: skip
    assert completion.object == "text_completion" and len(completion.choices) == 4
    expected = native(dense_server, {
        "text": ["12 + 7 =", "3 * 4 ="], "return_logprob": True, "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 5, "n": 2, "temperature": 1.0, "sampling_seed": 11, "top_k": 50,
                            "ignore_eos": True},
    })  # fmt: skip
    for index, (choice, want) in enumerate(zip(completion.choices, expected, strict=True)):
        meta = want["meta_info"]
        assert isinstance(meta, dict)
        assert choice.index == index and choice.text == want["text"] and choice.finish_reason == "length"
        assert choice.logprobs is not None
        assert choice.logprobs.token_logprobs == [entry[0] for entry in meta["output_token_logprobs"]]
        assert choice.logprobs.tokens == [entry[2] for entry in meta["output_token_logprobs"]]
        assert all(top is not None and len(top) == 2 for top in choice.logprobs.top_logprobs or [])
    prompts = [m["meta_info"]["prompt_tokens"] for m in expected[::2]]  # type: ignore[index]
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == sum(prompts) and completion.usage.completion_tokens == 20
    assert completion.usage.total_tokens == sum(prompts) + 20
    again = client.completions.create(
        model=model_name, prompt=["12 + 7 =", "3 * 4 ="], max_tokens=5, n=2, temperature=1.0, seed=11,
        extra_body={"top_k": 50, "ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in again.choices] == [c.text for c in completion.choices]


def test_completions_take_token_ids_and_stop(client: openai.OpenAI, dense_server: str) -> None:
    greedy = client.completions.create(model="default", prompt=[5, 6, 7], max_tokens=4, temperature=0)
    want = native(dense_server, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert greedy.choices[0].text == want[0]["text"] and greedy.model == "default"
    text = greedy.choices[0].text
    if len(text.strip()) > 1:  # a stop string taken from the greedy output ends it there, trimmed
        stop = text.strip()[1]
        stopped = client.completions.create(model="default", prompt=[5, 6, 7], max_tokens=4, temperature=0, stop=stop)
        assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text


def test_chat_renders_the_template_and_equals_native(
    client: openai.OpenAI, model_name: str, dense_server: str, dense_dir: Path
) -> None:
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "12 + 7 ="}]
    chat = client.chat.completions.create(
        model=model_name, messages=messages, max_completion_tokens=6, temperature=0.8, seed=3, logprobs=True,
        top_logprobs=3, n=2,
    )  # fmt: skip
    assert chat.object == "chat.completion" and len(chat.choices) == 2
    ids = AutoTokenizer.from_pretrained(dense_dir).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    expected = native(dense_server, {
        "input_ids": list(ids), "return_logprob": True, "top_logprobs_num": 3, "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.8, "sampling_seed": 3, "n": 2},
    })  # fmt: skip
    for choice, want in zip(chat.choices, expected, strict=True):
        meta = want["meta_info"]
        assert isinstance(meta, dict)
        assert choice.message.role == "assistant" and choice.message.content == want["text"]
        assert choice.finish_reason == meta["finish_reason"]["type"]  # type: ignore[index]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert [t.logprob for t in choice.logprobs.content] == [e[0] for e in meta["output_token_logprobs"]]
        assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
        assert all(t.bytes == list(t.token.encode()) for t in choice.logprobs.content)
    assert chat.usage is not None and chat.usage.prompt_tokens == len(ids)


IMAGE_PART = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
BAD = [
    ({"model": "default", "prompt": "hi", "max_tokens": "many"}, "/v1/completions", "max_tokens"),
    ({"model": "default", "prompt": "hi", "max_tokens": 0}, "/v1/completions", "max_tokens"),
    ({"model": "default", "prompt": []}, "/v1/completions", "prompt"),
    ({"model": "default", "prompt": "hi", "top_k": 0}, "/v1/completions", "top_k"),
    ({"model": "default", "prompt": "hi", "stream": True, "stream_options": "yes"}, "/v1/completions",
     "stream_options"),
    ({"model": "default", "prompt": "hi", "logit_bias": {"five": 10}}, "/v1/completions", "logit_bias"),
    ({"model": "default", "prompt": "hi", "logprobs": 99}, "/v1/completions", "logprobs"),
    ({"model": "default", "prompt": "hi", "regex": "([a-z"}, "/v1/completions", "regex"),
    ({"model": "default", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     "/v1/chat/completions", "json_schema"),
    ({"model": "default", "messages": []}, "/v1/chat/completions", "messages"),
    ({"model": "default", "messages": [{"role": "wizard", "content": "x"}]}, "/v1/chat/completions", "role"),
    ({"model": "default", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "/v1/chat/completions", "top_logprobs"),
    ({"model": "default", "messages": [{"role": "user", "content": [IMAGE_PART]}]}, "/v1/chat/completions",
     "messages"),
    ({"model": "default", "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "/v1/chat/completions", "tools"),
]  # fmt: skip


def test_bad_input_is_an_openai_4xx_and_the_server_is_unchanged(client: openai.OpenAI, dense_server: str) -> None:
    probe = {"model": "default", "prompt": [3, 1, 4, 1, 5], "max_tokens": 5, "temperature": 0, "logprobs": 1}
    before = httpx.post(f"{dense_server}/v1/completions", json=probe, timeout=120).json()
    for body, path, needle in BAD:
        response = httpx.post(f"{dense_server}{path}", json=body, timeout=60)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert needle in error["message"] and error["type"] == "invalid_request_error", (body, error)
    for raw in (b"{not json", b"[1, 2]"):
        response = httpx.post(f"{dense_server}/v1/completions", content=raw, timeout=60,
                              headers={"Content-Type": "application/json"})  # fmt: skip
        assert response.status_code == 400 and "error" in response.json()
    unknown = httpx.post(f"{dense_server}/v1/completions", json={**probe, "model": "gpt-4"}, timeout=60)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="default", prompt="hi", max_tokens=-1)
    after = httpx.post(f"{dense_server}/v1/completions", json=probe, timeout=120).json()
    assert after["choices"] == before["choices"]
    assert json.dumps(after["usage"]) == json.dumps(before["usage"])


def read_events(url: str, path: str, body: dict[str, object]) -> list[dict[str, object]]:
    """A streamed request's events (`data: ...` lines), which must end with `[DONE]`."""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        payloads = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def test_native_generate_streams_sglang_chunks(dense_server: str) -> None:
    """SGLang's native stream: per token a chunk with the sample's text and ids so far (`index` in a batch / n > 1),
    its final response last; streamed texts are prefixes of the final text, with a stop string to hold back."""
    body = {"text": ["12 + 7 =", "hi"], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "n": 2, "sampling_seed": 5, "stop": ["e ", "an"]}}  # fmt: skip
    final = native(dense_server, body)
    events = read_events(dense_server, "/generate", {**body, "stream": True})
    for index, want in enumerate(final):
        mine = [e for e in events if e["index"] == index]
        last = mine[-1]
        assert last["text"] == want["text"] and last["output_ids"] == want["output_ids"]
        assert last["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]  # type: ignore[index]
        assert all(e["meta_info"].get("finish_reason") is None for e in mine[:-1])  # type: ignore[union-attr]
        assert all(str(want["text"]).startswith(str(e["text"])) for e in mine)
        ids = [e["output_ids"] for e in mine]
        assert all(len(a) < len(b) for a, b in itertools.pairwise(ids))  # type: ignore[arg-type]
    single = read_events(dense_server, "/generate", {"input_ids": [1, 2, 3], "stream": True,
                                                     "sampling_params": {"max_new_tokens": 3}})  # fmt: skip
    assert "index" not in single[0] and len(single) == 3
    # Input the engine refuses is a 4xx with a JSON body, before anything streams.
    too_long = httpx.post(f"{dense_server}/generate", json={"input_ids": [1] * 600, "stream": True}, timeout=60)
    assert too_long.status_code == 400 and "context length" in too_long.json()["detail"]
    chat_too_long = httpx.post(f"{dense_server}/v1/completions", timeout=60,
                               json={"prompt": [1] * 600, "stream": True, "model": "default"})  # fmt: skip
    assert chat_too_long.status_code == 400 and "context length" in chat_too_long.json()["error"]["message"]


@pytest.mark.parametrize("chat", [False, True])
def test_openai_streams_equal_the_whole_response(client: openai.OpenAI, chat: bool) -> None:
    """The openai client's stream: concatenated deltas are the non-streamed text, the last chunk of each choice has
    its finish_reason, the chat's first delta carries the role, `include_usage` adds the usage chunk."""
    common = {"model": "default", "n": 2, "seed": 4, "stop": ["e "], "temperature": 1.0}
    if chat:
        request = {**common, "messages": [{"role": "user", "content": "12 + 7 ="}], "max_tokens": 6, "logprobs": True}
        whole = client.chat.completions.create(**request)  # type: ignore[call-overload]
        chunks = list(client.chat.completions.create(**request, stream=True,  # type: ignore[call-overload]
                                                     stream_options={"include_usage": True}))  # fmt: skip
        texts = [c.message.content for c in whole.choices]
    else:
        request = {**common, "prompt": "12 + 7 =", "max_tokens": 6, "logprobs": 1}
        whole = client.completions.create(**request)  # type: ignore[call-overload]
        chunks = list(client.completions.create(**request, stream=True,  # type: ignore[call-overload]
                                                stream_options={"include_usage": True}))  # fmt: skip
        texts = [c.text for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    for index, text in enumerate(texts):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index]
        if chat:
            assert mine[0].delta.role == "assistant"
            assert "".join(c.delta.content or "" for c in mine) == text
            streamed = [t.logprob for c in mine if c.logprobs and c.logprobs.content for t in c.logprobs.content]
            assert streamed == [t.logprob for t in whole.choices[index].logprobs.content]  # type: ignore[union-attr]
        else:
            assert "".join(c.text for c in mine) == text
            streamed = [lp for c in mine if c.logprobs for lp in c.logprobs.token_logprobs or []]
            assert streamed == whole.choices[index].logprobs.token_logprobs  # type: ignore[union-attr]
        assert mine[-1].finish_reason == whole.choices[index].finish_reason
        assert all(c.finish_reason is None for c in mine[:-1])


def test_a_disconnect_mid_stream_aborts_and_frees_the_pages(dense_server: str, wait_for_engine) -> None:
    info = httpx.get(f"{dense_server}/get_server_info", timeout=10).json()
    generated = info["num_generated_tokens"]
    body = {"input_ids": [9, 8, 7], "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    with httpx.stream("POST", f"{dense_server}/generate", json=body, timeout=120) as response:
        lines = response.iter_lines()
        next(lines), next(lines)  # two tokens streamed; the client then goes away
    # The request ends (aborted) without generating its 400 tokens, and holds no page: every page in use is one the
    # prefix cache keeps.
    asyncio.run(wait_for_engine(dense_server, lambda s: s["num_running"] == 0 and s["num_prefilling"] == 0))
    after = httpx.get(f"{dense_server}/get_server_info", timeout=10).json()
    assert after["num_generated_tokens"] - generated < 400
    assert after["num_used_pages"] == after["num_cached_pages"]


def test_prometheus_metrics_count_every_route(dense_server: str, dense_dir: Path) -> None:
    """`/metrics` parsed by prometheus-client's own parser: SGLang's metric names, the served model as label, and
    counters that move by exactly what the requests did (native, OpenAI, streamed)."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[str, float]:
        response = httpx.get(f"{dense_server}/metrics", timeout=10)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        samples = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                assert sample.labels.get("model_name") == str(dense_dir), sample
                if "le" not in sample.labels:
                    samples[sample.name] = sample.value
        return samples

    before = scrape()
    prompt = list(range(4, 44))  # two whole 16-token pages: the prefix cache keeps them
    params = {"max_new_tokens": 3, "ignore_eos": True}
    native(dense_server, {"input_ids": prompt, "sampling_params": {**params, "n": 2}})
    completion = {"model": "default", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    assert httpx.post(f"{dense_server}/v1/completions", json=completion, timeout=120).status_code == 200
    read_events(dense_server, "/v1/completions", {**completion, "stream": True})
    read_events(dense_server, "/generate", {"input_ids": prompt, "sampling_params": params, "stream": True})
    after = scrape()

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert moved("sglang:num_requests_total") == 5
    assert moved("sglang:generation_tokens_total") == 2 * 3 + 2 + 2 + 3
    assert moved("sglang:prompt_tokens_total") == 5 * len(prompt)
    assert moved("sglang:e2e_request_latency_seconds_count") == 5
    assert moved("sglang:cached_tokens_total") > 0  # the same prompt, four more times: served from the cache
    assert 0 < after["sglang:cache_hit_rate"] <= 1
    assert after["sglang:num_running_reqs"] == 0 and after["sglang:num_queue_reqs"] == 0
    assert after["sglang:max_total_num_tokens"] == 511 * 16  # --num-kv-pages 512 (one null page), 16-token pages
    assert 0 <= after["sglang:token_usage"] <= 1 and after["sglang:gen_throughput"] >= 0
    assert after["miles:weight_version"] == -1 and after["sglang:spec_accept_length"] == 1

"""The OpenAI routes (`/v1/models`, `/v1/completions`, `/v1/chat/completions`) of a real `miles-rollout serve`
process, driven by the official `openai` client: outputs equal the native `/generate` ones for the same request and
seed, and bad input is a 4xx in OpenAI's error body that leaves the server's outputs unchanged."""

from __future__ import annotations

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
    ({"model": "default", "prompt": "hi", "stream": True}, "/v1/completions", "stream"),
    ({"model": "default", "prompt": "hi", "logit_bias": {"5": 10}}, "/v1/completions", "logit_bias"),
    ({"model": "default", "prompt": "hi", "logprobs": 99}, "/v1/completions", "logprobs"),
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
        response = httpx.post(f"{dense_server}/v1/completions", content=raw, timeout=60)
        assert response.status_code == 400 and "error" in response.json()
    unknown = httpx.post(f"{dense_server}/v1/completions", json={**probe, "model": "gpt-4"}, timeout=60)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="default", prompt="hi", max_tokens=-1)
    after = httpx.post(f"{dense_server}/v1/completions", json=probe, timeout=120).json()
    assert after["choices"] == before["choices"]
    assert json.dumps(after["usage"]) == json.dumps(before["usage"])

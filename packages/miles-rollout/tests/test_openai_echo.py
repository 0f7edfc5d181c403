"""Completions' `echo` on a real `miles-rollout serve` process (server tier, CPU numerics; one in-process test, for
a model directory without a tokenizer): each choice starts with its prompt — the text and, with `logprobs`, the
prompt tokens' log-probs (the first one null) before the output's — as SGLang's OpenAI layer answers.
lm-evaluation-harness' `local-completions` model scores log-likelihood tasks with such requests; the prompt's
log-probs are checked against the native API's `input_token_logprobs` and against an independent forward of the same
weights in transformers, and lm-eval's rule for reading the response gives the right (sum of log-probs, is greedy).
Echo input the server cannot serve is a 4xx that says what to change."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles_kernels import KernelConfig
from miles_kernels.testing import save_random_model, tiny_config
from miles_rollout import Engine, EngineConfig, create_app
from miles_rollout.completion_layout import completion_logprobs

TEXTS = ["12 + 7 =", "The capital of France is"]


def test_alternatives_with_one_text_keep_the_most_likely() -> None:
    """Pure logic: two top tokens that decode to the same text (byte pieces) are one key holding the larger
    log-prob, so `max(top.values())` is still the position's top log-prob."""
    entries = [(-0.5, 7, "\ufffd")]
    top = [(-0.5, 7, "\ufffd"), (-1.5, 8, "\ufffd"), (-2.0, 9, "a")]
    layout = completion_logprobs(entries, [top])
    assert layout["top_logprobs"] == [{"\ufffd": -0.5, "a": -2.0}]


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def completion(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = post(url, "/v1/completions", {"model": "default", **body})
    assert response.status_code == 200, response.text
    return response.json()


def native(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = post(url, "/generate", body)
    assert response.status_code == 200, response.text
    out = response.json()
    return out if isinstance(out, list) else [out]


def streamed(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{url}/v1/completions", json={"model": "default", **body, "stream": True},
                      timeout=120) as response:  # fmt: skip
        assert response.status_code == 200
        payloads = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


@pytest.fixture(scope="module")
def tokenizer(dense_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(dense_dir)


@pytest.fixture(scope="module")
def hf_logprobs(dense_dir: Path) -> Any:
    """ids -> (log-prob of token p under tokens 0..p-1, for p >= 1; the argmax at each of those positions), from
    transformers' own implementation of the model, in float32."""
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()

    def score(ids: list[int]) -> tuple[list[float], list[int]]:
        with torch.no_grad():
            logprobs = model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
        return logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(), logprobs.argmax(-1).tolist()

    return score


def lm_eval_reading(response: dict[str, Any], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """How lm-eval 0.4.13's `LocalCompletionsAPI.parse_logprobs` reads a response: per choice, in `index` order, the
    continuation's entries are `token_logprobs[ctxlen:-1]` (the last one is the generated token); their sum, and
    whether each equals the largest value in its `top_logprobs` (test_lm_eval.py runs lm-eval's own code)."""
    results = []
    for choice, ctxlen in zip(sorted(response["choices"], key=lambda c: c["index"]), ctxlens, strict=True):
        logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        results.append((sum(logprobs), all(lp == max(top.values()) for lp, top in zip(logprobs, tops, strict=True))))
    return results


@pytest.mark.parametrize("num_top", [1, 5])
def test_lm_eval_loglikelihood_request(dense_server: str, tokenizer: Any, hf_logprobs: Any, num_top: int) -> None:
    """lm-eval's request: a batch of token-id prompts (context + continuation), echo, logprobs, one greedy token.
    One continuation is the model's own greedy one, so `is_greedy` is exercised both ways."""
    contexts = [tokenizer.encode(text) for text in TEXTS]
    greedy = native(dense_server, {"input_ids": contexts[0], "sampling_params": {"max_new_tokens": 3,
                                                                                 "temperature": 0}})[0]  # fmt: skip
    pairs = [(contexts[0], greedy["output_ids"]), (contexts[0], tokenizer.encode(" 19")),
             (contexts[1], tokenizer.encode(" Paris"))]  # fmt: skip
    prompts = [context + continuation for context, continuation in pairs]
    response = completion(dense_server, {"prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": num_top,
                                         "seed": 1234, "echo": True})  # fmt: skip
    want = native(dense_server, {
        "input_ids": prompts, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": num_top,
        "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    })  # fmt: skip
    assert [c["index"] for c in response["choices"]] == [0, 1, 2]
    for choice, prompt, expected in zip(response["choices"], prompts, want, strict=True):
        meta, logprobs = expected["meta_info"], choice["logprobs"]
        assert choice["text"] == tokenizer.decode(prompt, skip_special_tokens=True) + expected["text"]
        entries = meta["input_token_logprobs"] + meta["output_token_logprobs"]
        assert len(entries) == len(prompt) + 1
        assert logprobs["token_logprobs"] == [lp for lp, _, _ in entries]
        assert logprobs["tokens"] == [text for _, _, text in entries]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        tops = meta["input_top_logprobs"][1:] + meta["output_top_logprobs"]
        for top, alternatives in zip(logprobs["top_logprobs"][1:], tops, strict=True):
            assert 1 <= len(top) <= num_top  # tokens whose texts coincide share a key
            assert max(top.values()) == alternatives[0][0]
        reference, _ = hf_logprobs(prompt)
        torch.testing.assert_close(logprobs["token_logprobs"][1 : len(prompt)], reference, rtol=0, atol=2e-4)
    readings = lm_eval_reading(response, [len(context) for context, _ in pairs])
    for (total, is_greedy), (context, continuation), expected in zip(readings, pairs, want, strict=True):
        scored = expected["meta_info"]["input_token_logprobs"][len(context) :]
        assert total == sum(lp for lp, _, _ in scored)
        _, argmax = hf_logprobs(context + continuation)
        assert is_greedy == (argmax[len(context) - 1 :] == continuation)
    assert readings[0][1], "the model's own greedy continuation is greedy"


def test_echo_text_prompts_with_samples(dense_server: str, tokenizer: Any) -> None:
    """Text prompts, n=2, sampled: each choice's text is its prompt's then its output, which echo leaves as it was;
    the prompt's entries come first and their offsets index the echoed text."""
    body = {"prompt": TEXTS, "n": 2, "max_tokens": 3, "temperature": 1.0, "seed": 5, "logprobs": 2}
    plain = completion(dense_server, body)
    echoed = completion(dense_server, {**body, "echo": True})
    inputs = native(dense_server, {"text": TEXTS, "return_logprob": True, "logprob_start_len": 0,
                                   "sampling_params": {"max_new_tokens": 1, "temperature": 0}})  # fmt: skip
    assert echoed["usage"] == plain["usage"] and len(echoed["choices"]) == 4
    for index, (choice, alone) in enumerate(zip(echoed["choices"], plain["choices"], strict=True)):
        prompt = TEXTS[index // 2]
        num_prompt = len(tokenizer.encode(prompt))
        logprobs = choice["logprobs"]
        assert choice["text"] == prompt + alone["text"]
        assert logprobs["token_logprobs"][:num_prompt] == [e[0] for e in inputs[index // 2]["meta_info"][
            "input_token_logprobs"]]  # fmt: skip
        assert logprobs["token_logprobs"][num_prompt:] == alone["logprobs"]["token_logprobs"]
        assert "".join(logprobs["tokens"][:num_prompt]) == prompt
        offsets = logprobs["text_offset"]
        assert offsets[:num_prompt] == [len("".join(logprobs["tokens"][:i])) for i in range(num_prompt)]
        assert offsets[num_prompt:] == [len(prompt) + o for o in alone["logprobs"]["text_offset"]]
        assert all(choice["text"][o:].startswith(t) for o, t in zip(offsets, logprobs["tokens"], strict=True))


def test_echo_without_logprobs_is_text_only(dense_server: str, tokenizer: Any) -> None:
    """No logprobs: the text only. `logprobs: 0`: every token's entry, prompt's included, with no alternatives
    (where SGLang, reading 0 as false, leaves the prompt's entries out and the lists no longer match the text)."""
    ids = tokenizer.encode(TEXTS[1])
    body = {"prompt": ids, "max_tokens": 4, "temperature": 0}
    plain = completion(dense_server, body)["choices"][0]
    echoed = completion(dense_server, {**body, "echo": True})["choices"][0]
    assert echoed["text"] == TEXTS[1] + plain["text"] and echoed["logprobs"] is None
    text = completion(dense_server, {**body, "prompt": TEXTS[0], "echo": True})["choices"][0]
    assert text["text"].startswith(TEXTS[0]) and text["logprobs"] is None
    response = completion(dense_server, {**body, "echo": True, "logprobs": 0})
    bare, num_tokens = response["choices"][0]["logprobs"], len(ids) + response["usage"]["completion_tokens"]
    assert len(bare["token_logprobs"]) == num_tokens and bare["token_logprobs"][0] is None
    assert bare["top_logprobs"] == [None] * num_tokens and "".join(bare["tokens"]).startswith(TEXTS[1])


@pytest.mark.parametrize("num_top", [None, 1])
def test_echo_streams_the_prompt_in_each_choices_first_chunk(
    dense_server: str, tokenizer: Any, num_top: int | None
) -> None:
    """As SGLang streams it: a choice's first chunk starts with its prompt (text, and its log-probs when asked); the
    chunks add up to the non-streamed response."""
    prompts = [tokenizer.encode(text) for text in TEXTS]
    body = {"prompt": prompts, "n": 2, "max_tokens": 4, "temperature": 1.0, "seed": 3, "echo": True,
            "logprobs": num_top}  # fmt: skip
    whole = completion(dense_server, body)["choices"]
    chunks = [chunk["choices"][0] for chunk in streamed(dense_server, body)]
    for index, choice in enumerate(whole):
        mine = [c for c in chunks if c["index"] == index]
        assert mine[0]["text"].startswith(TEXTS[index // 2])
        assert "".join(c["text"] for c in mine) == choice["text"]
        if num_top is None:
            assert all(c["logprobs"] is None for c in mine)
            continue
        assert mine[0]["logprobs"]["token_logprobs"][0] is None
        assert len(mine[0]["logprobs"]["tokens"]) > len(prompts[index // 2])
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for c in mine for x in c["logprobs"][key]] == choice["logprobs"][key], key


def test_echo_mistakes_are_4xx_that_say_what_to_change(dense_server: str) -> None:
    probe = {"prompt": [3, 1, 4, 1, 5], "max_tokens": 2, "temperature": 0, "logprobs": 1, "echo": True}
    before = completion(dense_server, probe)
    cases = [
        ("/v1/completions", {**probe, "max_tokens": 0}, ["max_tokens", "echo", "max_tokens: 1", "/generate"]),
        ("/v1/completions", {**probe, "prompt": [[3, 1], [4, 600]]}, ["prompt[1]", "600", "vocabulary"]),
        ("/v1/completions", {**probe, "prompt": [2**40]}, ["vocabulary"]),
        ("/v1/completions", {**probe, "stream": True, "prompt": [[5, 9999]]}, ["vocabulary"]),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True},
         ["echo", "/v1/completions"]),
    ]  # fmt: skip
    for path, body, needles in cases:
        response = post(dense_server, path, {"model": "default", **body})
        assert response.status_code == 400, (body, response.text)
        message = response.json()["error"]["message"]
        assert all(needle in message for needle in needles), (body, message)
    assert completion(dense_server, probe)["choices"] == before["choices"]


async def test_echoing_token_ids_needs_the_tokenizer(tmp_path: Path) -> None:
    """In process, a model directory without a tokenizer: a token-id prompt's echo is a 400 that says why and what to
    do instead; the same request without echo is served."""
    save_random_model(tmp_path, tiny_config("dense", vocab_size=512, max_position_embeddings=512))
    engine = Engine(str(tmp_path), KernelConfig(page_size=16), EngineConfig(num_kv_pages=64))
    try:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:30000", timeout=60) as client:
            body = {"model": "default", "prompt": [[3, 1, 4], [1, 5]], "max_tokens": 2, "logprobs": 1}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            refused = await client.post("/v1/completions", json={**body, "echo": True})
    finally:
        engine.shutdown()
    assert refused.status_code == 400
    assert all(word in refused.json()["error"]["message"] for word in ("no tokenizer", "remove echo", "/generate"))

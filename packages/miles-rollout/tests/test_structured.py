"""Constrained sampling on a real server: structured output through xgrammar (`json_schema`, `regex`, `ebnf`
natively, `response_format` on `/v1`), `logit_bias` and `stop_regex`, each deterministic; a grammar that does not
compile is a 400 naming the field, and the server's outputs are unchanged after it."""

from __future__ import annotations

import asyncio
import json
import math
import re

import httpx
import openai
import pytest
import transformers

from miles_contracts import GenerateRequest, SamplingParams
from miles_kernels import KernelConfig
from miles_kernels.testing import FAMILIES, family_model
from miles_rollout import Engine, EngineConfig, InProcessClient
from miles_rollout.grammar import NO_TOKEN_FITS_THE_GRAMMAR

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


def generate(url: str, params: dict[str, object], prompt: str = "Is 12 + 7 = 19?") -> dict[str, object]:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 48, "temperature": 1.0, **params},
            "return_logprob": True}  # fmt: skip
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    out = response.json()
    assert isinstance(out, dict)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_regex_and_ebnf_outputs_match_their_grammar(dense_server: str, seed: int) -> None:
    out = generate(dense_server, {"regex": "(yes|no), [0-9]{1,2}", "sampling_seed": seed})
    assert re.fullmatch("(yes|no), [0-9]{1,2}", str(out["text"])), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"  # type: ignore[index]
    ebnf = 'root ::= "answer: " ("yes" | "no")'
    out = generate(dense_server, {"ebnf": ebnf, "sampling_seed": seed})
    assert out["text"] in ("answer: yes", "answer: no")


def test_json_schema_output_is_valid_json_for_the_schema(dense_server: str) -> None:
    for seed in range(3):
        params = {"json_schema": json.dumps(SCHEMA), "sampling_seed": seed, "max_new_tokens": 128}
        out = generate(dense_server, params)
        value = json.loads(str(out["text"]))
        assert set(value) == {"answer", "sure"} and value["answer"] in ("yes", "no")
        assert isinstance(value["sure"], bool)
        assert generate(dense_server, params)["text"] == out["text"]  # the same request and seed: the same output


def test_the_constraint_leaves_the_logprob_contract(dense_server: str) -> None:
    """The grammar decides the choice; the returned log-probs stay those of the unconstrained distribution (the
    log-prob contract): over the whole vocabulary they sum to 1, and the chosen token's is its entry there."""
    body = {"text": "Is 12 + 7 = 19?", "return_logprob": True, "top_logprobs_num": 512,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "regex": "(yes|no)"}}  # fmt: skip
    out = httpx.post(f"{dense_server}/generate", json=body, timeout=120).json()
    assert out["text"] in ("yes", "no")
    for (logprob, token, _), top in zip(out["meta_info"]["output_token_logprobs"],
                                        out["meta_info"]["output_top_logprobs"], strict=True):  # fmt: skip
        everything = {t: lp for lp, t, _ in top}
        assert len(everything) == 512 and abs(sum(math.exp(lp) for lp in everything.values()) - 1) < 1e-4
        assert everything[token] == logprob


def test_logit_bias_and_stop_regex(dense_server: str) -> None:
    favoured = 97
    out = generate(dense_server, {"logit_bias": {str(favoured): 100.0}, "max_new_tokens": 4, "ignore_eos": True})
    assert out["output_ids"] == [favoured] * 4
    free = generate(dense_server, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    text = str(free["text"])
    assert len(text) >= 4
    pattern = f"{re.escape(text[2])}.?{re.escape(text[3])}"  # matches from text[2] on, or earlier
    match = re.search(pattern, text)
    assert match is not None
    stopped = generate(dense_server, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True,
                                      "stop_regex": ["^never$", pattern]})  # fmt: skip
    assert stopped["text"] == text[: match.start()]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": match.group(0)}  # type: ignore[index]


BAD = [
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": json.dumps({"type": "nonsense"})}, "json_schema"),
    ({"regex": "([a-z"}, "regex"),
    ({"ebnf": "root ::= (("}, "ebnf"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {"99999": 1.0}}, "logit_bias"),
    ({"stop_regex": "(("}, "stop_regex"),
]


def test_invalid_constraints_are_a_400_and_the_server_is_unchanged(dense_server: str) -> None:
    probe = {"regex": "(yes|no)", "sampling_seed": 7}
    before = generate(dense_server, probe)
    for params, needle in BAD:
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 4, **params}}
        response = httpx.post(f"{dense_server}/generate", json=body, timeout=60)
        assert response.status_code == 400, (params, response.text)
        assert needle in response.json()["detail"], (params, response.json())
    assert generate(dense_server, probe)["output_ids"] == before["output_ids"]


def test_response_format_on_the_openai_routes(dense_server: str) -> None:
    client = openai.OpenAI(base_url=f"{dense_server}/v1", api_key="unused", timeout=120, max_retries=0)
    chat = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Is 12 + 7 = 19?"}], max_tokens=128, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}, n=2,
    )  # fmt: skip
    for choice in chat.choices:
        value = json.loads(choice.message.content or "")
        assert value["answer"] in ("yes", "no") and isinstance(value["sure"], bool)
    stream = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Is 12 + 7 = 19?"}], max_tokens=128, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}, n=2,
        stream=True,
    )  # fmt: skip
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in chat.choices]
    completion = client.completions.create(model="default", prompt="Answer:", max_tokens=8, seed=1,
                                           extra_body={"regex": "(yes|no)"})  # fmt: skip
    assert completion.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        )  # fmt: skip


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    return {family: family_model(family, tmp_path_factory.mktemp(family)) for family in FAMILIES}


def engine_generate(model_dir: object, params: dict[str, object], prompt: str = "Is 12 + 7 = 19?") -> list:
    engine = Engine(str(model_dir), KernelConfig(page_size=16), EngineConfig(num_kv_pages=256))
    try:
        request = GenerateRequest(text=[prompt] * 3, sampling_params=[
            SamplingParams(max_new_tokens=128, temperature=1.0, sampling_seed=seed, **params) for seed in range(3)
        ])  # fmt: skip
        return asyncio.run(InProcessClient(engine).generate(request))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_json_schema_with_the_tokenizers_of_qwen_llama3_and_glm(family_dirs, family: str) -> None:
    """Byte-level BPE behind each family's split regex, special tokens after the learned vocabulary, the model's
    embedding padded past the tokenizer: the grammar's token table is the tokenizer's, so the output is the schema's
    JSON, ended by one of the model's EOS tokens (never the padding rows, never a pad token in between)."""
    model_dir = family_dirs[family]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    eos = set(json.loads((model_dir / "config.json").read_text())["eos_token_id"])
    for response in engine_generate(model_dir, {"json_schema": json.dumps(SCHEMA)}):
        value = json.loads(response.text)
        assert set(value) == {"answer", "sure"} and value["answer"] in ("yes", "no"), response.text
        assert response.meta_info.finish_reason.type == "stop" and response.meta_info.finish_reason.matched in eos
        *body, end = response.output_ids
        assert end in eos and all(token < len(tokenizer) and token not in tokenizer.all_special_ids for token in body)
        assert tokenizer.decode(body) == response.text


def test_a_grammar_no_token_can_continue_ends_the_sample_without_a_forbidden_token(tmp_path) -> None:
    """A BPE without the byte alphabet has no token for a character its corpus never showed ("Z"): once the grammar
    needs one, the mask allows nothing, and the sample ends there (`abort`, with the reason), keeping what it
    generated; no token the grammar forbids is emitted."""
    model_dir = family_model("qwen3", tmp_path / "no-z", byte_alphabet=False)
    for response in engine_generate(model_dir, {"regex": "Z+"}):
        assert response.output_ids == [] and response.text == ""
        assert response.meta_info.finish_reason.type == "abort"
        assert response.meta_info.finish_reason.message == NO_TOKEN_FITS_THE_GRAMMAR
    for response in engine_generate(model_dir, {"regex": "(yes|no)Z"}):
        assert response.text in ("yes", "no") and response.meta_info.finish_reason.type == "abort"
        assert len(response.meta_info.output_token_logprobs or response.output_ids) == len(response.output_ids)


def test_response_format_through_a_server_with_a_qwen_style_tokenizer(family_dirs, start_server) -> None:
    """`miles-rollout serve` on the Qwen-style checkpoint: `/generate` with `json_schema`, and the openai client's
    `response_format=json_schema`, both answer the schema's JSON."""
    with start_server(family_dirs["qwen3"], "--deterministic") as url:
        out = generate(url, {"json_schema": json.dumps(SCHEMA), "sampling_seed": 0, "max_new_tokens": 128})
        assert set(json.loads(str(out["text"]))) == {"answer", "sure"}
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        completion = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Is 12 + 7 = 19?"}], max_tokens=128, seed=1,
            response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}},
        )  # fmt: skip
        assert set(json.loads(completion.choices[0].message.content or "")) == {"answer", "sure"}

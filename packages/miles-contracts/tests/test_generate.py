"""Pure-logic tests (no torch): SGLang `/generate` schemas parse SGLang-shaped JSON and name bad fields."""

import json

import pytest
from pydantic import ValidationError

from miles_contracts import GenerateRequest, GenerateResponse, SamplingParams
from miles_contracts.generate import MAX_NEW_TOKENS_LIMIT

# A rollout request as slime sends it to SGLang (THUDM/slime, slime/rollout/sglang_rollout.py at 0044b40:
# `GenerateState.sampling_params` and `generate`'s payload), with the fields sglang-router adds when it forwards one.
SGLANG_REQUEST = {
    "input_ids": [151644, 872, 198],
    "sampling_params": {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 64,
        "stop": None,
        "stop_token_ids": None,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
        "sampling_seed": 1234,
    },
    "return_logprob": True,
    "model": "default",  # the router's
    "return_text_in_logprobs": False,
    "log_metrics": True,
}
SGLANG_RESPONSE = {
    "text": " 42",
    "output_ids": [220, 19, 17],
    "meta_info": {
        "id": "a1b2",
        "finish_reason": {"type": "stop", "matched": 151645},
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "cached_tokens": 0,
        "weight_version": "default",
        "e2e_latency": 0.12,
        "output_token_logprobs": [[-0.5, 220, None], [-0.125, 19, None], [-1.0, 17, None]],
    },
}


def test_sglang_request_parses() -> None:
    request = GenerateRequest.model_validate(SGLANG_REQUEST)
    assert not request.is_batch and request.batch_size == 1
    params = request.params_for(0)
    assert params.stop_strings() == [] and params.sampling_seed == 1234 and not params.spaces_between_special_tokens
    assert GenerateRequest.ignored_keys(SGLANG_REQUEST) == ["log_metrics", "model"]
    assert GenerateRequest.model_validate_json(request.model_dump_json()) == request


def test_sglang_nulls_take_the_defaults() -> None:
    params = SamplingParams.model_validate({"temperature": None, "top_k": None, "repetition_penalty": None})
    assert (params.temperature, params.top_k, params.repetition_penalty) == (1.0, -1, 1.0)
    assert SamplingParams.model_validate({"max_new_tokens": None}).max_new_tokens == MAX_NEW_TOKENS_LIMIT
    request = GenerateRequest.model_validate({"text": "hi", "return_logprob": None, "logprob_start_len": None})
    assert request.return_logprob is False and request.logprob_start_len == -1


@pytest.mark.parametrize(
    "field", ["image_data", "lora_id", "return_hidden_states", "return_indexer_topk", "input_embeds",
              "custom_logit_processor", "bootstrap_host", "session_params"],
)  # fmt: skip
def test_sglang_features_the_engine_lacks_are_refused_by_name(field: str) -> None:
    with pytest.raises(ValidationError, match=f"{field} .* is not supported by the embedded engine"):
        GenerateRequest.model_validate({"text": "hi", field: "x" if field != "return_indexer_topk" else True})
    assert GenerateRequest.model_validate({"text": "hi", field: None})  # absent in effect: accepted


def test_lora_path_is_one_adapter_or_one_per_prompt_as_sglang_normalizes_it() -> None:
    """SGLang 0.5.23's `lora_path` (io_struct.GenerateReqInput): a string names the adapter of every prompt, a list
    one per prompt (None: the base model); a list of another length is a client error naming the field. `lora_id`,
    which SGLang's server fills in itself, stays refused."""
    batch = {"input_ids": [[1, 2], [3], [4]], "sampling_params": {"max_new_tokens": 1}}
    one = GenerateRequest.model_validate({**batch, "lora_path": "math"})
    assert [one.lora_path_for(i) for i in range(3)] == ["math", "math", "math"]
    each = GenerateRequest.model_validate({**batch, "lora_path": ["math", None, "code"]})
    assert [each.lora_path_for(i) for i in range(3)] == ["math", None, "code"]
    assert GenerateRequest.model_validate_json(each.model_dump_json()) == each
    assert GenerateRequest.model_validate({"text": "hi", "lora_path": ""}).lora_path_for(0) is None
    assert GenerateRequest.model_validate({"text": "hi"}).lora_path_for(0) is None
    with pytest.raises(ValidationError, match="lora_path has 2 entries for 3 prompts"):
        GenerateRequest.model_validate({**batch, "lora_path": ["math", "code"]})
    with pytest.raises(ValidationError, match=r"lora_id .* name the adapter with lora_path"):
        GenerateRequest.model_validate({"text": "hi", "lora_id": "0123abcd"})


def test_routed_experts_fields_follow_sglang() -> None:
    """SGLang 0.5.23's `return_routed_experts` / `routed_experts_start_len` (io_struct.GenerateReqInput): defaults
    False and 0, null means the default, a negative start is a client error naming the field; the response carries
    the routing as one base64 string."""
    request = GenerateRequest.model_validate(SGLANG_REQUEST)
    assert request.return_routed_experts is False and request.routed_experts_start_len == 0
    request = GenerateRequest.model_validate(
        {**SGLANG_REQUEST, "return_routed_experts": True, "routed_experts_start_len": 2}
    )
    assert request.return_routed_experts is True and request.routed_experts_start_len == 2
    assert GenerateRequest.model_validate_json(request.model_dump_json()) == request
    nulls = GenerateRequest.model_validate(
        {"text": "hi", "return_routed_experts": None, "routed_experts_start_len": None}
    )
    assert nulls.return_routed_experts is False and nulls.routed_experts_start_len == 0
    with pytest.raises(ValidationError, match="routed_experts_start_len=-1 is negative"):
        GenerateRequest.model_validate({"text": "hi", "return_routed_experts": True, "routed_experts_start_len": -1})
    assert "return_routed_experts" not in GenerateRequest.ignored_keys({"text": "hi", "return_routed_experts": True})
    routed = "AAAAAAEAAAA="  # int32 [0, 1] (one row, one layer, top-2), base64 as SGLang's detokenizer writes it
    response = GenerateResponse.model_validate(
        {**SGLANG_RESPONSE, "meta_info": {**SGLANG_RESPONSE["meta_info"], "routed_experts": routed}}
    )
    assert response.meta_info.routed_experts == routed
    assert json.loads(response.model_dump_json())["meta_info"]["routed_experts"] == routed
    assert (
        "routed_experts"
        not in json.loads(GenerateResponse.model_validate(SGLANG_RESPONSE).model_dump_json())["meta_info"]
    )


@pytest.mark.parametrize("field", ["structural_tag", "choice", "beam_width", "watermark"])
def test_sampling_params_the_engine_lacks_are_refused_by_name(field: str) -> None:
    with pytest.raises(ValidationError, match=f"{field} .* is not supported by the embedded engine"):
        SamplingParams.model_validate({field: "x"})


def test_constraint_params_are_checked_where_they_can_be() -> None:
    """Structured output, logit bias and stop regexes are taken (the engine compiles grammars); what the contract
    can check without a tokenizer is checked here."""
    params = SamplingParams.model_validate(
        {"regex": "(yes|no)", "logit_bias": {"5": -1.5}, "stop_regex": ["a+b"], "custom_params": {"k": 1}}
    )
    assert params.grammar == "regex" and params.stop_regexes() == ["a+b"]
    for bad, needle in (
        ({"regex": "a", "json_schema": "{}"}, "at most one"),
        ({"logit_bias": {"five": 1.0}}, "not a token id"),
        ({"stop_regex": "(("}, "not a valid regular expression"),
    ):
        with pytest.raises(ValidationError, match=needle):
            SamplingParams.model_validate(bad)


def test_list_forms_of_the_logprob_options_follow_the_batch() -> None:
    request = GenerateRequest.model_validate(
        {"input_ids": [[1, 2], [3, 4]], "return_logprob": [True, False], "logprob_start_len": [0, -1],
         "top_logprobs_num": [2, 0]}
    )  # fmt: skip
    assert [request.return_logprob_for(i) for i in range(2)] == [True, False]
    assert [request.logprob_start_len_for(i) for i in range(2)] == [0, -1]
    assert [request.top_logprobs_num_for(i) for i in range(2)] == [2, 0]
    with pytest.raises(ValidationError, match="return_logprob has 1 entries for 2 prompts"):
        GenerateRequest.model_validate({"input_ids": [[1], [2]], "return_logprob": [True]})


def test_batch_request_shapes_are_checked() -> None:
    batch = GenerateRequest(text=["a", "b"], sampling_params=[SamplingParams(), SamplingParams(n=4)])
    assert batch.is_batch and batch.batch_size == 2 and batch.params_for(1).n == 4
    with pytest.raises(ValidationError, match="sampling_params has 1 entries for 2 prompts"):
        GenerateRequest(text=["a", "b"], sampling_params=[SamplingParams()])
    with pytest.raises(ValidationError, match="exactly one of `text` or `input_ids`"):
        GenerateRequest(text="a", input_ids=[1])
    with pytest.raises(ValidationError, match="exactly one of `text` or `input_ids`"):
        GenerateRequest()


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 10**9}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"temprature": 0.5}, "temprature"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens"),
        ({"max_new_tokens": "many"}, "max_new_tokens"),
    ],
)
def test_bad_sampling_params_name_the_field(params: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        GenerateRequest.model_validate({"text": "hi", "sampling_params": params})
    assert field in str(info.value)


def test_bad_prompts_name_the_field() -> None:
    for body, field in [
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [[1, 2], []]}, "input_ids"),
        ({"input_ids": [1, -2]}, "input_ids"),
        ({"text": ""}, "text"),
        ({"text": "hi", "logprob_start_len": -5}, "logprob_start_len"),
    ]:
        with pytest.raises(ValidationError) as info:
            GenerateRequest.model_validate(body)
        assert field in str(info.value), body


def test_top_k_error_says_allowed_values() -> None:
    with pytest.raises(ValidationError, match=r"-1 \(disabled\) or a positive integer"):
        SamplingParams(top_k=-7)


def test_sglang_response_parses_and_round_trips() -> None:
    response = GenerateResponse.model_validate(SGLANG_RESPONSE)
    meta = response.meta_info
    assert meta.finish_reason is not None and meta.finish_reason.type == "stop"
    assert meta.finish_reason.matched == 151645
    assert meta.weight_version is None  # SGLang's "default" means no numbered version yet
    assert meta.output_token_logprobs == [(-0.5, 220, None), (-0.125, 19, None), (-1.0, 17, None)]
    assert json.loads(response.model_dump_json())["meta_info"]["e2e_latency"] == 0.12  # extra fields kept
    numbered = GenerateResponse.model_validate(
        {**SGLANG_RESPONSE, "meta_info": {**meta.model_dump(), "weight_version": "7"}}
    )
    assert numbered.meta_info.weight_version == 7


def test_an_infinite_logprob_is_written_as_sglang_writes_it() -> None:
    # SGLang serializes responses with orjson, which writes a non-finite float as null; so does this schema (a
    # sampled token's log-prob is never -inf: it was sampled, so its probability is not 0).
    meta = {**SGLANG_RESPONSE["meta_info"], "output_token_logprobs": [(float("-inf"), 220, None)]}
    response = GenerateResponse.model_validate({**SGLANG_RESPONSE, "meta_info": meta})
    text = response.model_dump_json()
    assert json.loads(text)["meta_info"]["output_token_logprobs"] == [[None, 220, None]]
    assert GenerateResponse.model_validate_json(text).meta_info.output_token_logprobs == [(None, 220, None)]


def test_a_response_without_text_parses() -> None:  # SGLang started with --skip-tokenizer-init
    body = {key: value for key, value in SGLANG_RESPONSE.items() if key != "text"}
    assert GenerateResponse.model_validate(body).text == ""


def test_responses_are_written_in_sglangs_shape() -> None:
    response = GenerateResponse.model_validate(SGLANG_RESPONSE)
    meta = json.loads(response.model_dump_json())["meta_info"]
    assert meta["weight_version"] == "default" and "input_token_logprobs" not in meta  # no null keys
    assert meta["finish_reason"] == {"type": "stop", "matched": 151645}
    numbered = response.model_copy(update={"meta_info": response.meta_info.model_copy(update={"weight_version": 3})})
    assert json.loads(numbered.model_dump_json())["meta_info"]["weight_version"] == "3"
    assert numbered.model_dump()["meta_info"]["weight_version"] == 3  # Python dumps keep the int


def test_finish_reason_type_is_checked() -> None:
    bad = {**SGLANG_RESPONSE, "meta_info": {**SGLANG_RESPONSE["meta_info"], "finish_reason": {"type": "done"}}}
    with pytest.raises(ValidationError) as info:
        GenerateResponse.model_validate(bad)
    assert "finish_reason" in str(info.value) and "'stop', 'length' or 'abort'" in str(info.value)

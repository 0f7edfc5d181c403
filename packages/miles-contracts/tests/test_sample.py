"""Pure-logic tests (no torch): `Sample` round-trips and rejects inconsistent data with a named field."""

import base64
import struct

import pytest
from pydantic import ValidationError

from miles_contracts import ChatMessage, GenerateResponse, Sample, SampleStatus

# SGLang's routed-experts layout for 3 prompt + 3 response tokens, 1 layer, top-2: rows for tokens 0..4 (the last
# token has none), int32, base64.
ROUTING = [[[0, 1]], [[2, 3]], [[1, 0]], [[3, 2]], [[0, 2]]]
ROUTING_B64 = base64.b64encode(struct.pack("<10i", *(e for row in ROUTING for layer in row for e in layer))).decode()


def finished_sample() -> Sample:
    return Sample(
        index=7,
        group_index=1,
        prompt=[ChatMessage(role="user", content="2+3=?")],
        label="5",
        prompt_tokens=[1, 2, 3],
        response_tokens=[4, 5, 6],
        response="5</s>",
        rollout_logprobs=[-0.25, -1.5, -3.0517578125e-05],
        loss_mask=[1, 1, 1],
        reward=1.0,
        status=SampleStatus.COMPLETED,
        finish_reason="stop",
        weight_version=3,
        weight_versions=[3, 3, 3],
        routed_experts=ROUTING_B64,
        metadata={"source": "unit", "difficulty": [1, 2]},
    )


def test_json_round_trip_is_exact() -> None:
    sample = finished_sample()
    again = Sample.model_validate_json(sample.model_dump_json())
    assert again == sample
    assert again.rollout_logprobs == [-0.25, -1.5, -3.0517578125e-05]  # floats survive JSON exactly
    assert again.num_tokens == 6


def test_routed_experts_is_int32_base64() -> None:
    sample = finished_sample()
    assert sample.routed_experts is not None
    decoded = struct.unpack("<10i", base64.b64decode(sample.routed_experts))
    assert [list(decoded[i : i + 2]) for i in range(0, 10, 2)] == [layer for row in ROUTING for layer in row]
    assert Sample(index=0, group_index=0, prompt="p", routed_experts="").routed_experts == ""  # no rows
    with pytest.raises(ValidationError, match="routed_experts is not base64"):
        sample.routed_experts = "not base64!"
    with pytest.raises(ValidationError, match="routed_experts is not base64"):
        sample.routed_experts = ROUTING_B64[:-1]  # truncated: bad padding
    with pytest.raises(ValidationError, match="decodes to 6 bytes, not a whole number of int32"):
        sample.routed_experts = base64.b64encode(b"abcdef").decode()
    with pytest.raises(ValidationError, match="routed_experts"):
        Sample(index=0, group_index=0, prompt="p", routed_experts=[[[0, 1]]])  # the old nested-list form


def test_per_token_lengths_must_match() -> None:
    with pytest.raises(ValidationError, match="rollout_logprobs has 2 entries but response_tokens has 3"):
        Sample(index=0, group_index=0, prompt="p", response_tokens=[1, 2, 3], rollout_logprobs=[0.0, 0.0])
    with pytest.raises(ValidationError, match="loss_mask"):
        Sample(index=0, group_index=0, prompt="p", response_tokens=[1], loss_mask=[2])


def test_assignment_is_validated() -> None:
    sample = finished_sample()
    with pytest.raises(ValidationError, match="entries but response_tokens has 1"):
        sample.response_tokens = [1]


def test_status_values_and_failed_needs_error() -> None:
    assert {s.value for s in SampleStatus} == {"pending", "completed", "truncated", "aborted", "failed"}
    with pytest.raises(ValidationError) as info:
        Sample(index=0, group_index=0, prompt="p", status="finished")
    assert "status" in str(info.value) and "completed" in str(info.value)
    with pytest.raises(ValidationError, match="needs an `error`"):
        Sample(index=0, group_index=0, prompt="p", status="failed")
    assert Sample(index=0, group_index=0, prompt="p", status="failed", error="reward timed out").error


def test_negative_index_and_unknown_field_are_named() -> None:
    with pytest.raises(ValidationError, match="index"):
        Sample(index=-1, group_index=0, prompt="p")
    with pytest.raises(ValidationError, match="rewrd"):
        Sample(index=0, group_index=0, prompt="p", rewrd=1.0)


def test_effective_loss_mask_defaults_to_all_tokens() -> None:
    assert Sample(index=0, group_index=0, prompt="p", response_tokens=[5, 6]).effective_loss_mask() == [1, 1]


def engine_response(tokens: list[int], text: str, finish: str, version: str, **meta: object) -> GenerateResponse:
    """A response as SGLang's `/generate` returns it (JSON), parsed by the contract."""
    return GenerateResponse.model_validate({
        "text": text, "output_ids": tokens,
        "meta_info": {
            "id": "r", "finish_reason": {"type": finish}, "prompt_tokens": 3, "completion_tokens": len(tokens),
            "weight_version": version,
            "output_token_logprobs": [[-0.5 * (i + 1), t, None] for i, t in enumerate(tokens)],
            **meta,
        },
    })  # fmt: skip


def pending() -> Sample:
    return Sample(index=0, group_index=0, prompt="2+3=?", prompt_tokens=[1, 2, 3])


def test_extended_fills_a_pending_sample_from_a_response() -> None:
    spec = {"spec_verify_ct": 2, "spec_num_proposed_drafts": 4, "spec_num_correct_drafts": 1,
            "spec_accept_histogram": [1, 1]}  # fmt: skip
    sample = pending().extended(engine_response([4, 5], "5", "stop", "3", routed_experts=ROUTING_B64, **spec))
    assert sample.response_tokens == [4, 5] and sample.response == "5"
    assert sample.rollout_logprobs == [-0.5, -1.0] and sample.loss_mask is None
    assert (sample.status, sample.finish_reason) == (SampleStatus.COMPLETED, "stop")
    assert (sample.weight_version, sample.weight_versions) == (3, None)
    assert sample.routed_experts == ROUTING_B64
    assert sample.metadata["spec"] == {"verify_ct": 2, "num_correct": 1, "num_proposed": 4, "histogram": [1, 1]}


def test_extended_appends_a_continuation_across_a_weight_update() -> None:
    first = pending().extended(engine_response([4, 5], "a", "abort", "3", spec_verify_ct=1, spec_accept_histogram=[1]))
    assert first.status is SampleStatus.ABORTED
    again = first.extended(engine_response([6], "b", "length", "4", spec_verify_ct=1, spec_num_correct_drafts=1,
                                           spec_num_proposed_drafts=1, spec_accept_histogram=[0, 1]))  # fmt: skip
    assert again.response_tokens == [4, 5, 6] and again.response == "ab"
    assert again.rollout_logprobs == [-0.5, -1.0, -0.5]
    assert (again.weight_version, again.weight_versions, again.token_versions()) == (4, [3, 3, 4], [3, 3, 4])
    assert (again.status, again.finish_reason) == (SampleStatus.TRUNCATED, "length")
    assert again.metadata["spec"] == {"verify_ct": 2, "num_correct": 1, "num_proposed": 1, "histogram": [1, 1]}


def test_extended_reads_per_token_version_spans() -> None:
    spans = [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 2}]
    sample = pending().extended(engine_response([4, 5], "", "stop", "3", weight_versions=spans))
    assert sample.weight_versions == [2, 3]
    unnamed = [{"version": "default", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 2}]
    assert (
        pending().extended(engine_response([4, 5], "", "stop", "3", weight_versions=unnamed)).weight_versions is None
    )


def test_observation_tokens_do_not_train_and_keep_the_version() -> None:
    turn = pending().model_copy(update={"loss_mask": []}).extended(engine_response([4], "x", "stop", "2"))
    observed = turn.with_observation([7, 8])
    assert observed.response_tokens == [4, 7, 8] and observed.loss_mask == [1, 0, 0]
    assert observed.rollout_logprobs == [-0.5, 0.0, 0.0] and observed.token_versions() == [2, 2, 2]
    after = observed.extended(engine_response([9], "y", "stop", "3"))
    assert after.loss_mask == [1, 0, 0, 1] and after.weight_versions == [2, 2, 2, 3]
    assert after.response == "xy"  # the observation's text is the caller's (an agent decodes the whole response)

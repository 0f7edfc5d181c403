"""`CoalescingClient`: concurrent calls merged into one batched `/generate` against a real server (same responses,
bit for bit, as sent one by one), which requests stay alone, how errors are attributed, and the prompt cap."""

from __future__ import annotations

import asyncio

import pytest

from miles_contracts import GenerateRequest, GenerateResponse, MetaInfo, SamplingParams
from miles_rollout import Client, CoalescingClient, RolloutClientError


def group_request(i: int, n: int = 3) -> GenerateRequest:
    params = SamplingParams(n=n, max_new_tokens=5, temperature=1.0, sampling_seed=100 + i)
    return GenerateRequest(input_ids=[3 + i, 40 + i, 7, 9 + i], sampling_params=params, return_logprob=True)


def summary(responses: list[GenerateResponse]) -> list[tuple[list[int], list[float | None]]]:
    return [(r.output_ids, [e[0] for e in r.meta_info.output_token_logprobs or []]) for r in responses]


async def test_concurrent_groups_go_as_one_request_with_the_responses_of_separate_sends(dense_server: str) -> None:
    requests = [group_request(i) for i in range(6)]
    async with Client(dense_server) as client:
        alone = [await client.generate(r) for r in requests]
        batching = CoalescingClient(client)
        merged = await asyncio.gather(*(batching.generate(r) for r in requests))
        info = await batching.get_server_info()  # other calls go to the wrapped client
    assert batching.num_requests_sent == 1
    assert [summary(r) for r in merged] == [summary(r) for r in alone]  # deterministic mode: bit for bit
    assert all(len(r) == 3 for r in merged) and info["weight_version"] == "default"


async def test_requests_that_a_batch_cannot_carry_go_alone(dense_server: str) -> None:
    with_rid = group_request(1).model_copy(update={"rid": "keep-me"})
    other_n = group_request(2, n=2)
    no_logprobs = group_request(3).model_copy(update={"return_logprob": False})
    async with Client(dense_server) as client:
        batching = CoalescingClient(client)
        results = await asyncio.gather(
            *(batching.generate(r) for r in (group_request(0), with_rid, other_n, no_logprobs, group_request(4)))
        )
    # rid alone; n=2 alone; no-logprob alone; the two plain n=3 groups merged.
    assert batching.num_requests_sent == 4
    assert [len(r) for r in results] == [3, 3, 2, 3, 3]


async def test_an_invalid_request_fails_alone_with_the_servers_message(dense_server: str) -> None:
    bad = GenerateRequest(input_ids=[1, 2, 99_999], sampling_params=SamplingParams(n=3, max_new_tokens=2))
    bad = bad.model_copy(update={"return_logprob": True})
    async with Client(dense_server) as client:
        batching = CoalescingClient(client)
        results = await asyncio.gather(
            *(batching.generate(r) for r in (group_request(0), bad, group_request(1))), return_exceptions=True
        )
    assert isinstance(results[1], RolloutClientError) and "outside the vocabulary" in str(results[1])
    assert [len(r) for r in (results[0], results[2])] == [3, 3]  # type: ignore[arg-type]
    assert batching.num_requests_sent == 1 + 3  # the refused batch, then each request alone


class FakeClient:
    """A GenerateClient that records the prompts of each call and answers n responses per prompt."""

    def __init__(self, error: Exception | None = None, drop: int = 0) -> None:
        self.calls: list[int] = []
        self.error, self.drop = error, drop

    async def generate(self, request: GenerateRequest) -> list[GenerateResponse]:
        self.calls.append(request.batch_size)
        if self.error is not None:
            raise self.error
        prompts = request.input_ids if request.is_batch else [request.input_ids]
        out = [
            GenerateResponse(
                text="", output_ids=[prompt[0], k],  # type: ignore[index]
                meta_info=MetaInfo(id=f"{prompt[0]}-{k}", prompt_tokens=1, completion_tokens=2),
            )
            for i, prompt in enumerate(prompts or [])
            for k in range(request.params_for(i).n)
        ]  # fmt: skip
        return out[: len(out) - self.drop]


async def test_a_turn_larger_than_max_prompts_is_split_and_each_caller_gets_its_slice() -> None:
    fake = FakeClient()
    batching = CoalescingClient(fake, max_prompts=4)
    requests = [group_request(i, n=2) for i in range(7)]
    results = await asyncio.gather(*(batching.generate(r) for r in requests))
    assert fake.calls == [4, 3]
    assert [[r.output_ids for r in rs] for rs in results] == [[[3 + i, 0], [3 + i, 1]] for i in range(7)]


async def test_a_server_failure_fails_every_merged_call_and_a_short_reply_is_an_error() -> None:
    unavailable = RolloutClientError("engine restarting", endpoint="/generate", status_code=503)
    batching = CoalescingClient(FakeClient(error=unavailable))
    results = await asyncio.gather(*(batching.generate(group_request(i)) for i in range(3)), return_exceptions=True)
    assert all(r is unavailable for r in results) and batching.num_requests_sent == 1  # no resend after a 5xx
    short = CoalescingClient(FakeClient(drop=1))
    results = await asyncio.gather(*(short.generate(group_request(i)) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, RolloutClientError) and "expected 9" in str(r) for r in results)


def test_max_prompts_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_prompts"):
        CoalescingClient(FakeClient(), max_prompts=0)

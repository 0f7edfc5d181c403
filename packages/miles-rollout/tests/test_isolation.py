"""CPU tier, in-process engine: one request cannot hurt another. Token ids are checked against the vocabulary at
intake (a 400 naming the field, before the engine step sees them); a request whose own engine work fails (its
forward, its sampling, its stop / detokenization) fails alone while a victim decoding beside it finishes with the
same bits as alone; the queue limit answers 429 with Retry-After; a caller that gives up frees its request."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from miles_contracts import GenerateRequest, SamplingParams
from miles_kernels import KernelConfig
from miles_rollout import Engine, EngineConfig
from miles_rollout import model_runner as runner_module
from miles_rollout import output as output_module
from miles_rollout.config import RequestLimits
from miles_rollout.engine_error import EngineError

VICTIM = GenerateRequest(
    input_ids=[5, 6, 7, 8, 9, 10, 11, 12],
    sampling_params=SamplingParams(max_new_tokens=40, temperature=1.0, sampling_seed=3, ignore_eos=True),
    return_logprob=True,
    rid="victim",
)


def poison(rid: str = "poison", prompt: list[int] | None = None) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=8, temperature=1.0, sampling_seed=9, ignore_eos=True)
    return GenerateRequest(input_ids=prompt or [20, 21, 22], sampling_params=params, rid=rid)


@pytest.fixture
def engine(dense_dir: Any) -> Any:
    engine = Engine(str(dense_dir), KernelConfig(page_size=16), EngineConfig(num_kv_pages=128))
    yield engine
    engine.shutdown()


def bits(response: Any) -> tuple[list[int], list[float]]:
    return response.output_ids, [entry[0] for entry in response.meta_info.output_token_logprobs]


async def victim_beside(engine: Engine, hostile: GenerateRequest) -> tuple[Any, BaseException | None]:
    """The victim decoding, the hostile request sent once it runs: (the victim's response, the hostile's error)."""
    victim = asyncio.create_task(engine.generate(VICTIM))
    await engine.wait_until(lambda s: s["num_running"] > 0 and s["num_generated_tokens"] >= 2)
    try:
        await engine.generate(hostile)
        error = None
    except EngineError as raised:
        error = raised
    return (await victim)[0], error


# ---------------------------------------------------------------------------------------------- intake checks


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"min_new_tokens": 1, "stop_token_ids": [100000]}, "stop_token_ids"),  # IndexError in the step on main
        ({"min_new_tokens": 1, "stop_token_ids": [1 << 63]}, "stop_token_ids"),
        ({"logit_bias": {"9" * 5000: 1.0}}, "logit_bias"),  # int() of 5,000 digits raises ValueError
        ({"logit_bias": {str(1 << 64): 1.0}}, "logit_bias"),
    ],
)
async def test_token_ids_outside_the_vocabulary_are_a_400_naming_the_field(engine: Engine, params, field) -> None:
    request = GenerateRequest.model_validate({"input_ids": [1, 2, 3], "sampling_params": params})
    with pytest.raises(EngineError) as raised:
        await engine.generate(request)
    assert raised.value.status_code == 400 and field in raised.value.message
    for ids in ([1, 2, 1 << 63], [[1, 2], [3, 100000]]):
        with pytest.raises(EngineError, match=r"input_ids.*outside the vocabulary"):
            await engine.generate(GenerateRequest(input_ids=ids))
    assert engine.is_alive() and engine.scheduler.stats()["num_steps"] == 0  # nothing reached a step


async def test_request_size_limits(dense_dir: Any) -> None:
    limits = RequestLimits(max_prompts_per_request=2, max_samples_per_request=4, max_top_logprob_entries=100)
    engine = Engine(str(dense_dir), KernelConfig(page_size=16), EngineConfig(num_kv_pages=128, limits=limits))
    try:
        with pytest.raises(EngineError, match="3 prompts"):
            await engine.generate(GenerateRequest(input_ids=[[1], [2], [3]]))
        with pytest.raises(EngineError, match="6 samples"):
            await engine.generate(GenerateRequest(input_ids=[[1], [2]], sampling_params=SamplingParams(n=3)))
        many_tops = GenerateRequest(input_ids=[1, 2], sampling_params=SamplingParams(max_new_tokens=10),
                                    return_logprob=True, top_logprobs_num=20)  # fmt: skip
        with pytest.raises(EngineError, match="top_logprobs_num x positions is 200"):
            await engine.generate(many_tops)
        ok = GenerateRequest(input_ids=[[1], [2]], sampling_params=SamplingParams(n=2, max_new_tokens=2))
        assert len(await engine.generate(ok)) == 4
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------------------------------- step isolation


async def test_a_request_whose_sampling_fails_fails_alone(engine: Engine, monkeypatch) -> None:
    alone = bits((await engine.generate(VICTIM))[0])
    real = runner_module.sample_rows

    def failing(logits: torch.Tensor, rows: list[Any], *args: Any) -> Any:
        if any(row.seq.group.rid == "poison" for row in rows):
            raise IndexError("index 100000 is out of bounds for dimension 0 with size 512")
        return real(logits, rows, *args)

    monkeypatch.setattr(runner_module, "sample_rows", failing)
    victim, error = await victim_beside(engine, poison())
    assert isinstance(error, EngineError) and error.status_code == 500 and "IndexError" in error.message
    assert bits(victim) == alone  # all its tokens, the same bits
    assert engine.scheduler.stats()["num_cached_pages"] > 0  # the prefix cache was not thrown away
    monkeypatch.setattr(runner_module, "sample_rows", real)
    assert bits((await engine.generate(VICTIM))[0]) == alone  # and the engine keeps serving


async def test_a_request_whose_forward_fails_fails_alone(engine: Engine, monkeypatch) -> None:
    alone = bits((await engine.generate(VICTIM))[0])
    marker = next(t for t in range(400, 512) if t not in alone[0] and t not in VICTIM.input_ids)
    model = engine.model
    real = model.forward_hidden

    def failing(ids: torch.Tensor, *args: Any) -> Any:
        if bool((ids == marker).any()):
            raise RuntimeError("device-side assert triggered")
        return real(ids, *args)

    monkeypatch.setattr(model, "forward_hidden", failing)
    victim, error = await victim_beside(engine, poison(prompt=[marker] * 20))
    assert isinstance(error, EngineError) and "device-side assert" in error.message
    assert bits(victim) == alone


async def test_a_request_whose_stop_handling_fails_fails_alone(engine: Engine, monkeypatch) -> None:
    alone = bits((await engine.generate(VICTIM))[0])
    real = output_module.OutputStage.append_token

    def failing(self: Any, seq: Any, *args: Any) -> Any:
        if seq.group.rid == "poison" and len(seq.output_ids) >= 3:
            raise RecursionError("maximum recursion depth exceeded")
        return real(self, seq, *args)

    monkeypatch.setattr(output_module.OutputStage, "append_token", failing)
    victim, error = await victim_beside(engine, poison())
    assert isinstance(error, EngineError) and "RecursionError" in error.message
    assert bits(victim) == alone
    stats = engine.scheduler.stats()
    assert stats["num_running"] == 0 and stats["num_used_pages"] == stats["num_cached_pages"]  # nothing leaked


# ---------------------------------------------------------------------------------------------- lifetime, queue


async def test_a_full_queue_is_a_429_with_retry_after(dense_dir: Any) -> None:
    config = EngineConfig(num_kv_pages=128, limits=RequestLimits(max_queued_requests=2))
    engine = Engine(str(dense_dir), KernelConfig(page_size=16), config)
    try:
        await engine.control(lambda: engine.pause_generation("in_place"), needs_idle=False)
        waiting = [asyncio.create_task(engine.generate(poison(f"w{i}"))) for i in range(2)]
        await engine.wait_until(lambda s: s["num_waiting"] == 2)
        with pytest.raises(EngineError) as raised:
            await engine.generate(poison("third"))
        assert raised.value.status_code == 429 and int(raised.value.headers["Retry-After"]) >= 1
        await engine.control(engine.continue_generation, needs_idle=False)
        assert all(r[0].meta_info.completion_tokens == 8 for r in await asyncio.gather(*waiting))
    finally:
        engine.shutdown()


async def test_a_caller_that_gives_up_frees_its_request(engine: Engine) -> None:
    long = GenerateRequest(input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=400, ignore_eos=True))
    task = asyncio.create_task(engine.generate(long))
    await engine.wait_until(lambda s: s["num_running"] == 1)
    task.cancel()
    stats = await engine.wait_until(lambda s: s["num_running"] == 0 and s["num_waiting"] == 0, timeout=5)
    assert stats["num_generated_tokens"] < 400  # aborted, not run to max_new_tokens


def test_a_caller_whose_event_loop_is_gone_leaves_the_others_their_results(engine: Engine) -> None:
    """An in-process caller's loop closes while its request runs (its `asyncio.run` returned, say, once it had what
    it streamed): handing that request's result to the closed loop is not an engine error, and the victim decoding
    beside it finishes with its bits."""
    alone = asyncio.run(engine.generate(VICTIM))[0]
    orphan = GenerateRequest(input_ids=[20, 21, 22], rid="orphan",
                             sampling_params=SamplingParams(max_new_tokens=20, ignore_eos=True))  # fmt: skip

    def send_and_leave() -> None:
        loop = asyncio.new_event_loop()
        task = loop.create_task(engine.generate(orphan))  # never awaited again: its loop closes below
        loop.run_until_complete(engine.wait_until(lambda s: s["num_running"] >= 2))
        loop.close()
        del task  # never resumed: its loop is closed

    async def main() -> Any:
        victim = asyncio.create_task(engine.generate(VICTIM))
        await engine.wait_until(lambda s: s["num_running"] > 0 and s["num_generated_tokens"] >= 2)
        await asyncio.to_thread(send_and_leave)
        await engine.wait_until(lambda s: s["num_running"] == 1)  # the orphan finished while the victim decodes
        return (await victim)[0]

    assert bits(asyncio.run(main())) == bits(alone)

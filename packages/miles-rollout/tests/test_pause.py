"""CPU tier, in-process engine: SGLang's `/pause_generation` modes and the weight-update bracket. No request is
lost: `abort` finishes them with `abort`; `retract` and `in_place` outputs equal an uninterrupted run's, token for
token and log-prob for log-prob (deterministic mode); nothing generates while paused or inside
`begin_weight_update` .. `end_weight_update`."""

from __future__ import annotations

import asyncio

import pytest

from miles_contracts import GenerateRequest, SamplingParams
from miles_kernels import KernelConfig, checkpoint_tensors
from miles_rollout import Engine, EngineConfig, EngineError, InProcessClient, RolloutClientError

REQUEST = GenerateRequest(
    input_ids=[[(3 * i + 1) % 500 for i in range(40)], [7, 8, 9], [(11 * i) % 500 for i in range(70)]],
    sampling_params=SamplingParams(max_new_tokens=60, temperature=1.0, sampling_seed=5, n=2, ignore_eos=True),
    return_logprob=True,
)


@pytest.fixture
def engine(dense_dir):
    engine = Engine(str(dense_dir), KernelConfig(page_size=16), EngineConfig(num_kv_pages=96))
    yield engine
    engine.shutdown()


def summary(responses) -> list:
    return [(r.output_ids, [e[0] for e in r.meta_info.output_token_logprobs]) for r in responses]


async def paused_midway(engine: Engine, mode: str) -> tuple[list, int, dict]:
    """Generate REQUEST, pause once every sequence has decoded some tokens, check nothing runs, continue."""
    client = InProcessClient(engine)
    task = asyncio.create_task(client.generate(REQUEST))
    await engine.wait_until(lambda s: s["num_running"] == 6 and s["num_generated_tokens"] >= 6 * 10)
    count = await engine.control(lambda: engine.pause_generation(mode), needs_idle=False)
    frozen = engine.server_info()
    await asyncio.sleep(0)  # the engine thread is free to run: it must not step
    steps = await engine.control(lambda: engine.scheduler.num_steps, needs_idle=False)
    assert steps == frozen["num_steps"], "the engine stepped while paused"
    await engine.control(engine.continue_generation, needs_idle=False)
    return await task, count, frozen


def test_retract_and_in_place_continue_exactly_where_they_stopped(dense_dir, engine) -> None:
    reference = summary(asyncio.run(InProcessClient(engine).generate(REQUEST)))
    asyncio.run(engine.control(engine.scheduler.radix.reset, needs_idle=True))
    for mode in ("retract", "in_place"):
        responses, count, frozen = asyncio.run(paused_midway(engine, mode))
        assert count == 3, mode  # three prompt groups in flight
        assert summary(responses) == reference, mode
        if mode == "retract":
            assert frozen["num_retracted"] == 6 and frozen["num_running"] == 0
            assert frozen["num_used_pages"] == frozen["num_cached_pages"]  # no request holds a page; the cache may
        else:
            assert frozen["num_running"] == 6 and frozen["num_used_pages"] > 0
        assert all(r.meta_info.finish_reason.type == "length" for r in responses)


def test_abort_mode_finishes_requests_and_later_ones_wait(engine) -> None:
    async def scenario() -> tuple[list, list]:
        client = InProcessClient(engine)
        first = asyncio.create_task(client.generate(REQUEST))
        await engine.wait_until(lambda s: s["num_running"] == 6)
        await engine.control(lambda: engine.pause_generation("abort"), needs_idle=False)
        aborted = await first
        later = asyncio.create_task(client.generate(REQUEST))  # arrives while paused: waits
        await engine.wait_until(lambda s: s["num_waiting"] == 3)
        assert not later.done()
        await engine.control(engine.continue_generation, needs_idle=False)
        return aborted, await later

    aborted, later = asyncio.run(scenario())
    assert [r.meta_info.finish_reason.type for r in aborted] == ["abort"] * 6
    assert all(len(r.output_ids) == 60 for r in later)


def test_a_weight_update_while_paused_in_place_is_refused_not_deadlocked(dense_dir, engine) -> None:
    async def scenario() -> None:
        client = InProcessClient(engine)
        task = asyncio.create_task(client.generate(REQUEST))
        await engine.wait_until(lambda s: s["num_running"] == 6)
        await engine.control(lambda: engine.pause_generation("in_place"), needs_idle=False)
        with pytest.raises(RolloutClientError, match="paused in_place with requests holding KV"):
            await client.update_weights_from_disk(str(dense_dir), weight_version=3)
        await engine.control(lambda: engine.pause_generation("retract"), needs_idle=False)  # KV freed: allowed
        assert (await client.update_weights_from_disk(str(dense_dir), weight_version=3))["weight_version"] == 3
        await engine.control(engine.continue_generation, needs_idle=False)
        responses = await task
        assert len(responses) == 6
        for r in responses:  # retracted on version 0, continued on version 3: SGLang's per-token spans say so
            (first, second) = r.meta_info.weight_versions
            assert (first["version"], first["start"], second["version"], second["end"]) == ("default", 0, "3", 60)
            # weight_version: the newest version the response was generated with (SGLang reports the version served
            # when the response is sent), so a sample's version never claims older weights than its last tokens'
            assert first["end"] == second["start"] > 0 and r.meta_info.weight_version == 3

    asyncio.run(scenario())


def test_the_weight_update_bracket_holds_generation_until_it_closes(dense_dir, engine) -> None:
    tensors = checkpoint_tensors(engine.model)
    names = sorted(tensors)
    half = {n: tensors[n].clone() for n in names[: len(names) // 2]}
    rest = {n: tensors[n].clone() for n in names[len(names) // 2 :]}

    async def scenario() -> tuple[int, list]:
        client = InProcessClient(engine)
        await engine.control(engine.begin_weight_update, needs_idle=True)
        waiting = asyncio.create_task(client.generate(REQUEST))
        await engine.wait_until(lambda s: s["num_waiting"] == 3)
        await engine.control(lambda: engine.weights.load_tensors(half, None, partial=True), needs_idle=True)
        await engine.control(lambda: engine.weights.load_tensors(rest, None, partial=True), needs_idle=True)
        assert not waiting.done() and engine.scheduler.num_steps == 0
        version = await engine.control(lambda: engine.end_weight_update(7), needs_idle=False)
        return version, await waiting

    version, responses = asyncio.run(scenario())
    assert version == 7 and all(r.meta_info.weight_version == 7 for r in responses)
    with pytest.raises(EngineError, match="no weight update is open"):
        asyncio.run(engine.control(lambda: engine.end_weight_update(None), needs_idle=False))

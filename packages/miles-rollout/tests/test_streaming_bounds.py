"""CPU tier, in-process engine: what a streamed request costs the engine thread and memory (streaming.py). Each
token's ids, log-prob entries and text are handed over once (not the response so far after every token); a reader
that stops reading neither blocks the engine nor grows the request's channel past its bound; the native stream still
sends SGLang's responses so far, equal at the end to the non-streamed response."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from miles_contracts import GenerateRequest, GenerateResponse, SamplingParams
from miles_kernels import KernelConfig
from miles_rollout import Engine, EngineConfig, InProcessClient, openai_api, streaming
from miles_rollout import server as server_module
from miles_rollout.openai_requests import CompletionRequest
from miles_rollout.sequence import StreamDelta

PROMPT = [4, 8, 15, 16, 23, 42]


@pytest.fixture(scope="module")
def engine(dense_dir):
    """On one thread (its creator's setting), so that tests running beside it share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(str(dense_dir), KernelConfig(page_size=16), EngineConfig(num_kv_pages=128))
    finally:
        torch.set_num_threads(threads)
    yield engine
    engine.shutdown()


def request(n: int, max_new_tokens: int, **params) -> GenerateRequest:
    sampling = SamplingParams(n=n, max_new_tokens=max_new_tokens, ignore_eos=True, temperature=1.0, sampling_seed=7,
                              **params)  # fmt: skip
    return GenerateRequest(input_ids=PROMPT, sampling_params=sampling, return_logprob=True, logprob_start_len=0,
                           top_logprobs_num=2, return_text_in_logprobs=True, rid="r")  # fmt: skip


@pytest.fixture
def pushed(monkeypatch) -> list[tuple[int, object, bool]]:
    """Every (index, delta or final response, is it the last) the engine thread hands to a channel."""
    seen: list[tuple[int, object, bool]] = []
    push = streaming.StreamChannel.push

    def recording(self, index, payload, is_last):
        seen.append((index, payload, is_last))
        push(self, index, payload, is_last)

    monkeypatch.setattr(streaming.StreamChannel, "push", recording)
    return seen


@pytest.fixture
def queued(monkeypatch) -> list[int]:
    """How many events a channel holds after each push (what waits for the reader)."""
    lengths: list[int] = []
    push = streaming.StreamChannel.push

    def recording(self, index, payload, is_last):
        push(self, index, payload, is_last)
        lengths.append(len(self._events))

    monkeypatch.setattr(streaming.StreamChannel, "push", recording)
    return lengths


def test_each_token_is_handed_over_once(engine, pushed) -> None:
    """Two 200-token samples with a stop string that never matches: the engine thread hands over every token's id,
    log-prob entries and text once (400 ids in all, where the response so far after every token was ~40,000), and
    what the deltas carry adds up to the final response."""
    n, length = 2, 200
    whole = asyncio.run(InProcessClient(engine).generate(request(n, length, stop=["QQQQ"])))

    async def consume() -> list[streaming.StreamEvent]:
        return [event async for event in await engine.generate_stream(request(n, length, stop=["QQQQ"]))]

    events = asyncio.run(consume())
    deltas = [payload for _, payload, is_last in pushed if not is_last]
    assert all(isinstance(delta, StreamDelta) for delta in deltas)
    # Every token but each sample's last (it comes with the final response) was pushed once, alone.
    assert sum(len(delta.output_ids) for delta in deltas) == n * (length - 1) == len(deltas)
    assert sum(len(delta.output_token_logprobs or []) for delta in deltas) == n * (length - 1)
    assert sum(len(delta.output_top_logprobs or []) for delta in deltas) == n * (length - 1)
    assert sum(delta.input_token_logprobs is not None for delta in deltas) == n  # the input's entries, once each
    for index, want in enumerate(whole):
        mine = [event for event in events if event.index == index]
        final = mine[-1].final
        assert final is not None and all(event.final is None for event in mine[:-1])
        assert final.model_dump(exclude={"meta_info": {"e2e_latency"}}) == want.model_dump(
            exclude={"meta_info": {"e2e_latency"}}
        )
        ids = [token for event in mine[:-1] for token in event.delta.output_ids]
        assert ids == want.output_ids[: len(ids)] and len(ids) == length - 1
        streamed = "".join(event.delta.text for event in mine[:-1])
        assert want.text.startswith(streamed) and len(streamed) >= len(want.text) - 3 - 8  # held: "QQQQ"[1:], U+FFFD


def test_a_reader_that_stops_reading_neither_blocks_the_engine_nor_grows_the_channel(engine, pushed, queued) -> None:
    """The reader takes one event, then reads nothing while the engine generates two 300-token samples to the end;
    the channel then holds at most MAX_QUEUED_EVENTS + 2 events per sample, whose merged deltas hold each token once,
    and reading on gives the complete samples."""
    n, length = 2, 300
    bound = streaming.MAX_QUEUED_EVENTS + 2 * n

    async def scenario() -> tuple[list[streaming.StreamEvent], list[streaming.StreamEvent], list[GenerateResponse]]:
        events = await engine.generate_stream(request(n, length))
        first = [await anext(events)]
        await engine.wait_until(lambda s: s["num_running"] == 0 and s["num_waiting"] == 0, timeout=120)
        rest = [event async for event in events]
        finals = [event.final for event in first + rest if event.final is not None]
        return first, rest, sorted(finals, key=lambda r: r.meta_info.id)

    first, rest, finals = asyncio.run(scenario())
    assert len(pushed) == n * length  # the engine pushed every token and both finals while nobody read
    # The channel's own bound (what `rest` holds besides: events the iterator had taken with the first one).
    assert max(queued) <= bound, f"{max(queued)} events queued for a reader that stopped reading"
    assert len(rest) < n * length / 4  # merged: far fewer events than tokens
    for index, final in enumerate(finals):
        deltas = [event.delta for event in first + rest if event.index == index and event.delta is not None]
        ids = [token for delta in deltas for token in delta.output_ids]
        assert ids == final.output_ids[:-1]
        assert final.text.startswith("".join(delta.text for delta in deltas))


def test_the_native_stream_sends_sglangs_responses_so_far(engine) -> None:
    """SGLang's `/generate` stream, built on the loop from the deltas: each event the sample's text, ids and log-prob
    entries so far (input ones in every event), its last the non-streamed response."""
    n, length = 2, 24
    whole = asyncio.run(InProcessClient(engine).generate(request(n, length)))

    async def native() -> list[dict]:
        events = await engine.generate_stream(request(n, length))
        chunks = [chunk async for chunk in server_module._native_stream(events, True, lambda _: None)]
        assert chunks[-1] == b"data: [DONE]\n\n"
        return [json.loads(chunk.decode().removeprefix("data: ")) for chunk in chunks[:-1]]

    events = asyncio.run(native())
    for index, want in enumerate(whole):
        mine = [event for event in events if event["index"] == index]
        expected = json.loads(want.model_dump_json())
        last = {**mine[-1], "meta_info": dict(mine[-1]["meta_info"])}
        del last["index"], last["meta_info"]["e2e_latency"], expected["meta_info"]["e2e_latency"]
        assert last == expected
        for event in mine[:-1]:
            meta, count = event["meta_info"], len(event["output_ids"])
            assert event["output_ids"] == want.output_ids[:count] and want.text.startswith(event["text"])
            assert meta["completion_tokens"] == count and "finish_reason" not in meta
            assert [e[1] for e in meta["output_token_logprobs"]] == event["output_ids"]
            assert len(meta["output_top_logprobs"]) == count
            assert meta["input_token_logprobs"] == expected["meta_info"]["input_token_logprobs"]


def test_a_lagging_openai_stream_still_sends_every_token(engine) -> None:
    """The OpenAI stream of a reader that lagged (its events merged): the chunks' texts join into the final text,
    and every token's log-prob and text offset is sent once, in order."""
    n, length = 2, 120
    body = CompletionRequest(model="default", prompt=PROMPT, max_tokens=length, logprobs=1, n=n)

    async def lagging() -> tuple[list[dict], list[GenerateResponse]]:
        events = await engine.generate_stream(request(n, length, stop=["QQQQ"]))
        first = await anext(events)
        await engine.wait_until(lambda s: s["num_running"] == 0 and s["num_waiting"] == 0, timeout=120)

        async def replay():
            yield first
            async for event in events:
                yield event

        finals: list[GenerateResponse] = []
        chunks = [chunk async for chunk in openai_api._openai_stream(replay(), body, False, finals.append)]
        assert chunks[-1] == b"data: [DONE]\n\n"
        return [json.loads(chunk.decode().removeprefix("data: ")) for chunk in chunks[:-1]], finals

    chunks, finals = asyncio.run(lagging())
    assert len(chunks) < n * length / 2  # merged
    for final in finals:
        index = int(final.meta_info.id.rsplit("-", 1)[1])
        mine = [chunk["choices"][0] for chunk in chunks if chunk["choices"][0]["index"] == index]
        assert "".join(choice["text"] for choice in mine) == final.text
        logprobs = [lp for choice in mine for lp in choice["logprobs"]["token_logprobs"]]
        assert logprobs == [entry[0] for entry in final.meta_info.output_token_logprobs]
        offsets = [offset for choice in mine for offset in choice["logprobs"]["text_offset"]]
        texts = [entry[2] for entry in final.meta_info.output_token_logprobs]
        assert offsets == [sum(len(t) for t in texts[:k]) for k in range(len(texts))]
        assert mine[-1]["finish_reason"] == "length" and all(c["finish_reason"] is None for c in mine[:-1])

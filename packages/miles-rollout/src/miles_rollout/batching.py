"""`CoalescingClient`: concurrent `/generate` calls sent as one batched request.

A rollout runs one request per prompt group, all at once; sent one by one, each pays its own HTTP round trip and
server-side parsing, and the engine admits them over several scheduler steps as they trickle in (measured on the
vs-TRL workload, 8 groups x 8 samples on 2 cores: 111 ms per rollout one by one, 82 ms as one batch). The
wrapper collects the calls made in the same event-loop turn and sends them as one batched request (SGLang's
native batch form: a list of prompts, one sampling-params entry each), then hands each caller its own slice of
the prompt-major response list. Callers see exactly the responses they would have got alone: sampling is seeded
per request, and deterministic mode makes a row's bits independent of the batch around it.

Only requests that a batch can carry unchanged are merged: the same prompt kind (text or token ids), the same
log-prob and routed-experts options, the same `n` for every prompt (SGLang requires one `n` per batch), no `rid`
(aborting one request by id stays possible) and no streaming; anything else goes through on its own. Each prompt
keeps its LoRA adapter (`lora_path`, one per prompt in the batch). When a merged
request is refused as invalid (HTTP 4xx: nothing ran), each call is retried on its own, so only the faulty one fails
with the server's message; any other failure (timeout, 5xx, lost connection) fails every merged call with that
error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Hashable
from dataclasses import dataclass

from miles_contracts import GenerateClient, GenerateRequest, GenerateResponse, SamplingParams
from miles_rollout.client import RolloutClientError


@dataclass
class _Call:
    request: GenerateRequest
    future: asyncio.Future[list[GenerateResponse]]


class CoalescingClient:
    """A `GenerateClient` that merges the `generate` calls of one event-loop turn into one batched request.

    `max_prompts` caps the prompts of one merged request (a larger turn is split). Every other attribute (weight
    updates, health, ...) is the wrapped client's.
    """

    def __init__(self, client: GenerateClient, max_prompts: int = 1024) -> None:
        if max_prompts < 1:
            raise ValueError(f"max_prompts must be >= 1, got {max_prompts}")
        self._client = client
        self._max_prompts = max_prompts
        self._waiting: dict[Hashable, list[_Call]] = {}
        self._sending: set[asyncio.Task[None]] = set()  # strong references until each send is done
        self.num_requests_sent = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)

    async def generate(self, request: GenerateRequest) -> list[GenerateResponse]:
        key = _merge_key(request)
        if key is None:
            return await self._generate_one(request)
        loop = asyncio.get_running_loop()
        if key not in self._waiting:
            self._waiting[key] = []
            loop.call_soon(self._flush, key)  # runs after every call already scheduled in this turn has joined
        call = _Call(request, loop.create_future())
        self._waiting[key].append(call)
        return await call.future

    def _flush(self, key: Hashable) -> None:
        chunks: list[list[_Call]] = [[]]
        size = 0
        for call in self._waiting.pop(key):
            if chunks[-1] and size + call.request.batch_size > self._max_prompts:
                chunks.append([])
                size = 0
            chunks[-1].append(call)
            size += call.request.batch_size
        for chunk in chunks:
            task = asyncio.ensure_future(self._send(chunk))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, calls: list[_Call]) -> None:
        if len(calls) == 1:
            await _deliver(calls[0], self._generate_one(calls[0].request))
            return
        try:
            responses = await self._generate_merged([call.request for call in calls])
        except RolloutClientError as error:
            if error.status_code is not None and 400 <= error.status_code < 500:
                # Refused before anything ran: resend each alone, so the error lands on the faulty request only.
                await asyncio.gather(*(_deliver(call, self._generate_one(call.request)) for call in calls))
            else:
                _fail(calls, error)
            return
        except Exception as error:  # every merged caller sees the failure as its own
            _fail(calls, error)
            return
        start = 0
        for call in calls:
            count = call.request.batch_size * _n(call.request)
            _resolve(call, responses[start : start + count])
            start += count

    async def _generate_one(self, request: GenerateRequest) -> list[GenerateResponse]:
        self.num_requests_sent += 1
        return await self._client.generate(request)

    async def _generate_merged(self, requests: list[GenerateRequest]) -> list[GenerateResponse]:
        prompts: list[object] = []
        params: list[SamplingParams] = []
        adapters: list[str | None] = []  # each prompt's LoRA adapter: merged requests may name different ones
        for request in requests:
            rows = request.text if request.text is not None else request.input_ids
            prompts += rows if request.is_batch else [rows]  # type: ignore[operator,list-item,arg-type]
            params += [request.params_for(i) for i in range(request.batch_size)]
            adapters += [request.lora_path_for(i) for i in range(request.batch_size)]
        field_name = "text" if requests[0].text is not None else "input_ids"
        lora_path = adapters if any(adapters) else None
        merged = requests[0].model_copy(
            update={field_name: prompts, "sampling_params": params, "lora_path": lora_path}
        )
        responses = await self._generate_one(merged)
        expected = sum(request.batch_size * _n(request) for request in requests)
        if len(responses) != expected:
            raise RolloutClientError(
                f"a batch of {len(prompts)} prompts came back with {len(responses)} responses, expected {expected}",
                endpoint="/generate",
            )
        return responses


def _n(request: GenerateRequest) -> int:
    return request.params_for(0).n


def _merge_key(request: GenerateRequest) -> Hashable | None:
    """What merged requests must share, or None when the request must go alone."""
    if request.rid is not None or request.stream:
        return None
    n_values = {request.params_for(i).n for i in range(request.batch_size)}
    if len(n_values) != 1:
        return None
    options = (request.return_logprob, request.logprob_start_len, request.top_logprobs_num)
    if any(isinstance(value, list) for value in options):
        return None  # per-prompt options: merging would need them re-split
    routed = (request.return_routed_experts, request.routed_experts_start_len)
    return (request.text is not None, *options, request.return_text_in_logprobs, *routed, n_values.pop())


async def _deliver(call: _Call, responses: Awaitable[list[GenerateResponse]]) -> None:
    try:
        result = await responses
    except Exception as error:
        _fail([call], error)
    else:
        _resolve(call, result)


def _resolve(call: _Call, responses: list[GenerateResponse]) -> None:
    if not call.future.done():
        call.future.set_result(responses)


def _fail(calls: list[_Call], error: BaseException) -> None:
    for call in calls:
        if not call.future.done():
            call.future.set_exception(error)

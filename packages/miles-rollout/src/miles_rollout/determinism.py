"""The SGLang-style determinism harness: does a prompt get the same output whatever else the server is doing?

Three modes, each returning how many *unique* (output ids, output log-probs) results the target prompt got —
1 means deterministic — plus `<mode>_ids`, the unique output ids alone (log-probs ignored):
- `single`: the same prompt sent as one batch request of size 1, 2, 4, ... N;
- `mixed`: the prompt sent concurrently with random other prompts of varied lengths, several times;
- `prefix`: prompts sharing a prefix, after `/flush_cache` (cold) and then with prefix-cache hits.
Works against any `GenerateClient` with `flush_cache` (the HTTP `Client` or `InProcessClient`).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from miles_contracts import GenerateRequest, GenerateResponse, SamplingParams


def _key(response: GenerateResponse) -> tuple[tuple[int, ...], tuple[float, ...]]:
    logprobs = response.meta_info.output_token_logprobs or []
    return tuple(response.output_ids), tuple(float(entry[0]) for entry in logprobs if entry[0] is not None)


async def run_harness(
    client: Any,
    vocab_size: int,
    temperature: float = 0.0,
    seed: int = 1234,
    max_new_tokens: int = 16,
    max_batch: int = 8,
    num_trials: int = 3,
) -> dict[str, int]:
    """Unique results of the target prompt per mode (`single`, `mixed`, `prefix`, and `*_ids` for token ids
    alone); 1 everywhere = deterministic."""
    rng = random.Random(seed)
    target = [rng.randrange(vocab_size) for _ in range(37)]
    params = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, sampling_seed=seed, ignore_eos=True
    )

    def request(prompt: list[int] | list[list[int]]) -> GenerateRequest:
        return GenerateRequest(input_ids=prompt, sampling_params=params, return_logprob=True)

    results: dict[str, set[Any]] = {"single": set(), "mixed": set(), "prefix": set()}
    for batch_size in sorted({1, 2, 4, max_batch}):
        for response in await client.generate(request([target] * batch_size)):
            results["single"].add(_key(response))
    for _ in range(num_trials):
        others = [[rng.randrange(vocab_size) for _ in range(rng.randint(1, 120))] for _ in range(rng.randint(2, 10))]
        position = rng.randint(0, len(others))
        prompts = [*others[:position], target, *others[position:]]
        responses = await asyncio.gather(*(client.generate(request(p)) for p in prompts))
        results["mixed"].add(_key(responses[position][0]))
    await client.flush_cache()
    prefixed = target[:32]
    siblings = [prefixed + [rng.randrange(vocab_size) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    results["prefix"].add(_key((await client.generate(request(target)))[0]))  # cold cache
    await asyncio.gather(*(client.generate(request(s)) for s in siblings))
    warm = (await client.generate(request(target)))[0]  # reuses the shared prefix pages
    results["prefix"].add(_key(warm))
    if warm.meta_info.cached_tokens == 0:
        raise RuntimeError("prefix mode expected a prefix-cache hit; the harness is not testing what it claims")
    counts = {mode: len(keys) for mode, keys in results.items()}
    return counts | {f"{mode}_ids": len({ids for ids, _ in keys}) for mode, keys in results.items()}

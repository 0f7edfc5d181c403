"""Rollout: step 2 of the RL data path (and the evaluation that reuses it).

The driver expands each prompt of the data source into a group of `n` pending samples (sample index =
group_index * n + i), tokenizes the prompt once (tokens in, tokens out: the trainer never re-tokenizes) and hands
the group to the rollout function — `single_turn` by default, or a `module:function` `RolloutFn`. Groups run
concurrently against the engine (their requests merged into one batched `/generate` by default), but results
are kept in sample-index order, and each sample's sampling seed is `run_seed * 2**32 + index` (a request with
n samples and seed s draws sample i with s + i, DESIGN.md), so over-sampling, filtering and a resumed run
regenerate exactly the same batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from miles_contracts import (
    GenerateClient,
    GenerateRequest,
    RolloutFn,
    Sample,
    SampleStatus,
    SamplingParams,
    load_plugin,
)
from miles_rollout import CoalescingClient

SEED_STRIDE = 2**32


def sample_seed(run_seed: int, sample_index: int) -> int:
    """The sampling seed of one sample, from the run seed and its index only."""
    return run_seed * SEED_STRIDE + sample_index


_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


async def single_turn(client: GenerateClient, group: list[Sample], sampling_params: SamplingParams) -> list[Sample]:
    """The default `RolloutFn`: one request for the whole group (prefilled once, forked n ways), log-probs on."""
    params = sampling_params.model_copy(update={"n": len(group)})
    request = GenerateRequest(input_ids=group[0].prompt_tokens, sampling_params=params, return_logprob=True)
    responses = await client.generate(request)
    out = []
    for sample, response in zip(group, responses, strict=True):
        meta = response.meta_info
        reason = meta.finish_reason.type if meta.finish_reason else "length"
        out.append(sample.model_copy(update={
            "response_tokens": list(response.output_ids), "response": response.text,
            "rollout_logprobs": [float(entry[0] or 0.0) for entry in meta.output_token_logprobs or []],
            "finish_reason": reason, "status": _STATUS[reason], "weight_version": meta.weight_version,
        }))  # fmt: skip
    return out


def resolve_rollout_fn(path: str | None) -> RolloutFn:
    return single_turn if path is None else load_plugin(path, RolloutFn)  # type: ignore[type-abstract]


def expand_groups(prompts: Sequence[Sample], n: int, encode: Callable[[Sample], list[int]]) -> list[list[Sample]]:
    """One group of `n` pending samples per prompt, with the prompt's tokens."""
    groups = []
    for prompt in prompts:
        tokens = encode(prompt)
        groups.append([
            prompt.model_copy(update={"index": prompt.group_index * n + i, "prompt_tokens": tokens})
            for i in range(n)
        ])  # fmt: skip
    return groups


async def run_groups(
    client: GenerateClient,
    groups: Sequence[list[Sample]],
    params: SamplingParams,
    run_seed: int,
    rollout_fn: RolloutFn,
    on_done: Callable[[], Any] | None = None,
    batch_requests: bool = True,
) -> list[list[Sample]]:
    """Roll out every group concurrently; a group whose rollout raises comes back `failed` (never a crash).
    Returned in the order given (sample-index order), whatever order they finish in. With `batch_requests`, the
    `/generate` calls the groups make in the same event-loop turn go as one batched request (`CoalescingClient`)."""
    if batch_requests:
        client = CoalescingClient(client)

    async def one(group: list[Sample]) -> list[Sample]:
        seeded = params.model_copy(update={"sampling_seed": sample_seed(run_seed, group[0].index)})
        try:
            result = await rollout_fn(client, group, seeded)
            if len(result) != len(group):
                raise ValueError(f"the rollout function returned {len(result)} samples for a group of {len(group)}")
        except Exception as error:  # user code or the engine: record it on the samples, keep the run going
            message = f"rollout failed: {type(error).__name__}: {error}"
            result = [s.model_copy(update={"status": SampleStatus.FAILED, "error": message}) for s in group]
        if on_done is not None:
            on_done()
        return result

    return list(await asyncio.gather(*(one(g) for g in groups)))


class PromptEncoder:
    """Prompt → token ids with the policy's tokenizer: chat messages through its chat template (with the
    generation prompt), text as is."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def __call__(self, sample: Sample) -> list[int]:
        if isinstance(sample.prompt, str):
            return list(self.tokenizer.encode(sample.prompt, add_special_tokens=False))
        messages = [m.model_dump() for m in sample.prompt]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

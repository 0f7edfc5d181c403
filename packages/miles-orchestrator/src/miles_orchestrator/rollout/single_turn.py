"""The default rollout function: one turn, one `/generate` request per prompt group (step 2 of the RL data path), and
how a run picks its rollout function."""

from __future__ import annotations

import functools

from miles_contracts import GenerateClient, GenerateRequest, RolloutFn, Sample, SamplingParams, load_plugin


async def single_turn(
    client: GenerateClient, group: list[Sample], sampling_params: SamplingParams, *, routed_experts: bool = False
) -> list[Sample]:
    """The default `RolloutFn`: one request for the whole group (prefilled once, forked n ways), log-probs on;
    `routed_experts`: the engine's MoE routing of every token too (`Sample.routed_experts`, for routing replay)."""
    params = sampling_params.model_copy(update={"n": len(group)})
    request = GenerateRequest(input_ids=group[0].prompt_tokens, sampling_params=params, return_logprob=True,
                              return_routed_experts=routed_experts)  # fmt: skip
    responses = await client.generate(request)
    return [sample.extended(response) for sample, response in zip(group, responses, strict=True)]


def resolve_rollout_fn(path: str | None, routed_experts: bool = False) -> RolloutFn:
    """The run's rollout function: a plug-in, or `single_turn` (asking for the routed experts if `routed_experts`)."""
    if path is not None:
        return load_plugin(path, RolloutFn)  # type: ignore[type-abstract]
    return functools.partial(single_turn, routed_experts=True) if routed_experts else single_turn

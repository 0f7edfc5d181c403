"""A rollout plug-in for test_scale_out.py: the one-turn rollout, generating past EOS to `rollout.max_new_tokens`, so
that a rollout reliably outlasts a training step and the weight sync after it lands on generations in flight."""

from __future__ import annotations

from miles_contracts import GenerateClient, Sample, SamplingParams
from miles_orchestrator.rollout.single_turn import single_turn


async def past_eos(client: GenerateClient, group: list[Sample], sampling_params: SamplingParams) -> list[Sample]:
    return await single_turn(client, group, sampling_params.model_copy(update={"ignore_eos": True}))

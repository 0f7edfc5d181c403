"""Partial rollouts across a weight update (run.mode=async), on an in-process engine with a tiny random policy: a
group is paused mid-generation, the weights change to version 1, generation continues. Whatever the pause mode,
every sample ends with all its tokens (none lost, none repeated: the tokens before the pause are exactly those a
run under version 0 alone draws with the same seed), and each token carries the version that generated it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles_contracts import Sample, SampleStatus, SamplingParams
from miles_kernels import KernelConfig
from miles_kernels.testing import build_tokenizer, save_random_model, tiny_config
from miles_orchestrator.rollout.batch import run_groups
from miles_orchestrator.rollout.partial import Aborted
from miles_orchestrator.rollout.single_turn import single_turn
from miles_orchestrator.staleness import bound_staleness, onpolicy_mismatch
from miles_rollout import Engine, EngineConfig, InProcessClient

NEW_TOKENS = 48
PAUSE_AFTER = 8  # generated tokens (the whole group's) before the weight sync pauses it


@pytest.fixture(scope="module")
def policies(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("policies")
    tokenizer = build_tokenizer(vocab_size=300)
    config = tiny_config("dense", vocab_size=len(tokenizer))
    save_random_model(root / "v0", config, seed=3, tokenizer=tokenizer)
    save_random_model(root / "v1", config, seed=4, tokenizer=tokenizer)
    return root / "v0", root / "v1"


def group(n: int = 2) -> list[Sample]:
    return [Sample(index=i, group_index=0, prompt="p", prompt_tokens=[5, 6, 7, 8]) for i in range(n)]


PARAMS = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True)


async def roll_out(engine: Engine, aborted: Aborted | None) -> list[Sample]:
    (out,) = await run_groups(InProcessClient(engine), [group()], PARAMS, 11, single_turn, batch_requests=False,
                              aborted=aborted)  # fmt: skip
    return out


async def roll_out_across_a_sync(engine: Engine, new_policy: Path, mode: str, aborted: Aborted | None) -> list[Sample]:
    """The group rolled out while the weights change to version 1 once PAUSE_AFTER tokens are generated."""
    client = InProcessClient(engine)
    # The counter is the engine's total (the reference run's tokens included): count from here
    before = (await engine.wait_until(lambda stats: True))["num_generated_tokens"]
    running = asyncio.create_task(roll_out(engine, aborted))
    await engine.wait_until(lambda stats: stats["num_generated_tokens"] >= before + PAUSE_AFTER)
    await client.pause_generation(mode)
    await client.update_weights_from_disk(str(new_policy), 1)
    await client.continue_generation()
    return await running


def versions_split(sample: Sample) -> int:
    """How many leading tokens version 0 generated (the rest: version 1); asserts that shape."""
    versions = sample.token_versions()
    first = versions.count(0)
    assert versions == [0] * first + [1] * (len(versions) - first), versions
    return first


@pytest.mark.parametrize(
    ("mode", "aborted"), [("retract", None), ("abort", Aborted(is_partial=True, is_default_fn=True))]
)
@pytest.mark.timeout(120)
def test_a_partial_rollout_keeps_every_token_with_its_version(policies, mode: str, aborted: Aborted | None) -> None:
    v0, v1 = policies
    engine = Engine(str(v0), KernelConfig(), EngineConfig(max_running_requests=8, num_kv_pages=256))
    try:
        asyncio.run(InProcessClient(engine).update_weights_from_disk(str(v0), 0))
        reference = asyncio.run(roll_out(engine, None))  # version 0 alone, same seeds
        samples = asyncio.run(roll_out_across_a_sync(engine, v1, mode, aborted))
    finally:
        engine.shutdown()
    for sample, alone in zip(samples, reference, strict=True):
        assert sample.status == SampleStatus.TRUNCATED and len(sample.response_tokens) == NEW_TOKENS
        assert len(sample.rollout_logprobs or []) == NEW_TOKENS
        first = versions_split(sample)
        assert 0 < first < NEW_TOKENS, f"the sync did not land mid-generation ({first} tokens before it)"
        assert sample.response_tokens[:first] == alone.response_tokens[:first]  # nothing lost or repeated
        assert sample.rollout_logprobs[:first] == alone.rollout_logprobs[:first]  # type: ignore[index]
        assert sample.weight_version == 1
    if aborted is not None:
        assert all(s.metadata["partial_rollout_resumes"] == 1 for s in samples)


@pytest.mark.timeout(120)
def test_an_aborted_group_without_partial_rollouts_is_regenerated_under_the_new_weights(policies) -> None:
    v0, v1 = policies
    engine = Engine(str(v0), KernelConfig(), EngineConfig(max_running_requests=8, num_kv_pages=256))
    try:
        asyncio.run(InProcessClient(engine).update_weights_from_disk(str(v0), 0))
        aborted = Aborted(is_partial=False, is_default_fn=True)
        samples = asyncio.run(roll_out_across_a_sync(engine, v1, "abort", aborted))
    finally:
        engine.shutdown()
    assert all(len(s.response_tokens) == NEW_TOKENS and s.token_versions() == [1] * NEW_TOKENS for s in samples)


def _sample(index: int, group_index: int, versions: list[int], logprobs: list[float] | None = None) -> Sample:
    per_token = versions if len(set(versions)) > 1 else None
    return Sample(index=index, group_index=group_index, prompt="p", prompt_tokens=[1],
                  response_tokens=[2] * len(versions), rollout_logprobs=logprobs or [-1.0] * len(versions),
                  weight_version=max(versions), weight_versions=per_token)  # fmt: skip


def test_staleness_bound_drops_whole_groups_and_reports_the_histogram() -> None:
    batch = [_sample(0, 0, [5, 5]), _sample(1, 0, [4, 5]), _sample(2, 1, [3, 3]), _sample(3, 1, [5, 5])]
    kept, metrics, dropped = bound_staleness(batch, trained_version=5, max_staleness=1, mask_partial=True)
    assert dropped == [1] and [s.index for s in kept] == [0, 1]
    assert metrics["staleness_frac_0"] == 0.5 and metrics["staleness_frac_1"] == 0.25
    assert metrics["staleness_frac_2"] == 0.25 and metrics["staleness_max"] == 2.0
    assert metrics["num_stale_groups_dropped"] == 1.0 and metrics["num_partial_samples"] == 1.0
    assert kept[1].loss_mask == [0, 1]  # partial_tokens=mask: the token before the update does not train
    assert metrics["off_policy_token_frac"] == 0.25
    with pytest.raises(ValueError, match="newer than the trained one"):
        bound_staleness(batch, trained_version=4, max_staleness=9)
    unversioned = Sample(index=9, group_index=9, prompt="p", prompt_tokens=[1], response_tokens=[2])
    with pytest.raises(ValueError, match="has no weight version"):
        bound_staleness([unversioned], trained_version=0, max_staleness=0)


def test_the_mismatch_metric_covers_the_tokens_the_trained_version_generated_only() -> None:
    batch = [_sample(0, 0, [4, 5, 5], logprobs=[-1.0, -2.0, -3.0])]
    metrics = onpolicy_mismatch(batch, [[-9.0, -2.0, -3.5]], trained_version=5)
    assert metrics == {"train_rollout_logprob_abs_diff": 0.25, "train_rollout_logprob_abs_diff_max": 0.5,
                       "num_onpolicy_tokens": 2.0}  # fmt: skip
    assert onpolicy_mismatch(batch, [[-9.0, -2.0, -3.5]], trained_version=6) == {}

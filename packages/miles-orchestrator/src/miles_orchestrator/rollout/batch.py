"""Rollout: steps 2-4 of the RL data path. `generate_batch` is a step's rollout phase: generate prompt groups, score
them, filter them, and over-sample until enough groups pass (evaluation.py reuses the generation part); with
on-policy distillation, the teacher then scores the batch (miles_orchestrator.opd).

The driver expands each prompt of the data source into a group of `n` pending samples (sample index =
group_index * n + i), tokenizes the prompt once (tokens in, tokens out: the trainer never re-tokenizes) and hands
the group to the rollout function — `single_turn` by default, or a `module:function` `RolloutFn`. Groups run
concurrently against the engine (their requests merged into one batched `/generate` by default), but results
are kept in sample-index order, and each sample's sampling seed is `run_seed * 2**32 + index` (a request with
n samples and seed s draws sample i with s + i; docs/architecture.md), so over-sampling, filtering and a resumed
run regenerate exactly the same batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from miles_contracts import (
    GenerateClient,
    RolloutFn,
    Sample,
    SampleStatus,
    SamplingParams,
)
from miles_orchestrator.cluster import EngineFailed
from miles_orchestrator.config import RunConfig
from miles_orchestrator.rollout.agent_metrics import agent_metrics
from miles_orchestrator.rollout.filters import apply_filters
from miles_orchestrator.rollout.overlong import filter_overlong, punish_overlong, task_reward
from miles_orchestrator.run_dir import RunDir
from miles_rollout import CoalescingClient

if TYPE_CHECKING:
    from miles_orchestrator.parts import RunParts
    from miles_orchestrator.rollout.partial import Aborted

SEED_STRIDE = 2**32


def sample_seed(run_seed: int, sample_index: int) -> int:
    """The sampling seed of one sample, from the run seed and its index only."""
    return run_seed * SEED_STRIDE + sample_index


def spec_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Acceptance of speculative decoding over a step's samples: tokens per verify step, the accept rate, and the
    accept rate at each draft position j (verify steps that accepted at least j drafts / verify steps)."""
    verify = correct = proposed = 0
    histogram: list[int] = []
    for sample in samples:
        counts: Any = sample.metadata.get("spec")
        if not isinstance(counts, dict):
            continue
        verify += int(counts["verify_ct"])
        correct += int(counts["num_correct"])
        proposed += int(counts["num_proposed"])
        for accepted, steps in enumerate(counts["histogram"]):
            histogram += [0] * (accepted + 1 - len(histogram))
            histogram[accepted] += int(steps)
    if not verify:
        return {}
    out = {"spec_accept_length": 1.0 + correct / verify, "spec_accept_rate": correct / max(proposed, 1)}
    for j in range(1, len(histogram)):
        out[f"spec_accept_rate_pos{j}"] = sum(histogram[j:]) / verify
    return out


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
    aborted: Aborted | None = None,
) -> list[list[Sample]]:
    """Roll out every group concurrently; a group whose rollout raises comes back `failed` (never a crash).
    Returned in the order given (sample-index order), whatever order they finish in. With `batch_requests`, the
    `/generate` calls the groups make in the same event-loop turn go as one batched request (`CoalescingClient`).
    `aborted`: what becomes of generations a weight sync aborts (async runs; partial.py); None: they stay aborted."""
    if batch_requests:
        client = CoalescingClient(client)

    async def one(group: list[Sample]) -> list[Sample]:
        seeded = params.model_copy(update={"sampling_seed": sample_seed(run_seed, group[0].index)})
        try:
            result = await rollout_fn(client, group, seeded)
            if len(result) != len(group):
                raise ValueError(f"the rollout function returned {len(result)} samples for a group of {len(group)}")
            if aborted is not None:
                result = await aborted.complete(client, group, result, seeded, rollout_fn)
        except EngineFailed:  # the engines failed beyond what the run allows: it stops (cluster/ray/engine_health.py)
            raise
        except Exception as error:  # user code or the engine: record it on the samples, keep the run going
            message = f"rollout failed: {type(error).__name__}: {error}"
            result = [s.model_copy(update={"status": SampleStatus.FAILED, "error": message}) for s in group]
        if on_done is not None:
            on_done()
        return result

    return list(await asyncio.gather(*(one(g) for g in groups)))


class DataExhausted(Exception):
    """The data source ran out of prompts: the run ends early, normally."""


async def generate_batch(
    cfg: RunConfig, parts: RunParts, client: GenerateClient, run: RunDir, aborted: Aborted | None = None
) -> tuple[list[Sample], dict[str, float]]:
    """Generate (through `client`, the engines) and score prompt groups until `num_prompts_per_step` pass the
    filters (at most `filter.max_oversample_rounds` extra rounds); the batch comes back in sample-index order."""
    source, filters = parts.source, parts.filters
    r = cfg.rollout
    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p)
    kept: list[list[Sample]] = []
    dropped: list[list[Sample]] = []
    generated: list[Sample] = []
    num_failed_groups = num_rounds = num_overlong_filtered = 0
    penalties: list[float] = []
    reward_seconds = 0.0
    began = time.perf_counter()
    for round_index in range(1 + (cfg.filter.max_oversample_rounds if filters else 0)):
        needed = r.num_prompts_per_step - len(kept)
        if needed <= 0:
            break
        prompts = source.get_samples(needed)
        if not prompts:
            break  # a file source at the end of its last epoch
        num_rounds = round_index
        groups = expand_groups(prompts, r.n_samples_per_prompt, parts.encode)
        label = "rollout" if round_index == 0 else f"rollout (over-sampling round {round_index})"
        with run.progress(label, len(groups)) as advance:
            groups = await run_groups(
                client, groups, params, cfg.run.seed, parts.rollout_fn, advance, r.batch_requests, aborted
            )
        # Before rewards, a failed sample is the rollout's (an engine error, a crashed environment): its group cannot
        # be compared within itself, so it is not trained.
        for group in [g for g in groups if _failed_sample(g)]:
            run.log(f"prompt group {group[0].group_index} not trained: {_failed_sample(group).error}")  # type: ignore[union-attr]
            num_failed_groups += 1
        groups = [g for g in groups if not _failed_sample(g)]
        scoring = time.perf_counter()
        with run.timeline.span("reward"):
            stats = await parts.rewards.score([s for g in groups for s in g])
        reward_seconds += time.perf_counter() - scoring
        if stats.num_failed:
            run.log(f"{stats.num_failed} reward call(s) failed ({stats.num_timeouts} timed out), scored 0: "
                    + "; ".join(stats.errors))  # fmt: skip
        scored = [s for g in groups for s in g]
        if cfg.reward.overlong_buffer:  # DAPO's soft overlong punishment, before the filters see the rewards
            penalties.append(punish_overlong(scored, r.max_new_tokens, cfg.reward.overlong_buffer,
                                             cfg.reward.overlong_penalty))  # fmt: skip
        if cfg.filter.overlong:
            num_overlong_filtered += filter_overlong(scored)
        generated += scored
        result = apply_filters(groups, filters)
        kept += result.kept
        dropped += result.dropped
    num_short = max(r.num_prompts_per_step - len(kept), 0)
    kept += dropped[:num_short]  # too few groups passed the filters: train on dropped ones too (counted below)
    batch = [s for g in sorted(kept, key=lambda g: g[0].index) for s in g]
    if not batch and not generated and num_failed_groups == 0:
        raise DataExhausted("the data source has no prompts left (data.num_epochs passes done)")
    if not batch:
        raise RuntimeError("no prompt group could be rolled out this step; see run.log for the rollout errors")
    teacher_metrics: dict[str, float] = {}
    if parts.teacher is not None:  # on-policy distillation: the teacher scores what trains (miles_orchestrator.opd)
        scoring = time.perf_counter()
        batch, errors = await parts.teacher.score(batch)
        for error in errors:
            run.log(f"not trained, the teacher could not score it: {error}")
        if not batch:
            raise RuntimeError(
                f"the teacher scored no prompt group of this step ({errors[0]}); the run stops so that it never "
                "trains without its teacher: fix the teacher and resume (--resume)"
            )
        teacher_metrics = {"teacher_time_s": time.perf_counter() - scoring,
                           "num_teacher_failed_groups": float(len(errors))}  # fmt: skip
    seconds = time.perf_counter() - began
    lengths = [len(s.response_tokens) for s in generated]
    flops_metrics: dict[str, float] = {}
    if parts.throughput is not None:  # the generation's model FLOPs (its seconds without the rewards')
        rates = parts.throughput.rollout([len(s.prompt_tokens) for s in generated], lengths, seconds - reward_seconds)
        flops_metrics = {k: v for k, v in rates.items() if k != "rollout_tokens_per_s"}
    return batch, {
        "reward_mean": sum(s.reward or 0.0 for s in generated) / max(len(generated), 1),
        "pass_rate": sum(1 for s in generated if task_reward(s) >= 1.0) / max(len(generated), 1),
        "num_reward_failures": float(sum(1 for s in generated if s.status == SampleStatus.FAILED)),
        "num_failed_groups": float(num_failed_groups),
        "num_groups_filtered": float(len(dropped)),
        "num_filtered_groups_trained": float(min(num_short, len(dropped))),
        "num_oversample_rounds": float(num_rounds),
        **({"overlong_penalty_mean": sum(penalties) / len(penalties)} if penalties else {}),
        **({"num_overlong_filtered": float(num_overlong_filtered)} if cfg.filter.overlong else {}),
        "response_len_mean": sum(lengths) / max(len(lengths), 1),
        "truncated_fraction": sum(1 for s in generated if s.status == SampleStatus.TRUNCATED) / max(len(generated), 1),
        "rollout_time_s": seconds,
        "reward_time_s": reward_seconds,  # part of rollout_time_s
        "rollout_tokens_per_s": sum(lengths) / max(seconds, 1e-9),
        **flops_metrics,
        **spec_metrics(generated),
        **agent_metrics(generated),
        **teacher_metrics,
    }  # fmt: skip


def _failed_sample(group: list[Sample]) -> Sample | None:
    return next((s for s in group if s.status == SampleStatus.FAILED), None)


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

"""Held-out evaluation: pass@1 (greedy by default) and pass@k on the run's evaluation prompts, through the same
rollout path and reward workers as training (`run.eval_every`; step 0 is the policy before any RL step)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_contracts import GenerateClient, Sample, SampleStatus, SamplingParams
from miles_orchestrator.config import RunConfig
from miles_orchestrator.rollout.batch import expand_groups, run_groups
from miles_orchestrator.run_dir import RunDir

if TYPE_CHECKING:
    from miles_orchestrator.parts import RunParts


async def _evaluate_groups(
    cfg: RunConfig, parts: RunParts, client: GenerateClient, groups: list[list[Sample]], params: SamplingParams,
    label: str, run: RunDir,
) -> list[list[Sample]]:  # fmt: skip
    with run.progress(f"eval ({label})", len(groups)) as advance:
        done = await run_groups(
            client, groups, params, cfg.run.seed, parts.eval_fn, advance, cfg.rollout.batch_requests
        )
    await parts.rewards.score([s for g in done for s in g if s.status != SampleStatus.FAILED])
    return done


async def evaluate_held_out(cfg: RunConfig, parts: RunParts, client: GenerateClient, run: RunDir) -> dict[str, float]:
    """pass@1 on the held-out prompts (`parts.eval_prompts`) at `rollout.eval_temperature` (greedy by default) and,
    with `rollout.eval_k > 1`, pass@k over k samples at the training temperature; `parts.eval_fn` plays them (the
    multi-turn one in agentic runs, else the one-turn rollout)."""
    r = cfg.rollout
    out: dict[str, float] = {}
    settings = [(1, r.eval_temperature, "eval_pass@1")]
    if r.eval_k > 1:
        settings.append((r.eval_k, r.temperature, f"eval_pass@{r.eval_k}"))
    for n, temperature, key in settings:
        params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=temperature, top_p=r.top_p)
        groups = expand_groups(parts.eval_prompts, n, parts.encode)
        done = await _evaluate_groups(cfg, parts, client, groups, params, key, run)
        out[key] = sum(1.0 for g in done if any((s.reward or 0.0) >= 1.0 for s in g)) / max(len(done), 1)
    return out


async def evaluate_teacher(cfg: RunConfig, parts: RunParts, run: RunDir) -> dict[str, float]:
    """On-policy distillation: the teacher's own held-out pass@1 (and pass@k), the student's target, logged with
    step 0 as `teacher_eval_pass@1`; nothing without a teacher."""
    if parts.teacher is None:
        return {}
    async with parts.teacher.client_factory() as client:
        scores = await evaluate_held_out(cfg, parts, client, run)
    return {f"teacher_{key}": value for key, value in scores.items()}

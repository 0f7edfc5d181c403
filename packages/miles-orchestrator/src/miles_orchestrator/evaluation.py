"""Held-out evaluation: pass@1 (greedy by default) and pass@k on the run's evaluation prompts, through the same
rollout path and reward workers as training (`run.eval_every`; step 0 is the policy before any RL step)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_contracts import RolloutFn, Sample, SampleStatus, SamplingParams
from miles_orchestrator.config import RunConfig
from miles_orchestrator.rewards import RewardPool
from miles_orchestrator.rollout import PromptEncoder, expand_groups, run_groups, single_turn
from miles_orchestrator.run_dir import RunDir

if TYPE_CHECKING:
    from miles_orchestrator.cluster import Cluster


async def _evaluate_groups(
    cluster: Cluster, rewards: RewardPool, groups: list[list[Sample]], params: SamplingParams, cfg: RunConfig,
    label: str, run: RunDir, rollout_fn: RolloutFn,
) -> list[list[Sample]]:  # fmt: skip
    with run.progress(f"eval ({label})", len(groups)) as advance:
        done = await run_groups(
            cluster.engine, groups, params, cfg.run.seed, rollout_fn, advance, cfg.rollout.batch_requests
        )
    await rewards.score([s for g in done for s in g if s.status != SampleStatus.FAILED])
    return done


async def evaluate_held_out(
    cfg: RunConfig,
    cluster: Cluster,
    rewards: RewardPool,
    prompts: list[Sample],
    encode: PromptEncoder,
    run: RunDir,
    rollout_fn: RolloutFn = single_turn,
) -> dict[str, float]:
    """pass@1 on the held-out prompts at `rollout.eval_temperature` (greedy by default) and, with
    `rollout.eval_k > 1`, pass@k over k samples at the training temperature; `rollout_fn` plays them (the
    multi-turn one in agentic runs, else the one-turn rollout)."""
    r = cfg.rollout
    out: dict[str, float] = {}
    settings = [(1, r.eval_temperature, "eval_pass@1")]
    if r.eval_k > 1:
        settings.append((r.eval_k, r.temperature, f"eval_pass@{r.eval_k}"))
    for n, temperature, key in settings:
        params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=temperature, top_p=r.top_p)
        groups = expand_groups(prompts, n, encode)
        done = await _evaluate_groups(cluster, rewards, groups, params, cfg, key, run, rollout_fn)
        out[key] = sum(1.0 for g in done if any((s.reward or 0.0) >= 1.0 for s in g)) / max(len(done), 1)
    return out

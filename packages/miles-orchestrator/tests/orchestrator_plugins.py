"""Plug-ins that the orchestrator tests load by `module:function` path (not a test file: pytest does not collect it).

The tests put this folder on `sys.path`; spawned reward workers inherit the parent's `sys.path`, so they import
this module by name exactly as a user's reward module would be imported.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from miles_contracts import Sample

if TYPE_CHECKING:  # the reward workers import this module: keep it light
    from miles_orchestrator.config import DataSection


def behaves(sample: Sample) -> float:
    """Does what `sample.metadata["mode"]` says, so one pool exercises every failure; default: len(response)."""
    mode = sample.metadata.get("mode", "ok")
    if mode == "raise":
        raise ValueError(f"boom on sample {sample.index}")
    if mode == "sleep":
        time.sleep(60)
    if mode == "exit":
        os._exit(3)  # a hard crash: no exception, no reply
    if mode == "nan":
        return float("nan")
    if mode == "text":
        return "high"  # type: ignore[return-value]  # deliberately wrong type
    return float(len(sample.response))


def even_tokens(sample: Sample) -> float:
    """The share of even token ids in the response: a reward that differs between a random policy's samples, so
    its steps really update the weights."""
    tokens = sample.response_tokens
    return sum(1 for t in tokens if t % 2 == 0) / max(1, len(tokens))


async def async_length(sample: Sample) -> float:
    """An async reward: awaits, then scores the response length."""
    await asyncio.sleep(0)
    return float(len(sample.response))


def rank_in_group(samples: Sequence[Sample]) -> list[float]:
    """A group reward: 1.0 for the longest response(s) of the group, 0.0 for the others."""
    longest = max(len(s.response) for s in samples)
    return [1.0 if len(s.response) == longest else 0.0 for s in samples]


def wrong_length_group(samples: Sequence[Sample]) -> list[float]:
    """A broken group reward: one value too few."""
    return [0.0] * (len(samples) - 1)


def two_arguments(sample: Sample, other: Sample) -> float:
    """Not a RewardFn: needs two positional arguments."""
    return 0.0


def short_prompt(samples: Sequence[Sample]) -> bool:
    """A SampleFilter: keep groups whose prompt text is under 20 characters."""
    prompt = samples[0].prompt
    return isinstance(prompt, str) and len(prompt) < 20


def filter_raises(samples: Sequence[Sample]) -> bool:
    """A broken SampleFilter."""
    raise KeyError("no such column")


def filter_returns_number(samples: Sequence[Sample]) -> bool:
    """A broken SampleFilter: returns a float instead of a bool."""
    return 0.5  # type: ignore[return-value]


class CountingSource:
    """A DataSource plug-in (data.source=orchestrator_plugins:CountingSource): the prompts 'count N' for N = start,
    start + step, ... (data.source_args), `num_prompts` of them (None: endless), resumable from its state."""

    def __init__(self, cfg: DataSection, *, start: int = 0, step: int = 1, num_prompts: int | None = None) -> None:
        self.seed, self.start, self.step, self.num_prompts = cfg.seed, start, step, num_prompts
        self.next_index = 0

    def get_samples(self, num_prompts: int) -> list[Sample]:
        if self.num_prompts is not None:
            num_prompts = min(num_prompts, self.num_prompts - self.next_index)
        indices = range(self.next_index, self.next_index + num_prompts)
        self.next_index += num_prompts
        values = [self.start + self.step * k for k in indices]
        return [
            Sample(index=k, group_index=k, prompt=f"count {v}", label=str(v), metadata={"seed": self.seed})
            for k, v in zip(indices, values, strict=True)
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"next_index": self.next_index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_index = int(state["next_index"])


class SourceWithoutResume:
    """Not a DataSource: it cannot resume (no load_state_dict)."""

    def __init__(self, cfg: DataSection) -> None:
        self.next_index = 0

    def get_samples(self, num_prompts: int) -> list[Sample]:
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}


class RestartingSource(CountingSource):
    """A broken DataSource: every call starts its group indices from 0 again."""

    def get_samples(self, num_prompts: int) -> list[Sample]:
        return [s.model_copy(update={"group_index": k}) for k, s in enumerate(super().get_samples(num_prompts))]


class UnsavableSource(CountingSource):
    """A broken DataSource: its state is not JSON."""

    def state_dict(self) -> dict[str, Any]:
        return {"next_index": {self.next_index}}


class ScriptedEnv:
    """An Environment plug-in (rollout.agent.env=orchestrator_plugins:ScriptedEnv): observes "obs K" after turn K and
    is done after `done_after` turns with reward 1 per turn. A sample's metadata["mode"] makes it misbehave at its
    second step: "raise", "hang" (sleeps an hour) or "crash" (the worker process exits)."""

    def __init__(self, done_after: int = 2) -> None:
        self.done_after = done_after
        self.mode = "ok"

    def reset(self, sample: Sample) -> None:
        self.mode = str(sample.metadata.get("mode", "ok"))

    async def step(self, message: Any) -> dict[str, Any]:  # async and returning a dict: both are allowed
        if message.turn == 1 and self.mode == "raise":
            raise RuntimeError("the environment broke")
        if message.turn == 1 and self.mode == "hang":
            time.sleep(3600)
        if message.turn == 1 and self.mode == "crash":
            os._exit(3)
        done = message.turn + 1 >= self.done_after
        return {"observation": f"obs {message.turn}", "reward": 1.0, "is_done": done, "info": {"last": message.turn}}


class OpeningEnv:
    """An Environment whose reset opens the conversation itself (a system and a user message)."""

    def reset(self, sample: Sample) -> list[dict[str, str]]:
        return [{"role": "system", "content": "You add."}, {"role": "user", "content": f"{sample.prompt}!"}]

    def step(self, message: Any) -> Any:
        from miles_contracts import StepResult

        return StepResult(is_done=True, reward=0.5)

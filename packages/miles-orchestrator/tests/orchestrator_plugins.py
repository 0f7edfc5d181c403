"""Plug-ins that the orchestrator tests load by `module:function` path (not a test file: pytest does not collect it).

The tests put this folder on `sys.path`; spawned reward workers inherit the parent's `sys.path`, so they import
this module by name exactly as a user's reward module would be imported.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence

from miles_contracts import Sample


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

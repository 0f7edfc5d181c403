"""Reward plug-ins that misbehave on purpose (imported by the reward workers of test_orchestrator.py)."""

from __future__ import annotations

import time

from miles_contracts import Sample
from miles_orchestrator.data.task import verify


def flaky(sample: Sample) -> float:
    """Raises on every 5th sample, hangs on every 7th, scores the task otherwise."""
    if sample.index % 5 == 0:
        raise RuntimeError("reward service exploded")
    if sample.index % 7 == 0:
        time.sleep(60)
    return verify(sample.response, sample.label)

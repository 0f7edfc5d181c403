"""Reward plug-ins that score any output (imported by the reward workers of test_megatron_run.py): a policy with
random weights gets rewards that differ within a group, so GRPO's advantages are not all zero."""

from __future__ import annotations

from miles_contracts import Sample


def digit_share(sample: Sample) -> float:
    """The share of the response's characters that are digits."""
    return sum(ch.isdigit() for ch in sample.response) / max(len(sample.response), 1)

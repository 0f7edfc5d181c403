"""DAPO's two treatments of overlong responses (arXiv:2503.14476, section 3.4), between the reward and the filters
(step 3-4 of the RL data path):

- soft overlong punishment (`reward.overlong_buffer`, `reward.overlong_penalty`): with L the response length,
  L_max = rollout.max_new_tokens and B the buffer, the reward gains min(-(L - (L_max - B)) / B * penalty, 0):
  nothing up to L_max - B, then linearly down to -penalty at L_max (verl's DAPO reward manager);
- overlong filtering (`filter.overlong`): a truncated response's tokens leave the loss (its loss mask is zeroed), so
  a response cut by the length limit is not pushed toward or away from; its reward still counts in its group.

The penalty is kept in the sample's metadata (`overlong_penalty`), so the task's own pass rate stays measurable.
"""

from __future__ import annotations

from collections.abc import Sequence

from miles_contracts import Sample, SampleStatus


def overlong_penalty(length: int, max_len: int, buffer: int, penalty: float) -> float:
    """The soft overlong punishment of a response of `length` tokens (0 inside max_len - buffer, -penalty at
    max_len)."""
    return min(-(length - (max_len - buffer)) / buffer * penalty, 0.0)


def punish_overlong(samples: Sequence[Sample], max_len: int, buffer: int, penalty: float) -> float:
    """Add each scored sample's overlong punishment to its reward (recorded as metadata["overlong_penalty"]); the
    mean punishment."""
    total = 0.0
    for sample in samples:
        if sample.reward is None or sample.status == SampleStatus.FAILED:
            continue
        value = overlong_penalty(len(sample.response_tokens), max_len, buffer, penalty)
        sample.metadata["overlong_penalty"] = value
        sample.reward += value
        total += value
    return total / max(len(samples), 1)


def task_reward(sample: Sample) -> float:
    """The sample's reward before the overlong punishment (0 when unscored)."""
    penalty = sample.metadata.get("overlong_penalty", 0.0)
    return (sample.reward or 0.0) - (penalty if isinstance(penalty, float) else 0.0)


def filter_overlong(samples: Sequence[Sample]) -> int:
    """Zero the loss mask of every truncated response (DAPO's overlong filtering); how many."""
    count = 0
    for sample in samples:
        if sample.status == SampleStatus.TRUNCATED:
            sample.loss_mask = [0] * len(sample.response_tokens)
            count += 1
    return count

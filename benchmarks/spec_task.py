"""The speculative-decoding benchmark's task (`benchmarks/spec.py`): long outputs, and an RL phase that drifts.

"Count on from 37:" -> twelve numbers, each 1, 2 or 3 more than the one before ("39 40 43 45 ..."). The SFT rows
draw every step uniformly from {1, 2, 3}, so the bootstrapped policy (and its MTP draft) spread their mass over the
three choices; the RL reward is the fraction of the twelve steps that are exactly +2. RL therefore moves the policy
from the SFT's mixture to always +2 (the entropy collapse typical of RL post-training), which a draft frozen at the
SFT's distribution cannot follow, and an online one can.

Also the run's reward plug-in (`reward.name=spec_task:reward` with `benchmarks/` on PYTHONPATH).
"""

from __future__ import annotations

import random
import re

from miles_contracts import Sample

NUM_STEPS = 12  # numbers per response
STEPS = (1, 2, 3)  # the SFT's increments
REWARDED = 2  # the increment RL rewards
_INTEGER = re.compile(r"\d+")


def prompt(start: int) -> str:
    return f"Count on from {start}:"


def sft_row(rng: random.Random) -> dict[str, str]:
    start = rng.randrange(10, 90)
    numbers, value = [], start
    for _ in range(NUM_STEPS):
        value += rng.choice(STEPS)
        numbers.append(str(value))
    return {"prompt": prompt(start), "response": " ".join(numbers)}


def prompt_rows(count: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        start = rng.randrange(10, 90)
        rows.append({"prompt": prompt(start), "label": str(start)})
    return rows


def score(response: str, start: int) -> float:
    """Fraction of the NUM_STEPS steps, from `start` through the response's numbers, that are exactly +REWARDED."""
    numbers = [int(n) for n in _INTEGER.findall(response)[:NUM_STEPS]]
    previous, hits = start, 0
    for number in numbers:
        hits += number - previous == REWARDED
        previous = number
    return hits / NUM_STEPS


def reward(sample: Sample) -> float:
    return score(sample.response, int(str(sample.label)))

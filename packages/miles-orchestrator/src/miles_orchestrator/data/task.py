"""The built-in procedural task: integer arithmetic with a verifiable answer ("What is 37 + 48?" → "85").

It sits at both ends of the RL data path for the default example: `miles_orchestrator.data.sources.BuiltinTaskSource`
turns its problems into prompt `Sample`s (step 1), and `verify` is the built-in `task` reward (step 3). The same
generator also writes the supervised rows that bootstrap a tiny policy before RL (`BuiltinTask.sft_rows`).

Why this task: the project tokenizer (`miles_kernels.testing.build_tokenizer`, Qwen2 split pattern) encodes digits
one at a time, so a tiny Qwen3 can learn the answer digit by digit; the difficulty knobs (`num_digits`,
`operations`, `num_operands`) set how far a short SFT gets, which leaves room for RL to improve the held-out pass
rate.

Determinism: problem `index` of split `split` under `seed` depends only on those three values (a private
`random.Random`, never the global RNG). Train and held-out problems are disjoint: a problem belongs to the held-out
split when a hash of its question falls below `heldout_fraction`, so the same question is never in both.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Literal

from pydantic import JsonValue

Split = Literal["train", "heldout"]
OPERATIONS = ("+", "-", "*")
_INTEGER = re.compile(r"-?\d+(?:,\d{3})*")  # 1,234 is one integer; "85, 86" are two
_MAX_DRAWS = 10_000  # redraws to land in a split; with heldout_fraction in (0, 1) a few suffice


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem: the question shown to the policy and its integer answer."""

    question: str
    answer: int

    @property
    def label(self) -> str:
        """The answer as the `Sample.label` the reward compares against."""
        return str(self.answer)


@dataclass(frozen=True)
class BuiltinTask:
    """Arithmetic over `num_operands` integers with operators from `operations`.

    `num_digits` is the number of digits of every operand, or one count per operand (e.g. (2, 1): "37 + 8").

    The expression follows the usual precedence (`*` before `+` / `-`). The policy should answer with the
    number alone (`response_format`), e.g. "85"; `verify` accepts any response whose last integer is right.
    """

    num_digits: int | tuple[int, ...] = 2
    operations: tuple[str, ...] = ("+",)
    num_operands: int = 2
    heldout_fraction: float = 0.1

    def __post_init__(self) -> None:
        digits = (self.num_digits,) if isinstance(self.num_digits, int) else self.num_digits
        if not digits or not all(1 <= d <= 9 for d in digits):
            raise ValueError(f"num_digits={self.num_digits}: use 1..9 digits per operand (e.g. 2, or (2, 1))")
        if not isinstance(self.num_digits, int) and len(self.num_digits) != self.num_operands:
            raise ValueError(
                f"num_digits={self.num_digits} gives {len(self.num_digits)} digit counts for num_operands="
                f"{self.num_operands}; give one count per operand or a single int"
            )
        if not self.operations or any(op not in OPERATIONS for op in self.operations):
            raise ValueError(f"operations={list(self.operations)}: choose a non-empty subset of {list(OPERATIONS)}")
        if not 2 <= self.num_operands <= 8:
            raise ValueError(f"num_operands={self.num_operands}: use 2..8 operands (e.g. 2)")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction={self.heldout_fraction}: use a fraction in (0, 1), e.g. 0.1")

    @property
    def operand_digits(self) -> tuple[int, ...]:
        """Digits of each operand."""
        if isinstance(self.num_digits, int):
            return (self.num_digits,) * self.num_operands
        return self.num_digits

    def problem(self, index: int, *, seed: int = 0, split: Split = "train") -> Problem:
        """Problem number `index` of `split`: the same (seed, index, split) always gives the same problem."""
        if index < 0:
            raise ValueError(f"index={index}: problem indices start at 0")
        salt = 0 if split == "train" else 1
        rng = random.Random((seed * 1_000_003 + index) * 2 + salt)
        for _ in range(_MAX_DRAWS):
            problem = self._draw(rng)
            if self.split_of(problem.question) == split:
                return problem
        raise AssertionError(f"no {split} problem after {_MAX_DRAWS} draws; the split hash is broken")

    def problems(self, num_problems: int, *, seed: int = 0, split: Split = "train", start: int = 0) -> list[Problem]:
        """Problems `start .. start + num_problems - 1` of `split`."""
        return [self.problem(i, seed=seed, split=split) for i in range(start, start + num_problems)]

    def split_of(self, question: str) -> Split:
        """Which split a question belongs to (a hash of its text, so it does not depend on the seed)."""
        digest = hashlib.sha256(question.encode()).digest()
        bucket = int.from_bytes(digest[:8], "big") / 2**64
        return "heldout" if bucket < self.heldout_fraction else "train"

    def sft_rows(self, num_rows: int, seed: int = 0) -> list[dict[str, str]]:
        """Supervised rows `{"prompt": question, "response": answer}` from the train split, to bootstrap a policy.

        The prompt is the plain question; render it exactly as the rollout does (chat template or not) when
        training on it, and end the response with the tokenizer's EOS so the policy learns to stop.
        """
        return [{"prompt": p.question, "response": response_format(p)} for p in self.problems(num_rows, seed=seed)]

    def _draw(self, rng: random.Random) -> Problem:
        operands = [rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1) for d in self.operand_digits]
        operators = [rng.choice(self.operations) for _ in range(self.num_operands - 1)]
        parts = [str(operands[0])]
        for op, value in zip(operators, operands[1:], strict=True):
            parts += [op, str(value)]
        return Problem(question=f"What is {' '.join(parts)}?", answer=evaluate_expression(operands, operators))


def evaluate_expression(operands: list[int], operators: list[str]) -> int:
    """Value of `operands[0] op0 operands[1] op1 ...` with `*` binding tighter than `+` and `-`."""
    terms = [operands[0]]  # each term is a product; its sign is carried by the term itself
    for op, value in zip(operators, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= value
        else:
            terms.append(value if op == "+" else -value)
    return sum(terms)


def response_format(problem: Problem) -> str:
    """The response the policy is taught: the answer alone, e.g. "85"."""
    return problem.label


def extract_answer(response: str) -> int | None:
    """The last integer in `response` (so "37 + 48 = 85" and "The answer is 85." both give 85), or None."""
    matches = _INTEGER.findall(response)
    return int(matches[-1].replace(",", "")) if matches else None


def verify(response: str, label: JsonValue) -> float:
    """1.0 when the last integer of `response` equals `label` (an int or its decimal string), else 0.0."""
    if isinstance(label, bool) or not isinstance(label, int | str):
        raise ValueError(f"task label {label!r} must be an integer or its decimal string, e.g. '85'")
    try:
        expected = int(label)
    except ValueError as error:
        raise ValueError(f"task label {label!r} is not an integer; labels come from BuiltinTask problems") from error
    return 1.0 if extract_answer(response) == expected else 0.0

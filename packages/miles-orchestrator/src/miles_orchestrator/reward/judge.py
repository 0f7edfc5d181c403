"""The built-in generative judge (`reward.name=judge`): a served model grades each response, and a pattern reads the
grade out of its answer.

Each sample is one `POST {reward.judge_url}/v1/chat/completions` (any OpenAI-compatible server: SGLang, vLLM,
`miles-rollout serve`), whose one user message is `reward.judge_template` formatted with the sample's `prompt` (chat
messages as `role: content` lines), `response` and `label`; greedy (temperature 0), at most
`reward.judge_max_new_tokens`. The reward is the last match of `reward.judge_pattern`'s first group in the answer,
divided by `reward.judge_max_score`. Requests go concurrently (at most `reward.max_concurrency`: the server batches
them), each under `reward.timeout_s`, with the http reward's retries and failure rules (http.py, which this
extends): an answer without a score, or with one outside [0, judge_max_score], fails its sample (`failed`, reward
0.0, the error quoting the answer), never the run. At start-up `GET {judge_url}/v1/models` must answer 2xx.
"""

from __future__ import annotations

import json
import re
from typing import Any

from miles_contracts import Sample
from miles_orchestrator.config import RewardSection
from miles_orchestrator.reward.http import HttpReward, _Answer, _cut

__all__ = ["JudgeReward", "judge_prompt"]


def judge_prompt(template: str, sample: Sample) -> str:
    """The judge's user message for `sample`."""
    if isinstance(sample.prompt, str):
        prompt = sample.prompt
    else:
        prompt = "\n".join(f"{m.role}: {m.content}" for m in sample.prompt)
    label = "" if sample.label is None else str(sample.label)
    return template.format(prompt=prompt, response=sample.response, label=label)


class JudgeReward(HttpReward):
    """Grades samples with a served model (see the module docstring)."""

    label, url_field, health_field = "judge", "reward.judge_url", "reward.judge_url (GET /v1/models)"

    def __init__(self, cfg: RewardSection) -> None:
        assert cfg.judge_url is not None, "RewardSection requires reward.judge_url for reward.name=judge"
        base = cfg.judge_url.rstrip("/")
        super().__init__(cfg, url=f"{base}/v1/chat/completions", health_url=f"{base}/v1/models")
        self.template, self.pattern = cfg.judge_template, re.compile(cfg.judge_pattern)
        self.model, self.max_tokens, self.max_score = cfg.judge_model, cfg.judge_max_new_tokens, cfg.judge_max_score

    def _body(self, call: list[Sample]) -> dict[str, Any]:
        (sample,) = call
        return {
            "model": self.model, "messages": [{"role": "user", "content": judge_prompt(self.template, sample)}],
            "max_tokens": self.max_tokens, "temperature": 0.0,
        }  # fmt: skip

    def _rewards(self, answer: _Answer, num_samples: int) -> list[float]:
        if answer.status >= 400:
            raise ValueError(f"the judge answered {answer.status}: {answer.excerpt()}")
        try:
            text = json.loads(answer.body)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ValueError(f"not an OpenAI chat completion: {answer.excerpt()}") from None
        if not isinstance(text, str):
            raise ValueError(f"the judge's message has no text content: {answer.excerpt()}")
        matches = self.pattern.findall(text)
        if not matches:
            raise ValueError(f"the judge's answer has no score (reward.judge_pattern): {_cut(text)!r}")
        last = matches[-1]
        try:
            score = float(last[0] if isinstance(last, tuple) else last)
        except ValueError:
            raise ValueError(f"the judge's score {last!r} is not a number: {_cut(text)!r}") from None
        if not 0.0 <= score <= self.max_score:
            raise ValueError(f"the judge's score {score:g} is outside [0, {self.max_score:g}]: {_cut(text)!r}")
        return [score / self.max_score]

"""The built-in reward model (`reward.name=reward_model`): a Hugging Face sequence-classification checkpoint
(`reward.model_path`, AutoModelForSequenceClassification's format) scores each response in the driver process.

The conversation is rendered with the reward model's own tokenizer, as verl's and OpenRLHF's reward workers do (the
policy's token ids mean nothing to another tokenizer): through its chat template when it has one (the prompt's chat
messages, or the text prompt as a user message, then the response as the assistant's), else as prompt text plus
response text. The sequences of a step go through `miles_kernels.RewardModel` in micro-batches of at most
`reward.max_tokens_per_batch` tokens (packed, no padding: a score does not depend on its batch), one at a time on a
thread of their own; the reward is the score of label 0, read at the last token. A micro-batch that raises or runs
past `reward.timeout_s` fails its samples (`failed`, reward 0.0, the error saying why) and the run goes on; a
timed-out forward finishes in the background before the next one starts. A sequence longer than the model's
context fails on its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from miles_contracts import Sample
from miles_kernels import KernelConfig, load_reward_model
from miles_orchestrator.config import RewardSection
from miles_orchestrator.reward.http import CallResult

__all__ = ["RewardModelScorer"]


class RewardModelScorer:
    """Scores samples with a sequence-classification reward model (see the module docstring)."""

    def __init__(self, cfg: RewardSection, kernel: KernelConfig) -> None:
        from transformers import AutoTokenizer

        assert cfg.model_path is not None, "RewardSection requires reward.model_path for reward.name=reward_model"
        self.path, self.timeout_s, self.max_tokens = cfg.model_path, cfg.timeout_s, cfg.max_tokens_per_batch
        try:
            self.model = load_reward_model(cfg.model_path, kernel)
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        except (OSError, ValueError) as error:
            raise ValueError(f"reward.model_path={cfg.model_path!r}: {error}") from None
        self.context = self.model.trunk.config.max_position_embeddings
        # one forward at a time: a timed-out one still holds the thread, and the next waits for it to finish
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-model")

    def check_reachable(self) -> None:
        """Loaded in the constructor: nothing to reach."""

    def encode(self, sample: Sample) -> list[int]:
        """The sample's conversation as the reward model's token ids (see the module docstring)."""
        if self.tokenizer.chat_template:
            messages: list[dict[str, Any]] = (
                [{"role": "user", "content": sample.prompt}] if isinstance(sample.prompt, str)
                else [m.model_dump() for m in sample.prompt]
            )  # fmt: skip
            messages.append({"role": "assistant", "content": sample.response})
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        prompt = sample.prompt if isinstance(sample.prompt, str) else "\n".join(m.content for m in sample.prompt)
        return list(self.tokenizer.encode(prompt + sample.response, add_special_tokens=True))

    async def score_calls(self, calls: Sequence[list[Sample]]) -> list[CallResult]:
        """One result per call (one sample each), in order; never raises for a failed call."""
        results: list[CallResult | None] = [None] * len(calls)
        sequences: list[tuple[int, list[int]]] = []
        for i, (sample,) in enumerate(calls):
            try:
                ids = self.encode(sample)
            except Exception as error:  # a chat template that refuses the conversation, say
                results[i] = (None, f"reward model {self.path}: cannot render the sample: {error}", False)
                continue
            if not ids or len(ids) > self.context:
                too_long = f"reward model {self.path}: {len(ids)} tokens, its context is {self.context}"
                results[i] = (None, too_long, False)
            else:
                sequences.append((i, ids))
        for micro in _micro_batches(sequences, self.max_tokens):
            for i, result in zip([i for i, _ in micro], await self._score(micro), strict=True):
                results[i] = result
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    async def _score(self, micro: list[tuple[int, list[int]]]) -> list[CallResult]:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._thread, self._forward, [ids for _, ids in micro])
        try:
            async with asyncio.timeout(self.timeout_s):
                scores = await asyncio.shield(future)
        except TimeoutError:
            error = f"reward model {self.path}: timed out after {self.timeout_s:g}s (reward.timeout_s)"
            return [(None, error, True)] * len(micro)
        except Exception as error:
            return [(None, f"reward model {self.path}: {type(error).__name__}: {error}", False)] * len(micro)
        return [([score], None, False) for score in scores]

    def _forward(self, sequences: list[list[int]]) -> list[float]:
        return [float(row[0]) for row in self.model.scores(sequences)]

    def close(self) -> None:
        self._thread.shutdown(wait=True)


def _micro_batches(sequences: list[tuple[int, list[int]]], max_tokens: int) -> list[list[tuple[int, list[int]]]]:
    """Consecutive groups of at most `max_tokens` tokens (a longer sequence alone)."""
    out: list[list[tuple[int, list[int]]]] = []
    size = 0
    for item in sequences:
        if not out or size + len(item[1]) > max_tokens:
            out.append([])
            size = 0
        out[-1].append(item)
        size += len(item[1])
    return out

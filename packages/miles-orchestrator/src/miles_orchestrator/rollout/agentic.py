"""Agentic rollouts: step 2 of the RL data path when `rollout.agent.env` is set (docs/agentic.md). Each sample is
one episode: the policy's turns alternate with an environment's steps (env_pool.py runs it, sandboxed) until the
environment says done, `rollout.agent.max_turns` turns were played or `rollout.agent.max_response_tokens` are
spent.

The conversation stays token ids end to end (docs/architecture.md, "Agentic rollouts"):

- the model's tokens are kept exactly as generated (nothing is re-tokenized) with their log-probs and versions,
  loss mask 1;
- an observation is appended as the chat template's delta: the tokens that follow the model's end-of-turn token
  when the observation's messages and the next generation prompt are rendered (`ChatTemplate.delta`), loss mask 0,
  log-prob 0.0;
- the next turn sends the whole sequence as `input_ids`; the engine's prefix cache keeps the earlier turns.

So the trainer sees the same tokens the engine computed, and under true on-policy the trainer's log-probs of every
model token equal the rollout's, whatever the turn. Tool calls are parsed from each turn (tool_calls.py); a
malformed call is answered with an observation saying what is wrong, and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import JsonValue

from miles_contracts import (
    STATUS_OF_FINISH,
    AgentMessage,
    ChatMessage,
    GenerateClient,
    GenerateRequest,
    Sample,
    SampleStatus,
    SamplingParams,
    StepResult,
    observation_messages,
)
from miles_orchestrator.config.rollout import RolloutSection
from miles_orchestrator.rollout.env_pool import EnvError, EnvPool
from miles_orchestrator.rollout.sandbox import Limits
from miles_orchestrator.rollout.tool_calls import parse_tool_calls

# A fixed conversation the deltas are rendered after: only what follows its assistant turn's end matters. The
# marker finds that end wherever a template re-renders earlier turns (Qwen3 drops an earlier turn's <think> block).
_MARK = "MILES_END_OF_ASSISTANT_TURN"
_BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]


class ChatTemplate:
    """The tokenizer's chat template as token ids: the conversation's opening, and the delta of new messages."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        self._turn_end = _MARK + tokenizer.convert_ids_to_tokens(self.eos_id)
        if self._turn_end not in self._render(_BASE, add_generation_prompt=False):
            raise ValueError(
                f"the chat template does not end an assistant turn with the EOS token {tokenizer.eos_token!r}, so a "
                "model's turn cannot be continued token by token; use a chat model's tokenizer (e.g. Qwen's)"
            )
        self._delta_cache: dict[str, list[int]] = {}

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, **kwargs: Any) -> str:
        return str(self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        ))  # fmt: skip

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def opening(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The first prompt: `messages` with the generation prompt (and the tools' schemas, when the template
        renders them)."""
        extra = {"tools": tools} if tools else {}
        return self.encode(self._render(messages, add_generation_prompt=True, **extra))

    def delta(self, messages: list[dict[str, Any]]) -> list[int]:
        """The tokens after a model turn's EOS that append `messages` and open the next assistant turn."""
        full = self._render([*_BASE, *messages], add_generation_prompt=True)
        if full.count(self._turn_end) != 1:
            raise ValueError("the chat template does not end an earlier assistant turn with its EOS token")
        text = full[full.index(self._turn_end) + len(self._turn_end) :]
        if text not in self._delta_cache:
            self._delta_cache[text] = self.encode(text)
        return list(self._delta_cache[text])

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=True))


@dataclass(frozen=True)
class AgentRollout:
    """The multi-turn `RolloutFn` (`await rollout(client, group, params)`): one episode per sample, concurrently.
    Per turn a sample draws with its own seed (group seed + position), so a resumed run replays its episodes."""

    pool: EnvPool
    chat: ChatTemplate
    max_turns: int
    max_response_tokens: int
    routed_experts: bool = False

    async def __call__(self, client: GenerateClient, group: list[Sample], params: SamplingParams) -> list[Sample]:
        return list(await asyncio.gather(
            *(self.episode(client, sample, params, position) for position, sample in enumerate(group))
        ))  # fmt: skip

    async def episode(self, client: GenerateClient, sample: Sample, params: SamplingParams, position: int) -> Sample:
        """One sample's episode; an environment failure fails the sample (and so its group), not the run."""
        try:
            opened = await self.pool.open(sample)
        except EnvError as error:
            return _failed(sample, str(error))
        try:
            return await self._play(client, sample, params, position, opened.episode, opened.messages, opened.tools)
        except EnvError as error:
            return _failed(sample, str(error))
        finally:
            await self.pool.close(opened.episode)

    async def _play(
        self, client: GenerateClient, sample: Sample, params: SamplingParams, position: int, episode: Any,
        messages: list[ChatMessage] | None, tools: list[dict[str, Any]] | None,
    ) -> Sample:  # fmt: skip
        opening = [m.model_dump() for m in messages] if messages is not None else _prompt_messages(sample)
        prompt = self.chat.opening(opening, tools)
        seed = None if params.sampling_seed is None else params.sampling_seed + position
        played = sample.model_copy(update={
            "prompt_tokens": prompt, "response_tokens": [], "response": "", "rollout_logprobs": [], "loss_mask": [],
            "weight_version": None, "weight_versions": None, "routed_experts": None,
        })  # fmt: skip
        trace = _Trace()
        status, reason = SampleStatus.TRUNCATED, "length"
        for turn in range(self.max_turns):
            budget = min(params.max_new_tokens, self.max_response_tokens - len(played.response_tokens))
            if budget <= 0:
                trace.end = "budget"
                break
            request = GenerateRequest(
                input_ids=prompt + played.response_tokens, return_logprob=True,
                return_routed_experts=self.routed_experts,
                sampling_params=params.model_copy(update={"n": 1, "max_new_tokens": budget, "sampling_seed": seed}),
            )  # fmt: skip
            (response,) = await client.generate(request)
            reason = response.meta_info.finish_type
            trace.turn_spans.append(
                [len(played.response_tokens), len(played.response_tokens) + len(response.output_ids)]
            )
            played = played.extended(response)
            if reason != "stop":  # cut by the budget or the context (truncated), or aborted by a weight sync
                status, trace.end = STATUS_OF_FINISH[reason], "truncated" if reason == "length" else "aborted"
                break
            parsed = parse_tool_calls(response.text)
            trace.num_tool_calls += parsed.num_attempts
            trace.num_tool_errors += len(parsed.errors)
            result = StepResult()  # a turn of malformed calls only never reaches the environment
            if parsed.calls or not parsed.errors:
                message = AgentMessage(content=response.text, tool_calls=parsed.calls, turn=turn)
                result = await self.pool.step(episode, message)
            trace.add_step(result)
            if result.is_done:
                status, trace.end = SampleStatus.COMPLETED, "done"
                break
            if turn == self.max_turns - 1:
                trace.end = "max_turns"
                break
            errors = [{"role": "tool", "content": error} for error in parsed.errors]
            observed = observation_messages(result.observation, called_tools=parsed.num_attempts > 0) + errors
            delta = self.chat.delta(observed)
            if response.output_ids[-1] != self.chat.eos_id:  # a stop string or token ended the turn, not EOS
                delta = [self.chat.eos_id, *delta]
            if len(played.response_tokens) + len(delta) >= self.max_response_tokens:
                trace.end = "budget"
                break
            played = played.with_observation(delta)
        return played.model_copy(update={
            "response": self.chat.decode(played.response_tokens), "status": status, "finish_reason": reason,
            "metadata": played.metadata | {"agent": trace.metadata()},
        })  # fmt: skip


class _Trace:
    """An episode's record beside its tokens: each turn's span of the response, the environment's reward and
    info, tool calls and errors, and why it ended."""

    def __init__(self) -> None:
        self.turn_spans: list[list[int]] = []
        self.reward = 0.0
        self.num_tool_calls = self.num_tool_errors = 0
        self.end = "max_turns"
        self.info: dict[str, JsonValue] = {}

    def add_step(self, result: StepResult) -> None:
        self.reward += result.reward
        self.num_tool_errors += result.num_tool_errors
        self.info |= result.info

    def metadata(self) -> dict[str, JsonValue]:
        """`Sample.metadata["agent"]`."""
        return {
            "turns": len(self.turn_spans), "turn_spans": self.turn_spans,  # type: ignore[dict-item]
            "tool_calls": self.num_tool_calls, "tool_errors": self.num_tool_errors, "reward": self.reward,
            "end": self.end, "info": self.info,
        }  # fmt: skip


def _prompt_messages(sample: Sample) -> list[dict[str, Any]]:
    if isinstance(sample.prompt, str):
        return [{"role": "user", "content": sample.prompt}]
    return [m.model_dump() for m in sample.prompt]


def _failed(sample: Sample, error: str) -> Sample:
    return sample.model_copy(update={"status": SampleStatus.FAILED, "error": f"environment failed: {error}"})


@contextlib.contextmanager
def agent_rollout(cfg: RolloutSection, tokenizer: Any) -> Iterator[AgentRollout | None]:
    """The run's multi-turn rollout function and its environment workers (stopped on exit); None without
    `rollout.agent.env`."""
    agent = cfg.agent
    if agent.env is None:
        yield None
        return
    limits = Limits(
        cpu_s_per_call=agent.cpu_s_per_call,
        address_space_bytes=int(agent.address_space_gib * (1 << 30)),
        num_open_files=agent.num_open_files,
        env_passthrough=tuple(agent.env_passthrough),
    )
    with EnvPool(agent.env, agent.env_args, timeout_s=agent.timeout_s, num_workers=agent.num_workers,
                 limits=limits) as pool:  # fmt: skip
        yield AgentRollout(pool, ChatTemplate(tokenizer), agent.max_turns, agent.max_response_tokens,
                           routed_experts=cfg.return_routed_experts)  # fmt: skip

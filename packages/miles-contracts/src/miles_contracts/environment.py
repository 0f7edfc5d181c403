"""The environment interface of agentic (multi-turn) rollouts: what an environment receives and returns.

In the RL data path an environment sits inside step 2 (rollout): the orchestrator's multi-turn rollout function
alternates the policy's turns with the environment's steps until the episode is done. One environment instance
runs one episode (one sample), in a sandboxed worker process:

    env = MyEnv(**rollout.agent.env_args)
    first = env.reset(sample)                 # None: the sample's prompt opens the conversation
    result = env.step(message)                # the model's turn, tool calls parsed -> StepResult
    ...                                       # until result.is_done, the turn limit or the token budget

`reset` and `step` may be plain or `async` functions. Everything crosses the process boundary as JSON (pydantic
models), never as pickles. Tool calls are parsed by the rollout before `step` (Hermes / Qwen `<tool_call>` JSON);
a malformed call never reaches the environment: the rollout answers it with an observation that says what was
wrong.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from miles_contracts.sample import ChatMessage, Sample

Observation = str | list[ChatMessage]


class ToolCall(BaseModel):
    """One tool call the model made: the function's name and its JSON arguments."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="The tool's name, as the model wrote it.")
    arguments: dict[str, JsonValue] = Field(default_factory=dict, description="The call's keyword arguments.")


class AgentMessage(BaseModel):
    """The model's turn as the environment sees it: the decoded text and the well-formed tool calls in it."""

    model_config = ConfigDict(extra="forbid")

    content: str = Field(description="The turn's text as generated (tool-call markup included, special tokens not).")
    tool_calls: list[ToolCall] = Field(default_factory=list, description="The turn's tool calls, in order.")
    turn: int = Field(ge=0, description="0 for the model's first turn.")


class StepResult(BaseModel):
    """What an environment answers to one model turn.

    `observation` is appended to the conversation through the tokenizer's chat template: text becomes one message
    of role `tool` when the turn called tools, else `user`; a list of messages is appended as given. None (or an
    empty list) appends nothing, which only makes sense with `is_done`."""

    model_config = ConfigDict(extra="forbid")

    observation: Observation | None = Field(default=None, description="What the model reads next.")
    reward: float = Field(default=0.0, allow_inf_nan=False, description="This step's reward; the episode's sums.")
    is_done: bool = Field(default=False, description="The episode ended (answered, solved, failed for good).")
    num_tool_errors: int = Field(
        default=0, ge=0, description="Tool calls of this turn that failed (unknown tool, bad arguments, raised)."
    )
    info: dict[str, JsonValue] = Field(default_factory=dict, description="Free-form extras, kept on the sample.")


@runtime_checkable
class Environment(Protocol):
    """One episode of a multi-turn task. Built as `Env(**rollout.agent.env_args)`, one instance per sample.

    `tools` (optional attribute): OpenAI-style function schemas, given to the chat template (`tools=`) when the
    conversation's first turn is rendered."""

    def reset(self, sample: Sample, /) -> Observation | Awaitable[Observation | None] | None:
        """Start the episode of `sample`; the conversation's opening messages, or None for the sample's prompt."""
        ...

    def step(self, message: AgentMessage, /) -> StepResult | Awaitable[StepResult]:
        """React to the model's turn."""
        ...


def observation_messages(observation: Observation | None, *, called_tools: bool) -> list[dict[str, Any]]:
    """An observation as chat-template messages: text is one `tool` message after tool calls, else `user`."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "tool" if called_tools else "user", "content": observation}]
    return [message.model_dump() for message in observation]

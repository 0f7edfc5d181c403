"""Pure-logic tests (no torch): the environment interface of agentic rollouts -- what a step may return, how an
observation becomes chat messages, and `load_plugin`'s check of an environment class."""

import sys
import types

import pytest
from pydantic import ValidationError

from miles_contracts import AgentMessage, ChatMessage, Environment, Sample, StepResult, ToolCall, load_plugin
from miles_contracts import observation_messages as messages_of


class Echo:
    def reset(self, sample: Sample) -> None:
        return None

    def step(self, message: AgentMessage) -> StepResult:
        return StepResult(observation=message.content, is_done=True)


class NoStep:
    def reset(self, sample: Sample) -> None:
        return None


def test_step_results_are_checked() -> None:
    assert StepResult() == StepResult(observation=None, reward=0.0, is_done=False, num_tool_errors=0, info={})
    assert StepResult.model_validate({"observation": [{"role": "tool", "content": "4"}]}).observation == [
        ChatMessage(role="tool", content="4")
    ]
    for bad in ({"reward": float("nan")}, {"num_tool_errors": -1}, {"observation": 3}, {"done": True}):
        with pytest.raises(ValidationError):
            StepResult.model_validate(bad)
    with pytest.raises(ValidationError):
        ToolCall(name="", arguments={})
    with pytest.raises(ValidationError):
        AgentMessage(content="x", turn=-1)


def test_observations_become_chat_messages() -> None:
    assert messages_of(None, called_tools=True) == []
    assert messages_of("4", called_tools=True) == [{"role": "tool", "content": "4"}]
    assert messages_of("higher", called_tools=False) == [{"role": "user", "content": "higher"}]
    listed = [ChatMessage(role="tool", content="1"), ChatMessage(role="tool", content="2")]
    expected = [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    assert messages_of(listed, called_tools=True) == expected


def test_load_plugin_checks_an_environment_class() -> None:
    module = types.ModuleType("user_envs")
    module.Echo, module.NoStep, module.echo = Echo, NoStep, Echo()  # type: ignore[attr-defined]
    sys.modules["user_envs"] = module
    try:
        assert load_plugin("user_envs:Echo", Environment) is Echo
        with pytest.raises(TypeError, match="is not an Environment: it lacks step"):
            load_plugin("user_envs:NoStep", Environment)
        with pytest.raises(TypeError, match="is not a class"):
            load_plugin("user_envs:echo", Environment)
        with pytest.raises(ValueError, match="has no attribute 'Missing'"):
            load_plugin("user_envs:Missing", Environment)
    finally:
        del sys.modules["user_envs"]

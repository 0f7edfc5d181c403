"""Built-in environments of agentic rollouts, and `ToolEnv`, the base class for environments whose actions are tool
calls (docs/agentic.md). An environment implements miles_contracts' `Environment` (`reset`, `step`); the
multi-turn rollout (agentic.py) drives it, one instance per episode, inside a sandboxed worker (env_pool.py).

- `ToolEnv`: a turn with tool calls gets one `tool` message per call (the function's result, or the error it
  raised); a turn without any ends the episode, scored by `score` (0 by default).
- `CalculatorEnv` (`rollout.agent.env=calculator`): the built-in arithmetic task with one tool, `calculator`,
  which evaluates an arithmetic expression safely (`calculate`: an AST walk over numbers and + - * / // % **,
  never `eval`); the final answer is scored by the task's verifier.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import JsonValue

from miles_contracts import AgentMessage, ChatMessage, Sample, StepResult
from miles_orchestrator.data import task

MAX_TOOL_OUTPUT_CHARS = 4000  # a tool's answer is cut here, so one call cannot flood the context


class ToolEnv:
    """An environment whose tools are Python functions (`functions`), described to the model by `tools`
    (OpenAI-style schemas, rendered by the chat template). Subclass it, set both, and override `score`."""

    tools: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"{type(self).__name__} takes no rollout.agent.env_args, got {sorted(kwargs)}")
        self.sample: Sample | None = None

    def functions(self) -> dict[str, Callable[..., Any]]:
        """Tool name -> the function the call runs with its JSON arguments as keyword arguments."""
        return {}

    def reset(self, sample: Sample) -> None:
        """Keep the sample (its label scores the answer); the sample's prompt opens the conversation."""
        self.sample = sample

    def step(self, message: AgentMessage) -> StepResult:
        if not message.tool_calls:
            return StepResult(reward=self.score(message), is_done=True)
        functions = self.functions()
        outputs, num_errors = [], 0
        for call in message.tool_calls:
            function = functions.get(call.name)
            if function is None:
                num_errors += 1
                outputs.append(f"error: there is no tool {call.name!r}; the tools are {sorted(functions)}")
                continue
            try:
                outputs.append(str(function(**call.arguments))[:MAX_TOOL_OUTPUT_CHARS])
            except Exception as error:  # the model's arguments are untrusted: any failure is an observation
                num_errors += 1
                outputs.append(f"error: {type(error).__name__}: {error}")
        observation = [ChatMessage(role="tool", content=output) for output in outputs]
        return StepResult(observation=observation, num_tool_errors=num_errors)

    def score(self, message: AgentMessage) -> float:
        """The reward of the final answer (a turn without tool calls)."""
        return 0.0


class CalculatorEnv(ToolEnv):
    """The built-in task with a calculator: call `calculator(expression)` as often as needed, then answer with the
    number; reward 1 when its last integer is the task's answer (`task.verify`)."""

    tools: ClassVar[list[dict[str, Any]]] = [{
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression of numbers, + - * / // % ** and parentheses.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                           "required": ["expression"]},
        },
    }]  # fmt: skip

    def functions(self) -> dict[str, Callable[..., Any]]:
        return {"calculator": calculate}

    def score(self, message: AgentMessage) -> float:
        assert self.sample is not None, "step before reset"
        return task.verify(message.content, self.sample.label)


BUILTIN_ENVS: dict[str, type] = {"calculator": CalculatorEnv}

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_MAGNITUDE = 10**30  # operands and results beyond this are refused (2 ** 10 ** 9 would never finish)
MAX_EXPRESSION_CHARS = 200


def calculate(expression: JsonValue) -> int | float:
    """The value of an arithmetic expression ("37 * 48" -> 1776): numbers, + - * / // % **, parentheses; an int
    when the value is integral. Anything else is a ValueError that says what is allowed."""
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string such as '37 * 48', got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression is {len(expression)} characters; at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"{expression!r} is not an arithmetic expression ({error.msg})") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))  # type: ignore[no-any-return]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError(f"exponent {right} is too large; at most 64")
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ValueError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise ValueError(f"{ast.unparse(node)!r} is not allowed: use numbers, + - * / // % ** and parentheses")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"a value beyond ±1e30 ({value!r:.40}); the calculator refuses it")
    return value  # type: ignore[no-any-return]

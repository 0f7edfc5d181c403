"""Tool calls in the model's text, in the Hermes format that Qwen2.5 / Qwen3 chat models are trained on
(`rollout.agent.tool_call_format=hermes`; SGLang's `qwen25` tool parser reads the same):

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "37 * 48"}}
    </tool_call>

A turn may hold several calls; the text around them is kept as the turn's content. `parse_tool_calls` returns
the well-formed calls and, for each malformed one, what is wrong with it: the multi-turn rollout turns those into
an observation for the model (counted in `agent_tool_errors`), never into an exception.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from pydantic import ValidationError

from miles_contracts import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)
EXAMPLE = f'{OPEN}{{"name": "NAME", "arguments": {{"ARG": "VALUE"}}}}{CLOSE}'


@dataclass
class ParsedTurn:
    """A turn's tool calls: the well-formed ones, and one message per malformed one."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def num_attempts(self) -> int:
        return len(self.calls) + len(self.errors)


def parse_tool_calls(text: str) -> ParsedTurn:
    """Every `<tool_call>…</tool_call>` block of `text`, parsed as `{"name": str, "arguments": object}`."""
    parsed = ParsedTurn()
    for k, match in enumerate(_CALL.finditer(text)):
        call = _parse(match.group(1).strip(), is_closed=match.group(0).endswith(CLOSE))
        if isinstance(call, ToolCall):
            parsed.calls.append(call)
        else:
            parsed.errors.append(f"tool call {k + 1} is malformed: {call}; write {EXAMPLE}")
    return parsed


def _parse(body: str, is_closed: bool) -> ToolCall | str:
    """The call in one block's body, or what is wrong with it."""
    if not is_closed:
        return f"{OPEN} is never closed by {CLOSE}"
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        return f"its body is not JSON ({error.msg} at column {error.colno})"
    if not isinstance(value, dict):
        return f"its body is a JSON {type(value).__name__}, not an object"
    if not isinstance(value.get("name"), str) or not value["name"]:
        return 'it has no "name" string'
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI does
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            return f'"arguments" is a string that is not JSON ({error.msg})'
    try:
        return ToolCall.model_validate({"name": value["name"], "arguments": arguments})
    except ValidationError:
        return '"arguments" must be a JSON object of keyword arguments'


def format_tool_call(call: ToolCall) -> str:
    """A call as the model should write it (the bootstrap's SFT rows, the docs)."""
    return f"{OPEN}{json.dumps({'name': call.name, 'arguments': call.arguments})}{CLOSE}"

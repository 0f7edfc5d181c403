"""The request models of the OpenAI-compatible routes (openai_api.py): `/v1/completions`' and `/v1/chat/completions`'
bodies as pydantic models, validated before anything reaches the engine.

Field names and defaults follow SGLang's OpenAI layer (SGLang 0.5.23, `sglang/srt/entrypoints/openai/protocol.py`):
the OpenAI fields, plus SGLang's sampling extras (`top_k`, `min_p`, `min_tokens`, `repetition_penalty`,
`stop_token_ids`, `ignore_eos`, `no_stop_trim`, `skip_special_tokens`). Each request maps to the native sampling
parameters (`_Sampling.sampling_params`). Structured output: OpenAI's `response_format` (`json_object`,
`json_schema`) maps to the native `json_schema` as SGLang maps it; SGLang's `json_schema`, `regex`, `ebnf`,
`logit_bias`, `stop_regex` and `custom_params` pass through. SGLang's `lora_path` names the LoRA adapter (unless
`model` names one: openai_api.py).

A field this server cannot honour is refused (`UNSUPPORTED`; chat's `echo`) with a validation error that names it,
which the routes answer as a 400; unknown top-level keys are ignored, as SGLang (and its router, which adds its own)
does.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_MODEL_NAME = "default"  # SGLang's request default: always accepted
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on chat `top_logprobs` (completions `logprobs`: 5; SGLang allows 20 too)

# Fields of OpenAI's / SGLang's requests this server does not implement yet: refused unless absent, null, false or
# empty (then they change nothing).
UNSUPPORTED = {
    "suffix": "suffixes",
    "best_of": "best_of",
    "custom_logit_processor": "custom logit processors",
    "tools": "tool calling",
    "functions": "function calling",
    "return_hidden_states": "hidden states",
    "session_params": "sessions",
}
# Values of the same keys that change nothing.
_NEUTRAL: tuple[object, ...] = (None, False, "", [], {})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False  # a last chunk with `usage` and no choices


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type json_schema needs json_schema.schema")
        return self

    def as_json_schema(self) -> str | None:
        """The schema the output must follow (JSON text), as SGLang maps it; None for plain text."""
        if self.type == "json_object":
            return '{"type": "object"}'
        if self.type == "json_schema":
            assert self.json_schema is not None
            return json.dumps(self.json_schema.schema_)
        return None


class _Sampling(BaseModel):
    """The sampling fields both routes share (OpenAI's, then SGLang's extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str = DEFAULT_MODEL_NAME
    n: int = Field(default=1, ge=1, le=1024)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    rid: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    logit_bias: dict[str, float] | None = None
    stop_regex: str | list[str] | None = None
    custom_params: dict[str, Any] | None = None
    lora_path: str | list[str | None] | None = None  # SGLang's: the adapter, when `model` names none

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, feature in UNSUPPORTED.items():
                if data.get(key) not in _NEUTRAL:
                    raise ValueError(f"{key}: {feature} is not supported by this server yet; remove it")
        return data

    def sampling_params(self, max_new_tokens: int | None) -> dict[str, Any]:
        """The native sampling parameters (a null field takes SGLang's default there, as `SamplingParams` reads it)."""
        return {
            "max_new_tokens": max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "n": self.n,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "sampling_seed": self.seed,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "min_new_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "no_stop_trim": self.no_stop_trim,
            "skip_special_tokens": self.skip_special_tokens,
            "json_schema": self.response_format.as_json_schema() if self.response_format else self.json_schema,
            "regex": self.regex,
            "ebnf": self.ebnf,
            "logit_bias": self.logit_bias,
            "stop_regex": self.stop_regex,
            "custom_params": self.custom_params,
        }


class CompletionRequest(_Sampling):
    """`POST /v1/completions`."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default; null: up to the context length
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False  # the prompt in front of each choice: its text, and with logprobs its tokens' log-probs

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:  # SGLang's rule; the native API scores a prompt alone
            raise ValueError(
                "must be at least 1 (as SGLang requires). To score a prompt without generating, send echo: true "
                "with logprobs and max_tokens: 1 and drop the last entry (lm-eval's local-completions does), or "
                "POST /generate with max_new_tokens 0, return_logprob true and logprob_start_len 0"
            )
        return value


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_echo(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("echo") not in _NEUTRAL:  # SGLang's chat request has no echo
            raise ValueError(
                "echo: chat completions do not echo the prompt; use /v1/completions with echo, or remove it"
            )
        return data

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        return self

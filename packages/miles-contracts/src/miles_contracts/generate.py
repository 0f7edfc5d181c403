"""SGLang-compatible `/generate` request and response schemas.

Field names follow SGLang's native API (`sglang.srt.managers.io_struct.GenerateReqInput` and the
`meta_info` it returns), so the same client drives the embedded Miles engine and an SGLang server.
Requests forbid unknown fields (a typo is an error that names it); responses allow extra fields,
because servers add their own.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_NEW_TOKENS_LIMIT = 1 << 20  # anything larger is a client bug, not a request


class SamplingParams(BaseModel):
    """Sampling parameters of one generate request (SGLang `sampling_params`)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(default=128, ge=0, le=MAX_NEW_TOKENS_LIMIT, description="Most tokens to generate.")
    temperature: float = Field(default=1.0, ge=0.0, le=100.0, description="0 means greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass, in (0, 1].")
    top_k: int = Field(default=-1, description="Keep the k most likely tokens; -1 disables.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="Drop tokens below min_p * max prob.")
    stop: str | list[str] | None = Field(default=None, description="Stop strings; trimmed from the output.")
    stop_token_ids: list[int] | None = Field(default=None, description="Token ids that end generation.")
    ignore_eos: bool = Field(default=False, description="Keep generating past EOS.")
    skip_special_tokens: bool = Field(default=True, description="Drop special tokens from the output text.")
    no_stop_trim: bool = Field(default=False, description="Keep the matched stop string in the output text.")
    n: int = Field(default=1, ge=1, le=1024, description="Number of samples for this prompt.")
    sampling_seed: int | None = Field(
        default=None, ge=0, description="Seed of sample 0; sample i uses seed + i. None: engine-chosen."
    )

    @field_validator("top_k")
    @classmethod
    def _top_k_valid(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("top_k must be -1 (disabled) or a positive integer")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _ids_non_negative(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return value

    def stop_strings(self) -> list[str]:
        """`stop` normalized to a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class GenerateRequest(BaseModel):
    """A `/generate` request: one prompt or a batch, as text or token ids."""

    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = Field(default=None, description="Prompt text, or a batch of them.")
    input_ids: list[int] | list[list[int]] | None = Field(default=None, description="Prompt token ids, or a batch.")
    sampling_params: SamplingParams | list[SamplingParams] = Field(default_factory=SamplingParams)
    return_logprob: bool = Field(default=False, description="Return log-probs of output (and input) tokens.")
    logprob_start_len: int = Field(
        default=-1, ge=-1, description="First prompt position whose log-prob is returned; -1: none."
    )
    top_logprobs_num: int = Field(default=0, ge=0, le=1024, description="Top alternatives per position.")
    return_routed_experts: bool = Field(default=False, description="Return MoE routing per token.")
    stream: bool = Field(default=False, description="Stream partial outputs (server-sent events).")
    rid: str | list[str] | None = Field(default=None, description="Request id(s), for /abort_request.")

    @field_validator("input_ids")
    @classmethod
    def _ids_valid(cls, value: list[int] | list[list[int]] | None) -> list[int] | list[list[int]] | None:
        if value is None:
            return value
        if len(value) == 0:
            raise ValueError("input_ids is empty; send at least one token id")
        rows = value if isinstance(value[0], list) else [value]
        for row in rows:
            assert isinstance(row, list)
            if len(row) == 0:
                raise ValueError("input_ids contains an empty prompt; send at least one token id per prompt")
            if any(t < 0 for t in row):
                raise ValueError("input_ids must be non-negative token ids")
        return value

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `text` or `input_ids`")
        if isinstance(self.text, list) and len(self.text) == 0:
            raise ValueError("text is an empty batch; send at least one prompt")
        if isinstance(self.text, str) and self.text == "":
            raise ValueError("text is empty; send a non-empty prompt")
        num = self.batch_size
        if isinstance(self.sampling_params, list) and len(self.sampling_params) != num:
            raise ValueError(f"sampling_params has {len(self.sampling_params)} entries for {num} prompts")
        if isinstance(self.rid, list) and len(self.rid) != num:
            raise ValueError(f"rid has {len(self.rid)} entries for {num} prompts")
        return self

    @property
    def is_batch(self) -> bool:
        """True when the request carries a list of prompts (the response is then a list too)."""
        if self.text is not None:
            return isinstance(self.text, list)
        assert self.input_ids is not None
        return isinstance(self.input_ids[0], list)

    @property
    def batch_size(self) -> int:
        """Number of prompts (before `n` expansion)."""
        if not self.is_batch:
            return 1
        prompts = self.text if self.text is not None else self.input_ids
        assert prompts is not None
        return len(prompts)

    def params_for(self, i: int) -> SamplingParams:
        """Sampling parameters of prompt i."""
        return self.sampling_params[i] if isinstance(self.sampling_params, list) else self.sampling_params


class FinishReason(BaseModel):
    """Why generation ended: `stop` (EOS, stop string/token; `matched` says which), `length`, `abort`."""

    model_config = ConfigDict(extra="allow")

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    message: str | None = None
    length: int | None = None


LogprobEntry = tuple[float | None, int, str | None]
"""(log-prob, token id, token text or None). The first input token has no log-prob (None)."""


class MetaInfo(BaseModel):
    """`meta_info` of a generate response."""

    model_config = ConfigDict(extra="allow", ser_json_inf_nan="constants")  # -inf log-probs stay -Infinity

    id: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    cached_tokens: int = Field(default=0, ge=0)
    weight_version: int | None = Field(default=None, description="Policy version of the weights that generated.")
    output_token_logprobs: list[LogprobEntry] | None = None
    input_token_logprobs: list[LogprobEntry] | None = None
    output_top_logprobs: list[list[LogprobEntry] | None] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None
    routed_experts: list[list[list[int]]] | None = None

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version_as_int(cls, value: Any) -> Any:
        # SGLang reports versions as strings ("default" until the first named update).
        if isinstance(value, str):
            return int(value) if value.lstrip("-").isdigit() else None
        return value


class GenerateResponse(BaseModel):
    """One generated sequence. A batch or `n > 1` request returns a list of these."""

    model_config = ConfigDict(extra="allow", ser_json_inf_nan="constants")  # -inf log-probs stay -Infinity

    text: str
    output_ids: list[int]
    meta_info: MetaInfo

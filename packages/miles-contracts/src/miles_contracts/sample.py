"""`Sample`: one prompt and (after rollout) one response, as it travels through the RL data path.

Data source → rollout (fills tokens, log-probs, versions) → reward → filter → advantages → trainer.
Every per-response-token list (`rollout_logprobs`, `loss_mask`, `weight_versions`) has one entry per
`response_tokens` entry; this is checked on construction and on assignment. `routed_experts` (MoE routing replay)
covers every token but the last, as SGLang's `meta_info.routed_experts` with `routed_experts_start_len=0`.
"""

from __future__ import annotations

import base64
import binascii
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator


class SampleStatus(StrEnum):
    """Where a sample stands. `pending` until the rollout returns."""

    PENDING = "pending"
    COMPLETED = "completed"  # the response ended by itself (EOS, a stop string or token)
    TRUNCATED = "truncated"  # the response hit max_new_tokens or the context length
    ABORTED = "aborted"  # the request was aborted (e.g. weight update, over-sampling no longer needed)
    FAILED = "failed"  # rollout or reward raised / timed out; `error` says why


FinishReasonType = Literal["stop", "length", "abort"]


class ChatMessage(BaseModel):
    """One chat message in the OpenAI / Hugging Face chat-template format."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class Sample(BaseModel):
    """One prompt/response pair. Token ids are the source of truth; text is for humans and rewards."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    index: int = Field(ge=0, description="Global, run-unique sample index; seeds derive from it.")
    group_index: int = Field(ge=0, description="Index of the prompt group (the n samples of one prompt).")
    prompt: str | list[ChatMessage] = Field(description="Prompt text or chat messages.")
    label: JsonValue = Field(default=None, description="Reference answer for the reward function.")
    prompt_tokens: list[int] = Field(default_factory=list, description="Prompt token ids as sent to the engine.")
    response_tokens: list[int] = Field(default_factory=list, description="Response token ids returned by the engine.")
    response: str = Field(default="", description="Detokenized response text.")
    rollout_logprobs: list[float] | None = Field(
        default=None, description="Engine log-prob of each response token (float32 values; see the log-prob contract)."
    )
    loss_mask: list[int] | None = Field(
        default=None,
        description="1 where a response token trains (the model's own tokens), 0 elsewhere (tool output).",
    )
    reward: float | None = Field(default=None, description="Scalar reward, filled by the reward step.")
    status: SampleStatus = Field(default=SampleStatus.PENDING)
    finish_reason: FinishReasonType | None = Field(default=None, description="Engine finish reason type.")
    error: str | None = Field(default=None, description="Why the sample failed, when status is `failed`.")
    weight_version: int | None = Field(default=None, description="Policy version that produced the response.")
    weight_versions: list[int] | None = Field(
        default=None, description="Per-token policy versions (partial rollouts spanning a weight update)."
    )
    routed_experts: str | None = Field(
        default=None,
        description="MoE routing for routing replay, as the engine returns it (SGLang's meta_info.routed_experts "
        "with routed_experts_start_len=0): base64 (standard alphabet) of int32 [num_tokens - 1, num_hidden_layers, "
        "num_experts_per_tok] over prompt + response tokens (the last token has none), dense layers 0. Decode: "
        "np.frombuffer(base64.b64decode(s), np.int32).reshape(-1, num_hidden_layers, num_experts_per_tok). "
        "(num_tokens - 1) x layers x top_k x 4 bytes, a third more as base64.",
    )
    metadata: dict[str, JsonValue] = Field(default_factory=dict, description="Free-form, JSON-serializable extras.")

    @field_validator("routed_experts")
    @classmethod
    def _routed_experts_are_int32_base64(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            num_bytes = len(base64.b64decode(value, validate=True))
        except (binascii.Error, ValueError) as error:
            raise ValueError(
                f"routed_experts is not base64 ({error}); give the engine's meta_info.routed_experts string as is"
            ) from None
        if num_bytes % 4:
            raise ValueError(
                f"routed_experts decodes to {num_bytes} bytes, not a whole number of int32 entries; give the "
                "engine's meta_info.routed_experts string as is"
            )
        return value

    @model_validator(mode="after")
    def _per_token_lists_match(self) -> Sample:
        num_response = len(self.response_tokens)
        for name in ("rollout_logprobs", "loss_mask", "weight_versions"):
            values: list[Any] | None = getattr(self, name)
            if values is not None and len(values) != num_response:
                raise ValueError(
                    f"{name} has {len(values)} entries but response_tokens has {num_response}; "
                    f"give one {name} entry per response token"
                )
        if self.loss_mask is not None and any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask entries must be 0 or 1")
        if self.status is SampleStatus.FAILED and not self.error:
            raise ValueError("a sample with status 'failed' needs an `error` saying why")
        return self

    @property
    def num_tokens(self) -> int:
        """Prompt plus response length: what the trainer packs."""
        return len(self.prompt_tokens) + len(self.response_tokens)

    def token_versions(self) -> list[int | None]:
        """The policy version of each response token: `weight_versions` when the response spans a weight update
        (a partial rollout), else `weight_version` for every token."""
        if self.weight_versions is not None:
            return list(self.weight_versions)
        return [self.weight_version] * len(self.response_tokens)

    def effective_loss_mask(self) -> list[int]:
        """The loss mask, defaulting to all response tokens training."""
        return list(self.loss_mask) if self.loss_mask is not None else [1] * len(self.response_tokens)

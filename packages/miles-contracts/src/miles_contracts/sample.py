"""`Sample`: one prompt and (after rollout) one response, as it travels through the RL data path.

Data source → rollout (fills tokens, log-probs, versions) → reward → filter → advantages → trainer.
Every per-response-token list (`rollout_logprobs`, `teacher_logprobs`, `teacher_top_logprobs`, `loss_mask`,
`weight_versions`) has one entry per `response_tokens` entry; this is checked on construction and on assignment.
`routed_experts` (MoE routing replay) covers every token but the last, as SGLang's `meta_info.routed_experts` with
`routed_experts_start_len=0`.

A rollout fills a sample from engine responses with `Sample.extended` (one more generation appended: the one-turn
rollout, a partial rollout's continuation, each turn of an agentic episode) and `Sample.with_observation` (tokens
the model did not generate, e.g. an environment's reply).
"""

from __future__ import annotations

import base64
import binascii
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator

from miles_contracts.generate import GenerateResponse, MetaInfo


class SampleStatus(StrEnum):
    """Where a sample stands. `pending` until the rollout returns."""

    PENDING = "pending"
    COMPLETED = "completed"  # the response ended by itself (EOS, a stop string or token)
    TRUNCATED = "truncated"  # the response hit max_new_tokens or the context length
    ABORTED = "aborted"  # the request was aborted (e.g. weight update, over-sampling no longer needed)
    FAILED = "failed"  # rollout or reward raised / timed out; `error` says why


FinishReasonType = Literal["stop", "length", "abort"]
STATUS_OF_FINISH = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


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
    teacher_logprobs: list[float] | None = Field(
        default=None,
        description="On-policy distillation: the teacher's log-prob of each response token, at the rollout's "
        "temperature (filled after the rewards; see the orchestrator's opd section).",
    )
    teacher_top_logprobs: list[list[tuple[int, float]]] | None = Field(
        default=None,
        description="On-policy distillation with the teacher's top-k (opd.top_k): per response token, the teacher's "
        "k most likely next tokens as (token id, log-prob) pairs, most likely first, at the rollout's temperature.",
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
        for name in ("rollout_logprobs", "teacher_logprobs", "teacher_top_logprobs", "loss_mask", "weight_versions"):
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

    def extended(self, response: GenerateResponse) -> Sample:
        """This sample with one more generation appended to its response: the engine was sent the prompt plus the
        response so far as `input_ids`, and answered `response`. Appends the tokens, their log-probs, their versions
        (`weight_versions` kept only when the response now spans several) and text; the loss mask grows with 1s
        when the sample has one; status, finish reason, `weight_version` and `routed_experts` (which covered the
        whole sequence sent) come from the new generation; speculative decoding's counts add up in
        `metadata["spec"]`."""
        meta = response.meta_info
        tokens = list(response.output_ids)
        versions = [*self.token_versions(), *meta.output_versions(len(tokens))]
        return self.model_copy(update={
            "response_tokens": self.response_tokens + tokens,
            "response": self.response + response.text,
            "rollout_logprobs": (self.rollout_logprobs or []) + meta.output_logprobs(),
            "loss_mask": None if self.loss_mask is None else self.loss_mask + [1] * len(tokens),
            "finish_reason": meta.finish_type, "status": STATUS_OF_FINISH[meta.finish_type],
            "weight_version": meta.policy_version, "weight_versions": _spanning(versions),
            "routed_experts": meta.routed_experts, "metadata": self.metadata | _spec_counts(self.metadata, meta),
        })  # fmt: skip

    def with_observation(self, tokens: list[int]) -> Sample:
        """This sample with tokens the model did not generate appended to its response (an environment's reply):
        loss mask 0, log-prob 0.0, the version of the token before them."""
        versions = self.token_versions()
        version = versions[-1] if versions else self.weight_version
        return self.model_copy(update={
            "response_tokens": self.response_tokens + tokens,
            "rollout_logprobs": (self.rollout_logprobs or []) + [0.0] * len(tokens),
            "loss_mask": self.effective_loss_mask() + [0] * len(tokens),
            "weight_versions": _spanning([*versions, *[version] * len(tokens)]),
        })  # fmt: skip


def _spanning(versions: list[int | None]) -> list[int] | None:
    """`Sample.weight_versions` for these per-token versions: the list when they differ (and all are known), else
    None (`weight_version` says it)."""
    known = [v for v in versions if v is not None]
    return known if len(set(versions)) > 1 and len(known) == len(versions) else None


def _spec_counts(metadata: dict[str, JsonValue], meta: MetaInfo) -> dict[str, JsonValue]:
    """`metadata["spec"]` with a generation's speculative decoding counts added (verify steps, drafts proposed and
    accepted, the histogram of accepted drafts per verify step); nothing when the engine did not draft."""
    if meta.spec_verify_ct is None:
        return {}
    before: Any = metadata.get("spec") or {"verify_ct": 0, "num_correct": 0, "num_proposed": 0, "histogram": []}
    histogram = list(before["histogram"])
    for accepted, steps in enumerate(meta.spec_accept_histogram or []):
        histogram += [0] * (accepted + 1 - len(histogram))
        histogram[accepted] += steps
    return {"spec": {
        "verify_ct": before["verify_ct"] + meta.spec_verify_ct,
        "num_correct": before["num_correct"] + (meta.spec_num_correct_drafts or 0),
        "num_proposed": before["num_proposed"] + (meta.spec_num_proposed_drafts or 0),
        "histogram": histogram,
    }}  # fmt: skip

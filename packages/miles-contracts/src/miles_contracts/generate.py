"""SGLang-compatible `/generate` request and response schemas.

Field names follow SGLang 0.5.23's native API (`sglang.srt.managers.io_struct.GenerateReqInput`,
`sglang.srt.sampling.sampling_params.SamplingParams` and the `meta_info` it returns), so the same client and the
same request bodies (slime's, sglang-router's) drive the embedded Miles engine and an SGLang server:
- top-level keys as SGLang treats them: keys it does not know are ignored (routers add their own, e.g. `model`);
  SGLang features the embedded engine lacks (`image_data`, `return_hidden_states`, ...) are refused
  when set, naming the field, never silently ignored (`UNSUPPORTED_REQUEST_FIELDS`);
- sampling params forbid unknown keys (SGLang does too: a typo is an error that names it); SGLang's that the engine
  lacks are refused when set (`UNSUPPORTED_SAMPLING_FIELDS`); `null` means the default, as in SGLang.
Responses allow extra fields, because servers add their own.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from miles_contracts.weight_version import WeightVersion, reported_weight_version, version_string

MAX_NEW_TOKENS_LIMIT = 1 << 20  # anything larger is a client bug, not a request

# SGLang sampling params the embedded engine does not implement: refused unless absent, null or the default.
UNSUPPORTED_SAMPLING_FIELDS: dict[str, str] = {
    "structural_tag": "structural tags",
    "choice": "structured output (choice)",
    "beam_width": "beam search",
    "stream_interval": "streaming",
    "watermark": "watermarking",
}
# SGLang sampling params that take their default when sent as null (SGLang's SamplingParams.__post_init__).
_NULL_MEANS_DEFAULT = (
    "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "min_new_tokens", "n", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
)  # fmt: skip


class SamplingParams(BaseModel):
    """Sampling parameters of one generate request (SGLang `sampling_params`)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(
        default=128, ge=0, le=MAX_NEW_TOKENS_LIMIT, description="Most tokens to generate (null: up to the context)."
    )
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
    min_new_tokens: int = Field(
        default=0, ge=0, le=MAX_NEW_TOKENS_LIMIT, description="No stop (EOS, stop token or string) before this many."
    )
    repetition_penalty: float = Field(
        default=1.0, gt=0.0, le=2.0, description="Divide positive / multiply negative logits of generated tokens."
    )
    frequency_penalty: float = Field(
        default=0.0, ge=-2.0, le=2.0, description="Subtract this times a token's count in the output so far."
    )
    presence_penalty: float = Field(
        default=0.0, ge=-2.0, le=2.0, description="Subtract this from tokens already in the output."
    )
    spaces_between_special_tokens: bool = Field(
        default=True, description="Put spaces between special tokens in the output text."
    )
    sampling_seed: int | None = Field(
        default=None, ge=0, description="Seed of sample 0; sample i uses seed + i. None: engine-chosen."
    )
    json_schema: str | None = Field(default=None, description="Constrain the output to this JSON schema (JSON text).")
    regex: str | None = Field(default=None, description="Constrain the output to this regular expression.")
    ebnf: str | None = Field(default=None, description="Constrain the output to this EBNF grammar (GBNF style).")
    logit_bias: dict[str, float] | None = Field(
        default=None, description='Added to these token ids\' sampling logits ({"id": bias}; log-probs unchanged).'
    )
    stop_regex: str | list[str] | None = Field(
        default=None, description="Regular expressions that end generation where they first match (trimmed)."
    )
    custom_params: dict[str, Any] | None = Field(
        default=None, description="Parameters of custom logit processors (none run here: accepted, unused, as SGLang)."
    )

    @model_validator(mode="before")
    @classmethod
    def _sglang_conventions(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        refused = [key for key in UNSUPPORTED_SAMPLING_FIELDS if data.get(key) not in (None, False, {}, [], "")]
        if refused:
            key = refused[0]
            raise ValueError(
                f"{key} ({UNSUPPORTED_SAMPLING_FIELDS[key]}) is not supported by the embedded engine; remove it"
            )
        data = {k: v for k, v in data.items() if k not in UNSUPPORTED_SAMPLING_FIELDS}
        for key in _NULL_MEANS_DEFAULT:
            if key in data and data[key] is None:
                del data[key]
        if "max_new_tokens" in data and data["max_new_tokens"] is None:
            data["max_new_tokens"] = MAX_NEW_TOKENS_LIMIT  # SGLang: no limit but the context length
        return data

    @model_validator(mode="after")
    def _min_within_max(self) -> SamplingParams:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens={self.min_new_tokens} exceeds max_new_tokens={self.max_new_tokens}")
        grammars = [name for name in ("json_schema", "regex", "ebnf") if getattr(self, name) is not None]
        if len(grammars) > 1:
            raise ValueError(f"give at most one of json_schema, regex and ebnf (got {', '.join(grammars)})")
        for key in self.logit_bias or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias key {key!r} is not a token id (a string of digits)")
        for pattern in self.stop_regexes():
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {error}") from error
        return self

    @property
    def grammar(self) -> str | None:
        """The constraining field's name (json_schema, regex, ebnf), None without one."""
        return next((name for name in ("json_schema", "regex", "ebnf") if getattr(self, name) is not None), None)

    def stop_regexes(self) -> list[str]:
        """`stop_regex` normalized to a list."""
        if self.stop_regex is None:
            return []
        return [self.stop_regex] if isinstance(self.stop_regex, str) else list(self.stop_regex)

    @property
    def has_penalties(self) -> bool:
        """True when a penalty changes the sampling distribution (the log-probs still follow the contract)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

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


# SGLang request fields the embedded engine does not implement: refused unless absent, null, false, empty or 0.
UNSUPPORTED_REQUEST_FIELDS: dict[str, str] = {
    **dict.fromkeys(("input_embeds", "positional_embed_overrides"), "input embeddings"),
    **dict.fromkeys(
        (
            "image_data",
            "video_data",
            "audio_data",
            "modalities",
            "mm_hashes",
            "mm_content_hashes",
            "use_audio_in_video",
            "video_config",
        ),
        "multimodal inputs",
    ),
    "lora_id": "LoRA ids, which SGLang's server assigns itself: name the adapter with lora_path",
    "custom_logit_processor": "custom logit processors",
    "watermark": "watermarking",
    "token_ids_logprob": "log-probs of chosen token ids",
    **dict.fromkeys(("return_sampling_mask", "sampling_logprobs_mode"), "behaviour log-probs of the sampling support"),
    **dict.fromkeys(("return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs"), "flat top log-probs"),
    "return_hidden_states": "hidden states",
    "return_indexer_topk": "indexer top-k",
    "session_params": "sessions",
    **dict.fromkeys(
        (
            "bootstrap_host",
            "bootstrap_port",
            "bootstrap_room",
            "bootstrap_pair_key",
            "decode_tp_size",
            "disagg_prefill_dp_rank",
        ),
        "prefill/decode disaggregation",
    ),
    **dict.fromkeys(("require_reasoning", "max_thinking_tokens"), "reasoning budgets"),
    "background": "background responses",
    "return_bytes": "image generation",
    "return_entropy": "entropy",
    "return_prompt_token_ids": "prompt token ids without log-probs",
    "cache_salt": "prefix-cache salting",
    "kv_hints": "KV cache hints",
    "images_config": "multimodal inputs",
}


# Request fields that take their default when sent as null, as SGLang's GenerateReqInput does.
_REQUEST_NULL_MEANS_DEFAULT = (
    "return_logprob", "logprob_start_len", "top_logprobs_num", "return_routed_experts", "routed_experts_start_len",
)  # fmt: skip


class GenerateRequest(BaseModel):
    """A `/generate` request: one prompt or a batch, as text or token ids (SGLang's top-level rules: see the module
    docstring; `ignored_keys` names what a body carries that is ignored)."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = Field(default=None, description="Prompt text, or a batch of them.")
    input_ids: list[int] | list[list[int]] | None = Field(default=None, description="Prompt token ids, or a batch.")
    sampling_params: SamplingParams | list[SamplingParams] = Field(default_factory=SamplingParams)
    return_logprob: bool | list[bool] = Field(
        default=False, description="Return log-probs of output (and input) tokens; per prompt as a list."
    )
    logprob_start_len: int | list[int] = Field(
        default=-1, description="First prompt position whose log-prob is returned; -1: none. Per prompt as a list."
    )
    top_logprobs_num: int | list[int] = Field(
        default=0, description="Top alternatives per position (0 to 1024); per prompt as a list."
    )
    return_text_in_logprobs: bool = Field(default=False, description="Token text in each log-prob entry.")
    stream: bool = Field(default=False, description="Stream partial outputs (server-sent events).")
    rid: str | list[str] | None = Field(default=None, description="Request id(s), for /abort_request.")
    return_routed_experts: bool = Field(
        default=False,
        description="Return the MoE experts every token was routed to (meta_info.routed_experts, see MetaInfo); "
        "the server must run with --enable-return-routed-experts and serve an MoE model.",
    )
    routed_experts_start_len: int = Field(
        default=0,
        description="First position whose routing is returned: meta_info.routed_experts covers positions "
        "[routed_experts_start_len, prompt + output tokens - 1); at most the prompt length.",
    )
    lora_path: str | list[str | None] | None = Field(
        default=None,
        description="The LoRA adapter a prompt is generated with, by its loaded name (SGLang's field, named for "
        "its paths; --lora-paths / /load_lora_adapter); one for every prompt, or a list with one per prompt (null: "
        "the base model).",
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, feature in UNSUPPORTED_REQUEST_FIELDS.items():
                if data.get(key) not in (None, False, 0, "", [], {}):
                    raise ValueError(f"{key} ({feature}) is not supported by the embedded engine; remove it")
            for key in _REQUEST_NULL_MEANS_DEFAULT:
                if key in data and data[key] is None:
                    del data[key]  # SGLang: null means the default
        return data

    @classmethod
    def ignored_keys(cls, body: dict[str, Any]) -> list[str]:
        """The keys of a request body that are ignored: neither fields of this model nor refused SGLang fields."""
        return sorted(set(body) - set(cls.model_fields) - set(UNSUPPORTED_REQUEST_FIELDS))

    @field_validator("logprob_start_len")
    @classmethod
    def _start_valid(cls, value: int | list[int]) -> int | list[int]:
        if any(v < -1 for v in (value if isinstance(value, list) else [value])):
            raise ValueError("logprob_start_len must be -1 (no input log-probs) or a prompt position >= 0")
        return value

    @field_validator("routed_experts_start_len")
    @classmethod
    def _routed_start_valid(cls, value: int) -> int:
        if value < 0:
            raise ValueError(
                f"routed_experts_start_len={value} is negative; use a prompt position >= 0 (0: the whole sequence)"
            )
        return value

    @field_validator("top_logprobs_num")
    @classmethod
    def _top_valid(cls, value: int | list[int]) -> int | list[int]:
        if any(not 0 <= v <= 1024 for v in (value if isinstance(value, list) else [value])):
            raise ValueError("top_logprobs_num must be between 0 and 1024")
        return value

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
        if isinstance(self.text, list) and "" in self.text:
            raise ValueError("text contains an empty prompt; send a non-empty text per prompt")
        num = self.batch_size
        if isinstance(self.sampling_params, list) and len(self.sampling_params) != num:
            raise ValueError(f"sampling_params has {len(self.sampling_params)} entries for {num} prompts")
        if isinstance(self.rid, list) and len(self.rid) != num:
            raise ValueError(f"rid has {len(self.rid)} entries for {num} prompts")
        for key in ("return_logprob", "logprob_start_len", "top_logprobs_num", "lora_path"):
            value = getattr(self, key)
            if isinstance(value, list) and len(value) != num:
                raise ValueError(f"{key} has {len(value)} entries for {num} prompts")
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

    def return_logprob_for(self, i: int) -> bool:
        """Whether prompt i returns log-probs."""
        return self.return_logprob[i] if isinstance(self.return_logprob, list) else self.return_logprob

    def logprob_start_len_for(self, i: int) -> int:
        """The first prompt position of prompt i whose log-prob is returned (-1: none)."""
        return self.logprob_start_len[i] if isinstance(self.logprob_start_len, list) else self.logprob_start_len

    def top_logprobs_num_for(self, i: int) -> int:
        """How many top alternatives prompt i returns per position."""
        return self.top_logprobs_num[i] if isinstance(self.top_logprobs_num, list) else self.top_logprobs_num

    def lora_path_for(self, i: int) -> str | None:
        """The adapter prompt i is generated with (None, or "" as SGLang reads it: the base model)."""
        name = self.lora_path[i] if isinstance(self.lora_path, list) else self.lora_path
        return name or None


class FinishReason(BaseModel):
    """Why generation ended: `stop` (EOS, stop string/token; `matched` says which), `length`, `abort` (with
    SGLang's `message`, `status_code`, `err_type`). Serialized as SGLang writes it: keys without a value left out."""

    model_config = ConfigDict(extra="allow")

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    message: str | None = None
    length: int | None = None
    status_code: int | None = None
    err_type: str | None = None

    @model_serializer(mode="wrap")
    def _sglang_shape(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if v is not None} if info.mode_is_json() else data


LogprobEntry = tuple[float | None, int, str | None]
"""(log-prob, token id, token text or None). The first input token has no log-prob (None)."""


class MetaInfo(BaseModel):
    """`meta_info` of a generate response."""

    model_config = ConfigDict(extra="allow")  # JSON writes a non-finite log-prob as null, as SGLang (orjson) does

    id: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    cached_tokens: int = Field(default=0, ge=0)
    e2e_latency: float | None = Field(default=None, description="Seconds from arrival to the last token.")
    weight_version: WeightVersion = Field(
        default=None,
        description="Version of the weights that generated: the orchestrator's policy step (an int), or the label "
        'another client updated them with (SGLang: any string, "default" unset).',
    )
    weight_versions: list[dict[str, Any]] | None = Field(
        default=None, description="Per-token version spans {version, start, end} when the weights changed mid-way."
    )
    output_token_logprobs: list[LogprobEntry] | None = None
    input_token_logprobs: list[LogprobEntry] | None = None
    output_top_logprobs: list[list[LogprobEntry] | None] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None
    routed_experts: str | None = Field(
        default=None,
        description="With return_routed_experts: the MoE experts of positions [routed_experts_start_len, "
        "prompt_tokens + completion_tokens - 1) (the last token never went through a forward), as SGLang 0.5.23 "
        "returns them: base64 (standard alphabet) of int32 [rows, num_hidden_layers, num_experts_per_tok], each "
        "row in rank order, dense layers' entries 0. Decode: np.frombuffer(base64.b64decode(s), "
        "np.int32).reshape(-1, num_hidden_layers, num_experts_per_tok). rows x layers x top_k x 4 bytes, a third "
        "more as base64.",
    )
    # Speculative decoding (SGLang's keys; absent when the server does not speculate): verify steps, drafts
    # proposed and accepted, accepted / proposed, tokens per verify step ((verify_ct + correct) / verify_ct), and
    # the histogram of accepted drafts per verify step.
    spec_verify_ct: int | None = Field(default=None, ge=0)
    spec_num_proposed_drafts: int | None = Field(default=None, ge=0)
    spec_num_correct_drafts: int | None = Field(default=None, ge=0)
    spec_accept_rate: float | None = None
    spec_accept_length: float | None = None
    spec_accept_histogram: list[int] | None = None

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version(cls, value: Any) -> Any:
        return reported_weight_version(value) if isinstance(value, str) else value

    @property
    def policy_version(self) -> int | None:
        """The weight version as the orchestrator's policy step; None when unset or a label that is not one."""
        return self.weight_version if isinstance(self.weight_version, int) else None

    @property
    def finish_type(self) -> Literal["stop", "length", "abort"]:
        """Why generation ended; `length` when the server did not say."""
        return self.finish_reason.type if self.finish_reason else "length"

    def output_logprobs(self) -> list[float]:
        """The log-prob of each output token (`output_token_logprobs` entries: [logprob, token id, text])."""
        return [float(entry[0] or 0.0) for entry in self.output_token_logprobs or []]

    def output_versions(self, num_tokens: int) -> list[int | None]:
        """The policy version of each of the `num_tokens` output tokens: from the version spans (SGLang's
        `weight_versions`: {version, start, end}, reported when the weights changed mid-generation), else
        `policy_version` for all (also when a span is the engine's unnumbered "default" weights)."""
        versions: list[int | None] = []
        for span in self.weight_versions or []:
            version = str(span["version"])
            if not version.isdigit():
                return [self.policy_version] * num_tokens
            versions += [int(version)] * (int(span["end"]) - int(span["start"]))
        return versions if self.weight_versions else [self.policy_version] * num_tokens

    @model_serializer(mode="wrap")
    def _sglang_shape(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        """In JSON, as SGLang 0.5.23 writes meta_info: keys without a value left out, the weight version a string
        (Python dumps keep the model's types)."""
        data: dict[str, Any] = handler(self)
        if not info.mode_is_json():
            return data
        data = {k: v for k, v in data.items() if v is not None}
        data["weight_version"] = version_string(self.weight_version)
        return data


class GenerateResponse(BaseModel):
    """One generated sequence. A batch or `n > 1` request returns a list of these."""

    model_config = ConfigDict(extra="allow")  # JSON writes a non-finite log-prob as null, as SGLang (orjson) does

    text: str = ""  # absent from a server started with --skip-tokenizer-init
    output_ids: list[int]
    meta_info: MetaInfo

"""The rollout side's config models, torch-free: `EngineConfig` (how the embedded engine runs) and `ServeConfig`
(what `miles-rollout serve` takes: a model directory, the kernels, the engine and the HTTP server).

`miles-rollout serve --help` is generated from these models, and a run config nests `EngineConfig` as
`rollout.engine`, so every engine setting is defined once, here (docs/architecture.md, "Config").
"""

from __future__ import annotations

import json
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from miles_kernels.config import KernelConfig, LoraConfig, WeightFormat, WeightQuantConfig

LOG_LEVELS = ("debug", "info", "warning", "error")
MTP_ALGORITHMS = ("NEXTN", "EAGLE")  # SGLang's names that draft with the model's own MTP layers
DRAFT_ALGORITHMS = (*MTP_ALGORITHMS, "EAGLE3")  # EAGLE3: a separate EAGLE-3 draft (speculative_draft_model_path)
DEFAULT_DRAFT_STEPS = 3


class RequestLimits(BaseModel):
    """Bounds on the work one request may ask of the engine, checked at intake (a 4xx naming the limit, 429 when the
    queue is full). The defaults sit far above what SGLang's clients (slime, sglang-router, the openai client) send
    in normal use; they exist so that no single request can stall or starve the others."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_queued_requests: int = Field(
        default=4096,
        ge=1,
        description="Prompts (groups of n samples) waiting for admission; past it a request is refused with 429 "
        "and Retry-After.",
    )
    max_prompts_per_request: int = Field(
        default=4096, ge=1, description="Prompts in one batched /generate request (text or input_ids lists)."
    )
    max_samples_per_request: int = Field(
        default=8192, ge=1, description="Samples in one request: its prompts times sampling_params.n."
    )
    max_top_logprob_entries: int = Field(
        default=1 << 21,
        ge=1,
        description="top_logprobs_num times the positions that return them (output tokens, plus prompt tokens when "
        "logprob_start_len is set), summed over a request's samples.",
    )
    max_stop_patterns: int = Field(
        default=64, ge=0, description="Stop strings plus stop regexes of one sample's sampling params."
    )
    max_stop_chars: int = Field(default=1024, ge=1, description="Longest stop string or stop regex, in characters.")
    stop_regex_window_chars: int = Field(
        default=4096,
        ge=64,
        description="Stop regexes are matched (linear-time, RE2) over this many trailing characters of a sample's "
        "text after each token; a match longer than this is not found.",
    )
    intake_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a request's intake work (chat template, tokenization, grammar compilation) may take, "
        "in the intake worker pool; past it the request is refused with 400.",
    )
    max_intake_workers: int = Field(
        default=2, ge=1, le=64, description="Threads doing intake work (templates, tokenization, grammars)."
    )


class EngineConfig(BaseModel):
    """How the embedded engine runs: memory, batching, context, device and the default seed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_kv_pages: int = Field(
        default=1024,
        ge=2,
        description="KV-cache pages (kernel.page_size tokens each), the memory bound of the cache: enough for "
        "max_running_requests sequences of prompt + max new tokens. Colocated runs re-allocate them every step: "
        "don't oversize.",
    )
    max_running_requests: int = Field(default=256, ge=1, description="Most sequences decoding at once.")
    max_prefill_tokens: int = Field(default=2048, ge=1, description="Token budget of one engine step (prefill).")
    context_length: int | None = Field(
        default=None, ge=2, description="Longest prompt + output in tokens; null: the model's max_position_embeddings."
    )
    device: str = Field(default="cpu", description="torch device of the engine, e.g. cpu or cuda:0.")
    seed: int = Field(default=0, ge=0, description="Base seed of requests that carry no sampling_seed.")
    speculative_algorithm: str | None = Field(
        default=None,
        description="Speculative decoding, SGLang's flag: NEXTN (or EAGLE, the same for an MTP draft) drafts with "
        "the model's own MTP layers (num_nextn_predict_layers >= 1 in config.json); EAGLE3 with the EAGLE-3 draft "
        "at speculative_draft_model_path (SpecForge's layout); null: off.",
    )
    speculative_draft_model_path: str | None = Field(
        default=None,
        description="EAGLE3's draft: a SpecForge-format EAGLE-3 checkpoint directory (LlamaForCausalLMEagle3) for "
        "this model (its vocabulary, hidden size and layers).",
    )
    speculative_num_steps: int | None = Field(
        default=None,
        ge=1,
        le=16,
        description=f"Draft tokens proposed per decoding step (the draft applied recursively); "
        f"default {DEFAULT_DRAFT_STEPS} when speculative decoding is on.",
    )
    speculative_eagle_topk: int | None = Field(
        default=None,
        ge=1,
        le=16,
        description="Draft branches per level: 1, a chain of drafts (the default); k > 1, a draft tree (SGLang's "
        "EAGLE tree: each level the k best paths propose their k likeliest tokens), verified with tree attention.",
    )
    speculative_num_draft_tokens: int | None = Field(
        default=None,
        ge=2,
        description="Tokens one verify step checks, the last sampled one included: with topk 1, num_steps + 1 (the "
        "default); with topk k > 1 the tree's size, at most 1 + k + (num_steps - 1) k^2 (default 1 + num_steps k).",
    )
    enable_return_routed_experts: bool = Field(
        default=False,
        description="Record the MoE experts every token is routed to, for requests with return_routed_experts "
        "(routing replay; SGLang's flag). MoE models only; a host buffer of num_kv_pages x page_size x "
        "num_hidden_layers x num_experts_per_tok x 4 bytes.",
    )
    limits: RequestLimits = Field(
        default_factory=RequestLimits, description="Bounds on the work one request may ask of the engine."
    )
    policy_lora: LoraConfig = Field(
        default_factory=LoraConfig,
        description="LoRA RL: the served policy is the base plus adapters of this shape that weight updates send "
        "(rank 0: none). The engine keeps the base and merges each adapter update into it with the trainer's "
        "kernel (docs/lora.md); a run derives it from trainer.lora.",
    )
    weight_dtype: WeightFormat = Field(
        default="kernel",
        description="How the decoder's linear layers (attention, MLP, experts) are stored and computed: kernel "
        "(kernel.dtype), fp8_block (FP8 e4m3 with 128x128 block scales, DeepSeek-V3's checkpoints), fp8_channel "
        "(FP8 with per-channel scales) or int4_group (symmetric INT4 with group scales, compressed-tensors' "
        "pack-quantized); dequantized into the batch-invariant matmul (docs/low-precision.md).",
    )
    weight_block_size: tuple[int, int] = Field(
        default=(128, 128), description="fp8_block: (output rows, input columns) sharing one scale."
    )
    weight_group_size: int = Field(
        default=128, ge=8, le=4096, description="int4_group: input columns sharing one scale (a multiple of 8)."
    )

    @field_validator("speculative_algorithm", mode="before")
    @classmethod
    def _known_algorithm(cls, value: object) -> object:
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        name = str(value).upper()
        if name not in DRAFT_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm {value!r} is not supported: Miles drafts with the policy's own MTP layers "
                f"({' or '.join(MTP_ALGORITHMS)}) or an EAGLE-3 draft (EAGLE3); STANDALONE and NGRAM are not "
                "implemented"
            )
        return name

    @model_validator(mode="after")
    def _speculative_settings(self) -> EngineConfig:
        given = {
            "speculative_num_steps": self.speculative_num_steps,
            "speculative_eagle_topk": self.speculative_eagle_topk,
            "speculative_num_draft_tokens": self.speculative_num_draft_tokens,
        }
        if self.speculative_algorithm is None and any(v is not None for v in given.values()):
            names = ", ".join(k for k, v in given.items() if v is not None)
            raise ValueError(f"{names} set without speculative_algorithm: add speculative_algorithm=NEXTN")
        has_path = self.speculative_draft_model_path is not None
        if self.speculative_algorithm == "EAGLE3" and not has_path:
            raise ValueError("speculative_algorithm=EAGLE3 drafts with an EAGLE-3 checkpoint: set "
                             "speculative_draft_model_path (miles-spec train --draft eagle3 writes one)")  # fmt: skip
        if self.speculative_algorithm != "EAGLE3" and has_path:
            raise ValueError(
                f"speculative_draft_model_path is EAGLE3's draft; speculative_algorithm={self.speculative_algorithm} "
                "drafts with the model's own MTP layers: set speculative_algorithm=EAGLE3 or leave the path unset"
            )
        tokens, topk, steps = self.speculative_num_draft_tokens, self.speculative_eagle_topk or 1, self.num_draft_steps
        if topk > 1:
            most = 1 + topk + (steps - 1) * topk * topk
            if tokens is not None and tokens > most:
                raise ValueError(
                    f"speculative_num_draft_tokens={tokens}: a tree of speculative_num_steps={steps} levels with "
                    f"speculative_eagle_topk={topk} has at most 1 + {topk} + {steps - 1} x {topk}^2 = {most} tokens"
                )
            return self
        if tokens is not None and tokens != self.num_draft_steps + 1:
            raise ValueError(
                f"speculative_num_draft_tokens={tokens} with speculative_num_steps={self.num_draft_steps}: with "
                f"topk 1 a verify step checks num_steps + 1 = {self.num_draft_steps + 1} tokens; set that or leave "
                "it unset"
            )
        return self

    @model_validator(mode="after")
    def _weight_format(self) -> EngineConfig:
        self.weight_quant()  # a bad block or group size names itself now
        if self.weight_dtype != "kernel" and self.policy_lora.is_enabled:
            raise ValueError(
                f"weight_dtype={self.weight_dtype} with LoRA adapters (policy_lora) is not supported: the adapters "
                "are merged into the base, which a quantized engine does not hold in full precision; use "
                "weight_dtype=kernel"
            )
        return self

    def weight_quant(self) -> WeightQuantConfig:
        """The low-precision format of the decoder's linear weights (`weight_dtype` and its block / group size)."""
        return WeightQuantConfig(
            format=self.weight_dtype, block_size=self.weight_block_size, group_size=self.weight_group_size
        )

    @property
    def draft_kind(self) -> Literal["mtp", "eagle3"] | None:
        """Which draft proposes tokens: the model's MTP layers, an EAGLE-3 checkpoint, or none."""
        if self.speculative_algorithm is None:
            return None
        return "eagle3" if self.speculative_algorithm == "EAGLE3" else "mtp"

    @property
    def num_draft_tokens(self) -> int:
        """Tokens one verify step checks at most, the last sampled one included (SGLang's
        speculative_num_draft_tokens); 1 without speculative decoding."""
        if self.speculative_algorithm is None:
            return 1
        topk = self.speculative_eagle_topk or 1
        return self.speculative_num_draft_tokens or 1 + self.num_draft_steps * topk

    @property
    def num_draft_steps(self) -> int:
        """Draft tokens per decoding step (0: no speculative decoding)."""
        if self.speculative_algorithm is None:
            return 0
        return self.speculative_num_steps or DEFAULT_DRAFT_STEPS


class LoraAdapterSpec(NamedTuple):
    """One adapter of `--lora-paths`: the name requests use, its PEFT directory, SGLang's `pinned`."""

    lora_name: str
    lora_path: str
    pinned: bool = False


def parse_lora_path(entry: str) -> LoraAdapterSpec:
    """One `--lora-paths` entry as SGLang 0.5.23 reads it: `NAME=PATH`, a bare `PATH` (named by the path itself), or
    JSON `{"lora_name": ..., "lora_path": ..., "pinned": ...}`; ValueError naming the entry otherwise."""
    text = entry.strip()
    if text.startswith("{") and text.endswith("}"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"lora_paths entry {entry!r} looks like JSON but is not: {error}") from error
        if not (isinstance(obj, dict) and all(isinstance(obj.get(key), str) for key in ("lora_name", "lora_path"))):
            raise ValueError(f"lora_paths entry {entry!r} looks like JSON but lacks string lora_name and lora_path")
        unknown = sorted(set(obj) - {"lora_name", "lora_path", "pinned"})
        if unknown:
            raise ValueError(f"lora_paths entry {entry!r}: unknown keys {unknown} (lora_name, lora_path, pinned)")
        spec = LoraAdapterSpec(obj["lora_name"], obj["lora_path"], bool(obj.get("pinned", False)))
    elif "=" in text:
        name, path = text.split("=", 1)
        spec = LoraAdapterSpec(name, path)
    else:
        spec = LoraAdapterSpec(text, text)
    if not spec.lora_name or not spec.lora_path:
        raise ValueError(f"lora_paths entry {entry!r} has an empty name or path: use NAME=PATH or PATH")
    return spec


class ServedLoraConfig(BaseModel):
    """LoRA adapters served per request, SGLang's multi-LoRA serving and its flags: PEFT adapters on the trunk's
    attention and dense MLP layers, chosen by `lora_path` on /generate or `model` on the OpenAI routes, loaded at
    start-up or with /load_lora_adapter."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_lora: bool = Field(
        default=False,
        description="Serve LoRA adapters per request (SGLang's flag; on when lora_paths is given): /load_lora_adapter "
        "and a request's lora_path need it.",
    )
    lora_paths: list[str] = Field(
        default_factory=list,
        description="PEFT adapter directories loaded at start-up (SGLang's --lora-paths), each NAME=PATH, a PATH "
        '(named by the path itself) or JSON {"lora_name": ..., "lora_path": ..., "pinned": ...}.',
    )
    max_loras_per_batch: int = Field(
        default=8,
        ge=1,
        description="Most adapters in one engine step, the base model counted as one (SGLang's); a request of "
        "another adapter waits for the batch to have room.",
    )
    max_lora_rank: int | None = Field(
        default=None, ge=1, description="Largest adapter rank accepted (SGLang's flag); null: any rank."
    )

    @field_validator("lora_paths", mode="before")
    @classmethod
    def _sglang_forms(cls, value: object) -> object:
        """SGLang's config-file forms too: {name: path}, and a list mixing strings and {lora_name, lora_path}."""
        if isinstance(value, dict):
            return [f"{name}={path}" for name, path in value.items()]
        if isinstance(value, list):
            return [json.dumps(item) if isinstance(item, dict) else item for item in value]
        return value

    @model_validator(mode="after")
    def _adapters_parse(self) -> ServedLoraConfig:
        names = [spec.lora_name for spec in self.adapters()]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"lora_paths names {repeated} more than once: give each adapter its own name")
        return self

    @property
    def is_enabled(self) -> bool:
        """True when the engine serves adapters (`enable_lora`, or adapters given at start-up)."""
        return self.enable_lora or bool(self.lora_paths)

    def adapters(self) -> list[LoraAdapterSpec]:
        """The adapters to load at start-up, in order."""
        return [parse_lora_path(entry) for entry in self.lora_paths]


class ServeConfig(BaseModel):
    """`miles-rollout serve`: one model behind SGLang's HTTP API."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: str = Field(description="Hugging Face model directory (config.json + safetensors).")
    host: str = Field(default="127.0.0.1", description="Address to bind; a non-loopback one needs admin_key.")
    port: int = Field(default=30000, ge=1, le=65535, description="TCP port.")
    api_key: str | None = Field(
        default=None,
        description="Require 'Authorization: Bearer KEY' on every endpoint but /health. Visible in `ps`: prefer "
        "api_key_file or the MILES_API_KEY environment variable.",
    )
    admin_key: str | None = Field(
        default=None,
        description="Key of the weight, memory and control endpoints. Visible in `ps`: prefer admin_key_file or "
        "the MILES_ADMIN_KEY environment variable.",
    )
    api_key_file: str | None = Field(default=None, description="Read api_key from this file (first line).")
    admin_key_file: str | None = Field(default=None, description="Read admin_key from this file (first line).")
    allowed_hosts: list[str] | None = Field(
        default=None,
        description="Host header names (optionally host:port) the server answers; others get 400 (DNS rebinding). "
        "null: the loopback names (localhost, 127.0.0.1, ::1) when bound to loopback, any host otherwise; ['*']: "
        "any host.",
    )
    allow_client_chat_template: bool = Field(
        default=False,
        description="Let /v1/chat/completions requests bring their own chat_template (Jinja, rendered in a sandbox "
        "but able to loop for long): off, such requests are a 400.",
    )
    max_request_bytes: int = Field(
        default=64 << 20, ge=1024, description="Largest JSON request body; a larger one is refused with 413."
    )
    max_bucket_bytes: int = Field(
        default=8 << 30,
        ge=1024,
        description="Largest weight bucket body (/update_weights_from_tensor); a larger one is refused with 413.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="Server log level.")
    kernel: KernelConfig = Field(
        default_factory=lambda: KernelConfig(mode="fast"),
        description="The model's kernels. A standalone server defaults to mode=fast; pass --mode deterministic for "
        "batch-invariant outputs and log-probs (true on-policy; a run config defaults to it).",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig, description="How the engine runs.")
    lora: ServedLoraConfig = Field(
        default_factory=ServedLoraConfig, description="LoRA adapters served per request (SGLang's flags)."
    )
    dp_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Engines on this machine, each a process on a free 127.0.0.1 port, behind sglang-router "
        "(cache-aware) on host:port (as `python -m sglang_router.launch_server --dp-size N` does for SGLang; needs "
        "`pip install sglang-router`).",
    )


class SGLangConfig(BaseModel):
    """SGLang engines (a run's `rollout.backend=sglang`, docs/laptop-to-cluster.md): how each SGLang server is
    launched. The settings an engine shares with the embedded one (context length, running requests, seed,
    speculative decoding, routed experts) come from `EngineConfig`, the dtype from `KernelConfig`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tp_size: int = Field(default=1, ge=1, le=64, description="Tensor-parallel GPUs of each SGLang server.")
    dp_size: int = Field(default=1, ge=1, le=64, description="Data-parallel replicas inside each server.")
    ep_size: int = Field(default=1, ge=1, le=64, description="Expert-parallel size of each server (MoE models).")
    mem_fraction_static: float | None = Field(
        default=None, gt=0, lt=1,
        description="Share of GPU memory for weights and KV cache; null: SGLang's choice. Colocated runs leave the "
        "trainer room: e.g. 0.5.",
    )  # fmt: skip
    attention_backend: str | None = Field(
        default=None,
        description="SGLang's --attention-backend (fa3, flashinfer, triton, ...); null: SGLang's choice (fa3 on "
        "Hopper with deterministic inference).",
    )
    chunked_prefill_size: int | None = Field(default=None, ge=1, description="SGLang's chunked prefill budget.")
    deterministic_inference: bool = Field(
        default=False,
        description="SGLang's --enable-deterministic-inference: batch-invariant kernels, so a request's output does "
        "not depend on what else the server runs (reproducible rollouts; not the trainer's kernels, so the "
        "train / rollout mismatch stays and TIS / MIS corrects it).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="warning", description="The SGLang server's log level."
    )
    server_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Further SGLang ServerArgs fields by name (e.g. {enable_metrics: true, cuda_graph_max_bs_decode: "
        "256}), written to the server's config file; the fields Miles sets itself are refused here.",
    )
    launch_command: list[str] | None = Field(
        default=None,
        description="The command that starts a server, before `--config FILE`; null: this Python's "
        "`-m sglang.launch_server`.",
    )
    startup_timeout_s: float = Field(
        default=1200.0, gt=0, description="Seconds a server may take to load and answer /health."
    )

    def network_transports(self, colocated: bool) -> tuple[str, ...]:
        """The network weight transports these servers take: a broadcast (`/update_weights_from_distributed`)
        unless they share their GPUs with the trainer (`colocated`: NCCL cannot join two processes on one GPU) or
        have data-parallel replicas (SGLang 0.5.23 refuses the broadcast then); never http (SGLang's
        `/update_weights_from_tensor` unpickles its payload)."""
        return () if colocated or self.dp_size > 1 else ("distributed",)

"""The run config's rollout section (step 2 of the data path; docs/architecture.md, "Config"): sampling, the engines
and their router, async pausing and partial rollouts, the embedded engine's own `EngineConfig`, and the agentic
settings (`rollout.agent`, docs/agentic.md). Torch-free, like every config module.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from miles_contracts import MAX_NEW_TOKENS_LIMIT, PluginPath, is_plugin_path
from miles_orchestrator.config.sections import RayResources, Section
from miles_rollout.config import EngineConfig, SGLangConfig

BUILTIN_ENV_NAMES = ("calculator",)  # miles_orchestrator.rollout.environments.BUILTIN_ENVS


class AgentSection(Section):
    """Agentic rollouts (docs/agentic.md): each sample is an episode of turns between the policy and an environment,
    which runs in sandboxed worker processes."""

    env: str | None = Field(
        default=None,
        description="'calculator' (the built-in task with a calculator tool) or a 'module:Class' Environment; "
        "null: one-turn rollouts.",
    )
    env_args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the environment, built as Env(**env_args) per episode."
    )
    max_turns: int = Field(default=4, ge=1, le=256, description="Most model turns per episode.")
    max_response_tokens: int = Field(
        default=256, ge=1, le=MAX_NEW_TOKENS_LIMIT,
        description="Most response tokens per episode, the model's and the observations' (each turn also stops at "
        "rollout.max_new_tokens).",
    )  # fmt: skip
    tool_call_format: Literal["hermes"] = Field(
        default="hermes",
        description='How tool calls are written: hermes is Qwen\'s <tool_call>{"name": ..., "arguments": {...}}'
        "</tool_call>.",
    )
    timeout_s: float = Field(
        default=10.0, gt=0, description="Seconds per environment call (reset, step) before the episode fails."
    )
    num_workers: int = Field(default=2, ge=1, le=256, description="Environment worker processes.")
    env_passthrough: list[str] = Field(
        default_factory=list,
        description="Environment variables a worker sees besides PATH, HOME, locale, TMPDIR, PYTHONPATH and "
        "VIRTUAL_ENV (e.g. HF_HOME); the driver's keys and tokens stay out unless named here.",
    )
    cpu_s_per_call: float | None = Field(
        default=None,
        gt=0,
        description="CPU seconds one environment call may use (RLIMIT_CPU, renewed per call); null: timeout_s x "
        "the machine's cores.",
    )
    address_space_gib: float = Field(
        default=16.0, ge=1, description="A worker's address-space limit (RLIMIT_AS) in GiB; past it, MemoryError."
    )
    num_open_files: int = Field(default=1024, ge=64, description="A worker's open-file limit (RLIMIT_NOFILE).")

    @field_validator("env")
    @classmethod
    def _known_env(cls, value: str | None) -> str | None:
        if value is None or value in BUILTIN_ENV_NAMES or is_plugin_path(value):
            return value
        raise ValueError(
            f"rollout.agent.env={value!r}: use one of {list(BUILTIN_ENV_NAMES)} or a 'package.module:Class' "
            "Environment"
        )


class FaultToleranceSection(Section):
    """Engine failures (run.cluster=ray; docs/fault-tolerance.md): a dead or hung engine is killed, restarted on its
    bundle, re-synced and re-added to the router; the requests it held are re-issued with the same seeds."""

    enabled: bool = Field(default=True, description="Watch the engines and restart one that dies or hangs.")
    check_interval_s: float = Field(
        default=5.0, gt=0, le=3600, description="Seconds between health checks of each engine."
    )
    check_timeout_s: float = Field(
        default=30.0, gt=0, le=3600,
        description="A health check (/health_generate while the engine serves, /health otherwise) that has not "
        "answered in this many seconds fails: the engine is dead or hung.",
    )  # fmt: skip
    failure_threshold: int = Field(
        default=2, ge=1, le=100, description="Consecutive failed checks before an engine is restarted."
    )
    max_restarts_per_hour: int = Field(
        default=4, ge=0, le=1000,
        description="Engine restarts allowed in any hour of the run (all engines together); one more stops the run "
        "with an error (its last checkpoint resumes it). 0: never restart, a failed engine stops the run.",
    )  # fmt: skip
    generate_retries: int = Field(
        default=3, ge=0, le=100,
        description="Times a /generate call that failed for an engine's sake (no connection, HTTP 5xx) is re-issued, "
        "with the same request and seeds, once the engines are healthy again.",
    )  # fmt: skip


class RolloutSection(Section):
    """How responses are generated (step 2)."""

    num_prompts_per_step: int = Field(default=32, ge=1, description="Prompts per rollout.")
    n_samples_per_prompt: int = Field(default=8, ge=1, description="Responses per prompt (the GRPO group size).")
    max_new_tokens: int = Field(default=16, ge=1, le=MAX_NEW_TOKENS_LIMIT, description="Longest response.")
    temperature: float = Field(default=1.0, ge=0, le=100, description="Sampling temperature (0: greedy).")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass in (0, 1].")
    allow_greedy: bool = Field(default=False, description="Allow temperature=0 for training rollouts.")
    eval_temperature: float = Field(default=0.0, ge=0, le=100, description="Temperature of evaluation (0: greedy).")
    eval_k: int = Field(default=1, ge=1, le=64, description="Also report pass@k over k samples (1: pass@1 only).")
    rollout_fn: PluginPath | None = Field(
        default=None,
        description="'module:function' RolloutFn, for training and held-out evaluation; null: one-turn rollout.",
    )
    return_routed_experts: bool = Field(
        default=False,
        description="MoE policies: the one-turn rollout asks the engine for the experts of every token (SGLang's "
        "return_routed_experts) and keeps them on the samples, for the routing metrics (moe_routing_flip_frac); "
        "on whenever trainer.routing_replay=rollout. A sample holds (tokens - 1) x layers x top_k int32 (4 bytes "
        "each, as base64 a third more); a custom rollout_fn must request and copy them itself.",
    )
    batch_requests: bool = Field(
        default=True,
        description="Send the /generate calls the prompt groups make at once as one batched request (one HTTP round "
        "trip, admitted together); false: one request each (e.g. for a router that spreads them over engines).",
    )
    backend: Literal["embedded", "sglang"] = Field(
        default="embedded",
        description="The rollout engines: embedded (miles-rollout's own engine, CPU or CUDA; bitwise on-policy with "
        "the FSDP2 trainer) or sglang (an SGLang server per engine on the GPUs of its placement bundle, "
        "run.cluster=ray, kernel.mode=fast; the miles-rollout[sglang] extra; docs/laptop-to-cluster.md).",
    )
    sglang: SGLangConfig = Field(
        default_factory=SGLangConfig, description="How each SGLang engine is launched (rollout.backend=sglang)."
    )
    num_engines: int = Field(
        default=1,
        ge=1,
        le=256,
        description="Rollout engines (run.cluster=ray). More than one: sglang-router (cache-aware by default) in "
        "front of them, weights synced to every engine (docs/scale-out.md).",
    )
    engine_resources: RayResources = Field(
        default_factory=lambda: {"CPU": 1.0},
        description="Ray resources of each engine's placement bundle, e.g. {CPU: 8, GPU: 1}; a custom resource "
        "that only some nodes advertise (ray start --resources) puts the engines on those nodes.",
    )
    engine_host: str = Field(
        default="127.0.0.1",
        description="Address each engine binds to. 127.0.0.1: engines on the driver's node only; engines on other "
        "nodes need an address the driver's node reaches (0.0.0.0 binds every interface; admin calls keep the "
        "run's key).",
    )
    router_policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] = Field(
        default="cache_aware", description="sglang-router's policy in front of several engines."
    )
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        default="retract",
        description="run.mode=async: how a weight sync pauses the generations in flight. retract: the engine frees "
        "their KV and continues them under the new weights (KV recomputed); abort: they stop and the rollout "
        "continues (rollout.partial_rollout) or regenerates them. in_place is refused for training: it would "
        "continue on KV the old weights computed.",
    )
    partial_rollout: bool = Field(
        default=True,
        description="run.mode=async with pause_mode=abort: continue an aborted generation under the new weights "
        "from where it stopped (its earlier tokens keep their version); false: regenerate it from the start.",
    )
    partial_tokens: Literal["train", "mask"] = Field(
        default="train",
        description="Tokens of a partial rollout generated before its last weight update: train (against the "
        "trainer's recomputed old log-probs; TIS/MIS-corrected when trainer.loss.is_mode is set) or mask (loss "
        "mask 0).",
    )
    agent: AgentSection = Field(
        default_factory=AgentSection, description="Multi-turn rollouts with an environment (rollout.agent.env)."
    )
    fault_tolerance: FaultToleranceSection = Field(
        default_factory=FaultToleranceSection,
        description="Dead or hung engines restarted, re-synced and re-added (run.cluster=ray; "
        "docs/fault-tolerance.md).",
    )
    engine: EngineConfig = Field(
        default_factory=lambda: EngineConfig(max_running_requests=64),
        description="The embedded engine (miles_rollout.config.EngineConfig; here max_running_requests defaults to "
        "64, where `miles-rollout serve` defaults to 256).",
    )

    @model_validator(mode="after")
    def _sampling(self) -> RolloutSection:
        if self.agent.env is not None and self.rollout_fn is not None:
            raise ValueError(
                f"rollout.agent.env={self.agent.env!r} plays multi-turn episodes with its own rollout function, and "
                f"rollout.rollout_fn={self.rollout_fn!r} names another; drop one of them"
            )
        if self.temperature == 0 and not self.allow_greedy:
            raise ValueError(
                "temperature=0 makes every response of a group identical, so GRPO learns nothing; set "
                "rollout.temperature>0 (e.g. 1.0), or rollout.allow_greedy=true if that is what you want"
            )
        return self

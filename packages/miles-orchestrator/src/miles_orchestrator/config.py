"""The run config: one typed, nested pydantic model per component, loaded from YAML plus dotted CLI overrides.

It sits before the RL data path: `load_config` runs once at start-up and every component (data source, rollout,
reward pool, filters, trainer, loop) reads its own section. Each component's model is owned by its package and
nested here, so every setting is defined once (docs/architecture.md, "Config"): `kernel` is miles-kernels'
`KernelConfig` (engine and trainer share it), `rollout.engine` miles-rollout's `EngineConfig`, and
`trainer.optimizer`, `trainer.loss`, `trainer.backend` miles-trainer's models; this module adds the sections only
the loop has. All of them are torch-free: a whole config validates without importing torch.
A bad value fails here, with a `ValueError` that names the dotted field and the fix, rather than minutes into a
run. `config_help` and `dump_config` render the same models for `miles-orchestrator run --help` and for the
resolved config a run writes next to its outputs. Plug-in paths (`module:function`) are only checked for shape
here; they are imported when their component starts.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from miles_contracts import MAX_NEW_TOKENS_LIMIT, PluginPath, is_plugin_path
from miles_kernels.config import KernelConfig
from miles_memory.config import MemoryConfig
from miles_orchestrator.task import BuiltinTask
from miles_rollout.config import EngineConfig
from miles_spec.config import SpecConfig
from miles_trainer.config import (
    ADVANTAGE_ESTIMATOR_NAMES,
    AdvantageConfig,
    CriticConfig,
    FSDP2Config,
    OptimizerConfig,
    PolicyLossConfig,
)

__all__ = ["RunConfig", "check_batch_identity", "config_help", "dump_config", "load_config"]

BUILTIN_REWARD_NAMES = ("exact_match", "math", "task")
HTTP_REWARD = "http"  # the built-in remote reward (miles_orchestrator.http_reward)
DATA_SUFFIXES = (".jsonl", ".parquet")
HF_PREFIX = "hf:"  # a local Hugging Face dataset (miles_orchestrator.hf_data); reserved, so never a plug-in path
CLUSTERS = ("ray", "local")
# A Ray placement bundle: resource name -> amount (CPU, GPU, memory or a custom resource a node advertises)
RayResources = Annotated[dict[str, Annotated[float, Field(ge=0)]], Field(min_length=1)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Section):
    """The policy: a Hugging Face checkpoint, or the built-in tiny Qwen3 bootstrapped by SFT on the built-in task."""

    path: str | None = Field(default=None, description="HF model directory; null: bootstrap the built-in policy.")
    bootstrap_steps: int = Field(
        default=400, ge=0, description="Most SFT steps of the built-in policy (path=null); the LR schedule's length."
    )
    bootstrap_target_pass_rate: float | None = Field(
        default=0.35, gt=0, le=1,
        description="Stop the bootstrap SFT at the first check (every 25 steps) where greedy pass@1 on 128 "
        "train-split probe prompts reaches this; null: run all bootstrap_steps.",
    )  # fmt: skip
    bootstrap_lr: float = Field(default=3e-3, gt=0, description="SFT learning rate of the built-in policy.")
    bootstrap_batch_size: int = Field(default=32, ge=1, description="SFT rows per step of the built-in policy.")
    bootstrap_vocab_size: int = Field(
        default=264, ge=259, description="Tokenizer size of the built-in policy (its corpus bounds it: ~265)."
    )
    bootstrap_architecture: Literal["qwen3", "qwen3_moe", "glm4_moe"] = Field(
        default="qwen3",
        description="The built-in policy's family: a dense Qwen3, a Qwen3-MoE (8 experts, top-2) or a GLM-4.5-style "
        "MoE (8 experts, top-2, a shared expert, a dense first layer); the sizes are in miles_orchestrator.bootstrap.",
    )


class TaskSection(_Section):
    """Difficulty of the built-in arithmetic task (`miles_orchestrator.task.BuiltinTask`)."""

    num_digits: int | list[int] = Field(default=2, description="Digits of each operand, or a list: one per operand.")
    operations: list[Literal["+", "-", "*"]] = Field(default=["+"], min_length=1, description="Operators drawn.")
    num_operands: int = Field(default=2, ge=2, le=8, description="Operands per problem.")
    heldout_fraction: float = Field(default=0.1, gt=0, lt=1, description="Share of problems kept for evaluation.")

    @model_validator(mode="after")
    def _valid_task(self) -> TaskSection:
        self.to_task()  # the task checks its own knobs (and how they combine)
        return self

    def to_task(self) -> BuiltinTask:
        """The `BuiltinTask` these knobs describe."""
        return BuiltinTask(
            num_digits=self.num_digits if isinstance(self.num_digits, int) else tuple(self.num_digits),
            operations=tuple(self.operations),
            num_operands=self.num_operands,
            heldout_fraction=self.heldout_fraction,
        )


DataSourceKind = Literal["builtin", "file", "hf", "plugin"]


def data_source_kind(value: str) -> DataSourceKind | None:
    """What a `data.source` / `data.eval_path` value names (None: nothing valid), by shape only."""
    if value == "builtin":
        return "builtin"
    if value.startswith(HF_PREFIX):
        return "hf" if value.removeprefix(HF_PREFIX).strip() else None
    if value.endswith(DATA_SUFFIXES):
        return "file"
    return "plugin" if is_plugin_path(value) else None


class DataSection(_Section):
    """Where prompts come from (step 1 of the data path)."""

    source: str = Field(
        default="builtin",
        description="'builtin' (the arithmetic task), a .jsonl / .parquet file, 'hf:PATH' (a local Hugging Face "
        "dataset: a save_to_disk directory, a folder of data files, or one .json/.jsonl/.parquet/.csv/.arrow file; "
        "needs the hf extra), or a 'module:Class' DataSource plug-in.",
    )
    source_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of a 'module:Class' data.source, built as Class(data_section, **source_args).",
    )
    hf_split: str = Field(default="train", description="Split of an 'hf:' data.source that has several.")
    prompt_key: str = Field(default="prompt", description="Row key of the prompt (text or chat messages).")
    label_key: str = Field(default="label", description="Row key of the reference answer.")
    apply_chat_template: bool = Field(default=False, description="Send the prompt as a user chat message.")
    shuffle: bool = Field(default=True, description="Shuffle rows each epoch (file sources).")
    seed: int = Field(default=0, ge=0, description="Seed of the shuffle and of the built-in task's problems.")
    num_epochs: int = Field(default=1, ge=1, description="Passes over a file source; the built-in task never ends.")
    eval_path: str | None = Field(
        default=None, description="Held-out .jsonl / .parquet file or 'hf:PATH'; null: the task's held-out."
    )
    hf_eval_split: str = Field(default="test", description="Split of an 'hf:' data.eval_path that has several.")
    num_eval_prompts: int = Field(default=200, ge=0, description="Held-out prompts per evaluation (0: no evaluation).")
    task: TaskSection = Field(default_factory=TaskSection, description="The built-in task's difficulty.")

    @field_validator("source")
    @classmethod
    def _known_source(cls, value: str) -> str:
        if data_source_kind(value) is not None:
            return value
        raise ValueError(
            f"{value!r} is neither 'builtin', a {' / '.join(DATA_SUFFIXES)} file, 'hf:PATH' (a local Hugging Face "
            "dataset, e.g. hf:data/gsm8k or hf:train.csv) nor a 'package.module:Class' DataSource plug-in; give one "
            "of these"
        )

    @field_validator("eval_path")
    @classmethod
    def _known_eval_path(cls, value: str | None) -> str | None:
        if value is None or data_source_kind(value) in ("file", "hf"):
            return value
        raise ValueError(
            f"{value!r} is neither a {' / '.join(DATA_SUFFIXES)} file nor 'hf:PATH' (a local Hugging Face dataset); "
            "null evaluates on the built-in task's held-out problems, and a plug-in is for data.source only"
        )

    @model_validator(mode="after")
    def _source_args_need_a_plugin(self) -> DataSection:
        if self.source_args and data_source_kind(self.source) != "plugin":
            raise ValueError(
                f"data.source_args={self.source_args!r} are keyword arguments of a 'module:Class' data.source, but "
                f"data.source={self.source!r}; drop data.source_args or name a plug-in class"
            )
        return self


class RolloutSection(_Section):
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
        default=None, description="'module:function' RolloutFn; null: one-turn rollout."
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
    engine: EngineConfig = Field(
        default_factory=lambda: EngineConfig(max_running_requests=64),
        description="The embedded engine (miles_rollout.config.EngineConfig; here max_running_requests defaults to "
        "64, where `miles-rollout serve` defaults to 256).",
    )

    @model_validator(mode="after")
    def _sampling(self) -> RolloutSection:
        if self.temperature == 0 and not self.allow_greedy:
            raise ValueError(
                "temperature=0 makes every response of a group identical, so GRPO learns nothing; set "
                "rollout.temperature>0 (e.g. 1.0), or rollout.allow_greedy=true if that is what you want"
            )
        return self


class RewardSection(_Section):
    """How responses are scored (step 3): user code runs in worker processes with a timeout; the http reward asks a
    server."""

    name: str = Field(
        default="task",
        description="'exact_match', 'math', 'task', 'http' (a reward server at reward.url), or a 'module:function' "
        "path.",
    )
    is_group: bool = Field(default=False, description="The function scores a whole prompt group at once.")
    timeout_s: float = Field(
        default=10.0, gt=0, description="Seconds per reward call (http: per attempt) before it counts as failed."
    )
    num_workers: int = Field(
        default=2, ge=1, le=256, description="Reward worker processes (unused by reward.name=http)."
    )
    url: str | None = Field(
        default=None,
        description="The http reward's endpoint, e.g. http://127.0.0.1:8000/reward: each call POSTs the sample(s) as "
        "JSON there.",
    )
    health_url: str | None = Field(
        default=None,
        description="http reward: a URL that must answer GET with 2xx at start-up; null: a GET of reward.url must "
        "get any answer but 404.",
    )
    max_retries: int = Field(
        default=3, ge=0, le=20,
        description="http reward: extra attempts of a call after a connection error, a timeout, a 5xx or a 429 "
        "(never after another 4xx).",
    )  # fmt: skip
    backoff_s: float = Field(
        default=0.5, gt=0, description="http reward: wait before the first retry; doubles per retry."
    )
    max_backoff_s: float = Field(default=8.0, gt=0, description="http reward: the longest wait between retries.")
    max_concurrency: int = Field(
        default=32, ge=1, le=4096, description="http reward: most requests in flight at once."
    )
    api_key_env: str | None = Field(
        default=None,
        description="http reward: environment variable holding an API key, sent as 'Authorization: Bearer KEY' "
        "(the key itself stays out of config files); null: no key.",
    )

    @field_validator("name")
    @classmethod
    def _known(cls, value: str) -> str:
        if value in BUILTIN_REWARD_NAMES or value == HTTP_REWARD or is_plugin_path(value):
            return value
        raise ValueError(
            f"reward.name={value!r}: use one of {[*BUILTIN_REWARD_NAMES, HTTP_REWARD]} or a 'module:function' path"
        )

    @field_validator("url", "health_url")
    @classmethod
    def _http_url(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        parts = urlsplit(value)
        if parts.scheme in ("http", "https") and parts.hostname and not any(c.isspace() for c in value):
            try:
                _ = parts.port  # an out-of-range or non-numeric port raises here
                return value
            except ValueError:
                pass
        raise ValueError(
            f"reward.{info.field_name}={value!r} is not an http(s) URL with a host; give e.g. "
            "http://127.0.0.1:8000/reward"
        )

    @model_validator(mode="after")
    def _http_settings(self) -> RewardSection:
        if self.name == HTTP_REWARD and self.url is None:
            raise ValueError(
                "reward.name=http needs reward.url, the endpoint that scores samples (e.g. "
                "reward.url=http://127.0.0.1:8000/reward)"
            )
        if self.name != HTTP_REWARD and (self.url is not None or self.health_url is not None):
            raise ValueError(
                f"reward.url / reward.health_url are for reward.name=http, not reward.name={self.name!r}; set "
                "reward.name=http or drop them"
            )
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(
                f"reward.max_backoff_s={self.max_backoff_s:g} is below reward.backoff_s={self.backoff_s:g}; raise "
                "max_backoff_s or lower backoff_s"
            )
        return self


class FilterSection(_Section):
    """Which prompt groups train (step 4)."""

    dynamic_sampling: bool = Field(default=True, description="Drop groups whose rewards are all equal.")
    max_oversample_rounds: int = Field(default=4, ge=0, description="Extra rollouts to refill dropped groups.")
    custom: PluginPath | None = Field(
        default=None, description="'module:function' SampleFilter applied to each group."
    )


def _run_optimizer() -> OptimizerConfig:
    return OptimizerConfig(lr=2e-4)


class TrainerSection(_Section):
    """The policy update (steps 5-6): batch shape, data-parallel ranks, advantages, and the trainer's own models."""

    global_batch_size: int = Field(default=256, ge=1, description="Samples per optimizer step, all ranks together.")
    steps_per_rollout: int = Field(default=1, ge=1, description="Optimizer steps per rollout.")
    num_ranks: int = Field(default=1, ge=1, description="Trainer processes (FSDP2 data parallel).")
    rank_resources: RayResources = Field(
        default_factory=lambda: {"CPU": 1.0},
        description="Ray resources of each trainer rank's placement bundle, e.g. {CPU: 8, GPU: 1}, or a custom "
        "resource that puts the ranks on chosen nodes.",
    )
    advantage_estimator: str = Field(
        default="grpo",
        description=f"One of {list(ADVANTAGE_ESTIMATOR_NAMES)}, 'gae' (PPO with a critic: trainer.critic), or a "
        "'module:function' plug-in.",
    )
    advantage: AdvantageConfig = Field(
        default_factory=AdvantageConfig,
        description="Knobs of the estimators (miles_trainer.config.AdvantageConfig): GRPO's scale_rewards and "
        "std epsilon, the discount and GAE lambda, whitening.",
    )
    critic: CriticConfig = Field(
        default_factory=CriticConfig,
        description="PPO's critic (miles_trainer.config.CriticConfig), used when advantage_estimator=gae.",
    )
    optimizer: OptimizerConfig = Field(
        default_factory=_run_optimizer,
        description="AdamW and its schedule (miles_trainer.config.OptimizerConfig; here lr defaults to 2e-4, "
        "where the trainer's own default is 1e-5).",
    )
    loss: PolicyLossConfig = Field(
        default_factory=PolicyLossConfig,
        description="The policy loss (miles_trainer.config.PolicyLossConfig); its temperature follows "
        "rollout.temperature.",
    )
    backend: FSDP2Config = Field(
        default_factory=FSDP2Config, description="The FSDP2 backend (miles_trainer.config.FSDP2Config)."
    )
    routing_replay: Literal["off", "rollout"] = Field(
        default="off",
        description="MoE policies: 'rollout' routes each token in the trainer's forward passes to the experts the "
        "rollout engine chose (R3, routing replay; the router still learns through the replayed experts' scores); "
        "'off': the trainer's router decides. True on-policy runs agree without it (deterministic mode routes the "
        "same bits on both sides); it matters in fast mode and bf16, where routing can flip.",
    )
    log_kl: bool = Field(
        default=False,
        description="Keep the initial policy and log 'kl', its KL to the current policy on the rollout's response "
        "tokens (trainer.loss.kl_estimator), every step, also when trainer.loss.kl_coef = 0 (then it is a metric "
        "only: the update is unchanged). With kl_coef > 0 it is logged anyway.",
    )

    @field_validator("advantage_estimator")
    @classmethod
    def _estimator(cls, value: str) -> str:
        if value in (*ADVANTAGE_ESTIMATOR_NAMES, "gae") or is_plugin_path(value):
            return value
        raise ValueError(
            f"trainer.advantage_estimator={value!r}: use one of {[*ADVANTAGE_ESTIMATOR_NAMES, 'gae']} or a "
            "'module:function' advantage plug-in"
        )

    @property
    def uses_critic(self) -> bool:
        """PPO: GAE needs the critic's values."""
        return self.advantage_estimator == "gae"

    @model_validator(mode="after")
    def _consistent(self) -> TrainerSection:
        if self.global_batch_size % self.num_ranks:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} does not split over num_ranks={self.num_ranks}; "
                "make global_batch_size a multiple of num_ranks"
            )
        return self


class LogSection(_Section):
    """Metric sinks; JSONL is always written."""

    tensorboard: bool = Field(default=False, description="Also write TensorBoard events (needs the extra).")
    wandb: bool = Field(default=False, description="Also log to Weights & Biases (needs wandb installed).")
    wandb_project: str = Field(default="miles", description="W&B project name.")


class RunSection(_Section):
    """Steps, seeds, outputs and logging of the whole run."""

    run_dir: str = Field(default="runs/miles", description="Outputs: metrics, checkpoints, plots, the config.")
    seed: int = Field(default=0, ge=0, description="Run seed; sample seeds derive from it and the sample index.")
    num_steps: int = Field(default=120, ge=1, description="RL steps (rollouts) to run.")
    eval_every: int = Field(default=20, ge=0, description="Evaluate every this many steps (0: never).")
    checkpoint_every: int = Field(default=0, ge=0, description="Checkpoint every this many steps (0: only at end).")
    cluster: Literal["ray", "local"] = Field(
        default="ray",
        description="Where engine and trainer run. ray: Ray actors (a local Ray, or run.ray_address), any number of "
        "trainer ranks; local: the engine and one trainer rank in this process (no Ray, no HTTP).",
    )
    ray_address: str | None = Field(
        default=None, description="Ray cluster address (run.cluster=ray); null: start Ray locally."
    )
    colocate: bool = Field(
        default=True,
        description="Engine and trainer share devices, offloading in turn (one placement group); false: "
        "disaggregated, the engines and the trainer ranks in placement groups of their own.",
    )
    mode: Literal["sync", "one_step_off", "async"] = Field(
        default="sync",
        description="sync: generate, then train; one_step_off: the rollout of step k+1 overlaps the training of "
        "step k (samples one version old); async: rollouts run ahead by up to run.max_staleness versions, weight "
        "syncs pause the generations in flight (rollout.pause_mode). Both need run.cluster=ray, colocate=false.",
    )
    max_staleness: int = Field(
        default=1,
        ge=0,
        le=64,
        description="run.mode=async: the most weight versions a trained token may lag the trained policy; older "
        "samples are dropped, counted, never trained on.",
    )
    sync_bucket_bytes: int = Field(
        default=512 << 20, ge=1, description="Largest weight-sync bucket over HTTP, in bytes (run.cluster=ray)."
    )
    sync_transport: Literal["auto", "shm", "disk", "http", "distributed"] = Field(
        default="auto",
        description="How weights reach the engines on run.cluster=ray (local copies them in memory); trainer rank "
        "0 sends the gathered weights every time. shm: a safetensors checkpoint in /dev/shm the engines load (on "
        "rank 0's node; one copy in RAM); disk: the same in run.sync_dir, a directory every node reads; http: "
        "buckets over HTTP to each engine; distributed: buckets broadcast over a torch.distributed group (gloo on "
        "CPU, NCCL on GPU) of rank 0 and every engine; auto: shm when every engine is on rank 0's node and the "
        "checkpoint is at most 1 GiB, else http for one engine and distributed for several.",
    )
    sync_dir: str | None = Field(
        default=None,
        description="run.sync_transport=disk: a directory every node reads (e.g. NFS); null: RUN_DIR/sync.",
    )
    num_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch threads of the engine and of each trainer rank; null: the machine's CPU count.",
    )
    pin_cpus: bool = Field(
        default=False,
        description="run.cluster=ray: pin each trainer rank and engine to cores of its own (ranks first, then "
        "engines; run.num_threads cores each, fewer if the node has too few), e.g. to measure overlap.",
    )
    log: LogSection = Field(default_factory=LogSection, description="Metric sinks.")


class RunConfig(_Section):
    """Everything one RL run needs; each section configures one component."""

    model: ModelSection = Field(default_factory=ModelSection, description="The policy to train.")
    kernel: KernelConfig = Field(
        default_factory=KernelConfig,
        description="The model's kernels, one KernelConfig for engine and trainer (miles_kernels.config): "
        "mode=deterministic is bitwise true on-policy.",
    )
    data: DataSection = Field(default_factory=DataSection, description="Where prompts come from.")
    rollout: RolloutSection = Field(default_factory=RolloutSection, description="How responses are generated.")
    reward: RewardSection = Field(default_factory=RewardSection, description="How responses are scored.")
    filter: FilterSection = Field(default_factory=FilterSection, description="Which prompt groups train.")
    trainer: TrainerSection = Field(default_factory=TrainerSection, description="The policy update.")
    spec: SpecConfig = Field(
        default_factory=SpecConfig,
        description="The MTP draft (miles_spec.config.SpecConfig): trained online on the rollouts, or not.",
    )
    memory: MemoryConfig = Field(
        default_factory=MemoryConfig,
        description="Offload, the memory budget, OOM handling and the memory planner (miles_memory.config).",
    )
    run: RunSection = Field(default_factory=RunSection, description="Steps, seeds, outputs and logging.")

    def _speculative_engine(self) -> None:
        """spec.mode frozen / online turns the engine's speculative decoding on (SGLang's NEXTN, spec.num_steps
        drafts per step) unless rollout.engine already sets it; off leaves it off."""
        engine, spec = self.rollout.engine, self.spec
        if not spec.drafts and engine.speculative_algorithm is not None:
            raise ValueError(
                f"rollout.engine.speculative_algorithm={engine.speculative_algorithm} with spec.mode=off: set "
                "spec.mode=frozen (draft with the MTP modules as loaded) or online (and train them) instead"
            )
        if spec.drafts and engine.speculative_algorithm is None:
            self.rollout.engine = engine.model_copy(
                update={"speculative_algorithm": "NEXTN", "speculative_num_steps": spec.num_steps}
            )

    def _routed_experts(self) -> None:
        """Routing replay needs the engine's routed experts: the rollout requests them and the engine records them."""
        if self.trainer.routing_replay == "rollout":
            self.rollout.return_routed_experts = True
        engine = self.rollout.engine
        if self.rollout.return_routed_experts and not engine.enable_return_routed_experts:
            self.rollout.engine = engine.model_copy(update={"enable_return_routed_experts": True})

    @model_validator(mode="after")
    def _cross_section(self) -> RunConfig:
        check_batch_identity(self)
        self._routed_experts()
        loss = self.trainer.loss
        if "max_response_len" not in loss.model_fields_set:  # Dr.GRPO's constant L: the longest response
            self.trainer.loss = loss = loss.model_copy(update={"max_response_len": self.rollout.max_new_tokens})
        if "temperature" not in loss.model_fields_set:  # the log-prob contract: the rollout's temperature
            self.trainer.loss = loss.model_copy(update={"temperature": self.rollout.temperature})
        elif loss.temperature != self.rollout.temperature:
            raise ValueError(
                f"trainer.loss.temperature={loss.temperature} differs from rollout.temperature="
                f"{self.rollout.temperature}: the trainer's log-probs must use the rollout's temperature; drop "
                "trainer.loss.temperature (it follows rollout.temperature) or set both"
            )
        if self.kernel.is_deterministic and self.rollout.top_p < 1.0:
            raise ValueError(
                f"rollout.top_p={self.rollout.top_p} samples from a truncated distribution, while true on-policy "
                "(kernel.mode=deterministic) trains on the log-prob contract's full one (log_softmax(logits / T)): "
                "the samples would not follow the log-probs the trainer uses; set rollout.top_p=1, or run "
                "kernel.mode=fast"
            )
        self._speculative_engine()
        if self.run.cluster == "local" and self.trainer.num_ranks > 1:
            raise ValueError(
                f"run.cluster=local runs one trainer rank in this process, not trainer.num_ranks="
                f"{self.trainer.num_ranks}; use run.cluster=ray for more ranks"
            )
        devices = {
            "rollout.engine": (self.rollout.engine.device, "rollout.engine_resources", self.rollout.engine_resources),
            "trainer.backend": (self.trainer.backend.device, "trainer.rank_resources", self.trainer.rank_resources),
        }
        for name, (device, field, resources) in devices.items():
            if self.run.cluster == "ray" and device != "cpu" and resources.get("GPU", 0) <= 0:
                raise ValueError(
                    f"{name}.device={device}: the Ray placement gives these actors only the resources in {field} "
                    f"({resources}); add a GPU, e.g. {field}={{CPU: 8, GPU: 1}}, or use the cpu device"
                )
        check_scale_out(self)
        if self.filter.dynamic_sampling and self.rollout.n_samples_per_prompt < 2:
            raise ValueError(
                "filter.dynamic_sampling drops groups whose rewards are all equal, which is every group when "
                f"rollout.n_samples_per_prompt={self.rollout.n_samples_per_prompt}; set n_samples_per_prompt >= 2 "
                "or filter.dynamic_sampling=false"
            )
        if self.reward.is_group and self.reward.name in BUILTIN_REWARD_NAMES:
            raise ValueError(
                f"reward.name={self.reward.name!r} scores one sample at a time; set reward.is_group=false, or give "
                "a 'module:function' GroupRewardFn (or http) as reward.name"
            )
        return self


def check_scale_out(cfg: RunConfig) -> None:
    """Several engines, disaggregated placement and async modes: what they need of each other."""
    rollout, run = cfg.rollout, cfg.run
    if run.cluster == "local" and (rollout.num_engines > 1 or run.mode != "sync"):
        what = f"rollout.num_engines={rollout.num_engines}" if rollout.num_engines > 1 else f"run.mode={run.mode}"
        raise ValueError(f"{what} needs run.cluster=ray: run.cluster=local runs one engine and one trainer rank on "
                         "one thread in this process")  # fmt: skip
    if run.mode != "sync" and run.colocate:
        raise ValueError(
            f"run.mode={run.mode} overlaps rollout and training, which colocation (engine and trainer taking turns "
            "on the same devices) forbids; set run.colocate=false"
        )
    if run.mode == "async" and rollout.pause_mode == "in_place":
        raise ValueError(
            "rollout.pause_mode=in_place keeps the paused generations' KV, computed by the old weights, so their next "
            "tokens would come from neither policy; the engine refuses a weight update under it. Use retract (KV "
            "recomputed under the new weights) or abort"
        )
    if run.mode == "async" and rollout.pause_mode == "retract" and not rollout.partial_rollout:
        raise ValueError(
            "rollout.pause_mode=retract continues paused generations under the new weights (a partial rollout); to "
            "regenerate them from the start instead, set rollout.pause_mode=abort with rollout.partial_rollout=false"
        )
    continues_aborted = run.mode == "async" and rollout.pause_mode == "abort" and rollout.partial_rollout
    if continues_aborted and rollout.return_routed_experts:
        raise ValueError(
            "rollout.partial_rollout continues an aborted generation as a new request, whose routed experts cover its "
            "new tokens only, so routing replay would not match the sample; use rollout.pause_mode=retract (the "
            "engine keeps each token's routing with its KV) or rollout.partial_rollout=false"
        )
    if rollout.num_engines > 1 and "batch_requests" not in rollout.model_fields_set:
        rollout.batch_requests = False  # one batched request would go to one engine: let the router spread them


def check_batch_identity(cfg: RunConfig) -> None:
    """Raise ValueError unless one rollout fills exactly `steps_per_rollout` optimizer steps.

    num_prompts_per_step × n_samples_per_prompt must equal global_batch_size × steps_per_rollout, so that no
    sample is dropped or trained twice.
    """
    r, t = cfg.rollout, cfg.trainer
    num_samples = r.num_prompts_per_step * r.n_samples_per_prompt
    num_trained = t.global_batch_size * t.steps_per_rollout
    if num_samples == num_trained:
        return
    if num_samples % t.steps_per_rollout == 0:
        fix = f"set trainer.global_batch_size={num_samples // t.steps_per_rollout}"
    else:
        fix = f"set trainer.global_batch_size={num_samples} and trainer.steps_per_rollout=1"
    raise ValueError(
        f"rollout.num_prompts_per_step ({r.num_prompts_per_step}) × rollout.n_samples_per_prompt "
        f"({r.n_samples_per_prompt}) = {num_samples} samples per rollout, but trainer.global_batch_size "
        f"({t.global_batch_size}) × trainer.steps_per_rollout ({t.steps_per_rollout}) = {num_trained}; make them "
        f"equal: {fix}, or change the rollout side (a valid example: num_prompts_per_step=8, "
        "n_samples_per_prompt=8, global_batch_size=32, steps_per_rollout=2)"
    )


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The run config from a YAML file (None: all defaults) and `section.field=value` overrides, validated.

    An override's value is parsed as YAML (`trainer.lr=1e-6` is a float, `model.path=null` is None, `x=[1, 2]` a
    list). Unknown keys, malformed overrides and invalid values raise ValueError naming the dotted field.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as error:
            raise ValueError(f"cannot read config file {str(path)!r}: {error}") from error
        except yaml.YAMLError as error:
            raise ValueError(f"config file {str(path)!r} is not valid YAML: {error}") from error
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"config file {str(path)!r} must hold a mapping of sections (model:, data:, ...)")
        data = loaded or {}
        _check_keys(data, RunConfig, "", source=f"config file {str(path)!r}")
    for override in overrides:
        _apply_override(data, override)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise ValueError(_describe(error)) from error


def dump_config(cfg: RunConfig) -> str:
    """The config as YAML that `load_config` reads back to an equal config."""
    return str(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def config_help(model: type[BaseModel] = RunConfig) -> str:
    """Every field as `section.field (type, default X): description`, grouped by section. Defaults are the run's:
    a nested component model shows the values its section starts from (e.g. `trainer.optimizer.lr`'s 2e-4)."""
    lines: list[str] = []
    _help_lines(model, "", lines, model.model_construct())
    return "\n".join(lines).strip() + "\n"


def _help_lines(model: type[BaseModel], prefix: str, lines: list[str], defaults: BaseModel) -> None:
    for name, info in model.model_fields.items():
        dotted = f"{prefix}{name}"
        default = getattr(defaults, name)
        section = _section_model(info.annotation)
        if section is not None:
            lines += ["", f"{dotted}: {' '.join((section.__doc__ or '').split())}"]
            _help_lines(section, f"{dotted}.", lines, default)
            continue
        text = yaml.safe_dump(list(default) if isinstance(default, tuple) else default, default_flow_style=True)
        text = text.strip().removesuffix("...").strip()
        lines.append(f"  {dotted} ({type_text(info.annotation)}, default {text}): {info.description}")


def type_text(annotation: Any) -> str:
    """A field's type as help shows it: `float`, `str | None`, one of `{constant, cosine}`, `list[int]`."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return type_text(args[0])
    if origin is Literal:
        return "{" + ", ".join(str(v) for v in args) + "}"
    if origin in (Union, UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_text(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def _section_model(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _check_keys(data: dict[str, Any], model: type[BaseModel], prefix: str, *, source: str) -> None:
    for key, value in data.items():
        _check_key(model, prefix, str(key), source=source)
        section = _section_model(model.model_fields[str(key)].annotation)
        if section is not None and isinstance(value, dict):
            _check_keys(value, section, f"{prefix}{key}.", source=source)


def _check_key(model: type[BaseModel], prefix: str, key: str, *, source: str) -> None:
    if key in model.model_fields:
        return
    valid = list(model.model_fields)
    close = difflib.get_close_matches(key, valid, n=1)
    # namesakes in the same section first, then the shallowest: trainer.lr moved to trainer.optimizer.lr, not to
    # trainer.critic.optimizer.lr or spec.optimizer.lr
    named = [n for n in _fields_named(RunConfig, key) if n.startswith(prefix)] or _fields_named(RunConfig, key)
    nearest = [name for name in named if name.count(".") == min(n.count(".") for n in named)]
    elsewhere = MOVED.get(prefix + key) or ", ".join(nearest)
    hint = f" (did you mean {prefix}{close[0]}?)" if close else f" (now {elsewhere})" if elsewhere else ""
    where = prefix.rstrip(".") or "the top level"
    raise ValueError(f"{source}: unknown key {prefix + key!r}{hint}; valid keys of {where}: {', '.join(valid)}")


# Keys of earlier run configs whose setting moved under another name (fields that only moved into a nested
# section, e.g. trainer.lr -> trainer.optimizer.lr, are found by name).
MOVED = {
    "rollout.deterministic": "kernel.mode (deterministic or fast)",
    "trainer.dtype": "kernel.dtype",
    "trainer.lr_schedule": "trainer.optimizer.schedule",
}


def _fields_named(model: type[BaseModel], name: str, prefix: str = "") -> list[str]:
    """The dotted paths of every field called `name` in `model`'s sections."""
    found = []
    for field, info in model.model_fields.items():
        section = _section_model(info.annotation)
        if section is not None:
            found += _fields_named(section, name, f"{prefix}{field}.")
        elif field == name:
            found.append(f"{prefix}{field}")
    return found


def _apply_override(data: dict[str, Any], override: str) -> None:
    dotted, sep, text = override.partition("=")
    dotted = dotted.strip()
    source = f"override {override!r}"
    if not sep or not dotted:
        raise ValueError(f"{source} must look like section.field=value, e.g. trainer.lr=1e-6")
    parts = dotted.split(".")
    model: type[BaseModel] = RunConfig
    node = data
    for depth, key in enumerate(parts[:-1]):
        prefix = "".join(f"{p}." for p in parts[:depth])
        _check_key(model, prefix, key, source=source)
        section = _section_model(model.model_fields[key].annotation)
        if section is None:
            raise ValueError(f"{source}: {prefix}{key} is a value, not a section; drop what follows it")
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ValueError(f"{source}: {prefix}{key} is not a mapping in the config file; fix the file first")
        node, model = child, section
    _check_key(model, "".join(f"{p}." for p in parts[:-1]), parts[-1], source=source)
    try:
        node[parts[-1]] = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"{source}: the value {text!r} is not valid YAML; quote it ({error})") from error


def _describe(error: ValidationError) -> str:
    problems = []
    for item in error.errors():
        dotted = ".".join(str(part) for part in item["loc"]) or "config"
        message = str(item["msg"]).removeprefix("Value error, ")
        given = "" if item["type"] in ("value_error", "missing") else f" (got {item['input']!r})"
        problems.append(f"{dotted}: {message}{given}")
    return "invalid run config: " + "; ".join(problems)  # one line, whatever the number of problems

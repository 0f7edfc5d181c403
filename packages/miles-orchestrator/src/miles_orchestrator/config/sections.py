"""The run config's sections (docs/architecture.md, "Config"): one pydantic model per component the loop owns --
model, task, data, filter, trainer, logging, run (rollout and its agentic settings: rollout.py; reward: reward.py;
on-policy distillation: opd.py) -- each nesting its package's own config model where there is one. `RunConfig`
(run.py) puts them together and checks them against each other.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from miles_contracts import PluginPath, is_plugin_path
from miles_orchestrator.data.task import BuiltinTask
from miles_trainer.config import (
    ADVANTAGE_ESTIMATOR_NAMES,
    AdvantageConfig,
    BackendConfig,
    CriticConfig,
    LoraTrainConfig,
    OptimizerConfig,
    PolicyLossConfig,
)

DATA_SUFFIXES = (".jsonl", ".parquet")
HF_PREFIX = "hf:"  # a local Hugging Face dataset (miles_orchestrator.data.hf); reserved, so never a plug-in path
CLUSTERS = ("ray", "local")
# A Ray placement bundle: resource name -> amount (CPU, GPU, memory or a custom resource a node advertises)
RayResources = Annotated[dict[str, Annotated[float, Field(ge=0)]], Field(min_length=1)]


def is_http_url(value: str) -> bool:
    """An http(s) URL with a host, no whitespace and a valid port (if any)."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in value):
        return False
    try:
        _ = parts.port  # an out-of-range or non-numeric port raises here
    except ValueError:
        return False
    return True


class Section(BaseModel):
    """A config section: unknown keys are errors (the loader names the closest valid one)."""

    model_config = ConfigDict(extra="forbid")


class ModelSection(Section):
    """The policy: a Hugging Face checkpoint, or the built-in tiny Qwen3 bootstrapped by SFT on the built-in task."""

    path: str | None = Field(default=None, description="HF model directory; null: bootstrap the built-in policy.")
    bootstrap_steps: int = Field(
        default=1000, ge=0,
        description="Most SFT steps of the built-in policy (path=null) and its cosine LR schedule's length: a cap the "
        "probe target normally stops well before (at steps 230-410 in benchmarks/results/robustness.json), with the "
        "LR still high.",
    )  # fmt: skip
    bootstrap_target_pass_rate: float | None = Field(
        default=0.35, gt=0, le=1,
        description="Stop the bootstrap SFT at the first check (every 10 steps from step 100) where greedy pass@1 on "
        "128 train-split probe prompts reaches this; null: run all bootstrap_steps.",
    )  # fmt: skip
    bootstrap_lr: float = Field(default=3e-3, gt=0, description="SFT learning rate of the built-in policy.")
    bootstrap_batch_size: int = Field(default=32, ge=1, description="SFT rows per step of the built-in policy.")
    bootstrap_vocab_size: int = Field(
        default=264, ge=259, description="Tokenizer size of the built-in policy (its corpus bounds it: ~265)."
    )
    bootstrap_num_layers: int = Field(
        default=4, ge=1, le=32,
        description="Decoder layers of the built-in policy (its width stays hidden 256): a larger built-in model, "
        "e.g. a distillation teacher (opd.teacher).",
    )  # fmt: skip
    bootstrap_tool_use: float = Field(
        default=0.0, ge=0, le=1,
        description="Share of the built-in policy's SFT rows that call the calculator tool before answering "
        "(rollout.agent.env=calculator; needs data.apply_chat_template=true); 0: every row answers directly.",
    )  # fmt: skip
    bootstrap_architecture: Literal["qwen3", "qwen2", "llama", "qwen3_moe", "glm4_moe", "deepseek_v3"] = Field(
        default="qwen3",
        description="The built-in policy's family: a dense Qwen3, Qwen2.5 (qwen2) or Llama 3.x (llama, with its chat "
        "template and Llama 3 RoPE scaling), a Qwen3-MoE (8 experts, top-2), a GLM-4.5-style MoE (8 experts, top-2, "
        "a shared expert, a dense first layer) or a DeepSeek-V3-style MoE (GLM's MoE with multi-head latent "
        "attention and YaRN); the sizes are in miles_orchestrator.data.bootstrap.",
    )


class TaskSection(Section):
    """Difficulty of the built-in arithmetic task (`miles_orchestrator.data.task.BuiltinTask`)."""

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


class DataSection(Section):
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


class FilterSection(Section):
    """Which prompt groups train (step 4)."""

    dynamic_sampling: bool = Field(default=True, description="Drop groups whose rewards are all equal.")
    max_oversample_rounds: int = Field(default=4, ge=0, description="Extra rollouts to refill dropped groups.")
    overlong: bool = Field(
        default=False,
        description="DAPO's overlong filtering: a truncated response (it hit rollout.max_new_tokens or the context) "
        "leaves the loss (its loss mask is zeroed); its reward still counts in its group's advantages.",
    )
    custom: PluginPath | None = Field(
        default=None, description="'module:function' SampleFilter applied to each group."
    )


def _run_optimizer() -> OptimizerConfig:
    return OptimizerConfig(lr=2e-4)


class TrainerSection(Section):
    """The policy update (steps 5-6): batch shape, data-parallel ranks, advantages, and the trainer's own models."""

    global_batch_size: int = Field(default=256, ge=1, description="Samples per optimizer step, all ranks together.")
    steps_per_rollout: int = Field(default=1, ge=1, description="Optimizer steps per rollout.")
    num_ranks: int = Field(default=1, ge=1, description="Trainer processes (FSDP2 data parallel).")
    rank_resources: RayResources = Field(
        default_factory=lambda: {"CPU": 1.0},
        description="Ray resources of each trainer rank's placement bundle, e.g. {CPU: 8, GPU: 1}, or a custom "
        "resource that puts the ranks on chosen nodes.",
    )
    hang_timeout_s: float = Field(
        default=30.0, ge=0, le=86400,
        description="run.cluster=ray: while the ranks work, each is pinged (a heartbeat answered beside its work); "
        "one that has not answered within this many seconds is hung, and the run stops naming it (a rank that "
        "dies stops it at once). Resume from the last checkpoint. 0: no heartbeat (a hung single rank then "
        "blocks the run; peers still time out after memory.collective_timeout_s).",
    )  # fmt: skip
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
    backend: BackendConfig = Field(
        default_factory=BackendConfig, description="The FSDP2 backend (miles_trainer.config.BackendConfig)."
    )
    lora: LoraTrainConfig = Field(
        default_factory=LoraTrainConfig,
        description="LoRA (miles_trainer.config.LoraTrainConfig): rank > 0 trains adapters on a frozen base "
        "(docs/lora.md); rank 0, the default, trains every weight.",
    )
    qat: bool = Field(
        default=False,
        description="Quantization-aware training: the trainer's forward computes with the weights fake-quantized "
        "to rollout.engine.weight_dtype (straight-through gradients to the full-precision masters), so its "
        "log-probs equal the low-precision engine's bit for bit (docs/low-precision.md). Off: the engine's "
        "quantization is an off-policy gap that trainer.loss.is_mode (TIS / MIS) corrects.",
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
        shares, over = self.num_ranks, f"num_ranks={self.num_ranks}"
        if self.backend.name == "megatron":  # TP / PP / CP peers train the same samples
            layout = self.backend.megatron
            model_parallel = layout.tp * layout.pp * layout.cp
            if self.num_ranks % model_parallel:
                raise ValueError(
                    f"num_ranks={self.num_ranks} is not a multiple of megatron tp * pp * cp = {model_parallel}"
                )
            shares, over = (
                self.num_ranks // model_parallel,
                f"the {self.num_ranks // model_parallel} data-parallel ranks",
            )
        if self.global_batch_size % shares:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} does not split over {over}; make global_batch_size a "
                "multiple of it"
            )
        return self


class LogSection(Section):
    """Metric trackers besides RUN_DIR/metrics.jsonl, which is always written (trackers.py). Each gets every step's
    numeric metrics, the resolved config at the start and the run's plots (summary.png) at the end; a resumed run
    continues the same W&B / MLflow run."""

    tensorboard: bool = Field(
        default=False, description="Also write TensorBoard events to RUN_DIR/tensorboard (the tensorboard extra)."
    )
    wandb: bool = Field(default=False, description="Also log to Weights & Biases (the wandb extra).")
    wandb_project: str = Field(default="miles", description="W&B project name.")
    wandb_entity: str | None = Field(
        default=None, description="W&B entity (user or team); null: WANDB_ENTITY, else the API key's default."
    )
    wandb_name: str | None = Field(default=None, description="W&B run name; null: the run directory's name.")
    wandb_group: str | None = Field(default=None, description="W&B group the run is shown in; null: none.")
    wandb_mode: Literal["online", "offline"] | None = Field(
        default=None,
        description="online: stream to the W&B server; offline: files only (no network, no API key; upload later "
        "with `wandb sync`); null: WANDB_MODE, else online.",
    )
    wandb_dir: str | None = Field(
        default=None, description="Folder W&B writes its files in (under wandb/); null: the run directory."
    )
    mlflow: bool = Field(default=False, description="Also log to MLflow (the mlflow extra).")
    mlflow_tracking_uri: str | None = Field(
        default=None,
        description="MLflow tracking URI (http(s)://SERVER, sqlite:///PATH.db, ...); null: MLFLOW_TRACKING_URI, "
        "else sqlite:///RUN_DIR/mlflow.db with artifacts in RUN_DIR/mlartifacts.",
    )
    mlflow_experiment: str = Field(default="miles", description="MLflow experiment name (created if missing).")
    mlflow_run_name: str | None = Field(default=None, description="MLflow run name; null: the run directory's name.")


class RunSection(Section):
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
    bind_host: str = Field(
        default="127.0.0.1",
        description="The IP address the Ray head that the run starts (run.ray_address=null) listens on; when it is "
        "loopback, trainer ranks that share one node also meet there (MASTER_ADDR, rank 0's TCPStore), else at rank "
        "0's node IP. 127.0.0.1: nothing of a one-node run is reachable from the network; this node's IP: other "
        "nodes may join the local Ray head.",
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
        "syncs pause the generations in flight (rollout.pause_mode). Both need run.cluster=ray, colocate=false, and "
        "make trainer.loss.is_mode default to truncate (TIS against the rollout's log-probs).",
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
        "checkpoint is at most 1 GiB, else http for one engine and distributed for several (SGLang engines: "
        "distributed where their layout allows it, else disk; docs/laptop-to-cluster.md).",
    )
    sync_dir: str | None = Field(
        default=None,
        description="run.sync_transport=disk (and the weight file a restarted SGLang engine loads with "
        "distributed): a directory every node reads (e.g. NFS); null: RUN_DIR/sync.",
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
    save_rollouts: bool = Field(
        default=False,
        description="Write each trained batch to RUN_DIR/rollouts/step_N.parquet (prompt and response tokens, the "
        "rollout's and the trainer's log-probs, rewards, advantages, weight versions, routed experts, loss masks) "
        "and, once trained, the trainer's per-tensor weight digests to step_N.json: what miles-orchestrator inspect, "
        "mismatch and replay read (docs/debugging.md). The digests hash every weight each step.",
    )
    save_rollouts_every: int = Field(
        default=1,
        ge=1,
        description="run.save_rollouts: every this many steps (a replay of step N needs every step after the "
        "checkpoint it starts from).",
    )
    save_rollouts_max_bytes: int = Field(
        default=4 << 30,
        ge=0,
        description="run.save_rollouts: the most bytes RUN_DIR/rollouts holds; beyond it the oldest steps are "
        "deleted (logged). 0: no bound.",
    )
    profile_steps: list[int] = Field(
        default_factory=list,
        description="Steps whose torch.profiler traces (Chrome / Perfetto JSON) are written to RUN_DIR/profiles/"
        "step_N/: the driver, each trainer rank and each embedded engine (docs/debugging.md).",
    )
    log: LogSection = Field(default_factory=LogSection, description="Metric trackers besides metrics.jsonl.")

    @field_validator("bind_host")
    @classmethod
    def _ip_address(cls, value: str) -> str:
        try:
            address = ipaddress.ip_address(value)
        except ValueError:
            address = None
        if address is None or address.is_unspecified:
            raise ValueError(
                f"run.bind_host={value!r}: give one IP address of this node (127.0.0.1, or its address on the "
                "network other nodes use), not a host name or 0.0.0.0"
            )
        return value

    @model_validator(mode="after")
    def _profile_steps_are_run(self) -> RunSection:
        outside = [s for s in self.profile_steps if not 1 <= s <= self.num_steps]
        if outside:
            raise ValueError(
                f"run.profile_steps={self.profile_steps}: steps {outside} are not among the run's steps 1.."
                f"{self.num_steps}; give steps the run trains (e.g. run.profile_steps=[2])"
            )
        return self

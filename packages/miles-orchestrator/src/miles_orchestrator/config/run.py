"""The run config: one typed, nested pydantic model per component, loaded from YAML plus dotted CLI overrides
(loading.py).

It sits before the RL data path: `load_config` runs once at start-up and every component (data source, rollout,
reward pool, filters, trainer, loop) reads its own section. Each component's model is owned by its package and
nested here, so every setting is defined once (docs/architecture.md, "Config"): `kernel` is miles-kernels'
`KernelConfig` (engine and trainer share it), `rollout.engine` miles-rollout's `EngineConfig`, and
`trainer.optimizer`, `trainer.loss`, `trainer.backend` miles-trainer's models; sections.py defines the
sections only the loop has, and this module puts them together in `RunConfig` and checks them against each other.
All of them are torch-free: a whole config validates without importing torch.
A bad value fails at loading, with a `ValueError` that names the dotted field and the fix, rather than minutes into
a run. `config_help` and `dump_config` (loading.py) render the same models for `miles-orchestrator run --help` and
for the resolved config a run writes next to its outputs. Plug-in paths (`module:function`) are only checked for
shape here; they are imported when their component starts.
"""

from __future__ import annotations

from pydantic import Field, PrivateAttr, model_validator

from miles_kernels.config import KernelConfig
from miles_memory.config import MemoryConfig
from miles_orchestrator.config.opd import OPDSection
from miles_orchestrator.config.resolve import Derived, resolve
from miles_orchestrator.config.reward import BUILTIN_REWARD_NAMES, RewardSection
from miles_orchestrator.config.rollout import RolloutSection
from miles_orchestrator.config.sections import (
    DataSection,
    FilterSection,
    ModelSection,
    RunSection,
    Section,
    TrainerSection,
)
from miles_rollout.config import SGLangConfig
from miles_spec.config import SpecConfig


class RunConfig(Section):
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
    opd: OPDSection = Field(
        default_factory=OPDSection, description="On-policy distillation from a teacher (off without a teacher)."
    )
    trainer: TrainerSection = Field(default_factory=TrainerSection, description="The policy update.")
    spec: SpecConfig = Field(
        default_factory=SpecConfig,
        description="The speculative-decoding draft, MTP or EAGLE-3 (miles_spec.config.SpecConfig): trained online "
        "on the rollouts, or not.",
    )
    memory: MemoryConfig = Field(
        default_factory=MemoryConfig,
        description="Offload, the memory budget, OOM handling and the memory planner (miles_memory.config).",
    )
    run: RunSection = Field(default_factory=RunSection, description="Steps, seeds, outputs and logging.")
    _derived: dict[str, Derived] = PrivateAttr(default_factory=dict)

    @property
    def is_true_on_policy(self) -> bool:
        """Whether the rollout's log-probs are the trainer's bit for bit (docs/true-on-policy.md): deterministic
        kernels on both sides, and a low-precision engine only with quantization-aware training."""
        return self.kernel.is_deterministic and (self.rollout.engine.weight_dtype == "kernel" or self.trainer.qat)

    def _low_precision(self) -> None:
        """rollout.engine.weight_dtype and trainer.qat (docs/low-precision.md)."""
        weights = self.rollout.engine.weight_dtype
        if self.trainer.qat and weights == "kernel":
            raise ValueError(
                "trainer.qat=true trains against the low-precision engine's weights, but rollout.engine.weight_dtype "
                "is kernel: set it to fp8_block, fp8_channel or int4_group"
            )
        if weights == "kernel":
            return
        unsupported = {
            "trainer.lora (the adapters are merged into a full-precision base)": self.trainer.lora.is_enabled,
            "trainer.backend.name=megatron (use fsdp2)": self.trainer.backend.name == "megatron",
            "rollout.backend=sglang (SGLang quantizes on its own: rollout.sglang.server_args={quantization: fp8}, "
            "with kernel.mode=fast)": self.rollout.backend == "sglang",
        }
        named = [name for name, used in unsupported.items() if used]
        if named:
            raise ValueError(f"rollout.engine.weight_dtype={weights} does not support {', '.join(named)} yet")

    @property
    def derived(self) -> dict[str, Derived]:
        """The fields this config derived from others (dotted name → its row of resolve.DERIVED)."""
        return dict(self._derived)

    def _megatron_backend(self) -> None:
        """trainer.backend.name=megatron: what the Megatron backend needs and what it does not support yet
        (docs/megatron.md): the critic, the online MTP draft, routing replay, the MoE losses, memory budgets and LoRA
        (tp = etp = 1) run on it as on FSDP2, and true on-policy (kernel.mode=deterministic) on the layouts its Miles
        layers run exactly (docs/true-on-policy.md)."""
        if self.trainer.backend.name != "megatron":
            return
        backend = self.trainer.backend
        inexact = backend.megatron.exactness_problems()
        if self.kernel.is_deterministic and inexact:
            raise ValueError(
                f"trainer.backend.name=megatron with kernel.mode=deterministic: with {'; '.join(inexact)}, the "
                "trainer's log-probs cannot equal the rollout's bit for bit (docs/true-on-policy.md lists the exact "
                "layouts); change the layout, or set kernel.mode=fast (the old log-probs are recomputed and "
                "trainer.loss.is_mode=truncate (TIS) or mask (MIS) corrects the mismatch)"
            )
        unrun = backend.megatron.miles_layer_problems()
        if backend.megatron.uses_miles_layers(self.kernel.is_deterministic) and unrun:
            raise ValueError(
                f"trainer.backend.megatron.layer_spec=miles does not run {'; '.join(unrun)}; change the layout or set "
                "layer_spec=megatron"
            )
        loss, replays = self.trainer.loss, self.trainer.routing_replay == "rollout"
        in_routers = replays or loss.moe_aux_loss != "none" or loss.moe_z_loss_coef > 0
        unsupported = {
            # each TP rank's router sees its share of the tokens: not instrumented (miles_trainer.megatron_moe)
            "routing replay or the MoE losses with trainer.backend.megatron.sequence_parallel": (
                in_routers and backend.megatron.sequence_parallel
            ),
            "trainer.backend.megatron.cp > 1 (context parallelism)": backend.megatron.cp > 1,
            "trainer.optimizer.algorithm=muon (Muon runs on FSDP2)": self.trainer.optimizer.algorithm == "muon",
            "spec.draft=eagle3 (the EAGLE-3 draft trains and syncs with FSDP2)": (
                self.spec.drafts and self.spec.draft == "eagle3"
            ),
            "opd.top_k (the teacher's top-k loss is the FSDP2 step's)": self.opd.is_enabled and self.opd.top_k > 0,
            "trainer.optimizer.offload, trainer.critic.optimizer.offload or spec.optimizer.offload (the host-memory "
            "AdamW runs on FSDP2)": any(
                o.offload != "none"
                for o in (self.trainer.optimizer, self.trainer.critic.optimizer, self.spec.optimizer)
            ),
            "trainer.lora (LoRA adapters) with trainer.backend.megatron.tp > 1 or etp > 1 (the adapters would need "
            "splitting the way the weights are: LoRA runs with tp = etp = 1)": (
                self.trainer.lora.is_enabled and (backend.megatron.tp > 1 or (backend.megatron.etp or 1) > 1)
            ),
        }
        named = [name for name, used in unsupported.items() if used]
        if named:
            raise ValueError(f"trainer.backend.name=megatron does not support {', '.join(named)} yet; use fsdp2")

    def _sglang_backend(self) -> None:
        """rollout.backend=sglang: what SGLang engines need (docs/laptop-to-cluster.md)."""
        rollout = self.rollout
        if rollout.backend != "sglang":
            if rollout.sglang != SGLangConfig():
                raise ValueError("rollout.sglang is set but rollout.backend is embedded: set rollout.backend=sglang")
            return
        if self.run.cluster != "ray":
            raise ValueError(
                "rollout.backend=sglang launches SGLang servers as Ray actors: use run.cluster=ray (the local "
                "cluster runs the embedded engine in this process)"
            )
        if self.spec.mode == "online" and self.spec.draft == "eagle3":
            raise ValueError(
                "spec.mode=online spec.draft=eagle3 with rollout.backend=sglang is not supported yet: weight updates "
                "reach SGLang's target model, not its EAGLE-3 draft; use the embedded engine, or spec.mode=frozen "
                "(SGLang drafts with spec.draft_path as loaded)"
            )
        if self.trainer.lora.is_enabled:
            raise ValueError(
                "trainer.lora with rollout.backend=sglang is not supported yet: the SGLang engines would need the "
                "adapters loaded as a LoRA (/load_lora_adapter_from_tensors) at every sync; use the embedded engine"
            )
        if self.kernel.is_deterministic:
            raise ValueError(
                "rollout.backend=sglang with kernel.mode=deterministic: SGLang's kernels are not the trainer's, so "
                "the rollout log-probs cannot equal the trainer's bit for bit; set kernel.mode=fast (the old "
                "log-probs are recomputed, trainer.loss.is_mode=truncate (TIS) or mask (MIS) corrects the mismatch; "
                "rollout.sglang.deterministic_inference=true keeps the rollouts reproducible)"
            )
        if self.run.sync_transport == "http":
            raise ValueError(
                "run.sync_transport=http with SGLang engines: SGLang's /update_weights_from_tensor unpickles its "
                "payload (Miles never sends pickles); use distributed (an NCCL broadcast), shm (one node), disk (a "
                "run.sync_dir every node reads) or auto"
            )
        if self.run.sync_transport == "distributed" and not rollout.sglang.network_transports(self.run.colocate):
            why = ("run.colocate=true puts the trainer and the engine on the same GPUs, which NCCL cannot join"
                   if self.run.colocate else
                   f"rollout.sglang.dp_size={rollout.sglang.dp_size}: SGLang takes a broadcast only without "
                   "data-parallel replicas")  # fmt: skip
            raise ValueError(
                f"run.sync_transport=distributed with SGLang engines: {why}; use shm (one node), disk (a "
                "run.sync_dir every node reads) or auto"
            )
        gpus = rollout.sglang.tp_size * rollout.sglang.dp_size
        if rollout.sglang.launch_command is None and rollout.engine_resources.get("GPU", 0) < gpus:
            raise ValueError(
                f"rollout.engine_resources={rollout.engine_resources} gives each SGLang engine "
                f"{rollout.engine_resources.get('GPU', 0):g} GPUs and rollout.sglang.tp_size * dp_size = {gpus} needs "
                f"as many: e.g. rollout.engine_resources={{CPU: 8, GPU: {gpus}}}"
            )

    def _optimizer(self) -> None:
        """trainer.optimizer.algorithm=muon against the other sections (the Megatron backend's refusal is there)."""
        if self.trainer.optimizer.algorithm == "muon" and self.trainer.lora.is_enabled:
            raise ValueError(
                "trainer.optimizer.algorithm=muon orthogonalizes the policy's weight matrices, which trainer.lora "
                "freezes: train the adapters with algorithm=adamw"
            )

    def _opd(self) -> None:
        """On-policy distillation (miles_orchestrator.opd) against the other sections."""
        if not self.opd.is_enabled:
            return
        if not self.opd.task_reward and self.filter.dynamic_sampling:
            raise ValueError(
                "opd.task_reward=false trains every prompt group on the teacher's signal, but filter.dynamic_sampling "
                "drops the groups whose rewards are all equal; set filter.dynamic_sampling=false"
            )
        if not self.opd.task_reward and self.trainer.uses_critic:
            raise ValueError(
                "opd.task_reward=false trains on the teacher's KL alone, so PPO's critic would learn task returns no "
                "advantage uses; use a group estimator (trainer.advantage_estimator=grpo) or keep opd.task_reward"
            )
        if self.opd.teacher is not None and self.opd.teacher.path is None and self.model.path is not None:
            raise ValueError(
                "opd.teacher bootstraps a built-in teacher on the built-in task's tokenizer, but model.path is your "
                "own model: give the teacher's directory as opd.teacher.path (or a server as opd.teacher_url)"
            )

    @model_validator(mode="after")
    def _cross_section(self) -> RunConfig:
        """The derived settings (resolve.py), then the checks across sections, which only read the config."""
        self._derived = resolve(self)
        check_batch_identity(self)
        self._low_precision()
        self._megatron_backend()
        self._sglang_backend()
        self._opd()
        self._optimizer()
        if self.kernel.is_deterministic and self.rollout.top_p < 1.0:
            raise ValueError(
                f"rollout.top_p={self.rollout.top_p} samples from a truncated distribution, while true on-policy "
                "(kernel.mode=deterministic) trains on the log-prob contract's full one (log_softmax(logits / T)): "
                "the samples would not follow the log-probs the trainer uses; set rollout.top_p=1, or run "
                "kernel.mode=fast"
            )
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
        if self.reward.overlong_buffer >= self.rollout.max_new_tokens:
            raise ValueError(
                f"reward.overlong_buffer={self.reward.overlong_buffer} must be below rollout.max_new_tokens="
                f"{self.rollout.max_new_tokens}: the punishment ramps over the last overlong_buffer tokens before it"
            )
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
        if self.model.bootstrap_tool_use and not self.data.apply_chat_template:
            raise ValueError(
                f"model.bootstrap_tool_use={self.model.bootstrap_tool_use} teaches tool calls in chat turns; set "
                "data.apply_chat_template=true"
            )
        if self.reward.name == "env" and self.rollout.agent.env is None:
            raise ValueError(
                "reward.name=env scores a sample by its episode's environment reward, but rollout.agent.env is not "
                "set; name an environment (e.g. rollout.agent.env=calculator) or choose another reward.name"
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

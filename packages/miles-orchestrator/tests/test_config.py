"""Pure-logic tier (no torch): the run config loads from YAML and dotted overrides, rejects mistakes with messages
that name the field and the fix, renders help and YAML that round-trip, nests each component's own config model,
and validates without importing torch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from miles_memory import read_run
from miles_orchestrator.config import RunConfig, check_batch_identity, config_help, dump_config, load_config


def test_defaults_are_valid() -> None:
    cfg = load_config(None, [])
    assert cfg == RunConfig()
    check_batch_identity(cfg)
    assert cfg.model.path is None and cfg.data.source == "builtin" and cfg.reward.name == "task"


def test_yaml_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  optimizer: {lr: 0.001}\n  loss: {kl_coef: 0.1}\nrollout:\n  max_new_tokens: 32\n")
    overrides = ["trainer.optimizer.lr=1e-6", "model.path=/models/x", "data.task.operations=[+, '-']"]
    cfg = load_config(path, [*overrides, "run.log.tensorboard=true"])
    assert cfg.trainer.optimizer.lr == 1e-6 and isinstance(cfg.trainer.optimizer.lr, float)  # override wins
    assert cfg.trainer.loss.kl_coef == 0.1 and cfg.rollout.max_new_tokens == 32  # file values kept
    assert cfg.model.path == "/models/x"
    assert cfg.data.task.operations == ["+", "-"]
    assert cfg.run.log.tensorboard is True
    assert load_config(None, ["model.path=null"]).model.path is None


def test_unknown_override_key_lists_valid_keys() -> None:
    with pytest.raises(ValueError, match=r"unknown key 'trainer\.optimizer\.lrr'") as info:
        load_config(None, ["trainer.optimizer.lrr=1e-6"])
    message = str(info.value)
    assert "did you mean trainer.optimizer.lr?" in message
    assert "valid keys of trainer.optimizer: lr, weight_decay" in message
    with pytest.raises(ValueError, match=r"did you mean trainer\.optimizer\?"):
        load_config(None, ["trainer.optimiser.lr=1e-6"])
    with pytest.raises(ValueError, match="valid keys of the top level: model, kernel, data"):
        load_config(None, ["trainr.lr=1"])


def test_keys_of_earlier_configs_say_where_they_went() -> None:
    with pytest.raises(ValueError, match=r"unknown key 'trainer\.lr' \(now trainer\.optimizer\.lr\)"):
        load_config(None, ["trainer.lr=1e-6"])
    with pytest.raises(
        ValueError, match=r"'rollout\.max_running_requests' \(now rollout\.engine\.max_running_requests\)"
    ):
        load_config(None, ["rollout.max_running_requests=8"])
    with pytest.raises(ValueError, match=r"'rollout\.deterministic' \(now kernel\.mode \(deterministic or fast\)\)"):
        load_config(None, ["rollout.deterministic=false"])
    with pytest.raises(ValueError, match=r"'trainer\.dtype' \(now kernel\.dtype\)"):
        load_config(None, ["trainer.dtype=bfloat16"])


def test_unknown_yaml_key_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  temprature: 0.7\n")
    with pytest.raises(ValueError, match=r"bad\.yaml.*'rollout\.temprature'.*did you mean rollout\.temperature"):
        load_config(path, [])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.optimizer.lr=-1", r"trainer\.optimizer\.lr: Input should be greater than 0 \(got -1\)"),
        ("trainer.optimizer.lr=fast", r"trainer\.optimizer\.lr: Input should be a valid number"),
        ("trainer.optimizer.schedule=linear", r"trainer\.optimizer\.schedule: Input should be 'constant' or 'cosine'"),
        ("trainer.optimizer.betas=[0.9, 1.5]", r"trainer\.optimizer\.betas: betas=\[0\.9, 1\.5\]: each must be in"),
        ("trainer.loss.agg_mode=mean", r"trainer\.loss\.agg_mode: Input should be 'token-mean'"),
        ("trainer.loss.loss_fn=mymodule", r"trainer\.loss\.loss_fn: 'mymodule' must be a 'package\.module:function'"),
        ("kernel.page_size=12", r"kernel: page_size=12 must be a power of two"),
        ("kernel.mode=exact", r"kernel\.mode: Input should be 'deterministic' or 'fast'"),
        ("rollout.engine.num_kv_pages=1", r"rollout\.engine\.num_kv_pages: Input should be greater than or equal"),
        ("run.cluster=k8s", r"run\.cluster: Input should be 'ray' or 'local'"),
        ("trainer.advantage_estimator=ppo", r"trainer\.advantage_estimator: .*use one of \['grpo'"),
        (
            "data.source=prompts.csv",
            r"data\.source: 'prompts\.csv' is neither 'builtin', a \.jsonl / \.parquet file, ",
        ),
        ("data.eval_path=my_data:Source", r"data\.eval_path: 'my_data:Source' is neither .* for data\.source only"),
        ("data.source_args={n: 1}", r"data: data\.source_args=\{'n': 1\} are keyword arguments of a 'module:Class'"),
        ("reward.name=http", r"reward: reward\.name=http needs reward\.url, the endpoint"),
        ("reward.url=http://localhost:8000/r", r"reward: reward\.url / reward\.health_url are for reward\.name=http"),
        ("reward.name=accuracy", r"reward\.name: reward\.name='accuracy': use one of"),
        ("rollout.rollout_fn=mymodule", r"rollout\.rollout_fn: 'mymodule' must be a 'package\.module:function'"),
        ("trainer.loss.dual_clip=0.5", r"trainer\.loss\.dual_clip: Input should be greater than 1"),
        ("rollout.temperature=0", r"rollout: .*set rollout\.temperature>0 .*or rollout\.allow_greedy=true"),
        ("rollout.top_p=0.9", r"rollout\.top_p=0\.9 samples from a truncated distribution.*kernel\.mode=fast"),
    ],
)
def test_invalid_values_name_the_field(override: str, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        load_config(None, [override])


def test_data_and_reward_plugins_are_accepted_in_every_form_and_refused_with_the_fix() -> None:
    plugin = load_config(None, ["data.source=my_data:Source", "data.source_args={split: dev, limit: 5}"]).data
    assert plugin.source == "my_data:Source" and plugin.source_args == {"split": "dev", "limit": 5}
    hf = load_config(None, ["data.source=hf:/data/gsm8k", "data.eval_path=hf:/data/gsm8k", "data.hf_split=dev"]).data
    assert (hf.source, hf.eval_path, hf.hf_split, hf.hf_eval_split) == (
        "hf:/data/gsm8k",
        "hf:/data/gsm8k",
        "dev",
        "test",
    )
    http = load_config(None, ["reward.name=http", "reward.url=https://rm.example:8443/score", "reward.is_group=true"])
    assert http.reward.url == "https://rm.example:8443/score" and http.reward.max_retries == 3
    for url in ("localhost:8000/reward", "ftp://rm.example/score", "http://", "http://rm.example:99999/"):
        with pytest.raises(ValueError, match=rf"reward\.url: reward\.url='{re.escape(url)}' is not an http\(s\) URL"):
            load_config(None, ["reward.name=http", f"reward.url={url}"])
    with pytest.raises(ValueError, match=r"reward\.health_url: reward\.health_url='health' is not an http\(s\) URL"):
        load_config(None, ["reward.name=http", "reward.url=http://h/r", "reward.health_url=health"])
    with pytest.raises(ValueError, match=r"reward\.max_backoff_s=1 is below reward\.backoff_s=2; raise max_backoff_s"):
        load_config(
            None, ["reward.name=http", "reward.url=http://h/r", "reward.backoff_s=2", "reward.max_backoff_s=1"]
        )


def test_truncated_sampling_is_allowed_off_true_on_policy() -> None:
    assert load_config(None, ["rollout.top_p=0.9", "kernel.mode=fast"]).rollout.top_p == 0.9


def test_task_knobs_are_checked_by_the_task() -> None:
    assert load_config(None, ["data.task.num_digits=[2, 1]"]).data.task.to_task().operand_digits == (2, 1)
    with pytest.raises(ValueError, match=r"data\.task: num_digits=\(3,\) gives 1 digit counts for num_operands=2"):
        load_config(None, ["data.task.num_digits=[3]"])


def test_greedy_rollout_needs_opt_in() -> None:
    assert load_config(None, ["rollout.temperature=0", "rollout.allow_greedy=true"]).rollout.temperature == 0


def test_malformed_overrides() -> None:
    with pytest.raises(ValueError, match=r"must look like section\.field=value"):
        load_config(None, ["trainer.optimizer.lr"])
    with pytest.raises(ValueError, match=r"trainer\.optimizer\.lr is a value, not a section"):
        load_config(None, ["trainer.optimizer.lr.max=1"])
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(None, ["trainer.optimizer.lr=[1,"])


def test_batch_identity_says_what_to_change() -> None:
    with pytest.raises(ValueError) as info:
        load_config(
            None, ["rollout.num_prompts_per_step=4", "rollout.n_samples_per_prompt=8", "trainer.global_batch_size=64"]
        )
    message = str(info.value)
    assert "(4) × rollout.n_samples_per_prompt (8) = 32" in message
    assert "(64) × trainer.steps_per_rollout (1) = 64" in message
    assert "set trainer.global_batch_size=32" in message
    assert "num_prompts_per_step=8, n_samples_per_prompt=8, global_batch_size=32, steps_per_rollout=2" in message
    # The example in the message is itself valid.
    load_config(
        None, ["rollout.num_prompts_per_step=8", "trainer.global_batch_size=32", "trainer.steps_per_rollout=2"]
    )
    with pytest.raises(ValueError, match=r"set trainer\.global_batch_size=63 and trainer\.steps_per_rollout=1"):
        load_config(
            None, ["rollout.num_prompts_per_step=9", "rollout.n_samples_per_prompt=7", "trainer.steps_per_rollout=2"]
        )


def test_cross_section_checks() -> None:
    with pytest.raises(ValueError, match=r"n_samples_per_prompt >= 2 or filter\.dynamic_sampling=false"):
        load_config(
            None,
            [
                "filter.dynamic_sampling=true",
                "rollout.n_samples_per_prompt=1",
                "rollout.num_prompts_per_step=64",
                "trainer.global_batch_size=64",
            ],
        )
    with pytest.raises(ValueError, match=r"reward\.is_group=false"):
        load_config(None, ["reward.is_group=true"])
    with pytest.raises(ValueError, match="does not split over num_ranks=3"):
        load_config(None, ["trainer.num_ranks=3"])


def test_agentic_settings_are_checked_together() -> None:
    example = Path(__file__).parents[3] / "examples" / "agentic_calculator.yaml"
    cfg = load_config(example, [])
    assert cfg.rollout.agent.env == "calculator" and cfg.reward.name == "env" and cfg.model.bootstrap_tool_use > 0
    with pytest.raises(ValueError, match=r"drop one of them"):
        load_config(example, ["rollout.rollout_fn=my_rollouts:fn"])
    with pytest.raises(ValueError, match=r"rollout\.agent\.env is not set"):
        load_config(None, ["reward.name=env"])
    with pytest.raises(ValueError, match=r"set data\.apply_chat_template=true"):
        load_config(example, ["data.apply_chat_template=false"])
    with pytest.raises(ValueError, match=r"rollout\.agent\.env='calculater': use one of \['calculator'\]"):
        load_config(None, ["rollout.agent.env=calculater"])
    with pytest.raises(ValueError, match=r"rollout\.agent\.max_turns"):
        load_config(None, ["rollout.agent.max_turns=0"])


def test_yaml_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_config(path, [])
    with pytest.raises(ValueError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml", [])


def test_dump_round_trips(tmp_path: Path) -> None:
    cfg = load_config(None, ["trainer.optimizer.lr=3e-5", "data.task.operations=['+', '*']", "run.ray_address=auto",
                             "rollout.temperature=0.7", "trainer.optimizer.betas=[0.8, 0.9]"])  # fmt: skip
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path, []) == cfg
    # derived settings are not saved: they follow their sources again (a resumed run's overrides, say)
    assert "temperature" not in yaml.safe_load(path.read_text())["trainer"]["loss"]
    resumed = load_config(path, ["rollout.temperature=0.5", "run.num_steps=50"])
    assert resumed.trainer.loss.temperature == 0.5 and resumed.trainer.optimizer.total_steps == 50


def test_every_field_is_documented_in_help(leaf_fields) -> None:
    text = config_help(RunConfig)
    for dotted in leaf_fields(RunConfig):
        assert f"  {dotted} (" in text, dotted
    # Defaults are the run's: a nested component model shows what its section starts from.
    assert "  trainer.optimizer.lr (float, default 0.0002): AdamW peak learning rate." in text
    assert "  rollout.engine.max_running_requests (int, default 64): " in text
    modes = "{token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm, token-sum, token-sum-norm}"
    assert f"  trainer.loss.agg_mode ({modes}, default token-mean)" in text
    assert "  kernel.mode ({deterministic, fast}, default deterministic): " in text
    assert "  model.path (str | None, default null): " in text
    assert "  data.task.operations (" in text and "default [+]" in text


def test_every_field_has_a_default_and_description() -> None:
    def check(model: type[BaseModel]) -> None:
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"
            assert not info.is_required(), f"{model.__name__}.{name} has no default"
            annotation = info.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                check(annotation)

    check(RunConfig)


def test_component_models_are_the_packages_own() -> None:
    """Each section that configures a component is that package's model (defined once), with the run's defaults
    where they differ from the component's own."""
    from miles_kernels.config import KernelConfig
    from miles_rollout.config import EngineConfig
    from miles_trainer.config import BackendConfig, OptimizerConfig, PolicyLossConfig

    cfg = RunConfig()
    assert type(cfg.kernel) is KernelConfig and type(cfg.rollout.engine) is EngineConfig
    assert type(cfg.trainer.optimizer) is OptimizerConfig and type(cfg.trainer.loss) is PolicyLossConfig
    assert type(cfg.trainer.backend) is BackendConfig
    assert (cfg.trainer.optimizer.lr, OptimizerConfig().lr) == (2e-4, 1e-5)
    assert (cfg.rollout.engine.max_running_requests, EngineConfig().max_running_requests) == (64, 256)
    assert cfg.kernel.mode == "deterministic"


def test_options_that_were_unreachable_are_set_from_the_run_config() -> None:
    cfg = load_config(None, ["trainer.loss.is_level=sequence", "trainer.loss.is_threshold=3.0",
                             "trainer.optimizer.betas=[0.9, 0.95]", "trainer.optimizer.eps=1e-6",
                             "kernel.linear_tile=32", "rollout.engine.max_prefill_tokens=512"])  # fmt: skip
    assert cfg.trainer.loss.is_level == "sequence" and cfg.trainer.loss.is_threshold == 3.0
    assert cfg.trainer.optimizer.betas == (0.9, 0.95) and cfg.trainer.optimizer.eps == 1e-6
    assert cfg.kernel.linear_tile == 32 and cfg.rollout.engine.max_prefill_tokens == 512


def test_dr_grpo_length_follows_the_rollout() -> None:
    cfg = load_config(None, ["rollout.max_new_tokens=48", "trainer.loss.agg_mode=seq-mean-token-sum-norm"])
    assert cfg.trainer.loss.max_response_len == 48
    assert load_config(None, ["trainer.loss.max_response_len=64"]).trainer.loss.max_response_len == 64


def test_loss_temperature_follows_the_rollout() -> None:
    assert load_config(None, ["rollout.temperature=0.7"]).trainer.loss.temperature == 0.7
    both = load_config(None, ["rollout.temperature=0.7", "trainer.loss.temperature=0.7"])
    assert both.trainer.loss.temperature == 0.7
    with pytest.raises(ValueError, match=r"trainer\.loss\.temperature=0\.5 disagrees with rollout\.temperature=1\.0"):
        load_config(None, ["trainer.loss.temperature=0.5"])


def test_cluster_choice_is_checked_against_what_it_can_run() -> None:
    assert load_config(None, ["run.cluster=local"]).run.cluster == "local"
    with pytest.raises(ValueError, match=r"run\.cluster=local runs one trainer rank .* use run\.cluster=ray"):
        load_config(None, ["run.cluster=local", "trainer.num_ranks=2"])
    with pytest.raises(ValueError, match=r"trainer\.backend\.device=cuda: the Ray placement .* add a GPU, e\.g\."):
        load_config(None, ["trainer.backend.device=cuda"])
    gpus = ["trainer.backend.device=cuda", "trainer.rank_resources={CPU: 4, GPU: 1}"]
    assert load_config(None, gpus).trainer.rank_resources == {"CPU": 4.0, "GPU": 1.0}
    assert load_config(None, ["run.cluster=local", "rollout.engine.device=cuda"]).rollout.engine.device == "cuda"


def test_the_megatron_backend_is_checked_against_what_it_needs() -> None:
    gpus = ["trainer.backend.name=megatron", "trainer.backend.device=cuda", "trainer.rank_resources={CPU: 4, GPU: 1}"]
    fast = [*gpus, "kernel.mode=fast"]
    cfg = load_config(None, [*fast, "trainer.num_ranks=4", "trainer.backend.megatron.tp=2"])
    assert cfg.trainer.backend.megatron.tp == 2 and cfg.trainer.backend.name == "megatron"
    plan = read_run(cfg.model_dump(mode="json")).plan  # the planner plans the run's own layout
    assert (plan.trainer_backend, plan.tp, plan.distributed_optimizer) == ("megatron", 2, False)
    on_cpu = load_config(None, ["trainer.backend.name=megatron", "kernel.mode=fast"])  # the CPU device mode
    assert (on_cpu.trainer.backend.device, on_cpu.run.cluster) == ("cpu", "ray")
    # true on-policy: the Miles layers (the engine's kernels) on the layouts they run exactly
    exact = load_config(None, [*gpus, "trainer.num_ranks=4", "trainer.backend.megatron.tp=2"])
    assert exact.kernel.is_deterministic and exact.trainer.backend.megatron.uses_miles_layers(True)
    with pytest.raises(ValueError, match=r"deterministic: with layer_spec=megatron \(megatron-core's kernels .* "
                                         r"set kernel\.mode=fast"):  # fmt: skip
        load_config(None, [*gpus, "trainer.backend.megatron.layer_spec=megatron"])
    with pytest.raises(ValueError, match=r"tp=2 with tp_reduce=all_reduce \(the row-parallel layers"):
        load_config(None, [*gpus, "trainer.num_ranks=2", "trainer.backend.megatron.tp=2",
                           "trainer.backend.megatron.tp_reduce=all_reduce"])  # fmt: skip
    with pytest.raises(ValueError, match=r"layer_spec=miles does not run transformer_impl=transformer_engine"):
        load_config(None, [*fast, "trainer.backend.megatron.layer_spec=miles",
                           "trainer.backend.megatron.transformer_impl=transformer_engine"])  # fmt: skip
    replayed = load_config(None, [*fast, "trainer.routing_replay=rollout", "trainer.loss.moe_aux_loss=seq_aux_loss"])
    assert replayed.trainer.routing_replay == "rollout"  # megatron-core's routers replay and train the balance
    ppo = load_config(None, [*fast, "trainer.advantage_estimator=gae", "spec.mode=online"])  # critic, MTP online
    assert ppo.trainer.uses_critic and ppo.spec.mode == "online"
    with pytest.raises(ValueError, match=r"routing replay or the MoE losses with .*sequence_parallel yet"):
        load_config(None, [*fast, "trainer.routing_replay=rollout", "trainer.num_ranks=2",
                           "trainer.backend.megatron.tp=2", "trainer.backend.megatron.sequence_parallel=true",
                           "trainer.backend.megatron.transformer_impl=transformer_engine"])  # fmt: skip
    with pytest.raises(ValueError, match=r"does not support trainer\.backend\.megatron\.cp > 1 \(context"):
        load_config(None, [*fast, "trainer.num_ranks=2", "trainer.backend.megatron.cp=2"])
    with pytest.raises(ValueError, match=r"does not support trainer\.optimizer\.offload, .*runs on FSDP2"):
        load_config(None, [*fast, "trainer.critic.optimizer.offload=moments"])
    piped = load_config(None, [*fast, "trainer.num_ranks=6", "trainer.backend.megatron.pp=3",
                               "trainer.backend.megatron.vpp=2"])  # fmt: skip
    assert (piped.trainer.backend.megatron.pp, read_run(piped.model_dump(mode="json")).plan.pp) == (3, 3)
    with pytest.raises(ValueError, match=r"num_ranks=3 is not a multiple of megatron tp \* pp \* cp = 2"):
        load_config(None, [*fast, "trainer.num_ranks=3", "trainer.backend.megatron.tp=2"])
    with pytest.raises(ValueError, match=r"does not split over the 3 data-parallel ranks"):
        load_config(None, [*fast, "trainer.num_ranks=6", "trainer.backend.megatron.tp=2"])
    with pytest.raises(ValueError, match=r"trainer\.backend\.megatron is set but trainer\.backend\.name is fsdp2"):
        load_config(None, ["trainer.backend.megatron.tp=2"])


def test_sglang_engines_are_checked_against_what_they_need() -> None:
    gpus = ["rollout.backend=sglang", "kernel.mode=fast", "rollout.engine_resources={CPU: 8, GPU: 2}"]
    cfg = load_config(None, [*gpus, "rollout.sglang.tp_size=2", "rollout.sglang.deterministic_inference=true"])
    assert (cfg.rollout.backend, cfg.rollout.sglang.tp_size, cfg.rollout.sglang.deterministic_inference) == (
        "sglang",
        2,
        True,
    )
    with pytest.raises(ValueError, match=r"kernel\.mode=deterministic: SGLang's kernels are not the trainer's"):
        load_config(None, ["rollout.backend=sglang", "rollout.engine_resources={CPU: 8, GPU: 1}"])
    with pytest.raises(ValueError, match=r"use run\.cluster=ray"):
        load_config(None, [*gpus, "run.cluster=local"])
    with pytest.raises(ValueError, match=r"run\.sync_transport=http with SGLang engines: .* unpickles"):
        load_config(None, [*gpus, "run.sync_transport=http"])
    apart = [*gpus, "run.colocate=false", "run.sync_transport=distributed"]
    assert load_config(None, apart).run.sync_transport == "distributed"  # an NCCL broadcast to separate GPUs
    with pytest.raises(
        ValueError, match=r"sync_transport=distributed with SGLang engines: run\.colocate=true .* NCCL"
    ):
        load_config(None, [*gpus, "run.colocate=true", "run.sync_transport=distributed"])
    with pytest.raises(
        ValueError, match=r"sync_transport=distributed with SGLang engines: rollout\.sglang\.dp_size=2"
    ):
        load_config(None, [*apart, "rollout.sglang.dp_size=2"])
    with pytest.raises(ValueError, match=r"gives each SGLang engine 2 GPUs and .* = 4 needs as many"):
        load_config(None, [*gpus, "rollout.sglang.tp_size=4"])
    stand_in = load_config(None, ["rollout.backend=sglang", "kernel.mode=fast", "rollout.sglang.launch_command=[x]"])
    assert stand_in.rollout.sglang.launch_command == ["x"]  # a command of the user's own: no GPU check
    with pytest.raises(ValueError, match=r"rollout\.sglang is set but rollout\.backend is embedded"):
        load_config(None, ["rollout.sglang.tp_size=2"])


def test_a_whole_config_validates_without_torch(tmp_path: Path) -> None:
    """The orchestrator's config, and every package config it nests, load in a fresh interpreter with no torch."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from miles_orchestrator.config import load_config, config_help\n"
        "cfg = load_config(None, ['trainer.optimizer.lr=1e-6', 'kernel.dtype=bfloat16'])\n"
        "config_help()\n"
        "import miles_trainer, miles_rollout, miles_kernels\n"  # the packages themselves load lazily
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print(cfg.trainer.optimizer.lr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "1e-06", result.stderr


def test_routing_replay_asks_the_rollout_and_the_engine_for_routed_experts() -> None:
    cfg = load_config(None, ["trainer.routing_replay=rollout", "model.bootstrap_architecture=glm4_moe"])
    assert cfg.rollout.return_routed_experts and cfg.rollout.engine.enable_return_routed_experts
    cfg = load_config(None, ["rollout.return_routed_experts=true"])  # recorded for the metrics, not replayed
    assert cfg.trainer.routing_replay == "off" and cfg.rollout.engine.enable_return_routed_experts
    default = load_config(None, [])
    assert not default.rollout.return_routed_experts and not default.rollout.engine.enable_return_routed_experts
    with pytest.raises(ValueError, match=r"trainer\.routing_replay"):
        load_config(None, ["trainer.routing_replay=always"])
    with pytest.raises(ValueError, match="moe_aux_loss"):
        load_config(None, ["trainer.loss.moe_aux_loss=switch"])


@pytest.mark.parametrize("name", ["moe.yaml", "glm4moe.yaml"])
def test_the_moe_examples_load(name: str) -> None:
    cfg = load_config(Path(__file__).parents[3] / "examples" / name, [])
    assert cfg.model.bootstrap_architecture in ("qwen3_moe", "glm4_moe") and cfg.trainer.routing_replay == "rollout"
    assert cfg.rollout.engine.enable_return_routed_experts and cfg.kernel.mode == "deterministic"


def test_the_megatron_examples_load_with_their_layouts() -> None:
    examples = Path(__file__).parents[3] / "examples"
    dense = load_config(examples / "megatron_dense_tp2.yaml", [])
    backend = dense.trainer.backend
    assert (backend.name, dense.trainer.num_ranks, backend.megatron.tp, dense.kernel.mode) == (
        "megatron",
        2,
        2,
        "deterministic",
    )
    assert backend.megatron.uses_miles_layers(True) and not backend.megatron.exactness_problems()  # true on-policy
    glm = load_config(examples / "glm4moe_megatron.yaml", [])
    layout = glm.trainer.backend.megatron
    assert (glm.trainer.num_ranks, layout.pp, layout.ep, glm.spec.mode) == (4, 2, 2, "online")
    assert glm.trainer.routing_replay == "rollout" and glm.kernel.is_deterministic and not layout.exactness_problems()
    assert read_run(glm.model_dump(mode="json")).plan.trainer_backend == "megatron"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["run.cluster=local", "rollout.num_engines=2"], r"rollout\.num_engines=2 needs run\.cluster=ray"),
        (["run.cluster=local", "run.mode=async", "run.colocate=false"], r"run\.mode=async needs run\.cluster=ray"),
        (["run.mode=one_step_off"], r"run\.mode=one_step_off overlaps rollout and training.*run\.colocate=false"),
        (["run.mode=async", "run.colocate=false", "rollout.pause_mode=in_place"], r"in_place keeps .*retract"),
        (["run.mode=async", "run.colocate=false", "rollout.partial_rollout=false"], r"pause_mode=abort with"),
        (
            ["run.mode=async", "run.colocate=false", "rollout.pause_mode=abort", "trainer.routing_replay=rollout"],
            r"routed experts cover its new tokens only.*pause_mode=retract",
        ),
        (["run.sync_transport=nccl"], r"run\.sync_transport: Input should be 'auto', 'shm', 'disk', 'http' or"),
        (["rollout.router_policy=least_load"], r"rollout\.router_policy: Input should be 'cache_aware'"),
        (["run.max_staleness=-1"], r"run\.max_staleness: Input should be greater than or equal to 0"),
        (["rollout.engine_resources={CPU: -1}"], r"rollout\.engine_resources\.CPU: Input should be greater than or"),
        (["trainer.rank_resources={}"], r"trainer\.rank_resources: Dictionary should have at least 1 item"),
    ],
)
def test_scale_out_settings_that_cannot_work_together_are_refused(overrides: list[str], expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        load_config(None, overrides)


def test_several_engines_spread_requests_unless_told_otherwise() -> None:
    assert load_config(None, ["rollout.num_engines=2"]).rollout.batch_requests is False
    assert load_config(None, ["rollout.num_engines=2", "rollout.batch_requests=true"]).rollout.batch_requests is True
    assert load_config(None, []).rollout.batch_requests is True
    cfg = load_config(None, ["run.mode=async", "run.colocate=false", "rollout.pause_mode=abort"])
    assert (cfg.run.mode, cfg.rollout.pause_mode, cfg.rollout.partial_rollout) == ("async", "abort", True)
    assert cfg.trainer.loss.is_mode == "truncate"  # stale tokens are importance-weighted by default
    overlapped = ["run.mode=one_step_off", "run.colocate=false"]
    assert load_config(None, [*overlapped, "trainer.loss.is_mode=mask"]).trainer.loss.is_mode == "mask"
    assert load_config(None, [*overlapped, "trainer.loss.is_mode=null"]).trainer.loss.is_mode is None
    assert load_config(None, []).trainer.loss.is_mode is None


def test_the_low_precision_settings_reach_the_memory_planner() -> None:
    """rollout.engine.weight_dtype (and its group size) and trainer.qat, as a run resolves them, are what the planner
    reads (miles_memory.read_run): the engine's weight bytes follow the format the run stores."""
    example = Path(__file__).resolve().parents[3] / "examples" / "fp8_qat.yaml"
    run = read_run(load_config(example, []).model_dump(mode="json"))
    assert run.weight_quant is not None and run.weight_quant.format == "fp8_block" and run.qat
    int4 = read_run(load_config(None, ["rollout.engine.weight_dtype=int4_group",
                                       "rollout.engine.weight_group_size=32"]).model_dump(mode="json"))  # fmt: skip
    assert int4.weight_quant is not None and (int4.weight_quant.format, int4.weight_quant.group_size) == (
        "int4_group", 32) and not int4.qat  # fmt: skip
    assert read_run(RunConfig().model_dump(mode="json")).weight_quant is None


def test_a_partial_section_keeps_the_runs_defaults(tmp_path) -> None:
    """A section whose run default is not its class's keeps that default's values for the keys a config leaves out:
    trainer.optimizer (lr 2e-4, not OptimizerConfig's 1e-5), rollout.engine (64 running requests), the critic's
    optimizer (lr 1e-4), from overrides and from a file alike."""
    default = load_config(None, [])
    cfg = load_config(None, ["trainer.optimizer.warmup_steps=3", "rollout.engine.weight_dtype=fp8_block",
                             "trainer.critic.kind=separate", "trainer.critic.optimizer.warmup_steps=1"])  # fmt: skip
    assert (
        (cfg.trainer.optimizer.lr, cfg.trainer.optimizer.warmup_steps)
        == (default.trainer.optimizer.lr, 3)
        == (2e-4, 3)
    )
    assert cfg.rollout.engine.max_running_requests == default.rollout.engine.max_running_requests == 64
    assert (cfg.trainer.critic.optimizer.lr, cfg.trainer.critic.optimizer.warmup_steps) == (1e-4, 1)
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  optimizer:\n    algorithm: muon\n")
    from_file = load_config(path, [])
    assert (from_file.trainer.optimizer.algorithm, from_file.trainer.optimizer.lr) == ("muon", 2e-4)
    assert load_config(None, ["trainer.optimizer.lr=1e-3"]).trainer.optimizer.lr == 1e-3  # what is given wins

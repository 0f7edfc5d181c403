"""Pure-logic tier (no torch, except one check that the config's trainer names match miles-trainer's): the run
config loads from YAML and dotted overrides, rejects mistakes with messages that name the field and the fix, and
renders help and YAML that round-trip."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from miles_orchestrator.config import RunConfig, check_batch_identity, config_help, dump_config, load_config


def leaf_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    names = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names += leaf_fields(annotation, f"{prefix}{name}.")
        else:
            names.append(f"{prefix}{name}")
    return names


def test_defaults_are_valid() -> None:
    cfg = load_config(None, [])
    assert cfg == RunConfig()
    check_batch_identity(cfg)
    assert cfg.model.path is None and cfg.data.source == "builtin" and cfg.reward.name == "task"


def test_yaml_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  lr: 0.001\n  kl_coef: 0.1\nrollout:\n  max_new_tokens: 32\n")
    cfg = load_config(
        path,
        ["trainer.lr=1e-6", "model.path=/models/x", "data.task.operations=[+, '-']", "run.log.tensorboard=true"],
    )
    assert cfg.trainer.lr == 1e-6 and isinstance(cfg.trainer.lr, float)  # override wins over the file
    assert cfg.trainer.kl_coef == 0.1 and cfg.rollout.max_new_tokens == 32  # file values kept
    assert cfg.model.path == "/models/x"
    assert cfg.data.task.operations == ["+", "-"]
    assert cfg.run.log.tensorboard is True
    assert load_config(None, ["model.path=null"]).model.path is None


def test_unknown_override_key_lists_valid_keys() -> None:
    with pytest.raises(ValueError, match=r"unknown key 'trainer\.lrr'") as info:
        load_config(None, ["trainer.lrr=1e-6"])
    message = str(info.value)
    assert "did you mean trainer.lr?" in message
    assert "valid keys of trainer: lr, weight_decay" in message
    with pytest.raises(ValueError, match="valid keys of the top level: model, data"):
        load_config(None, ["trainr.lr=1"])


def test_unknown_yaml_key_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  temprature: 0.7\n")
    with pytest.raises(ValueError, match=r"bad\.yaml.*'rollout\.temprature'.*did you mean rollout\.temperature"):
        load_config(path, [])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.lr=-1", r"trainer\.lr: Input should be greater than 0 \(got -1\)"),
        ("trainer.lr=fast", r"trainer\.lr: Input should be a valid number"),
        ("trainer.lr_schedule=linear", r"trainer\.lr_schedule: Input should be 'constant' or 'cosine'"),
        ("trainer.advantage_estimator=ppo", r"trainer\.advantage_estimator: .*use one of \['grpo'"),
        ("data.source=prompts.csv", r"data\.source: 'prompts\.csv' is neither 'builtin' nor"),
        ("reward.name=accuracy", r"reward\.name: reward\.name='accuracy': use one of"),
        ("rollout.rollout_fn=mymodule", r"rollout\.rollout_fn='mymodule' must be a 'package\.module:function'"),
        ("trainer.dual_clip=0.5", r"trainer: dual_clip=0\.5 must be > 1"),
        ("rollout.temperature=0", r"rollout: .*set rollout\.temperature>0 .*or rollout\.allow_greedy=true"),
    ],
)
def test_invalid_values_name_the_field(override: str, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        load_config(None, [override])


def test_task_knobs_are_checked_by_the_task() -> None:
    assert load_config(None, ["data.task.num_digits=[2, 1]"]).data.task.to_task().operand_digits == (2, 1)
    with pytest.raises(ValueError, match=r"data\.task: num_digits=\(3,\) gives 1 digit counts for num_operands=2"):
        load_config(None, ["data.task.num_digits=[3]"])


def test_greedy_rollout_needs_opt_in() -> None:
    assert load_config(None, ["rollout.temperature=0", "rollout.allow_greedy=true"]).rollout.temperature == 0


def test_malformed_overrides() -> None:
    with pytest.raises(ValueError, match=r"must look like section\.field=value"):
        load_config(None, ["trainer.lr"])
    with pytest.raises(ValueError, match=r"trainer\.lr is a value, not a section"):
        load_config(None, ["trainer.lr.max=1"])
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(None, ["trainer.lr=[1,"])


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
    with pytest.raises(ValueError, match="multiple of num_ranks"):
        load_config(None, ["trainer.num_ranks=3"])


def test_yaml_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_config(path, [])
    with pytest.raises(ValueError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml", [])


def test_dump_round_trips(tmp_path: Path) -> None:
    cfg = load_config(None, ["trainer.lr=3e-5", "data.task.operations=['+', '*']", "run.ray_address=auto"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path, []) == cfg


def test_every_field_is_documented_in_help() -> None:
    text = config_help(RunConfig)
    for dotted in leaf_fields(RunConfig):
        assert f"  {dotted} (" in text, dotted
    assert "  trainer.lr (float, default 0.0002): AdamW learning rate." in text
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


def test_trainer_names_match_miles_trainer() -> None:
    miles_trainer = pytest.importorskip("miles_trainer")
    from miles_orchestrator.config import ADVANTAGE_ESTIMATORS, TrainerSection

    assert set(ADVANTAGE_ESTIMATORS) == set(miles_trainer.ADVANTAGE_ESTIMATORS)
    agg_modes = TrainerSection.model_fields["agg_mode"].annotation.__args__  # type: ignore[union-attr]
    assert set(agg_modes) == set(miles_trainer.AGGREGATION_MODES)

"""Config tier: the derived settings (config/resolve.py: defaults that yield to a value given, owned settings that
refuse a contradiction) and `config show`'s origins."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from miles_orchestrator.config import load_config
from miles_orchestrator.config.resolve import DERIVED
from miles_orchestrator.config.show import show_config


def test_every_derived_setting_names_real_fields() -> None:
    cfg = load_config(None, [])
    for row in DERIVED:
        node: object = cfg
        for part in row.field.split("."):
            assert isinstance(node, BaseModel) and part in type(node).model_fields, row.field
            node = getattr(node, part)
        if row.owned:  # an owned setting's source is one field: the knob the error names
            source: object = cfg
            for part in row.source.split("."):
                assert isinstance(source, BaseModel) and part in type(source).model_fields, row.source
                source = getattr(source, part)


def test_derived_defaults_yield_to_a_value_given_and_owned_ones_refuse_a_contradiction() -> None:
    cfg = load_config(None, ["run.num_steps=30", "trainer.steps_per_rollout=2", "trainer.global_batch_size=128"])
    assert cfg.trainer.optimizer.total_steps == 60 and cfg.spec.optimizer.total_steps == 60
    assert "trainer.optimizer.total_steps" in cfg.derived and "trainer.loss.temperature" in cfg.derived
    given = load_config(None, ["trainer.optimizer.total_steps=500", "trainer.loss.max_response_len=4"])
    assert given.trainer.optimizer.total_steps == 500 and given.trainer.loss.max_response_len == 4
    assert "trainer.optimizer.total_steps" not in given.derived
    with pytest.raises(
        ValueError, match=r"return_routed_experts=False disagrees with trainer\.routing_replay=rollout"
    ):
        load_config(None, ["trainer.routing_replay=rollout", "model.bootstrap_architecture=glm4_moe",
                           "rollout.return_routed_experts=false"])  # fmt: skip
    with pytest.raises(
        ValueError, match=r"drop rollout\.engine\.enable_return_routed_experts and set rollout\.return"
    ):
        load_config(None, ["rollout.engine.enable_return_routed_experts=true"])
    megatron = ["trainer.backend.name=megatron", "trainer.backend.device=cuda", "kernel.mode=fast",
                "trainer.rank_resources={CPU: 1, GPU: 1}"]  # fmt: skip
    assert load_config(None, megatron).memory.plan.distributed_optimizer is False  # AdamW replicated over DP
    given = load_config(None, [*megatron, "memory.plan.distributed_optimizer=true"])
    assert given.memory.plan.distributed_optimizer and "memory.plan.distributed_optimizer" not in given.derived


def test_config_show_says_where_each_value_came_from(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("rollout:\n  temperature: 0.8\nrun:\n  num_steps: 7\n")
    shown = show_config(path, ["trainer.optimizer.lr=2e-6"])
    lines = {line.strip().split(":")[0]: line for line in shown.splitlines() if "#" in line and ":" in line}
    assert lines["temperature"].count("#") == 1
    assert f"num_steps: 7  # from {path}" in shown and "lr: 2.0e-06  # from the command line" in shown
    assert "temperature: 0.8  # from rollout.temperature: the log-prob contract" in shown
    assert "total_steps: 7  # from run.num_steps x trainer.steps_per_rollout" in shown
    assert "seed: 0\n" in shown  # a default carries no comment
    again = tmp_path / "shown.yaml"
    again.write_text(shown)
    assert load_config(again, []).model_dump() == load_config(path, ["trainer.optimizer.lr=2e-6"]).model_dump()

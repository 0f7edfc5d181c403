"""The run config's `spec` section: it turns the engine's draft on (MTP or EAGLE-3, chain or tree) and refuses what
cannot run, with the setting to change named."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_orchestrator.config import load_config


def test_the_spec_section_turns_the_engines_draft_on_and_refuses_what_cannot_run() -> None:
    assert load_config(None, ["spec.mode=online"]).rollout.engine.speculative_algorithm == "NEXTN"  # built-in policy
    assert load_config(None, ["spec.mode=off"]).spec.mode == "off"  # YAML's bare off is false
    with pytest.raises(
        ValueError, match=r"speculative_algorithm=NEXTN disagrees with spec\.mode=off.*set spec\.mode instead"
    ):
        load_config(None, ["model.path=/m", "rollout.engine.speculative_algorithm=NEXTN"])
    cfg = load_config(None, ["spec.mode=online", "model.path=/models/with-mtp", "spec.mtp_loss_coef=0.3"])
    assert cfg.spec.mode == "online" and cfg.spec.optimizer.lr == 1e-4 and cfg.spec.mtp_loss_coef == 0.3
    engine = cfg.rollout.engine  # spec.mode turns the engine's speculative decoding on, SGLang's NEXTN
    assert (engine.speculative_algorithm, engine.num_draft_steps, engine.max_running_requests) == ("NEXTN", 3, 64)
    cfg = load_config(None, ["spec.mode=frozen", "model.path=/m", "spec.num_steps=2"])
    assert cfg.rollout.engine.num_draft_steps == 2
    # spec owns the speculative settings: the engine's may repeat them, not contradict them
    cfg = load_config(None, ["spec.mode=frozen", "model.path=/m", "rollout.engine.speculative_algorithm=EAGLE",
                             "spec.num_steps=5", "rollout.engine.speculative_num_steps=5"])  # fmt: skip
    assert cfg.rollout.engine.speculative_algorithm == "EAGLE" and cfg.rollout.engine.num_draft_steps == 5
    with pytest.raises(
        ValueError, match=r"speculative_num_steps=5 disagrees with spec\.num_steps=3.*set spec\.num_steps"
    ):
        load_config(None, ["spec.mode=frozen", "model.path=/m", "rollout.engine.speculative_algorithm=NEXTN",
                           "rollout.engine.speculative_num_steps=5"])  # fmt: skip


def test_an_eagle3_draft_sets_the_engines_eagle3_flags_and_is_refused_where_it_cannot_run() -> None:
    cfg = load_config(None, ["spec.mode=online", "spec.draft=eagle3", "model.path=/m", "run.run_dir=/runs/x"])
    engine = cfg.rollout.engine
    assert (engine.speculative_algorithm, engine.speculative_draft_model_path) == ("EAGLE3", "/runs/x/eagle3_draft")
    assert cfg.spec.eagle3_steps == 3 and "rollout.engine.speculative_draft_model_path" in cfg.derived
    cfg = load_config(None, ["spec.mode=frozen", "spec.draft=eagle3", "spec.draft_path=/drafts/d", "model.path=/m",
                             "spec.num_steps=4", "spec.eagle_topk=2"])  # fmt: skip
    engine = cfg.rollout.engine
    assert (engine.speculative_draft_model_path, engine.num_draft_tokens, engine.speculative_eagle_topk) == (
        "/drafts/d", 9, 2)  # fmt: skip
    with pytest.raises(
        ValueError, match=r"spec\.mode=frozen drafts with the EAGLE-3 draft as loaded: set spec\.draft_path"
    ):
        load_config(None, ["spec.mode=frozen", "spec.draft=eagle3", "model.path=/m"])
    with pytest.raises(ValueError, match=r"spec\.draft_path is the EAGLE-3 draft's: set spec\.draft=eagle3"):
        load_config(None, ["spec.mode=frozen", "spec.draft_path=/d", "model.path=/m"])
    with pytest.raises(ValueError, match=r"speculative_draft_model_path=/other disagrees with spec\.draft_path=/d"):
        load_config(None, ["spec.mode=frozen", "spec.draft=eagle3", "spec.draft_path=/d", "model.path=/m",
                           "rollout.engine.speculative_algorithm=EAGLE3",
                           "rollout.engine.speculative_draft_model_path=/other"])  # fmt: skip
    with pytest.raises(ValueError, match=r"megatron does not support spec\.draft=eagle3"):
        load_config(None, ["spec.mode=online", "spec.draft=eagle3", "model.path=/m", "trainer.backend.name=megatron"])
    sglang = [
        "rollout.backend=sglang",
        "kernel.mode=fast",
        "run.cluster=ray",
        "rollout.engine_resources={CPU: 8, GPU: 1}",
    ]
    with pytest.raises(ValueError, match=r"spec\.mode=online spec\.draft=eagle3 with rollout\.backend=sglang"):
        load_config(None, [*sglang, "spec.mode=online", "spec.draft=eagle3", "model.path=/m"])
    with pytest.raises(
        ValueError, match=r"spec\.num_draft_tokens=30: a tree of 3 levels with spec\.eagle_topk=3 has at most 22"
    ):
        load_config(None, ["spec.mode=online", "spec.eagle_topk=3", "spec.num_draft_tokens=30"])
    with pytest.raises(ValueError, match=r"speculative_eagle_topk=2 disagrees with spec\.eagle_topk=1"):
        load_config(None, ["spec.mode=online", "model.path=/m", "rollout.engine.speculative_algorithm=NEXTN",
                           "rollout.engine.speculative_eagle_topk=2"])  # fmt: skip
    frozen = load_config(
        None, [*sglang, "spec.mode=frozen", "spec.draft=eagle3", "spec.draft_path=/d", "model.path=/m"]
    )
    assert frozen.rollout.engine.speculative_draft_model_path == "/d"


def test_a_draft_that_does_not_fit_the_model_is_refused_before_the_run(tmp_path: Path) -> None:
    from miles_kernels import new_eagle3, save_eagle3
    from miles_kernels.testing import save_random_model, tiny_config
    from miles_orchestrator.preflight import ModelRefused, check_model

    save_random_model(tmp_path / "model", tiny_config("dense", num_hidden_layers=4), seed=0)
    save_eagle3(new_eagle3(tiny_config("dense", num_hidden_layers=4, vocab_size=512)), tmp_path / "draft")
    cfg = load_config(None, ["spec.mode=frozen", "spec.draft=eagle3", f"spec.draft_path={tmp_path / 'draft'}",
                             f"model.path={tmp_path / 'model'}"])  # fmt: skip
    with pytest.raises(ModelRefused, match=r"spec\.draft_path=.*vocab_size 512 differs from the target's 256"):
        check_model(cfg, str(tmp_path / "model"))

"""Loop helpers that need no cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_orchestrator.steps import batch_keys


def test_trainer_reward_stats_do_not_overwrite_the_rollouts() -> None:
    rollout = {"reward_mean": 0.25, "pass_rate": 0.25}
    trained = batch_keys({"reward_mean": 0.5, "reward_max": 1.0, "advantage_mean": 0.0, "loss": 0.1})
    assert rollout | trained == {
        "reward_mean": 0.25, "pass_rate": 0.25, "batch_reward_mean": 0.5, "batch_reward_max": 1.0,
        "advantage_mean": 0.0, "loss": 0.1,
    }  # fmt: skip


def test_pinned_actors_get_cores_of_their_own(monkeypatch) -> None:
    import os

    from miles_orchestrator.cluster.ray.cluster import cpu_sets
    from miles_orchestrator.config import load_config

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4}, raising=False)
    cfg = load_config(None, ["run.pin_cpus=true", "rollout.num_engines=2", "run.colocate=false"])
    assert cpu_sets(cfg, threads=1) == [[0], [1], [2]]  # rank 0, then engines 0 and 1
    assert cpu_sets(cfg, threads=4) == [[0], [1], [2]]  # five cores: one each, not four
    cfg = load_config(None, ["run.pin_cpus=true"])
    assert cpu_sets(cfg, threads=2) == [[0, 1], [2, 3]]
    cfg = load_config(None, ["run.pin_cpus=true", "rollout.num_engines=5", "trainer.num_ranks=2"])
    with pytest.raises(ValueError, match=r"each of 7 actors .* only 5 are available"):
        cpu_sets(cfg, threads=1)


def test_the_fleet_checks_that_its_engines_agree() -> None:
    import asyncio

    from miles_orchestrator.cluster.ray.fleet import EngineFleet

    class FakeEngine:
        def __init__(self, checksum: str, fingerprint: str, kv: int) -> None:
            self.checksum, self.fingerprint, self.kv = checksum, fingerprint, kv

        async def weights_checksum(self) -> str:
            return self.checksum

        async def get_server_info(self) -> dict[str, object]:
            return {"kernel_config": {"fingerprint": self.fingerprint}, "memory_bytes": {"kv_cache": self.kv}}

    same = EngineFleet([FakeEngine("a" * 64, "f", 3), FakeEngine("a" * 64, "f", 4)], None)  # type: ignore[list-item,arg-type]
    assert asyncio.run(same.weights_checksum()) == "a" * 64
    assert asyncio.run(same.get_server_info())["memory_bytes"] == {"kv_cache": 7}  # the room all engines take
    other = EngineFleet([FakeEngine("a" * 64, "f", 1), FakeEngine("b" * 64, "g", 1)], None)  # type: ignore[list-item,arg-type]
    with pytest.raises(RuntimeError, match=r"engines \[1\] hold \['bbbb"):
        asyncio.run(other.weights_checksum())
    with pytest.raises(RuntimeError, match="different kernel configs"):
        asyncio.run(other.get_server_info())


def test_the_on_policy_guard_compares_kernels_device_kind_and_weights() -> None:
    """`check_on_policy` after the version-0 sync: a deterministic run refuses an engine whose kernel fingerprint
    differs from the trainer's (here: the same config on a CUDA engine) or whose weights differ; equal ones pass."""
    import asyncio

    from miles_kernels import KernelConfig, describe_kernel, kernel_fingerprint
    from miles_orchestrator import preflight
    from miles_orchestrator.config import RunConfig

    kernel = KernelConfig()

    class FakeEngine:
        def __init__(self, described: dict[str, object], checksum: str = "a" * 64) -> None:
            self.described, self.checksum = described, checksum

        async def get_server_info(self) -> dict[str, object]:
            return {"kernel_config": self.described}

        async def weights_checksum(self) -> str:
            return self.checksum

    class FakeCluster:
        trainer_fingerprint = kernel_fingerprint(kernel)
        sync_method = "a fake"

        def __init__(self, engine: FakeEngine) -> None:
            self.engine = engine
            self.synced: list[int] = []

        async def sync_weights(self, version: int, bucket_bytes: int) -> dict[str, int]:
            self.synced.append(version)
            return {"num_bytes": 0}

        async def trainer_checksum(self) -> str:
            return "a" * 64

    cfg, logs = RunConfig(), []

    def guard(cluster: FakeCluster) -> None:
        asyncio.run(preflight.check_on_policy(cfg, cluster, version=0, log=logs.append))  # type: ignore[arg-type]

    with pytest.raises(RuntimeError, match=r"true on-policy refused.*same kind of device"):
        guard(FakeCluster(FakeEngine(describe_kernel(kernel, "cuda"))))
    with pytest.raises(RuntimeError, match="weight sync check failed"):
        guard(FakeCluster(FakeEngine(describe_kernel(kernel), checksum="b" * 64)))
    cluster = FakeCluster(FakeEngine(describe_kernel(kernel)))
    guard(cluster)
    assert cluster.synced == [0] and logs and "verified" in logs[-1] and kernel_fingerprint(kernel) in logs[-1]


def test_colocated_turns_switch_once_each_way() -> None:
    """The engine's memory is resumed once per trainer turn (by the weight sync when there is one), never twice."""
    import asyncio

    from miles_orchestrator.turns import Turns

    calls: list[str] = []

    class Engine:
        async def release_memory_occupation(self) -> None:
            calls.append("release")

        async def resume_memory_occupation(self) -> None:
            calls.append("resume")

    class Cluster:
        engine = Engine()

        async def offload_trainer(self, room_for: int | None = None) -> int:
            calls.append("offload")
            return 0

        async def onload_trainer(self) -> None:
            calls.append("onload")

    async def step(turns: Turns, with_sync: bool) -> None:
        async with turns.trainer_turn():
            calls.append("train")
            if with_sync:
                await turns.resume_engine()
                calls.append("sync")

    turns = Turns(Cluster(), is_colocated=True)  # type: ignore[arg-type]
    asyncio.run(turns.engine_turn())
    asyncio.run(step(turns, with_sync=True))
    asyncio.run(step(turns, with_sync=False))  # e.g. the data ran out: no sync, the exit resumes the engine
    assert calls == ["offload", "release", "onload", "train", "resume", "sync", "offload",
                     "release", "onload", "train", "resume", "offload"]  # fmt: skip
    calls.clear()
    separate = Turns(Cluster(), is_colocated=False)  # type: ignore[arg-type]
    asyncio.run(separate.engine_turn())
    asyncio.run(step(separate, with_sync=True))
    assert calls == ["train", "sync"]


def test_advantages_follow_the_loss_masks() -> None:
    """A multi-turn sample's tool output (loss mask 0) gets no advantage and does not join REINFORCE++'s
    whitening; GAE's outcome reward sits on the last trained token."""
    from miles_contracts import Sample
    from miles_orchestrator.config import load_config
    from miles_orchestrator.steps import gae_targets, group_advantages

    def sample(i: int, mask: list[int], reward: float) -> Sample:
        tokens = list(range(len(mask)))
        return Sample(index=i, group_index=i // 2, prompt="", prompt_tokens=[1, 2], response_tokens=tokens,
                      loss_mask=mask, reward=reward)  # fmt: skip

    batch = [sample(0, [1, 1, 0, 0, 0, 1], 1.0), sample(1, [1, 1, 1], 0.0), sample(2, [1, 0, 1, 0], 1.0),
             sample(3, [1, 1], 0.0)]  # fmt: skip
    cfg = load_config(None, ["trainer.advantage_estimator=reinforce_plus_plus", "trainer.global_batch_size=16",
                             "rollout.num_prompts_per_step=2", "rollout.n_samples_per_prompt=8"])  # fmt: skip
    advantages = group_advantages(cfg, batch)
    trained = [a for s, adv in zip(batch, advantages, strict=True) for a, m in zip(adv, s.loss_mask, strict=True) if m]
    untrained = [a for s, adv in zip(batch, advantages, strict=True) for a, m in zip(adv, s.loss_mask, strict=True)
                 if not m]  # fmt: skip
    assert all(a == 0.0 for a in untrained)
    assert sum(trained) / len(trained) == pytest.approx(0.0, abs=1e-6)  # whitened over trained tokens only
    gae_cfg = load_config(None, ["trainer.advantage_estimator=gae", "trainer.advantage.whiten=false",
                                 "trainer.global_batch_size=16", "rollout.num_prompts_per_step=2",
                                 "rollout.n_samples_per_prompt=8"])  # fmt: skip
    values = [[0.0] * len(s.response_tokens) for s in batch]
    advantages, targets, metrics = gae_targets(gae_cfg, batch, values)
    assert advantages[2] == [1.0, 0.0, 1.0, 0.0]  # the reward on token 2, the last trained one; gamma = lam = 1
    assert targets.returns[0] == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0] and targets.old_values is values
    assert metrics["critic_value_mean"] == 0.0


def test_recording_routing_needs_an_moe_policy(tmp_path) -> None:
    from miles_kernels.testing import save_random_model, tiny_config
    from miles_orchestrator.config import load_config
    from miles_orchestrator.preflight import check_model

    dense = save_random_model(tmp_path / "dense", tiny_config("dense"))
    with pytest.raises(ValueError, match=r"trainer.routing_replay=rollout records MoE routing.*dense qwen3 model"):
        check_model(load_config(None, ["trainer.routing_replay=rollout"]), str(dense))
    check_model(
        load_config(None, ["trainer.routing_replay=rollout"]),
        str(save_random_model(tmp_path / "moe", tiny_config("moe"))),
    )


def test_a_deterministic_megatron_run_of_an_mla_policy_is_refused_at_start_up(tmp_path) -> None:
    """The Miles layers (Megatron in deterministic mode) have no MLA yet: said before any process starts, with the
    two ways out; fast mode (megatron-core's MLA) and the FSDP2 backend pass; LoRA on Megatron's MLA is refused."""
    from miles_kernels.testing import save_random_model, tiny_config
    from miles_orchestrator.config import load_config
    from miles_orchestrator.preflight import check_model

    deepseek = str(save_random_model(tmp_path / "deepseek", tiny_config("deepseek")))
    megatron = ["trainer.backend.name=megatron"]
    with pytest.raises(ValueError, match=r"trainer.backend.megatron: the Miles layers have no MLA yet.*fsdp2.*fast"):
        check_model(load_config(None, megatron), deepseek)
    check_model(load_config(None, [*megatron, "kernel.mode=fast"]), deepseek)
    with pytest.raises(ValueError, match=r"trainer.lora on the Megatron backend does not cover MLA.*fsdp2"):
        check_model(load_config(None, [*megatron, "kernel.mode=fast", "trainer.lora.rank=8"]), deepseek)
    check_model(load_config(None, []), deepseek)
    check_model(load_config(None, megatron), str(save_random_model(tmp_path / "glm", tiny_config("glm"))))


def test_lora_targets_are_checked_against_the_model_and_its_settings_against_the_run(tmp_path) -> None:
    """trainer.lora: targets that name no layer of the policy are refused at start-up with the layers it has; the
    engine's adapters follow trainer.lora (one knob); the Megatron backend takes it at tp = 1 and refuses tp > 1 by
    name, SGLang engines refuse LoRA by name."""
    from miles_kernels.testing import save_random_model, tiny_config
    from miles_orchestrator.config import load_config
    from miles_orchestrator.preflight import ModelRefused, check_model

    moe = str(save_random_model(tmp_path / "moe", tiny_config("moe")))
    lora = ["trainer.lora.rank=8"]
    check_model(load_config(None, [*lora, "trainer.lora.target_modules=[q_proj, experts.0.up_proj]"]), moe)
    with pytest.raises(ModelRefused, match=r"trainer.lora target_modules \['wq'\] match no linear layer.*'q_proj'"):
        check_model(load_config(None, [*lora, "trainer.lora.target_modules=[wq]"]), moe)
    cfg = load_config(None, [*lora, "trainer.lora.alpha=16", "trainer.lora.base_dtype=float32"])
    assert cfg.rollout.engine.policy_lora == cfg.trainer.lora.adapters()
    assert cfg.rollout.engine.policy_lora.rank == 8 and cfg.rollout.engine.policy_lora.alpha == 16
    with pytest.raises(ValueError, match=r"rollout.engine.policy_lora=.* disagrees with trainer.lora"):
        load_config(None, [*lora, "rollout.engine.policy_lora.rank=4"])
    megatron = [*lora, "trainer.backend.name=megatron", "kernel.mode=fast"]
    check_model(load_config(None, megatron), moe)  # tp = 1: LoRA runs on the Megatron backend
    with pytest.raises(
        ValueError,
        match=r"megatron does not support trainer.lora \(LoRA adapters\) with trainer"
        r"\.backend\.megatron\.tp > 1",
    ):
        load_config(None, [*megatron, "trainer.backend.megatron.tp=2", "trainer.num_ranks=2"])
    with pytest.raises(ValueError, match=r"trainer.lora with rollout.backend=sglang is not supported yet"):
        load_config(None, [*lora, "rollout.backend=sglang", "kernel.mode=fast"])


def glm45_saved_by_transformers(directory):
    """A tiny GLM-4.5 as Hugging Face tooling writes it: config.json declares one MTP layer, no tensor of it."""
    from miles_kernels.testing import build_tokenizer, save_transformers_model, tiny_config

    tokenizer = build_tokenizer(vocab_size=300)
    config = tiny_config("glm", vocab_size=len(tokenizer), num_nextn_predict_layers=1)
    return save_transformers_model(directory, config, seed=4, tokenizer=tokenizer)


def test_a_checkpoint_saved_by_transformers_drafts_online_with_fresh_mtp_modules_and_never_frozen(
    tmp_path, caplog
) -> None:
    """spec.mode=off runs its trunk (the driver logs, once, that the MTP modules are left out); online gets fresh
    MTP modules in the run directory (said once in the run log, found again on resume); frozen is refused with the
    fixes, since an untrained draft is useless frozen."""
    import logging

    from miles_kernels import num_absent_mtp_layers, read_model_config
    from miles_orchestrator.config import load_config
    from miles_orchestrator.preflight import check_model, with_fresh_draft
    from miles_orchestrator.run_dir import RunDir

    source = str(glm45_saved_by_transformers(tmp_path / "hf"))
    run = RunDir(tmp_path / "run", quiet=True)
    off = load_config(None, [])
    check_model(off, source)
    with caplog.at_level(logging.WARNING, logger="miles_kernels"):
        assert with_fresh_draft(off, source, run) == source
        assert with_fresh_draft(off, source, run) == source
    (warning,) = [r.getMessage() for r in caplog.records if r.name.startswith("miles_kernels")]
    assert source in warning and "declares 1 MTP layer" in warning and "no speculative-decoding draft" in warning
    with pytest.raises(ValueError, match=r"spec.mode=frozen.*declares 1.*spec.mode=online.*miles-spec train"):
        check_model(load_config(None, ["spec.mode=frozen"]), source)
    online = load_config(None, ["spec.mode=online"])
    check_model(online, source)
    model_dir = with_fresh_draft(online, source, run)
    assert model_dir == str(tmp_path / "run" / "model_with_draft")
    assert read_model_config(model_dir).num_nextn_predict_layers == 1 and num_absent_mtp_layers(model_dir) == 0
    check_model(online, model_dir)
    assert with_fresh_draft(online, source, run) == model_dir  # a resumed run: the same directory, not rebuilt
    assert with_fresh_draft(online, model_dir, run) == model_dir
    lines = [line for line in (tmp_path / "run" / "run.log").read_text().splitlines() if "fresh" in line]
    assert len(lines) == 1 and source in lines[0] and "declares 1 MTP module" in lines[0]


def test_a_low_precision_engine_is_true_on_policy_only_with_qat_and_the_guard_says_so() -> None:
    """rollout.engine.weight_dtype with trainer.qat is true on-policy: the engine's fingerprint carries its weight
    format and the trainer's the one it fake-quantizes to, so a QAT trainer facing a kernel-dtype engine (or another
    format) is refused. Without QAT the run is off-policy: the trainer recomputes old log-probs, the fingerprints may
    differ, the synced weights are still verified. Combinations that cannot run are refused by name at load."""
    import asyncio

    from miles_kernels import KernelConfig, describe_kernel, kernel_fingerprint
    from miles_kernels.config import WeightQuantConfig
    from miles_orchestrator import preflight
    from miles_orchestrator.cluster.settings import trainer_settings
    from miles_orchestrator.config import RunConfig, load_config

    fp8 = WeightQuantConfig(format="fp8_block")
    qat = load_config(None, ["rollout.engine.weight_dtype=fp8_block", "trainer.qat=true"])
    off = load_config(None, ["rollout.engine.weight_dtype=fp8_block"])
    assert qat.is_true_on_policy and not off.is_true_on_policy and RunConfig().is_true_on_policy
    assert not load_config(None, ["kernel.mode=fast"]).is_true_on_policy
    settings = trainer_settings(qat, Path("/tmp/run"))
    assert (
        settings.weight_quant == fp8 and settings.qat and trainer_settings(RunConfig(), Path(".")).weight_quant is None
    )
    assert kernel_fingerprint(KernelConfig(), "cpu", fp8) != kernel_fingerprint(KernelConfig())
    assert kernel_fingerprint(KernelConfig(), "cpu", WeightQuantConfig()) == kernel_fingerprint(KernelConfig())

    class Engine:
        async def get_server_info(self) -> dict[str, object]:
            return {"kernel_config": describe_kernel(KernelConfig(), "cpu", fp8)}

        async def weights_checksum(self) -> str:
            return "a" * 64

    class Cluster:
        engine, sync_method = Engine(), "a fake"

        def __init__(self, trainer_weights: WeightQuantConfig | None) -> None:
            self.trainer_fingerprint = kernel_fingerprint(KernelConfig(), "cpu", trainer_weights)

        async def sync_weights(self, version: int, bucket_bytes: int) -> dict[str, int]:
            return {"num_bytes": 0}

        async def trainer_checksum(self) -> str:
            return "a" * 64

    def guard(cfg: RunConfig, cluster: Cluster) -> None:
        asyncio.run(preflight.check_on_policy(cfg, cluster, version=0, log=lambda line: None))  # type: ignore[arg-type]

    guard(qat, Cluster(fp8))
    with pytest.raises(RuntimeError, match=r"true on-policy refused.*rollout.engine.weight_dtype with trainer.qat"):
        guard(qat, Cluster(None))
    guard(off, Cluster(None))  # the off-policy recipe: the trainer recomputes, the mismatch is measured
    with pytest.raises(ValueError, match=r"trainer\.qat=true .* rollout\.engine\.weight_dtype is kernel"):
        load_config(None, ["trainer.qat=true"])
    refused = {
        "trainer.lora.rank=8": r"does not support trainer.lora",
        "trainer.backend.name=megatron": r"does not support trainer.backend.name=megatron",
    }
    for override, message in refused.items():
        with pytest.raises(ValueError, match=rf"rollout.engine.weight_dtype=int4_group {message}"):
            load_config(None, ["rollout.engine.weight_dtype=int4_group", "kernel.mode=fast", override])
    with pytest.raises(ValueError, match=r"weight_group_size=12|multiple of 8"):
        load_config(None, ["rollout.engine.weight_dtype=int4_group", "rollout.engine.weight_group_size=12"])


def test_a_weight_format_the_policy_cannot_take_is_refused_at_start_up(tmp_path) -> None:
    """rollout.engine.weight_dtype: a layer whose input size the INT4 group does not divide is named at start-up,
    with a group size every layer takes (exit 2: a config error), before any actor starts."""
    from miles_kernels.testing import save_random_model, tiny_config
    from miles_orchestrator.config import load_config
    from miles_orchestrator.preflight import ModelRefused, check_model

    deepseek = str(save_random_model(tmp_path / "deepseek", tiny_config("deepseek")))
    int4 = ["rollout.engine.weight_dtype=int4_group"]
    check_model(load_config(None, [*int4, "rollout.engine.weight_group_size=8"]), deepseek)
    with pytest.raises(ModelRefused, match=r"weight_dtype=int4_group: .*q_b_proj.*\(group_size=8 fits every layer\)"):
        check_model(load_config(None, [*int4, "rollout.engine.weight_group_size=16"]), deepseek)

"""Start-up checks: every plug-in the config names imports and fits, the model has what the run asks of it
(MTP modules for drafting, MoE layers for routing replay; `with_fresh_draft` adds fresh MTP modules to a checkpoint
that declares them without tensors), and, once the cluster is up, the engine holds the trainer's weights and runs
its kernels (`check_on_policy`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from miles_kernels import (
    CausalLM,
    check_format,
    is_eagle3_dir,
    new_eagle3,
    num_absent_mtp_layers,
    read_eagle3_config,
    read_model_config,
    save_eagle3,
    target_names,
)
from miles_orchestrator.cluster import Cluster
from miles_orchestrator.config import RunConfig
from miles_orchestrator.data.sources import check_data_source
from miles_orchestrator.reward.pool import check_reward
from miles_orchestrator.rollout.env_pool import resolve_env
from miles_orchestrator.rollout.filters import build_filters
from miles_orchestrator.rollout.single_turn import resolve_rollout_fn
from miles_orchestrator.run_dir import RunDir
from miles_spec import add_mtp_modules
from miles_trainer import check_megatron_lora, load_advantage_estimator, resolve_loss_fn


def check_plugins(cfg: RunConfig) -> None:
    """Import and check every plug-in the config names (data source, reward, rollout function, filters, loss,
    advantage; the http reward's server), so a wrong path or signature fails at start-up with the field named."""
    env = cfg.rollout.agent.env
    checks: list[tuple[str, str | None, Callable[[], object]]] = [
        ("data.source", cfg.data.source, lambda: check_data_source(cfg.data)),
        ("reward.name", cfg.reward.name, lambda: check_reward(cfg.reward)),
        ("rollout.rollout_fn", cfg.rollout.rollout_fn, lambda: resolve_rollout_fn(cfg.rollout.rollout_fn)),
        ("rollout.agent.env", env, lambda: env is not None and resolve_env(env)),
        ("filter.custom", cfg.filter.custom, lambda: build_filters(cfg.filter)),
        ("trainer.loss.loss_fn", cfg.trainer.loss.loss_fn, lambda: resolve_loss_fn(cfg.trainer.loss.loss_fn)),
        ("trainer.advantage_estimator", cfg.trainer.advantage_estimator, lambda: _check_estimator(cfg)),
    ]
    for field, value, check in checks:
        try:
            check()
        except (ValueError, TypeError) as error:
            raise ValueError(f"{field}={value!r}: {error}") from error


class ModelRefused(ValueError):
    """The run asks of its model what the model's architecture lacks (a config error: exit 2)."""


def check_model(cfg: RunConfig, model_dir: str) -> None:
    """What the run asks of the model's architecture: MTP modules when the engine drafts with them (spec.mode
    frozen or online; online accepts a checkpoint whose config.json declares MTP modules it holds no tensor of,
    which `with_fresh_draft` completes); MoE layers when the run records or replays routing; a Megatron layout that
    builds its attention (the Miles layers have no MLA yet); LoRA targets that name its layers; a low-precision
    weight format its layers' shapes take. (Other runs read the model only when they load it.)"""
    megatron = cfg.trainer.backend.megatron if cfg.trainer.backend.name == "megatron" else None
    lora, weights = cfg.trainer.lora, cfg.rollout.engine.weight_quant()
    if not (cfg.spec.drafts or cfg.rollout.return_routed_experts or megatron is not None or lora.is_enabled
            or weights.is_enabled):  # fmt: skip
        return
    model = read_model_config(model_dir)
    if weights.is_enabled:
        with torch.device("meta"):
            try:
                check_format(CausalLM(model), weights)
            except ValueError as error:  # a layer the format cannot take, named, with a group size that fits
                raise ModelRefused(f"rollout.engine.weight_dtype={weights.format}: {error}") from error
    if lora.is_enabled:
        with torch.device("meta"):  # the layer names only: no weight is made
            try:
                target_names(CausalLM(model), lora.adapters())
            except ValueError as error:  # a target that matches no layer, named with the layers there are
                raise ModelRefused(f"trainer.{error}") from error
    if megatron is not None:
        problem = megatron.model_problem(model.model_type, model.is_mla, cfg.kernel.is_deterministic)
        if problem:
            raise ModelRefused(f"trainer.backend.megatron: {problem}")
        if lora.is_enabled:
            try:
                check_megatron_lora(lora, megatron, model)
            except ValueError as error:  # MLA's permuted projections (tp > 1 is refused with the config)
                raise ModelRefused(str(error)) from error
    if cfg.rollout.return_routed_experts and not model.is_moe:
        setting = (
            "trainer.routing_replay=rollout"
            if cfg.trainer.routing_replay == "rollout"
            else "rollout.return_routed_experts=true"
        )
        raise ModelRefused(
            f"{setting} records MoE routing, but {model_dir} is a dense {model.model_type} model; drop the setting, "
            "or use an MoE policy (e.g. model.bootstrap_architecture=qwen3_moe)"
        )
    if cfg.spec.drafts and cfg.spec.draft == "eagle3":
        path = cfg.rollout.engine.speculative_draft_model_path
        if cfg.spec.draft_path is not None and path is not None:
            try:  # the draft must read this model's features and vocabulary (its config says; no tensor is read)
                read_eagle3_config(path, model)
            except (ValueError, FileNotFoundError) as error:
                raise ModelRefused(f"spec.draft_path={path}: {error}") from error
        return
    if not cfg.spec.drafts or model.num_nextn_predict_layers:
        return
    absent = num_absent_mtp_layers(model_dir)
    if absent and cfg.spec.mode == "online":
        return  # the run starts them fresh (with_fresh_draft)
    if absent:
        raise ModelRefused(
            f"spec.mode=frozen drafts with the policy's MTP modules as loaded, but {model_dir} holds none: its "
            f"config.json declares {absent} (num_nextn_predict_layers) and the checkpoint has no tensor of them "
            "(transformers' save_pretrained does not write them), and an untrained draft left frozen would reject "
            "nearly every token; use spec.mode=online (fresh MTP modules, trained on the rollouts), train a draft "
            f"first (miles-spec train --model {model_dir} --data ROWS.jsonl --out DIR, then model.path=DIR), or "
            "spec.mode=off"
        )
    raise ModelRefused(
        f"spec.mode={cfg.spec.mode} drafts with the policy's MTP modules, but {model_dir} has none "
        "(num_nextn_predict_layers = 0 in its config.json); use a checkpoint with MTP layers (miles-spec train "
        "--num-mtp-layers 1 adds one), or spec.mode=off"
    )


FRESH_DRAFT_DIR = "model_with_draft"  # in the run directory


def with_fresh_eagle3(cfg: RunConfig, model_dir: str, run: RunDir) -> None:
    """spec.mode=online spec.draft=eagle3 without spec.draft_path: a new EAGLE-3 draft for the model, over its whole
    vocabulary, initialized from `run.seed`, in RUN_DIR/eagle3_draft (where the engine and the trainer load it; a
    resumed run finds it there, and its checkpoint holds the trained draft)."""
    path = cfg.rollout.engine.speculative_draft_model_path
    if not (cfg.spec.drafts and cfg.spec.draft == "eagle3" and cfg.spec.draft_path is None) or path is None:
        return
    if is_eagle3_dir(path):
        return
    draft = new_eagle3(read_model_config(model_dir), seed=cfg.run.seed)
    save_eagle3(draft, path)
    run.log(f"spec.draft=eagle3: a fresh EAGLE-3 draft for {model_dir} in {path} (feature layers "
            f"{list(draft.config.aux_layers)}, the whole vocabulary), trained from scratch on the "
            "rollouts")  # fmt: skip


def with_fresh_draft(cfg: RunConfig, model_dir: str, run: RunDir) -> str:
    """The checkpoint the run loads. For spec.mode=online on a checkpoint whose config.json declares MTP modules it
    holds no tensor of (one saved by transformers: any GLM-4.5 fine-tuned with Hugging Face tooling), a copy with
    fresh ones, initialized from `run.seed` (`miles_spec.add_mtp_modules`: the trunk's files linked, not copied),
    in RUN_DIR/model_with_draft: the draft then trains from scratch on the rollouts (slime / Megatron's MTP
    training from scratch). A resumed run finds it there (its checkpoint holds the trained draft). Any other run:
    `model_dir` as it is, read here first, so that miles-kernels' warning about MTP modules left out is logged by
    this process (the engines and trainer ranks log theirs in their own logs)."""
    fresh = run.path / FRESH_DRAFT_DIR
    if Path(model_dir).resolve() == fresh.resolve():
        return model_dir
    absent = num_absent_mtp_layers(model_dir)
    if cfg.spec.mode != "online" or not absent:
        read_model_config(model_dir)
        return model_dir
    if not fresh.is_dir():
        add_mtp_modules(model_dir, fresh, absent, seed=cfg.run.seed)
        run.log(
            f"{model_dir}: config.json declares {absent} MTP module(s) the checkpoint holds no tensor of (saved by "
            f"transformers); spec.mode=online trains {absent} fresh one(s) from scratch, initialized in {fresh} "
            "(the trunk's files linked from the checkpoint)"
        )
    return str(fresh)


def _check_estimator(cfg: RunConfig) -> None:
    if ":" in cfg.trainer.advantage_estimator:
        load_advantage_estimator(cfg.trainer.advantage_estimator)


async def check_on_policy(cfg: RunConfig, cluster: Cluster, version: int, log: Any) -> None:
    """Sync the trainer's weights to the engine as `version`, then refuse to start unless the engine holds the
    same bits (weight checksum) and, for true on-policy, runs the same kernels (fingerprint); SGLang engines, which
    report neither, must serve `version`."""
    await cluster.sync_weights(version, cfg.run.sync_bucket_bytes)
    if cfg.rollout.backend == "sglang":  # SGLang reports neither Miles' kernel config nor a checksum of HF tensors
        served = await cluster.engine.get_weight_version()  # every engine's, or a RuntimeError naming them
        if served != version:
            raise RuntimeError(f"weight sync check failed: the SGLang engines serve weights v{served}, not v{version}")
        log(f"weights v{version} synced via {cluster.sync_method}; the SGLang engines serve v{version} (SGLang "
            "reports no checksum of HF tensors to verify the bits by)")  # fmt: skip
        return
    described = (await cluster.engine.get_server_info())["kernel_config"]
    fingerprint = described["fingerprint"]
    if cfg.is_true_on_policy and fingerprint != cluster.trainer_fingerprint:
        raise RuntimeError(
            f"true on-policy refused: the engine runs kernel config {described} (fingerprint {fingerprint}), the "
            f"trainer {cluster.trainer_fingerprint}; give both the same KernelConfig (dtype, mode, tile and page "
            "sizes, and the weight format: rollout.engine.weight_dtype with trainer.qat), the same torch version and "
            "the same kind of device"
        )
    engine_checksum, checksum = await cluster.engine.weights_checksum(), await cluster.trainer_checksum()
    if engine_checksum != checksum:
        raise RuntimeError(
            f"weight sync check failed: the engine holds {engine_checksum[:16]}, the trainer sent {checksum[:16]} "
            f"(version {version})"
        )
    log(f"weights v{version} synced via {cluster.sync_method} and verified (checksum {checksum[:12]}), kernels "
        f"{fingerprint}")  # fmt: skip

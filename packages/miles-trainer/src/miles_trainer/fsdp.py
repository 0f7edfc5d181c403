"""The FSDP2 training backend: the miles-kernels model sharded with `fully_shard` over `torch.distributed`
(gloo on CPU, NCCL on GPU), AdamW with warmup + cosine/constant schedule and gradient clipping. A single
float32 rank keeps the plain module (same arithmetic, no sharding hooks).

Each rank trains on its share of the global batch. Losses are normalized by the global batch's token / sequence
counts (an all-reduce of the local counts) and each rank's loss is scaled by the world size, so FSDP2's
gradient average over ranks is the sum the global normalization needs: a step is the same whatever the
data-parallel size. Parameters are float32 masters; with a bf16/fp16 `KernelConfig` FSDP2's mixed precision casts
them to the kernel dtype for compute (round-to-nearest, the same cast the engine applies when it loads the
weights), so the log-probs before the first optimizer step equal the engine's under true on-policy.
Optional: activation checkpointing per decoder layer, a frozen reference copy for the KL term, offload/onload.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from miles_contracts import Sample
from miles_kernels import CausalLM, KernelConfig, disabled_adapters, load_eagle3, load_model
from miles_kernels.config import WeightQuantConfig
from miles_memory.config import MemoryConfig
from miles_trainer.auxiliary import AuxLoss
from miles_trainer.config import BackendConfig, CriticConfig, LoraTrainConfig, OptimizerConfig, PolicyLossConfig
from miles_trainer.critic import JointValueLoss, ValueHead, ValueModel, accumulate_value_gradients, critic_values
from miles_trainer.fsdp_sharding import apply_activation_checkpointing, shard, use_deterministic_backward
from miles_trainer.logprobs import batch_logprobs
from miles_trainer.lora import TrainedWeights, attach_adapters
from miles_trainer.memory import TrainerMemory, device_held
from miles_trainer.moe import moe_shape
from miles_trainer.optimizers import adamw, policy_optimizer
from miles_trainer.packing import MicroBatch, pack_samples, plan_samples
from miles_trainer.policy_step import accumulate_policy_gradients
from miles_trainer.qat import attach_quantization
from miles_trainer.step import (
    PerSample,
    StepStats,
    accumulate_sft_gradients,
    add_batch_stats,
    add_is_metrics,
    all_reduce,
    batch_normalizers,
    batch_summary,
    count_trained,
    has_update_signal,
    resolve_loss_fn,
)
from miles_trainer.weight_sender import WeightSender


class FSDP2Backend:
    """A `CausalLM` sharded over the default process group, with its optimizer (and optionally a frozen
    reference copy). Every rank makes the same calls in the same order (they are collectives)."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        kernel: KernelConfig,
        optimizer: OptimizerConfig | None = None,
        loss: PolicyLossConfig | None = None,
        config: BackendConfig | None = None,
        *,
        keep_reference: bool | None = None,
        offload_dir: str | os.PathLike[str] | None = None,
        critic: CriticConfig | None = None,
        aux_losses: Sequence[AuxLoss] = (),
        aux_optimizer: OptimizerConfig | None = None,
        memory: MemoryConfig | None = None,
        routing_replay: bool = False,
        lora: LoraTrainConfig | None = None,
        weight_quant: WeightQuantConfig | None = None,
        qat: bool = False,
        eagle3_draft: str | os.PathLike[str] | None = None,
    ) -> None:
        """`keep_reference`: keep the initial policy as the KL reference (default: when `loss.kl_coef > 0`).
        `offload_dir`: where `offload()` writes on a CPU run (default: the system temp dir). `critic`: PPO's
        value model (`miles_trainer.critic`), trained with its own optimizer by `train_step`. `aux_losses`:
        auxiliary losses (`miles_trainer.auxiliary`, e.g. miles-spec's MTP loss) trained in the same step; their
        parameters get their own AdamW (`aux_optimizer`, default: the policy's settings) and clipping. `memory`:
        offload target, allocation budget and OOM handling (`miles_trainer.memory`; default: no budget).
        `routing_replay`: the policy's MoE layers route every sample's tokens to the experts the rollout engine
        recorded (its `routed_experts`; miles_trainer.moe), in the train step and in `compute_logprobs` (the
        reference model routes by itself). `lora`: train adapters on a frozen base (miles_trainer.lora): only they
        get gradients, optimizer state and checkpoint bytes, and `weights` sends only them. `weight_quant`, `qat`: a
        low-precision engine's format, which `weights` sends, and quantization-aware training with it (qat.py).
        `eagle3_draft`: a SpecForge-format EAGLE-3 draft directory attached to the policy (`CausalLM.attach_eagle3`,
        float32 like the policy): it shards, checkpoints and weight-syncs with it, trains when an auxiliary loss
        trains it (miles-spec's `Eagle3Loss`), and `export_hf` writes it beside the policy."""
        if not dist.is_initialized():
            raise RuntimeError("FSDP2Backend needs torch.distributed initialized (torchrun, or init_process_group)")
        self.kernel = kernel
        self.model_dir = model_dir
        self.routing_replay = routing_replay
        if kernel.is_deterministic:
            use_deterministic_backward()
        self.optimizer_config = optimizer or OptimizerConfig()
        self.loss_config = loss or PolicyLossConfig()
        self.config = config or BackendConfig()
        if self.optimizer_config.schedule == "cosine" and self.optimizer_config.total_steps is None:
            raise ValueError("optimizer schedule='cosine' needs total_steps (the optimizer steps it spans)")
        resolve_loss_fn(
            self.loss_config.loss_fn, self.loss_config.surrogate
        )  # a bad plug-in path fails now, not at the first step
        self.max_tokens = self.config.max_tokens_per_micro_batch
        device = self.config.device
        self.model = load_model(model_dir, kernel, device, dtype=torch.float32).train()
        if eagle3_draft is not None:
            draft = load_eagle3(eagle3_draft, self.model.config, kernel, device, dtype=torch.float32)
            self.model.attach_eagle3(draft.train())
        self.lora = lora if lora is not None and lora.is_enabled else None
        if self.optimizer_config.algorithm == "muon" and self.lora is not None:
            raise ValueError("optimizer algorithm=muon orthogonalizes the policy's weight matrices, which LoRA "
                             "freezes: train the adapters with algorithm=adamw")  # fmt: skip
        if critic is not None and critic.optimizer.algorithm == "muon":
            raise ValueError("the critic steps with AdamW: set its optimizer algorithm=adamw (Muon is the policy's)")
        if self.lora is not None:
            attach_adapters(self.model, self.lora, kernel)
        quantizer = attach_quantization(self.model, weight_quant, qat, self.lora is not None)
        if self.config.activation_checkpointing:
            apply_activation_checkpointing(self.model)
        shard(self.model, kernel, offload_params=self.optimizer_config.is_master_offloaded)
        self.reference: CausalLM | None = None
        self.has_reference = keep_reference if keep_reference is not None else self.loss_config.kl_coef > 0
        if self.has_reference and self.lora is None:  # with LoRA the reference is the base: the policy, adapters off
            self.reference = load_model(model_dir, kernel, device, dtype=torch.float32).eval().requires_grad_(False)
            if qat:  # the initial policy as the engine ran it
                attach_quantization(self.reference, weight_quant, qat, has_lora=False)
            shard(self.reference, kernel)
        self.aux_losses = list(aux_losses)
        aux_ids = {id(p) for aux in self.aux_losses for p in aux.parameters(self.model)}
        # drafts no auxiliary loss trains stay as loaded (spec.mode off / frozen): outside every optimizer,
        # so a checkpoint holds optimizer state for exactly the parameters that train
        idle_mtp = {id(p) for p in self.model.draft_parameters()} - aux_ids
        # the policy's parameters (the trunk's), in the model's order: its optimizer and its clipping see these
        self.policy_params = [
            p for p in self.model.parameters() if id(p) not in aux_ids | idle_mtp and p.requires_grad
        ]  # with LoRA: the adapters (the frozen base trains in no optimizer)
        self.aux_params = [p for p in self.model.parameters() if id(p) in aux_ids]
        self.optimizer, self.scheduler = policy_optimizer(self.model, self.policy_params, self.optimizer_config)
        self.aux_optimizer_config = aux_optimizer or self.optimizer_config
        if self.aux_params:
            self.aux_optimizer, self.aux_scheduler = adamw(self.aux_params, self.aux_optimizer_config)
        self.critic_config = critic
        self.critic_model: ValueModel | None = None  # kind="separate"
        self.value_head: ValueHead | None = None  # kind="value_head"
        if critic is not None:
            if critic.optimizer.schedule == "cosine" and critic.optimizer.total_steps is None:
                raise ValueError("critic optimizer schedule='cosine' needs total_steps (the optimizer steps it spans)")
            if critic.kind == "separate":
                backbone = load_model(model_dir, kernel, device, dtype=torch.float32).train()
                if self.config.activation_checkpointing:
                    apply_activation_checkpointing(backbone)
                self.critic_model = ValueModel(backbone)
                shard(backbone, kernel, root=self.critic_model, offload_params=critic.optimizer.is_master_offloaded)
                critic_params = list(self.critic_model.parameters())
            else:
                self.value_head = ValueHead(self.model.config.hidden_size, device)
                critic_params = list(self.value_head.parameters())
            self.critic_optimizer, self.critic_scheduler = adamw(critic_params, critic.optimizer)
        self.step_count = 0
        mtp_ids = {id(p) for p in self.model.draft_parameters()}
        held = functools.partial(device_held, device)  # state in host memory (optimizer offload) stays put
        self.memory = TrainerMemory(
            memory or MemoryConfig(), device, offload_dir=offload_dir,
            weights=held(lambda: (p for m in self._models() for p in m.parameters() if id(p) not in mtp_ids)),
            mtp=held(self.model.draft_parameters), optimizer=held(self._optimizer_state),
            trainable=held(self._trainable_params),
            grads=held(lambda: (p.grad for m in self._models() for p in m.parameters() if p.grad is not None)),
            host_optimizer=self.optimizer_config.offload != "none",
        )  # fmt: skip
        self.memory.check_fits()
        # what weight sync sends: buckets, a file, tensors (with LoRA: the adapters and what else trains; the checksum
        # still covers every weight the engine holds, base included)
        self.weights = WeightSender(self._sync_model if self.lora is not None else self._export_model,
                                    checksum_model=self._export_model, quant=quantizer)  # fmt: skip

    def _num_passes(self, samples: Sequence[Sample]) -> int:
        """Sharded forward/backward passes are collectives: every rank runs as many as the busiest rank."""
        passes = torch.tensor([len(plan_samples(samples, self.max_tokens))])
        all_reduce(passes, op=dist.ReduceOp.MAX)
        return int(passes.item())

    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[Sample], reference: bool = False) -> list[list[float]]:
        """Log-probs of each sample's response tokens under the current (or the reference) weights: the old
        log-probs of fast mode, or the reference's for the KL term / a KL reward penalty."""
        if reference and not self.has_reference:
            raise ValueError("this backend keeps no reference model: create it with keep_reference=True")
        base_only = reference and self.reference is None  # LoRA: the reference is the policy, adapters off
        model = self.reference if reference and self.reference is not None else self.model
        self._check_onloaded()
        replay = self.routing_replay and not reference
        micro_batches = pack_samples(
            samples, self.kernel, self.max_tokens, routing_shape=moe_shape(model) if replay else None,
            require_routing=replay,
        )  # fmt: skip
        with disabled_adapters(model) if base_only else contextlib.nullcontext():
            return batch_logprobs(
                model, micro_batches, len(samples), self._num_passes(samples), self.loss_config.temperature, replay
            )

    @torch.no_grad()
    def compute_values(self, samples: Sequence[Sample]) -> list[list[float]]:
        """The critic's value V(s_t) of each response token of each sample (`miles_trainer.critic`): the old
        values of GAE and of the clipped value loss. Every rank calls it with its share."""
        self._check_onloaded()
        num_passes = self._num_passes(samples)
        if self.critic_model is not None:
            return critic_values(self.critic_model, samples, self.kernel, self.max_tokens, num_passes)
        head = self.value_head
        if head is None:
            raise ValueError("this backend has no critic: create it with critic=CriticConfig(...)")
        model = self.model

        def values(micro: MicroBatch) -> torch.Tensor:  # hidden states only: no logits
            device = next(head.parameters()).device
            hidden = model.forward_hidden(micro.input_ids_N.to(device), micro.batch)
            out: torch.Tensor = head(hidden[micro.score_rows_K.to(device)])
            return out

        return critic_values(values, samples, self.kernel, self.max_tokens, num_passes)

    def train_step(
        self,
        samples: Sequence[Sample],
        advantages: PerSample,
        *,
        old_logprobs: Sequence[Sequence[float]] | None = None,
        ref_logprobs: Sequence[Sequence[float]] | None = None,
        returns: Sequence[Sequence[float]] | None = None,
        old_values: Sequence[Sequence[float]] | None = None,
        measure_mismatch: bool = False,
    ) -> dict[str, float]:
        """One optimizer step on this rank's samples (every rank calls it with its share of the batch).

        See `accumulate_policy_gradients` for the arguments; with a reference model and no `ref_logprobs`, the
        reference model computes them (the KL term with `kl_coef > 0`, else the `kl` metric only). With a
        critic, `returns` (GAE's value targets) and `old_values` (`compute_values` before the step) train it too,
        with its own optimizer; during its first `warmup_steps` steps only the critic moves. Returns global
        metrics (identical on every rank).
        """
        if not samples:
            raise ValueError("every rank needs at least one sample per step")
        if (self.critic_config is None) != (returns is None and old_values is None):
            raise ValueError(
                "returns and old_values train the critic: pass both with a critic (PPO, advantage estimator gae), "
                "neither without one"
            )
        self._check_onloaded()
        start = time.perf_counter()
        loss = self.loss_config
        if self.has_reference and ref_logprobs is None:  # the KL term, or the kl metric alone
            ref_logprobs = self.compute_logprobs(samples, reference=True)
        is_weights, is_metrics, global_tokens, global_seqs = batch_normalizers(samples, old_logprobs, loss, all_reduce)
        aux_counts = self._aux_counts(samples)
        critic, is_warmup = self.critic_config, False
        if critic is not None:
            assert returns is not None and old_values is not None
            is_warmup = self.step_count < critic.warmup_steps

        def accumulate(max_tokens: int) -> tuple[StepStats, dict[str, float]]:
            self.max_tokens = max_tokens
            self._zero_grad()
            joint_value = None
            critic_stats: dict[str, float] = {}
            if critic is not None:
                assert returns is not None and old_values is not None
                if self.critic_model is not None:
                    critic_tokens, critic_seqs = count_trained(samples)
                    counts = torch.tensor([critic_tokens, critic_seqs], dtype=torch.int64)
                    all_reduce(counts)
                    critic_stats = accumulate_value_gradients(
                        self.critic_model, samples, returns, old_values, self.kernel, critic, self.max_tokens,
                        global_num_tokens=int(counts[0]), global_num_seqs=int(counts[1]),
                        max_response_len=loss.max_response_len, loss_scale=dist.get_world_size(),
                        num_micro_batches=self._num_passes(samples),
                    )  # fmt: skip
                else:
                    assert self.value_head is not None
                    joint_value = JointValueLoss(self.value_head, returns, old_values, critic)
            if is_warmup and joint_value is None:
                return StepStats(), critic_stats  # the separate critic warms up alone: no policy pass
            stats = accumulate_policy_gradients(
                self.model, samples, advantages, self.kernel, loss, self.max_tokens,
                global_num_tokens=global_tokens, global_num_seqs=global_seqs,
                loss_scale=dist.get_world_size(),  # FSDP2 averages gradients over ranks; the global loss wants a sum
                num_micro_batches=self._num_passes(samples), old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                is_weights=is_weights, joint_value=joint_value, aux_losses=self.aux_losses, aux_counts=aux_counts,
                measure_mismatch=measure_mismatch, routing_replay=self.routing_replay,
            )  # fmt: skip
            add_is_metrics(stats, is_metrics, samples)
            return stats, critic_stats

        (stats, critic_stats), self.max_tokens = self.memory.with_oom_retry(
            self.max_tokens, accumulate, self._zero_grad
        )
        if critic_stats:
            num_tokens = critic_stats.pop("num_tokens")
            stats.add("vf_loss", critic_stats.pop("vf_loss"))
            for name, total in critic_stats.items():
                stats.add_mean(name, total / max(num_tokens, 1.0), num_tokens)
        critic_metrics = self._critic_step() if critic is not None else {}
        critic_metrics |= self._aux_step()
        add_batch_stats(stats, samples, advantages)
        has_signal = has_update_signal(advantages, loss)
        metrics = self._finish_step(stats, start, skip_update=is_warmup or not has_signal)
        return metrics | critic_metrics

    def _aux_counts(self, samples: Sequence[Sample]) -> list[list[int]]:
        """Each auxiliary loss's normalizers over the global batch (summed over ranks)."""
        counts = [aux.counts(self.model, samples) for aux in self.aux_losses]
        flat = torch.tensor([c for group in counts for c in group], dtype=torch.int64)
        if flat.numel():
            all_reduce(flat)
        values, out = flat.tolist(), []
        for group in counts:
            out.append([int(v) for v in values[: len(group)]])
            values = values[len(group) :]
        return out

    def _aux_step(self) -> dict[str, float]:
        """Clip and apply the auxiliary losses' gradients with their own optimizer (never the policy's)."""
        if not self.aux_params:
            return {}
        grad_norm = torch.nn.utils.clip_grad_norm_(self.aux_params, self.aux_optimizer_config.max_grad_norm)
        self.aux_optimizer.step()
        self.aux_scheduler.step()
        norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        return {"aux_grad_norm": norm, "aux_lr": float(self.aux_scheduler.get_last_lr()[0])}

    def _critic_step(self) -> dict[str, float]:
        """Clip and apply the critic's gradients (a value head outside FSDP averages its own over ranks)."""
        assert self.critic_config is not None
        params = list((self.critic_model or self.value_head).parameters())  # type: ignore[union-attr]
        if self.value_head is not None and dist.get_world_size() > 1:
            for param in params:
                if param.grad is not None:
                    dist.all_reduce(param.grad)
                    param.grad /= dist.get_world_size()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.critic_config.optimizer.max_grad_norm)
        self.critic_optimizer.step()
        self.critic_scheduler.step()
        norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        return {"critic_grad_norm": norm, "critic_lr": float(self.critic_scheduler.get_last_lr()[0])}

    def sft_step(self, samples: Sequence[Sample], train_policy: bool = True) -> dict[str, float]:
        """One optimizer step of the SFT loss (token-mean NLL of the loss-masked tokens) on this rank's samples;
        the auxiliary losses (`aux_losses`, e.g. the MTP draft's) train on the same forward with their own
        optimizer. `train_policy=False` steps the auxiliary losses only: the policy's weights stay as they are
        (its loss is measured; `skipped_update` is 1)."""
        if not samples:
            raise ValueError("every rank needs at least one sample per step")
        self._check_onloaded()
        start = time.perf_counter()
        local = torch.tensor(count_trained(samples), dtype=torch.int64)
        all_reduce(local)
        global_tokens, global_seqs = (int(v) for v in local.tolist())
        aux_counts = self._aux_counts(samples)

        def accumulate(max_tokens: int) -> StepStats:
            self.max_tokens = max_tokens
            self._zero_grad()
            return accumulate_sft_gradients(
                self.model, samples, self.kernel, max_tokens, global_num_tokens=global_tokens,
                global_num_seqs=global_seqs, loss_scale=dist.get_world_size(),
                num_micro_batches=self._num_passes(samples), aux_losses=self.aux_losses, aux_counts=aux_counts,
                train_policy=train_policy,
            )  # fmt: skip

        stats, self.max_tokens = self.memory.with_oom_retry(self.max_tokens, accumulate, self._zero_grad)
        aux_metrics = self._aux_step()
        return self._finish_step(stats, start, skip_update=not train_policy) | aux_metrics

    def _finish_step(self, stats: StepStats, start: float, skip_update: bool = False) -> dict[str, float]:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy_params, self.optimizer_config.max_grad_norm)
        if not skip_update:
            self.optimizer.step()
            self.scheduler.step()
        self.step_count += 1
        stats.add("skipped_update", float(skip_update) / dist.get_world_size())
        for name, value in self.memory.step_metrics().items():  # the busiest rank's
            stats.add_max(name, value)
        stats.all_reduce()
        metrics = stats.summary()
        metrics.update(batch_summary(metrics))
        elapsed = time.perf_counter() - start
        metrics.update({
            "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
            "lr": float(self.scheduler.get_last_lr()[0]), "step_time_s": elapsed,
            "tokens_per_s": metrics.get("num_tokens", 0.0) / elapsed,
        })  # fmt: skip
        return metrics

    def _export_model(self) -> CausalLM:
        """The model `self.weights` gathers the engine's weights from (the trainer must be onloaded)."""
        self._check_onloaded()
        return self.model

    def _sync_model(self) -> TrainedWeights:
        """LoRA: what a weight sync sends, the parameters that train (adapters, and MTP layers trained online)."""
        self._check_onloaded()
        trained = {id(p) for p in self._trainable_params()}
        return TrainedWeights(self.model, lambda p: id(p) in trained)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters on CPU under HF checkpoint names (tied embeddings once, an MTP module's copies of
        the trunk's embedding and LM head left out), identical on every rank."""
        self._check_onloaded()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False)
        state: dict[str, Any] = get_model_state_dict(self.model, options=options)
        if self.model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        for name in self.model.mtp_copy_names():  # an MTP module's copies of trunk tensors: the same tensors
            state.pop(name, None)
        return state

    def _models(self) -> Iterator[torch.nn.Module]:
        """The policy, and the reference copy and the critic where there are any."""
        yield from (m for m in (self.model, self.reference, self.critic_model, self.value_head) if m is not None)

    def _optimizer_state(self) -> Iterator[torch.Tensor]:
        for optimizer in self._optimizers():
            for state in optimizer.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    def _trainable_params(self) -> Iterator[torch.nn.Parameter]:
        for optimizer in self._optimizers():
            for group in optimizer.param_groups:
                yield from group["params"]

    def offload(self, room_for: int | None = None) -> int:
        """Free parameters and optimizer state (to host memory on GPU, to a file on CPU: `memory.offload_to`)
        while the engine works; returns the bytes freed on this rank. `room_for`: the bytes the engine takes
        back beside this rank; with `memory.partial_offload` only what makes them fit within the budget moves,
        largest tensors first. `onload()` brings everything back bit for bit. The last step's gradients are
        dropped, not kept: every step starts from `zero_grad(set_to_none=True)` anyway."""
        self._zero_grad()
        return self.memory.offload(room_for).freed_bytes

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        """The policy's optimizer (AdamW or Muon's), then the critic's and the auxiliary losses' AdamW when there are
        any."""
        optimizers = [self.optimizer] + ([self.critic_optimizer] if self.critic_config is not None else [])
        return optimizers + ([self.aux_optimizer] if self.aux_params else [])

    def _zero_grad(self) -> None:
        for optimizer in self._optimizers():
            optimizer.zero_grad(set_to_none=True)

    def onload(self) -> int:
        """Bring back what `offload()` freed; returns the bytes restored on this rank. With `memory.limit_bytes`,
        a `torch.OutOfMemoryError` (with a report by tag) when it would not fit."""
        return self.memory.manager.onload()

    @property
    def is_offloaded(self) -> bool:
        return self.memory.manager.is_offloaded()

    def _check_onloaded(self) -> None:
        if self.memory.manager.is_offloaded():
            raise RuntimeError("the trainer is offloaded: call onload() before training or exporting weights")

"""One policy-gradient pass over a rollout batch (`accumulate_policy_gradients`), and its per-micro-batch part
(`PolicyStep`) for a backend whose schedule drives the forward and backward itself (the Megatron backend's pipeline
schedule: a micro-batch's loss is computed on the last pipeline stage, its backward runs later).

Every micro-batch's loss is divided by the global batch's counts (`step.py`), so the accumulated gradient does not
depend on the split into micro-batches or ranks. Shapes: K response tokens, B samples of a micro-batch, T the
longest response in it, N its packed rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from miles_contracts import Sample
from miles_kernels import CausalLM, KernelConfig
from miles_trainer.auxiliary import AuxLoss
from miles_trainer.config import PolicyLossConfig
from miles_trainer.critic import JointValueLoss, value_loss_part
from miles_trainer.distillation import check_teacher_top, teacher_top_K, topk_forward_kl
from miles_trainer.logprobs import micro_batch_forward
from miles_trainer.losses import aggregate_loss, entropy_bonus_loss, kl_estimate, train_rollout_logprob_abs_diff
from miles_trainer.moe import balance_loss, moe_shape, routing_metrics, z_loss
from miles_trainer.packing import MicroBatch, pack_samples, padded_lists, padded_passes, rows_to_padded
from miles_trainer.step import (
    PerSample,
    PerToken,
    StepStats,
    add_aux_stats,
    add_is_metrics,
    aux_parts_of,
    check_per_token,
    count_trained,
    mismatch_weights,
    resolve_loss_fn,
    token_advantages,
)

Finish = Callable[[StepStats], None]


class PolicyStep:
    """What a policy-gradient step shares over its micro-batches (the packed micro-batches, the per-token
    advantages, the TIS / MIS weights, the global counts), checked once; `loss(model, micro, weight, stats)` is one
    micro-batch's forward and loss. See `accumulate_policy_gradients` for the arguments."""

    def __init__(
        self,
        model: CausalLM,
        samples: Sequence[Sample],
        advantages: PerSample,
        kernel: KernelConfig,
        config: PolicyLossConfig,
        max_tokens_per_micro_batch: int,
        *,
        global_num_tokens: int | None = None,
        global_num_seqs: int | None = None,
        loss_scale: float = 1.0,
        old_logprobs: PerToken | None = None,
        ref_logprobs: PerToken | None = None,
        is_weights: PerToken | None = None,
        joint_value: JointValueLoss | None = None,
        aux_losses: Sequence[AuxLoss] = (),
        aux_counts: Sequence[Sequence[int]] | None = None,
        measure_mismatch: bool = False,
        routing_replay: bool = False,
        share_prompts: bool = True,
        computes_moe_terms: bool = True,
    ) -> None:
        """`computes_moe_terms` False: the model's routers add the routing metrics and the load-balancing and z losses
        themselves (the Megatron backend's pipeline stages: miles_trainer.megatron_moe); the rest is as
        `accumulate_policy_gradients`'s arguments."""
        self.samples, self.config = samples, config
        self.per_token_adv = token_advantages(samples, advantages)
        missing = [s.index for s in samples if s.rollout_logprobs is None]
        if missing:
            raise ValueError(f"samples {missing[:5]} have no rollout_logprobs; request return_logprob=True")
        check_per_token("old_logprobs", samples, old_logprobs)
        check_per_token("ref_logprobs", samples, ref_logprobs)
        if config.opd_topk_coef > 0:
            check_teacher_top(samples)
        if config.kl_coef > 0 and ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs (the reference policy's log-probs of the responses)")
        self.loss_fn = resolve_loss_fn(config.loss_fn, config.surrogate)
        self.is_metrics: dict[str, torch.Tensor] = {}
        if config.is_mode is not None and is_weights is None:
            is_weights, self.is_metrics = mismatch_weights(samples, old_logprobs, config)
        check_per_token("is_weights", samples, is_weights)
        self.old_logprobs, self.ref_logprobs, self.is_weights = old_logprobs, ref_logprobs, is_weights
        self.exclude_rejected = config.is_mode == "mask" and config.is_rejected == "excluded"
        self.aux_losses = aux_losses
        self.aux_counts = aux_counts if aux_counts is not None else [aux.counts(model, samples) for aux in aux_losses]
        local_tokens, local_seqs = count_trained(samples, is_weights if self.exclude_rejected else None)
        self.global_tokens = global_num_tokens if global_num_tokens is not None else local_tokens
        global_seqs = global_num_seqs if global_num_seqs is not None else local_seqs
        self.micro_batches: list[MicroBatch] = []
        if self.global_tokens == 0 or not samples:
            return  # no token trains (every loss mask is zero): no gradient
        if config.agg_mode in ("seq-mean-token-sum-norm", "token-sum-norm") and config.max_response_len is None:
            raise ValueError(
                f"agg_mode={config.agg_mode} divides by a constant L: set PolicyLossConfig.max_response_len (the "
                "longest response the rollout may produce; a run config sets it from rollout.max_new_tokens)"
            )
        self.counts = {"global_num_tokens": self.global_tokens, "global_num_seqs": global_seqs,
                       "max_response_len": config.max_response_len}  # fmt: skip
        self.routing_shape = moe_shape(model)
        wanted = {"routing replay": routing_replay, "moe_z_loss_coef > 0": config.moe_z_loss_coef > 0,
                  f"moe_aux_loss={config.moe_aux_loss}": config.moe_aux_loss != "none"}  # fmt: skip
        if any(wanted.values()) and self.routing_shape is None:
            wants = next(name for name, on in wanted.items() if on)
            raise ValueError(f"{wants} needs an MoE policy; {model.config.model_type} has no MoE layer")
        self.micro_batches = pack_samples(
            samples, kernel, max_tokens_per_micro_batch, share_prompts, self.routing_shape,
            require_routing=routing_replay,
        )  # fmt: skip
        self.total_rows = sum(m.num_tokens for m in self.micro_batches)
        self.loss_scale, self.joint_value = loss_scale, joint_value
        self.measure_mismatch, self.routing_replay = measure_mismatch, routing_replay
        self.computes_moe_terms = computes_moe_terms and self.routing_shape is not None

    @property
    def trains(self) -> bool:
        """False when no token of the global batch trains (no micro-batch to run)."""
        return bool(self.micro_batches)

    def loss(self, model: CausalLM, micro: MicroBatch, weight: float, stats: StepStats) -> tuple[torch.Tensor, Finish]:
        """One micro-batch's forward and its loss to backpropagate (the policy loss and its parts, plus the
        auxiliary losses; times `weight`, 0 for a padding pass, and the loss scale, by the caller), and a function
        that adds the micro-batch's stats once the backward has run (nothing for a padding pass)."""
        config, counts = self.config, self.counts
        rows = micro.sample_indices
        teacher_top = teacher_top_K(self.samples, rows) if config.opd_topk_coef > 0 else None
        logprobs_K, entropy_K, hidden_NH, student_top_KJ = micro_batch_forward(
            model,
            micro,
            config.temperature,
            with_entropy=True,
            with_hidden=self.joint_value is not None or bool(self.aux_losses),
            replay=self.routing_replay,
            entropy_grad=config.entropy_coef > 0,  # else only reported
            top_ids_KJ=None if teacher_top is None else teacher_top[0],
        )
        assert entropy_K is not None
        logprobs_BT, mask_BT = rows_to_padded(logprobs_K, micro)
        device = logprobs_BT.device
        rollout_BT = padded_lists([self.samples[i].rollout_logprobs or [] for i in rows], device)
        old_logprobs = self.old_logprobs
        old_BT = rollout_BT if old_logprobs is None else padded_lists([old_logprobs[i] for i in rows], device)
        advantages_BT = padded_lists([self.per_token_adv[i] for i in rows], device)
        is_weights_BT = None if self.is_weights is None else padded_lists([self.is_weights[i] for i in rows], device)
        if is_weights_BT is not None and self.exclude_rejected:
            mask_BT = mask_BT & (is_weights_BT > 0)
        pg_loss, pg_metrics = self.loss_fn(
            logprobs_BT, old_BT, advantages_BT, mask_BT,
            clip_low=config.clip_low, clip_high=config.clip_high, dual_clip=config.dual_clip,
            ratio_type=config.ratio_type, agg_mode=config.agg_mode, is_weights_BT=is_weights_BT, **counts,
        )  # fmt: skip
        entropy_BT, _ = rows_to_padded(entropy_K, micro)
        parts = {"pg_loss": pg_loss}
        if config.entropy_coef > 0:
            parts["entropy_loss"] = entropy_bonus_loss(
                entropy_BT, mask_BT, config.entropy_coef, config.agg_mode, **counts
            )
        kl_BT = None
        if self.ref_logprobs is not None:
            ref_BT = padded_lists([self.ref_logprobs[i] for i in rows], device)
            kl_BT = kl_estimate(logprobs_BT, ref_BT, config.kl_estimator)
            if (
                config.kl_ratio_correction
            ):  # TRL's use_bias_correction_kl: KL under pi_old's samples, times pi / pi_old
                kl_BT = kl_BT * torch.exp(torch.where(mask_BT, logprobs_BT - old_BT, 0.0).clamp(-20.0, 20.0))
            if config.kl_coef > 0:
                parts["kl_loss"] = config.kl_coef * aggregate_loss(kl_BT, mask_BT, config.agg_mode, **counts)
        opd_kl_BT = None
        if teacher_top is not None and student_top_KJ is not None:  # the teacher's top-k forward KL, a loss term
            opd_kl_BT, _ = rows_to_padded(topk_forward_kl(student_top_KJ, teacher_top[1].to(device)), micro)
            parts["opd_topk_loss"] = config.opd_topk_coef * aggregate_loss(opd_kl_BT, mask_BT, config.agg_mode,
                                                                           **counts)  # fmt: skip
        vf_metrics: dict[str, torch.Tensor] = {}
        if self.joint_value is not None:
            assert hidden_NH is not None
            joint = self.joint_value
            vf_loss, vf_metrics, _ = value_loss_part(
                joint.head(hidden_NH[micro.score_rows_K.to(device)]), micro, joint.returns, joint.old_values,
                joint.config, counts,
            )  # fmt: skip
            parts["vf_loss_term"] = joint.config.vf_coef * vf_loss
            vf_metrics["vf_loss"] = vf_loss
        # a token-weighted share of the batch's mean, averaged over ranks (FSDP2 averages their gradients)
        share = micro.num_tokens / self.total_rows / self.loss_scale
        if self.computes_moe_terms and config.moe_aux_loss != "none":
            balance = balance_loss(model, config.moe_aux_loss, micro.sequence_rows)
            parts["moe_aux_loss_term"] = config.moe_aux_loss_coef * balance * share
            stats.add_mean("moe_aux_loss", float(balance.detach()), micro.num_tokens * weight)
        if self.computes_moe_terms and config.moe_z_loss_coef > 0:
            z = z_loss(model)
            parts["moe_z_loss_term"] = config.moe_z_loss_coef * z * share
            stats.add_mean("moe_z_loss", float(z.detach()), micro.num_tokens * weight)
        loss = torch.stack(list(parts.values())).sum()
        aux_parts = aux_parts_of(model, micro, hidden_NH, self.samples, self.aux_losses, self.aux_counts)
        total = loss
        for part, _ in aux_parts.values():  # detached from the policy: its gradients are unchanged
            total = total + part

        def finish(stats: StepStats) -> None:
            if weight == 0.0:
                return
            num_valid = float(mask_BT.sum())
            stats.add("num_tokens", num_valid)
            stats.add("loss", float(loss.detach()))
            add_aux_stats(stats, aux_parts, num_valid)
            if vf_metrics:
                stats.add("vf_loss", float(vf_metrics.pop("vf_loss").detach()))
                for name, value in vf_metrics.items():
                    stats.add_mean(name, float(value), num_valid)
            for name, part in parts.items():
                stats.add(name, float(part.detach()))
            if self.computes_moe_terms:
                for name, (mean, count) in routing_metrics(model, micro.routing_NLK).items():
                    stats.add_mean(name, mean, count)
            with torch.no_grad():
                is_valid = mask_BT.bool()
                stats.add_mean("entropy", float(entropy_BT[is_valid].mean()) if num_valid else 0.0, num_valid)
                if kl_BT is not None:
                    stats.add_mean("kl", float(kl_BT.detach()[is_valid].mean()) if num_valid else 0.0, num_valid)
                if opd_kl_BT is not None:
                    mean = float(opd_kl_BT.detach()[is_valid].mean()) if num_valid else 0.0
                    stats.add_mean("opd_topk_kl", mean, num_valid)
                for name, value in pg_metrics.items():
                    if name.endswith("_max"):
                        stats.add_max(name, float(value))
                    else:
                        stats.add_mean(name, float(value), num_valid)
                if self.measure_mismatch:
                    diff = train_rollout_logprob_abs_diff(
                        logprobs_BT if old_logprobs is None else old_BT, rollout_BT, mask_BT
                    )
                    stats.add_mean("train_rollout_logprob_abs_diff", float(diff["mean"]), num_valid)
                    stats.add_max("train_rollout_logprob_abs_diff_max", float(diff["max"]))

        return total, finish

    def passes(self, num_micro_batches: int | None = None) -> list[tuple[MicroBatch, float]]:
        """The step's passes (`packing.padded_passes`): its micro-batches, padded to `num_micro_batches`."""
        return padded_passes(self.micro_batches, num_micro_batches)

    def add_metrics(self, stats: StepStats) -> None:
        """The TIS / MIS metrics of weights computed here (none when the caller passed `is_weights`)."""
        add_is_metrics(stats, self.is_metrics, self.samples)


def accumulate_policy_gradients(
    model: CausalLM,
    samples: Sequence[Sample],
    advantages: PerSample,
    kernel: KernelConfig,
    config: PolicyLossConfig,
    max_tokens_per_micro_batch: int,
    *,
    global_num_tokens: int | None = None,
    global_num_seqs: int | None = None,
    loss_scale: float = 1.0,
    num_micro_batches: int | None = None,
    old_logprobs: Sequence[Sequence[float]] | None = None,
    ref_logprobs: Sequence[Sequence[float]] | None = None,
    is_weights: PerToken | None = None,
    joint_value: JointValueLoss | None = None,
    aux_losses: Sequence[AuxLoss] = (),
    aux_counts: Sequence[Sequence[int]] | None = None,
    measure_mismatch: bool = False,
    routing_replay: bool = False,
    share_prompts: bool = True,
) -> StepStats:
    """Forward + backward over all micro-batches (gradients accumulate in `model`); returns the step's stats.

    `advantages`: a scalar per sample or one value per response token. `old_logprobs`: the trainer's recomputed
    log-probs under the rollout weights (fast mode); None uses the rollout log-probs (true on-policy).
    `ref_logprobs`: the reference policy's, needed when `config.kl_coef > 0`. `is_weights`: the TIS / MIS weights
    of `mismatch_weights` when `config.is_mode` is set (None: computed here, batch-normalized over `samples`;
    pass them, and counts that leave out rejected tokens, when the batch spans ranks). `joint_value`: a value
    head's clipped value loss, times its `vf_coef`, joins the loss (PPO with `CriticConfig.kind="value_head"`).
    `aux_losses` (`miles_trainer.auxiliary.AuxLoss`, e.g. the MTP draft's) join the backward on the same forward,
    normalized by `aux_counts` (the global batch's, one list per loss; default: this batch's); they are reported as
    `<name>_loss` and not added to `loss`.
    `routing_replay`: the MoE layers use the experts the engine recorded for each token (the samples'
    `routed_experts`, miles_trainer.moe), not their router's choice. An MoE policy's step also reports the routing
    metrics of miles_trainer.moe and, with `config.moe_aux_loss` / `moe_z_loss_coef`, trains its load-balancing loss /
    router z-loss.
    `measure_mismatch`: report
    `train_rollout_logprob_abs_diff` (the recomputed old log-probs, else this forward's, against the rollout's —
    meaningful while the weights are still those that generated the samples). `share_prompts=False` packs every
    sample whole (a model that takes one sequence per sample).
    With data parallelism, pass the token / sequence counts of the whole global batch (all ranks) and reduce
    gradients with a sum (or scale the loss by the number of ranks with `loss_scale` when the reduction is an
    average); by default the counts are those of `samples`. Reported losses are unscaled. With sharded models every
    rank must run as many forward/backward passes as the others: `num_micro_batches` pads this rank's passes with
    zero-weight repeats of its last micro-batch (their gradient is exactly zero).
    """
    step = PolicyStep(
        model, samples, advantages, kernel, config, max_tokens_per_micro_batch,
        global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs, loss_scale=loss_scale,
        old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, is_weights=is_weights, joint_value=joint_value,
        aux_losses=aux_losses, aux_counts=aux_counts, measure_mismatch=measure_mismatch,
        routing_replay=routing_replay, share_prompts=share_prompts,
    )  # fmt: skip
    stats = StepStats()
    if not step.trains:
        return stats
    for micro, weight in step.passes(num_micro_batches):
        total, finish = step.loss(model, micro, weight, stats)
        (total * loss_scale * weight).backward()  # type: ignore[no-untyped-call]
        finish(stats)
    step.add_metrics(stats)
    return stats

"""One policy-gradient pass over a rollout batch, on a single model replica: pack → per micro-batch forward →
policy loss normalized over the *global* batch → backward (gradients accumulate across micro-batches).

Because every micro-batch's loss is divided by global counts (tokens / sequences of the whole batch), the
accumulated gradient does not depend on how the batch is split into micro-batches (or, with a sum all-reduce,
across data-parallel ranks). Under true on-policy the samples' rollout log-probs are the old log-probs (no
recompute pass). The FSDP2 backend wraps this with sharding, the optimizer and checkpoints.
Shapes: N packed rows, B samples of a micro-batch, T the longest response in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from miles_contracts import Sample
from miles_kernels import CausalLM, KernelConfig
from miles_trainer.logprobs import micro_batch_logprobs
from miles_trainer.losses import policy_loss
from miles_trainer.packing import MicroBatch, pack_samples


@dataclass(frozen=True)
class PolicyLossConfig:
    """Policy-loss settings (see `miles_trainer.losses.policy_loss`)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    ratio_type: str = "token"
    agg_mode: str = "token-mean"
    temperature: float = 1.0


def rows_to_padded(values_N: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Response rows of each sample as (B, T) right-padded values and the matching mask (loss mask applied)."""
    per_sample = [values_N[micro.is_response_N & (micro.row_sample_N == i)] for i in range(len(micro.sample_indices))]
    trains = [micro.loss_mask_N[micro.is_response_N & (micro.row_sample_N == i)] for i in range(len(per_sample))]
    padded = torch.nn.utils.rnn.pad_sequence(per_sample, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence(trains, batch_first=True, padding_value=False)
    return padded, mask


def count_trained(samples: Sequence[Sample]) -> tuple[int, int]:
    """(trained tokens, sequences with at least one trained token): the normalizers of the losses."""
    return sum(sum(s.effective_loss_mask()) for s in samples), sum(1 for s in samples if any(s.effective_loss_mask()))


def accumulate_policy_gradients(
    model: CausalLM,
    samples: Sequence[Sample],
    advantages: Sequence[float],
    kernel: KernelConfig,
    config: PolicyLossConfig,
    max_tokens_per_micro_batch: int,
    global_num_tokens: int | None = None,
    global_num_seqs: int | None = None,
    loss_scale: float = 1.0,
    num_micro_batches: int | None = None,
) -> dict[str, float]:
    """Forward + backward over all micro-batches (gradients accumulate in `model`); returns summed loss metrics.

        With data parallelism, pass the token / sequence counts of the whole global batch (all ranks) and reduce
        gradients with a sum (or scale the loss by the number of ranks with `loss_scale` when the reduction is an
        average); by default the counts are those of `samples`. Reported losses are unscaled. With sharded models every
    rank must run as many forward/backward passes as the others: `num_micro_batches` pads this rank's passes with
    zero-weight repeats of its last micro-batch (their gradient is exactly zero).
    """
    if len(advantages) != len(samples):
        raise ValueError(f"got {len(advantages)} advantages for {len(samples)} samples; give one per sample")
    missing = [s.index for s in samples if s.rollout_logprobs is None]
    if missing:
        raise ValueError(f"samples {missing[:5]} have no rollout_logprobs; request return_logprob=True")
    global_tokens, global_seqs = count_trained(samples)
    global_tokens = global_num_tokens if global_num_tokens is not None else global_tokens
    global_seqs = global_num_seqs if global_num_seqs is not None else global_seqs
    totals = {"loss": 0.0, "num_micro_batches": 0.0}
    if global_tokens == 0 or not samples:
        return totals  # no token trains (every loss mask is zero): no gradient
    micro_batches = pack_samples(samples, kernel, max_tokens_per_micro_batch)
    num_passes = max(len(micro_batches), num_micro_batches or 0)
    for step in range(num_passes):
        micro = micro_batches[min(step, len(micro_batches) - 1)]
        weight = 1.0 if step < len(micro_batches) else 0.0
        logprobs_BT, mask_BT = rows_to_padded(micro_batch_logprobs(model, micro, config.temperature), micro)
        old = [torch.tensor(samples[i].rollout_logprobs or [], dtype=torch.float32) for i in micro.sample_indices]
        old_BT = torch.nn.utils.rnn.pad_sequence(old, batch_first=True).to(logprobs_BT.device)
        adv = torch.tensor([advantages[i] for i in micro.sample_indices], dtype=torch.float32)
        advantages_BT = adv[:, None].expand_as(old_BT).to(logprobs_BT.device)
        loss, _ = policy_loss(
            logprobs_BT, old_BT, advantages_BT, mask_BT,
            clip_low=config.clip_low, clip_high=config.clip_high, dual_clip=config.dual_clip,
            ratio_type=config.ratio_type, agg_mode=config.agg_mode,
            global_num_tokens=global_tokens, global_num_seqs=global_seqs,
        )  # fmt: skip
        (loss * loss_scale * weight).backward()  # type: ignore[no-untyped-call]
        totals["loss"] += float(loss.detach()) * weight
        totals["num_micro_batches"] += 1
    return totals

"""What a train step needs besides its micro-batch loop (which is `policy_step.py`'s): the step's stats and their
all-reduce, the global counts the losses are normalized by, the TIS / MIS weights, the advantages per token, the
policy-loss plug-ins, the SFT pass, and the reward / advantage summaries.

Because every micro-batch's loss is divided by global counts (tokens / sequences of the whole batch), the
accumulated gradient does not depend on how the batch is split into micro-batches (or, with a sum all-reduce,
across data-parallel ranks). Under true on-policy the samples' rollout log-probs are the old log-probs (no
recompute pass); otherwise the caller passes recomputed `old_logprobs` and, if configured, TIS / MIS weights
correct the difference. The FSDP2 backend wraps this with sharding, the optimizer and checkpoints.
Shapes: K response tokens, B samples of a micro-batch, T the longest response in it.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from miles_contracts import Sample
from miles_kernels import CausalLM, KernelConfig
from miles_trainer.auxiliary import AuxLoss
from miles_trainer.config import PolicyLossConfig
from miles_trainer.importance import importance_weight_sums, importance_weights, normalize_importance_weights
from miles_trainer.logprobs import micro_batch_forward
from miles_trainer.losses import cispo_loss, policy_loss, sft_loss
from miles_trainer.packing import (
    MicroBatch,
    pack_samples,
    pad_rows,
    padded_lists,
    padded_passes,
    padding_slots,
    rows_to_padded,
)
from miles_trainer.plugins import load_checked_plugin

PerSample = Sequence[float | Sequence[float]]
PerToken = Sequence[Sequence[float]]


class PolicyLossFn(Protocol):
    """A policy-loss plug-in, called like `miles_trainer.losses.policy_loss` (which is the default):

    `loss_fn(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, clip_low, clip_high, dual_clip, ratio_type,
    agg_mode, global_num_tokens, global_num_seqs, max_response_len, is_weights_BT) -> (scalar loss, {name: 0-dim
    tensor})`.
    Normalize with `aggregate_loss(..., global_num_tokens=..., global_num_seqs=...)` so gradients stay
    invariant to the micro-batch split; metrics are averaged over tokens (a key ending in `_max`: maximum).
    """

    def __call__(
        self,
        logprobs_BT: torch.Tensor,
        old_logprobs_BT: torch.Tensor,
        advantages_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        /,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


def resolve_loss_fn(path: str | None, surrogate: str = "ppo") -> PolicyLossFn:
    """The built-in loss of `surrogate` (`policy_loss`: PPO-clip; `cispo_loss`), or the plug-in at `path` checked to
    take 4 positional tensors."""
    if path is None:
        return cast(PolicyLossFn, cispo_loss if surrogate == "cispo" else policy_loss)
    fn: PolicyLossFn = load_checked_plugin(
        path, PolicyLossFn, "loss", ("logprobs_BT", "old_logprobs_BT", "advantages_BT", "mask_BT")
    )
    return fn


class StepStats:
    """Per-step metrics accumulated over micro-batches, then over ranks (`all_reduce`).

    Three kinds: sums (loss parts, already globally normalized, and counts), token-weighted means (clip
    fractions, entropy, KL, mismatch mean; each over the tokens it was measured on) and maxima (keys ending in
    `_max`).
    """

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weighted: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)
        self.maxima: dict[str, float] = {}

    def add(self, name: str, value: float) -> None:
        self.sums[name] += value

    def add_mean(self, name: str, mean: float, num_tokens: float) -> None:
        self.weighted[name] += mean * num_tokens
        self.weights[name] += num_tokens

    def add_max(self, name: str, value: float) -> None:
        self.maxima[name] = max(self.maxima.get(name, float("-inf")), value)

    def all_reduce(self, group: Any = None) -> None:
        """Combine every rank's stats (of `group`: default all; the Megatron backend passes its data-parallel
        group, whose ranks hold different samples). Keys are those of any rank (a metric measured on some ranks'
        data only, e.g. the routing flips of samples that carry the engine's routing, counts zero elsewhere)."""
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        names = all_gather_json([sorted(self.sums), sorted(self.weighted), sorted(self.maxima)], group)
        tables: tuple[dict[str, float], ...] = (self.sums, self.weighted, self.maxima)
        for index, table in enumerate(tables):
            for rank_names in names:
                for name in rank_names[index]:
                    if name not in table:
                        table[name] = float("-inf") if table is self.maxima else 0.0
                        if table is self.weighted:
                            self.weights[name] = 0.0
        for table, op in ((self.sums, dist.ReduceOp.SUM), (self.weighted, dist.ReduceOp.SUM),
                          (self.weights, dist.ReduceOp.SUM)):  # fmt: skip
            keys = sorted(table)
            values = torch.tensor([table[k] for k in keys], dtype=torch.float64)
            dist.all_reduce(values, op=op, group=group)
            table.update(zip(keys, values.tolist(), strict=True))
        keys = sorted(self.maxima)
        maxima = torch.tensor([self.maxima[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        self.maxima.update(zip(keys, maxima.tolist(), strict=True))

    def summary(self) -> dict[str, float]:
        out = dict(self.sums)
        out.update({name: total / max(self.weights[name], 1.0) for name, total in self.weighted.items()})
        out.update(self.maxima)
        return out


def all_gather_json(value: Any, group: Any = None) -> list[Any]:
    """Every rank's JSON-serializable `value`, as JSON bytes in uint8 tensors (no pickle crosses the process group)."""
    payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64), group=group)
    longest = max(int(size) for size in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.zeros(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    return [json.loads(bytes(data[: int(size)].tolist())) for data, size in zip(gathered, sizes, strict=True)]


def count_trained(samples: Sequence[Sample], is_weights: PerToken | None = None) -> tuple[int, int]:
    """(trained tokens, sequences with at least one trained token): the normalizers of the losses. With
    `is_weights` (MIS with `is_rejected="excluded"`), a token whose weight is 0 does not train."""
    masks = [s.effective_loss_mask() for s in samples]
    if is_weights is not None:
        masks = [
            [m and w > 0 for m, w in zip(mask, ws, strict=True)] for mask, ws in zip(masks, is_weights, strict=True)
        ]
    return sum(sum(mask) for mask in masks), sum(1 for mask in masks if any(mask))


def mismatch_weights(
    samples: Sequence[Sample],
    old_logprobs: PerToken | None,
    config: PolicyLossConfig,
    all_reduce: Callable[[torch.Tensor], None] | None = None,
) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """TIS / MIS importance weights (`importance.importance_weights`, as `config` sets them) of every response token of
    `samples`, and their metrics over the valid tokens. `old_logprobs` None: the rollout's (weights exactly 1).
    With `config.is_batch_normalize` the weights are divided by their mean over the batch; `all_reduce` (a sum
    over data-parallel ranks, e.g. `torch.distributed.all_reduce`) makes that the global batch's mean."""
    if config.is_mode is None:
        raise ValueError("mismatch_weights needs PolicyLossConfig.is_mode ('truncate' or 'mask')")
    rollout = [s.rollout_logprobs or [] for s in samples]
    cpu = torch.device("cpu")
    rollout_NT = padded_lists(rollout, cpu)
    old_NT = rollout_NT if old_logprobs is None else padded_lists(old_logprobs, cpu)
    masks = [s.effective_loss_mask() for s in samples]
    flat = torch.tensor([m for mask in masks for m in mask], dtype=torch.bool)
    mask_NT = pad_rows(flat, padding_slots([len(m) for m in masks]), False)
    weights_NT, metrics = importance_weights(
        old_NT, rollout_NT, mask_NT, level=config.is_level, mode=config.is_mode, threshold=config.is_threshold,
        threshold_low=config.is_threshold_low,
    )  # fmt: skip
    if config.is_batch_normalize:
        sums = torch.stack(importance_weight_sums(weights_NT, mask_NT, config.is_level))
        if all_reduce is not None:
            all_reduce(sums)
        batch_mean = sums[0] / sums[1].clamp(min=1)
        weights_NT = normalize_importance_weights(weights_NT, batch_mean)
        metrics["batch_norm_factor"] = batch_mean
    return [weights_NT[i, : len(s.response_tokens)].tolist() for i, s in enumerate(samples)], metrics


def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None) -> None:
    """`dist.all_reduce` in place over `group`'s ranks (default all), skipped on one rank, where it is the identity (a
    gloo collective of one rank still costs ~0.1 ms, several times a step)."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def batch_normalizers(
    samples: Sequence[Sample],
    old_logprobs: PerToken | None,
    config: PolicyLossConfig,
    all_reduce: Callable[[torch.Tensor], None],
) -> tuple[list[list[float]] | None, dict[str, torch.Tensor], int, int]:
    """What a train step needs of the whole batch before its micro-batches: the TIS / MIS weights (`config.is_mode`;
    None without), their metrics, and the trained token / sequence counts the losses are normalized by, summed over
    the data-parallel ranks by `all_reduce`. The weights come first: MIS may take rejected tokens out of the counts."""
    is_weights: list[list[float]] | None = None
    is_metrics: dict[str, torch.Tensor] = {}
    if config.is_mode is not None:
        is_weights, is_metrics = mismatch_weights(samples, old_logprobs, config, all_reduce=all_reduce)
    exclude_rejected = config.is_mode == "mask" and config.is_rejected == "excluded"
    local = torch.tensor(count_trained(samples, is_weights if exclude_rejected else None), dtype=torch.int64)
    all_reduce(local)
    global_tokens, global_seqs = (int(v) for v in local.tolist())
    return is_weights, is_metrics, global_tokens, global_seqs


def has_update_signal(advantages: PerSample, config: PolicyLossConfig) -> bool:
    """Whether any rank's batch moves the policy. A batch whose advantages are all zero (every group's rewards equal)
    has no policy-gradient signal; an AdamW step would still move the weights along stale momentum, so the update is
    skipped (unless a KL, entropy or distillation term trains)."""
    signal = torch.tensor([float(any(is_nonzero(a) for a in advantages))])
    all_reduce(signal, op=dist.ReduceOp.MAX)
    return bool(signal.item()) or config.kl_coef > 0 or config.entropy_coef > 0 or config.opd_topk_coef > 0


def token_advantages(samples: Sequence[Sample], advantages: PerSample) -> list[list[float]]:
    """One advantage per response token: a scalar per sample is broadcast, a list must match the response."""
    if len(advantages) != len(samples):
        raise ValueError(f"got {len(advantages)} advantages for {len(samples)} samples; give one per sample")
    out = []
    for sample, adv in zip(samples, advantages, strict=True):
        if isinstance(adv, (int, float)):
            out.append([float(adv)] * len(sample.response_tokens))
        elif len(adv) != len(sample.response_tokens):
            raise ValueError(
                f"sample {sample.index}: {len(adv)} token advantages for {len(sample.response_tokens)} response tokens"
            )
        else:
            out.append([float(a) for a in adv])
    return out


def check_per_token(name: str, samples: Sequence[Sample], values: Sequence[Sequence[float]] | None) -> None:
    if values is None:
        return
    if len(values) != len(samples) or any(
        len(v) != len(s.response_tokens) for s, v in zip(samples, values, strict=False)
    ):
        raise ValueError(f"{name} needs one list per sample with one value per response token")


def add_is_metrics(stats: StepStats, metrics: dict[str, torch.Tensor], samples: Sequence[Sample]) -> None:
    """`mismatch_weights`' metrics as `is_weight_*` step stats (means over the samples' valid tokens; raw_max a
    maximum; raw_min left out: the all-reduce keeps maxima only)."""
    num_valid = float(sum(sum(s.effective_loss_mask()) for s in samples))
    for name, value in metrics.items():
        if name == "raw_max":
            stats.add_max(f"is_weight_{name}", float(value))
        elif name != "raw_min":
            stats.add_mean(f"is_weight_{name}", float(value), num_valid)


def accumulate_sft_gradients(
    model: CausalLM,
    samples: Sequence[Sample],
    kernel: KernelConfig,
    max_tokens_per_micro_batch: int,
    *,
    agg_mode: str = "token-mean",
    global_num_tokens: int | None = None,
    global_num_seqs: int | None = None,
    loss_scale: float = 1.0,
    num_micro_batches: int | None = None,
    aux_losses: Sequence[AuxLoss] = (),
    aux_counts: Sequence[Sequence[int]] | None = None,
    train_policy: bool = True,
) -> StepStats:
    """Forward + backward of the SFT loss (NLL of the loss-masked response tokens, temperature 1), normalized
    over the global batch like `accumulate_policy_gradients` (same data-parallel and auxiliary-loss arguments:
    e.g. the MTP draft trains on the SFT data, its gradients isolated from the policy's). `train_policy=False`:
    the trunk's forward runs without autograd and only the auxiliary losses backpropagate (the SFT loss is still
    measured), e.g. to train the draft alone on a frozen policy."""
    local_tokens, local_seqs = count_trained(samples)
    counts = {
        "global_num_tokens": global_num_tokens if global_num_tokens is not None else local_tokens,
        "global_num_seqs": global_num_seqs if global_num_seqs is not None else local_seqs,
    }
    stats = StepStats()
    if counts["global_num_tokens"] == 0 or not samples:
        return stats
    if aux_counts is None:
        aux_counts = [aux.counts(model, samples) for aux in aux_losses]
    micro_batches = pack_samples(samples, kernel, max_tokens_per_micro_batch)
    for micro, weight in padded_passes(micro_batches, num_micro_batches):
        with torch.set_grad_enabled(train_policy):
            logprobs_K, _, hidden_NH, _ = micro_batch_forward(model, micro, with_hidden=bool(aux_losses))
            logprobs_BT, mask_BT = rows_to_padded(logprobs_K, micro)
            loss = sft_loss(logprobs_BT, mask_BT, agg_mode, **counts)
        aux_parts = aux_parts_of(model, micro, hidden_NH, samples, aux_losses, aux_counts)
        total = loss if train_policy else torch.zeros((), device=loss.device)
        for part, _ in aux_parts.values():
            total = total + part
        if total.requires_grad:
            (total * loss_scale * weight).backward()  # type: ignore[no-untyped-call]
        if weight:
            stats.add("loss", float(loss.detach()))
            stats.add("num_tokens", float(mask_BT.sum()))
            add_aux_stats(stats, aux_parts, float(mask_BT.sum()))
    return stats


def aux_parts_of(
    model: CausalLM,
    micro: MicroBatch,
    hidden_NH: torch.Tensor | None,
    samples: Sequence[Sample],
    aux_losses: Sequence[AuxLoss],
    aux_counts: Sequence[Sequence[int]],
) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Each auxiliary loss of a micro-batch (name -> its loss, its metrics), on the trunk's hidden states."""
    parts = {}
    for aux, aux_count in zip(aux_losses, aux_counts, strict=True):
        assert hidden_NH is not None
        parts[aux.name] = aux(model, micro, hidden_NH, samples, aux_count)
    return parts


def add_aux_stats(
    stats: StepStats, aux_parts: dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]], num_valid: float
) -> None:
    for name, (part, aux_metrics) in aux_parts.items():
        stats.add(f"{name}_loss", float(part.detach()))
        for metric, value in aux_metrics.items():
            stats.add_mean(metric, float(value), num_valid)


def is_nonzero(advantage: float | Sequence[float]) -> bool:
    return advantage != 0 if isinstance(advantage, (int, float)) else any(a != 0 for a in advantage)


def add_batch_stats(stats: StepStats, samples: Sequence[Sample], advantages: PerSample) -> None:
    """Sums from which `batch_summary` derives reward and advantage statistics over the global batch."""
    rewards = [s.reward for s in samples if s.reward is not None]
    per_sample = [a if isinstance(a, (int, float)) else (sum(a) / max(len(a), 1)) for a in advantages]
    for prefix, values in (("reward", rewards), ("advantage", per_sample)):
        stats.add(f"{prefix}_count", float(len(values)))
        stats.add(f"{prefix}_sum", float(sum(values)))
        stats.add(f"{prefix}_sq_sum", float(sum(v * v for v in values)))
        # every rank adds every key (the all-reduce pairs keys by name), with -inf where it has no value
        stats.add_max(f"{prefix}_max", float(max(values, default=float("-inf"))))
        stats.add_max(f"{prefix}_neg_min", -float(min(values, default=float("inf"))))


def batch_summary(metrics: dict[str, float]) -> dict[str, float]:
    out = {}
    for prefix in ("reward", "advantage"):
        if f"{prefix}_count" not in metrics:
            continue
        count = metrics.pop(f"{prefix}_count")
        total, squares = metrics.pop(f"{prefix}_sum", 0.0), metrics.pop(f"{prefix}_sq_sum", 0.0)
        neg_min, maximum = metrics.pop(f"{prefix}_neg_min"), metrics.pop(f"{prefix}_max")
        if count:
            mean = total / count
            out[f"{prefix}_mean"] = mean
            out[f"{prefix}_std"] = math.sqrt(max(squares / count - mean * mean, 0.0))
            out[f"{prefix}_min"], out[f"{prefix}_max"] = -neg_min, maximum
    return out

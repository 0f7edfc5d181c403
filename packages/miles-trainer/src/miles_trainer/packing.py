"""Sequence packing: rollout `Sample`s → micro-batches of packed variable-length sequences (no padding).

Each sample contributes its prompt + response tokens to a packed batch (the trainer path of
`miles_kernels.build_packed_batch`). Consecutive samples with the same prompt tokens (a GRPO group) share it:
the prompt is packed once and each response continues it (`build_packed_batch(parents=...)`, the layout the
engine's prefill + fork uses), so a group of n samples costs one prompt, not n. A sample's last token predicts
nothing and is left out. Neither changes a scored row's bits (a row depends only on its position and keys), so
log-probs equal the rollout's either way; `share_prompts=False` packs every sample whole.
Micro-batches are filled in sample order up to a token budget, so the same samples always pack the same way (a
sample longer than the budget gets a micro-batch of its own; a group cut by the budget repeats its prompt).

MoE routing (`routing_shape`): where every sample of a micro-batch carries the engine's recorded experts, the
micro-batch holds them on its packed rows (`routing_NLK`, miles_trainer.moe), for routing replay and the routing
metrics.

Scoring: response token j of a sample is predicted by the row before it — the prompt's last row for j = 0. The
micro-batch keeps, per response token (sample by sample, in order), that row, the token, and whether it trains
(the sample's loss mask: only the model's own tokens).
Shapes: N packed rows, K response tokens of the micro-batch.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from miles_contracts import Sample
from miles_kernels import AttentionBatch, KernelConfig, build_packed_batch
from miles_trainer.moe import recorded_routing


@dataclass(frozen=True)
class MicroBatch:
    """Packed tokens of some samples and, per response token, the row that scores it."""

    sample_indices: list[int]  # positions in the caller's sample list
    input_ids_N: torch.Tensor
    batch: AttentionBatch
    score_rows_K: torch.Tensor  # packed row whose logits predict each response token
    target_ids_K: torch.Tensor  # the response token
    loss_mask_K: torch.Tensor  # bool: the token trains (the sample's loss mask)
    response_lens: list[int]  # K split per sample (in `sample_indices` order)
    # per sample, the packed rows of its whole sequence (prompt + response, the last token excluded), in order:
    # row p holds token p (a shared prompt's rows are the prompt's, once for the group)
    sequence_rows: list[list[int]] = field(default_factory=list)
    # the engine's recorded experts (N, L, K) int32, -1 on rows none records; None: not asked for or not recorded
    routing_NLK: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_N.shape[0])

    def per_sample(self, values_K: torch.Tensor) -> list[torch.Tensor]:
        """Per-token values (K,) split into one tensor per sample."""
        return list(torch.split(values_K, self.response_lens))

    @functools.cached_property
    def slots_BT(self) -> torch.Tensor:
        """bool (B, T): the slots of the samples' right-padded rows that hold a response token (`rows_to_padded`)."""
        return padding_slots(self.response_lens)


def padding_slots(lengths: Sequence[int]) -> torch.Tensor:
    """bool (B, T = the longest): slot t of row b holds one of row b's `lengths[b]` values."""
    return torch.arange(max(lengths, default=0)) < torch.tensor(lengths, dtype=torch.int64).unsqueeze(1)


def pad_rows(values: torch.Tensor, slots_BT: torch.Tensor, fill: float | bool = 0) -> torch.Tensor:
    """Values laid end to end, row after row (K,), as right-padded rows (B, T): one masked scatter (K = the slots'
    count), so one op forward and one backward however many rows; a pure copy (its gradient too)."""
    slots_BT = slots_BT.to(values.device)
    return torch.full(slots_BT.shape, fill, dtype=values.dtype, device=values.device).masked_scatter(slots_BT, values)


def rows_to_padded(values_K: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-response-token values (K,) as (B, T) right-padded rows and the matching mask (loss mask applied)."""
    return pad_rows(values_K, micro.slots_BT), pad_rows(micro.loss_mask_K.to(values_K.device), micro.slots_BT, False)


def padded_lists(rows: Sequence[Sequence[float]], device: torch.device) -> torch.Tensor:
    """Lists of floats (one per sample) as a right-padded float32 (B, T) tensor on `device`."""
    flat = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.float32)
    return pad_rows(flat, padding_slots([len(r) for r in rows])).to(device)


def padded_passes(
    micro_batches: Sequence[MicroBatch], num_passes: int | None = None
) -> list[tuple[MicroBatch, float]]:
    """(micro-batch, weight) of each forward / backward pass: the micro-batches (weight 1), then zero-weight repeats
    of the last up to `num_passes` (sharded models: every rank runs as many passes as the busiest; a repeat's results
    are dropped, its gradient is exactly zero)."""
    last = len(micro_batches) - 1
    count = max(len(micro_batches), num_passes or 0)
    return [(micro_batches[min(i, last)], 1.0 if i <= last else 0.0) for i in range(count)]


def plan_micro_batches(
    lengths: Sequence[int], max_tokens: int, shared: Sequence[int] | None = None
) -> list[list[int]]:
    """Greedy, order-preserving groups of positions whose packed size fits `max_tokens`.

    `shared[i]`: tokens item i shares with item i - 1 (its prompt, when the two have the same one); they cost
    nothing unless i starts a micro-batch.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: a micro-batch needs a positive token budget")
    groups: list[list[int]] = []
    used = 0
    for i, length in enumerate(lengths):
        cost = length - (shared[i] if shared is not None and groups and groups[-1] else 0)
        if not groups or used + cost > max_tokens:
            groups.append([])
            used, cost = 0, length
        groups[-1].append(i)
        used += cost
    return groups


def _check(sample: Sample) -> None:
    if not sample.prompt_tokens or not sample.response_tokens:
        raise ValueError(f"sample {sample.index} needs prompt_tokens and response_tokens to train")


def plan_samples(samples: Sequence[Sample], max_tokens: int, share_prompts: bool = True) -> list[list[int]]:
    """The micro-batches `pack_samples` builds, as lists of sample positions."""
    for sample in samples:
        _check(sample)
    lengths = [s.num_tokens - 1 for s in samples]  # the last token predicts nothing
    shared = [
        len(s.prompt_tokens) if share_prompts and i and s.prompt_tokens == samples[i - 1].prompt_tokens else 0
        for i, s in enumerate(samples)
    ]
    return plan_micro_batches(lengths, max_tokens, shared)


def build_micro_batch(
    samples: Sequence[Sample],
    indices: list[int],
    kernel: KernelConfig,
    share_prompts: bool = True,
    routing_shape: tuple[int, int] | None = None,
    require_routing: bool = False,
) -> MicroBatch:
    """Pack `samples[i] for i in indices` into one micro-batch; with `routing_shape` (the model's layers and
    experts per token), the samples' recorded routing too when all carry one (`require_routing`: an error if not)."""
    ids: list[int] = []
    seq_lens: list[int] = []
    parents: list[int | None] = []
    rows: list[int] = []
    targets: list[int] = []
    trains: list[bool] = []
    sequence_rows: list[list[int]] = []

    def add_sequence(tokens: list[int], parent: int | None = None) -> int:
        start = len(ids)
        if tokens:  # a response of one token adds no rows: the prompt's last row scores it
            ids.extend(tokens)
            seq_lens.append(len(tokens))
            parents.append(parent)
        return start

    def same_prompt(i: int) -> object:
        return tuple(samples[i].prompt_tokens) if share_prompts else i

    for _, run in itertools.groupby(indices, key=same_prompt):
        group = list(run)
        for i in group:
            _check(samples[i])
        prompt = samples[group[0]].prompt_tokens
        if len(group) == 1:  # one sequence: prompt + response (its last token predicts nothing)
            sample = samples[group[0]]
            start = add_sequence(prompt + sample.response_tokens[:-1])
            rows += range(start + len(prompt) - 1, start + sample.num_tokens - 1)
            sequence_rows.append(list(range(start, start + sample.num_tokens - 1)))
        else:  # the prompt once, then each response continues it
            prompt_last_row = add_sequence(prompt) + len(prompt) - 1
            prompt_seq = len(seq_lens) - 1
            for i in group:
                response = samples[i].response_tokens
                start = add_sequence(response[:-1], prompt_seq)
                rows += [prompt_last_row, *range(start, start + len(response) - 1)]
                prompt_rows = range(prompt_last_row - len(prompt) + 1, prompt_last_row + 1)
                sequence_rows.append([*prompt_rows, *range(start, start + len(response) - 1)])
        for i in group:
            targets += samples[i].response_tokens
            trains += [m == 1 for m in samples[i].effective_loss_mask()]
    routing = None
    chosen = [samples[i] for i in indices]
    if routing_shape is not None and (require_routing or all(s.routed_experts is not None for s in chosen)):
        routing = recorded_routing(chosen, sequence_rows, len(ids), *routing_shape)
    return MicroBatch(
        routing_NLK=routing,
        sample_indices=list(indices),
        input_ids_N=torch.tensor(ids, dtype=torch.int64),
        batch=build_packed_batch(seq_lens, kernel.page_size, kernel.attention_query_tile, parents=parents),
        score_rows_K=torch.tensor(rows, dtype=torch.int64),
        target_ids_K=torch.tensor(targets, dtype=torch.int64),
        loss_mask_K=torch.tensor(trains, dtype=torch.bool),
        response_lens=[len(samples[i].response_tokens) for i in indices],
        sequence_rows=sequence_rows,
    )


def pack_samples(
    samples: Sequence[Sample],
    kernel: KernelConfig,
    max_tokens: int,
    share_prompts: bool = True,
    routing_shape: tuple[int, int] | None = None,
    require_routing: bool = False,
) -> list[MicroBatch]:
    """All samples, packed into micro-batches of at most `max_tokens` tokens (one oversized sample alone); see
    `build_micro_batch` for the routing arguments."""
    plan = plan_samples(samples, max_tokens, share_prompts)
    return [build_micro_batch(samples, group, kernel, share_prompts, routing_shape, require_routing) for group in plan]

"""Sequence packing: rollout `Sample`s → micro-batches of packed variable-length sequences (no padding).

Each sample contributes prompt + response tokens as one sequence of a packed batch (the trainer path of
`miles_kernels.build_packed_batch`). Micro-batches are filled in sample order up to a token budget, so the same
samples always pack the same way (a sample longer than the budget gets a micro-batch of its own).

Row alignment: row i of a sequence predicts token i + 1, so a response token at position p is scored by row
p - 1. `MicroBatch` keeps, per packed row, the target token, whether that target is a trained response token
(the sample's loss mask: only the model's own tokens), and which sample it belongs to.
Shapes: N packed tokens of the micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from miles_contracts import Sample
from miles_kernels import AttentionBatch, KernelConfig, build_packed_batch


@dataclass(frozen=True)
class MicroBatch:
    """Packed tokens of some samples and the row → target bookkeeping the losses need."""

    sample_indices: list[int]  # positions in the caller's sample list
    input_ids_N: torch.Tensor
    batch: AttentionBatch
    target_ids_N: torch.Tensor  # token each row predicts (0 where a row predicts nothing)
    is_response_N: torch.Tensor  # bool: the row predicts a response token
    loss_mask_N: torch.Tensor  # bool: ... and that token trains (the sample's loss mask)
    row_sample_N: torch.Tensor  # which of `sample_indices` each row belongs to

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_N.shape[0])


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Greedy, order-preserving groups of sample positions whose total length fits `max_tokens`."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: a micro-batch needs a positive token budget")
    groups: list[list[int]] = []
    used = 0
    for i, length in enumerate(lengths):
        if not groups or used + length > max_tokens:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += length
    return groups


def build_micro_batch(samples: Sequence[Sample], indices: list[int], kernel: KernelConfig) -> MicroBatch:
    """Pack `samples[i] for i in indices` into one micro-batch."""
    ids: list[int] = []
    targets: list[int] = []
    is_response: list[bool] = []
    trains: list[bool] = []
    row_sample: list[int] = []
    lengths = []
    for local, i in enumerate(indices):
        sample = samples[i]
        if not sample.prompt_tokens or not sample.response_tokens:
            raise ValueError(f"sample {sample.index} needs prompt_tokens and response_tokens to train")
        tokens = sample.prompt_tokens + sample.response_tokens
        num_prompt = len(sample.prompt_tokens)
        mask = sample.effective_loss_mask()
        ids += tokens
        lengths.append(len(tokens))
        for row in range(len(tokens)):
            target = row + 1
            is_resp = num_prompt <= target < len(tokens)
            targets.append(tokens[target] if target < len(tokens) else 0)
            is_response.append(is_resp)
            trains.append(is_resp and mask[target - num_prompt] == 1)
            row_sample.append(local)
    return MicroBatch(
        sample_indices=list(indices),
        input_ids_N=torch.tensor(ids, dtype=torch.int64),
        batch=build_packed_batch(lengths, kernel.page_size, kernel.attention_query_tile),
        target_ids_N=torch.tensor(targets, dtype=torch.int64),
        is_response_N=torch.tensor(is_response),
        loss_mask_N=torch.tensor(trains),
        row_sample_N=torch.tensor(row_sample, dtype=torch.int64),
    )


def pack_samples(samples: Sequence[Sample], kernel: KernelConfig, max_tokens: int) -> list[MicroBatch]:
    """All samples, packed into micro-batches of at most `max_tokens` tokens (one oversized sample alone)."""
    plan = plan_micro_batches([s.num_tokens for s in samples], max_tokens)
    return [build_micro_batch(samples, group, kernel) for group in plan]

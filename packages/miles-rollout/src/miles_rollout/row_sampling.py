"""The engine's sampling of a step's rows: SGLang's penalties and `min_new_tokens` applied to each row's logits,
then the kernel's sampler (`miles_kernels.sample`, reproducible per (seed, position)), and the log-probs and top
log-probs a response returns, taken from the unmodified logits (the log-prob contract, docs/architecture.md).

A row is one sequence at one position: its output so far plus `drafted`, the tokens between its last output and this
row (speculative decoding's draft tokens before a verify row, or the draft's own earlier tokens; empty for a plain
decode row). Everything is computed row by row (batch-invariant). Called by the model runner (model_runner.py) and the
draft (speculative.py). A prompt's own log-probs (`input_token_logprobs`) are `record_input_logprobs`'."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from miles_kernels import CausalLM, RowSampling, full_logprobs, sample, sampling_scores, token_logprobs
from miles_rollout.sequence import Group, Sequence


@dataclass
class Row:
    """One row to sample: `seq` after its outputs and `drafted`."""

    seq: Sequence
    drafted: list[int]

    @property
    def sampling(self) -> RowSampling:
        return self.seq.row_sampling(offset=len(self.drafted))


@dataclass
class SampledRows:
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[float, int]]]  # per row: (log-prob, token id) of the requested top log-probs


# Masks the sampling logits of rows in place: structured output's grammar matchers (grammar.py, `Grammars.mask`).
Constrain = Callable[[torch.Tensor, list[Any]], None]


def sample_tokens(
    row_logits: torch.Tensor, rows: Seq[Row], eos_ids: set[int], constrain: Constrain | None = None
) -> torch.Tensor:
    """The sampled token of every row (penalties, `logit_bias`, `min_new_tokens` and grammars applied)."""
    return sample(_sampling_logits(row_logits, rows, eos_ids, constrain), [row.sampling for row in rows])


def candidate_probs(row_logits: torch.Tensor, rows: Seq[Row], eos_ids: set[int]) -> torch.Tensor:
    """float64 (M, V): how strongly each row's sampler favours each token, as the softmax of the scores it takes the
    argmax of (penalties and the row's noise included): its most likely token is the one `sample_tokens` draws.
    A draft tree keeps each node's top-k children by it."""
    scores = sampling_scores(_sampling_logits(row_logits, rows, eos_ids), [row.sampling for row in rows])
    return torch.softmax(scores, dim=-1)


def sample_rows(
    row_logits: torch.Tensor, rows: Seq[Row], eos_ids: set[int], constrain: Constrain | None = None
) -> SampledRows:
    """Sampled tokens with their log-probs and top log-probs (of the unmodified logits)."""
    tokens = sample_tokens(row_logits, rows, eos_ids, constrain)
    temps = torch.tensor([[row.seq.group.logprob_temperature()] for row in rows], device=row_logits.device)
    logprobs = token_logprobs(row_logits, tokens, temps)
    return SampledRows(tokens.tolist(), logprobs.tolist(), _top_logprobs(row_logits, temps, rows))


def _sampling_logits(
    row_logits: torch.Tensor, rows: Seq[Row], eos_ids: set[int], constrain: Constrain | None = None
) -> torch.Tensor:
    """The logits to sample from: SGLang's penalties over each row's output so far, `logit_bias`, before
    `min_new_tokens` no stop token, and the grammar's allowed tokens (`constrain`)."""
    if constrain is None and not any(_needs_change(row) for row in rows):
        return row_logits
    out = row_logits.clone()
    for i, row in enumerate(rows):
        params = row.seq.group.params
        output = row.seq.output_ids + row.drafted
        logits = out[i]
        if params.has_penalties and output:
            ids, counts = torch.unique(torch.tensor(output, device=logits.device), return_counts=True)
            if params.repetition_penalty != 1.0:
                seen = logits[ids]
                logits[ids] = torch.where(seen > 0, seen / params.repetition_penalty, seen * params.repetition_penalty)
            logits[ids] -= params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty
        if params.logit_bias:
            ids = torch.tensor([int(key) for key in params.logit_bias], dtype=torch.long, device=logits.device)
            logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        if len(output) < params.min_new_tokens:
            stops = {*(params.stop_token_ids or ()), *(() if params.ignore_eos else eos_ids)}
            logits[torch.tensor(sorted(stops), dtype=torch.long, device=logits.device)] = float("-inf")
    if constrain is not None:
        constrain(out, [row.seq.matcher for row in rows])
    return out


def _needs_change(row: Row) -> bool:
    params = row.seq.group.params
    return (
        params.has_penalties
        or bool(params.logit_bias)
        or len(row.seq.output_ids) + len(row.drafted) < params.min_new_tokens
    )


def _top_logprobs(row_logits: torch.Tensor, temps: torch.Tensor, rows: Seq[Row]) -> list[list[tuple[float, int]]]:
    groups = [row.seq.group for row in rows]
    wanted = max(g.top_logprobs_num if g.return_logprob else 0 for g in groups)
    if wanted == 0:
        return [[] for _ in rows]
    values, indices = full_logprobs(row_logits, temps).topk(wanted, dim=-1)
    return [
        list(zip(values[j, : g.top_logprobs_num].tolist(), indices[j, : g.top_logprobs_num].tolist(), strict=True))
        for j, g in enumerate(groups)
    ]


def record_input_logprobs(model: CausalLM, group: Group, hidden_NH: torch.Tensor, first: int) -> None:
    """Add the prompt log-probs that a chunk's hidden states (prompt positions first .. first + N - 1) score: the
    row at position p scores prompt token p + 1; entries cover tokens logprob_start_len .. L - 1."""
    length = hidden_NH.shape[0]
    begin = max(group.logprob_start_len - 1, first)
    end = min(first + length, len(group.prompt_ids) - 1)
    if group.logprob_start_len == 0 and first == 0:
        group.input_logprobs.append(None)
        group.input_top_logprobs.append(None)
    if begin >= end:
        return
    logits = model.logits(hidden_NH[begin - first : end - first])
    next_ids = torch.tensor(group.prompt_ids[begin + 1 : end + 1], device=logits.device)
    temps = logits.new_full((logits.shape[0], 1), group.logprob_temperature())
    group.input_logprobs += token_logprobs(logits, next_ids, temps).tolist()
    if group.top_logprobs_num > 0:
        values, indices = full_logprobs(logits, temps).topk(group.top_logprobs_num, dim=-1)
        group.input_top_logprobs += [
            list(zip(v, i, strict=True)) for v, i in zip(values.tolist(), indices.tolist(), strict=True)
        ]

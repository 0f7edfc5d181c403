"""The trainer's log-probs of response tokens, under the DESIGN.md log-prob contract.

`log_softmax(logits / T)` over the full vocabulary in float32, T = the rollout temperature (1 for greedy),
computed by the same miles-kernels model and ops as the rollout engine. In deterministic mode these equal the
engine's returned log-probs bit for bit (true on-policy: the old-log-prob recompute pass can be skipped);
otherwise they are the recomputed old log-probs and the mismatch is measured.
Shapes: N packed rows of a micro-batch, V vocabulary.
"""

from __future__ import annotations

import torch

from miles_kernels import CausalLM, token_logprobs
from miles_trainer.losses import entropy_from_logits
from miles_trainer.packing import MicroBatch


def micro_batch_forward(
    model: CausalLM, micro: MicroBatch, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 log-prob of each row's target token (N,) — 0 on rows that predict no response token — and, when
    asked, the entropy of softmax(logits / T) on each row (N,), 0 off the response rows."""
    hidden = model.forward_hidden(micro.input_ids_N.to(_device(model)), micro.batch)
    logits_NV = model.logits(hidden)
    temps = logits_NV.new_full((logits_NV.shape[0], 1), 1.0 if temperature == 0.0 else temperature)
    is_response = micro.is_response_N.to(logits_NV.device)
    logprobs = token_logprobs(logits_NV, micro.target_ids_N.to(logits_NV.device), temps)
    logprobs = torch.where(is_response, logprobs, torch.zeros_like(logprobs))
    if not with_entropy:
        return logprobs, None
    entropy = logprobs.new_zeros(logprobs.shape)
    entropy[is_response] = entropy_from_logits(logits_NV[is_response] / temps[is_response])
    return logprobs, entropy


def micro_batch_logprobs(model: CausalLM, micro: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
    """float32 log-prob of each row's target token (N,); rows that predict no response token hold 0."""
    return micro_batch_forward(model, micro, temperature)[0]


def response_logprobs(model: CausalLM, micro: MicroBatch, temperature: float = 1.0) -> list[torch.Tensor]:
    """Per sample of the micro-batch, the log-probs of its response tokens (in order)."""
    rows = micro_batch_logprobs(model, micro, temperature)
    is_response = micro.is_response_N.to(rows.device)
    row_sample = micro.row_sample_N.to(rows.device)
    return [rows[is_response & (row_sample == i)] for i in range(len(micro.sample_indices))]


def _device(model: CausalLM) -> torch.device:
    return next(model.parameters()).device

"""The trainer's log-probs of response tokens, under the log-prob contract (docs/architecture.md).

`log_softmax(logits / T)` over the full vocabulary in float32, T = the rollout temperature (1 for greedy),
computed by the same miles-kernels model and ops as the rollout engine. In deterministic mode these equal the
engine's returned log-probs bit for bit (true on-policy: the old-log-prob recompute pass can be skipped);
otherwise they are the recomputed old log-probs and the mismatch is measured.
Shapes: N packed rows of a micro-batch, K its response tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miles_kernels import CausalLM, token_logprobs
from miles_trainer.distillation import student_logprobs_at
from miles_trainer.losses import entropy_from_logits
from miles_trainer.packing import MicroBatch, padded_passes


def micro_batch_forward(
    model: CausalLM,
    micro: MicroBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    with_hidden: bool = False,
    replay: bool = False,
    entropy_grad: bool = True,
    top_ids_KJ: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """float32 log-prob of each response token of the micro-batch (K,) and, when asked, the entropy of
    softmax(logits / T) on the row that predicts it (K,), the final-norm hidden states of every packed row
    (N, H), which a value head or an auxiliary loss reads, and the log-probs at `top_ids_KJ` (K, J: a teacher's
    top-k, miles_trainer.distillation). `replay`: the MoE layers use the micro-batch's recorded routing (routing
    replay). `entropy_grad` False: the entropy is computed outside autograd (a metric only: no graph, none of its
    K x V float32 intermediates kept for the backward); its values are the same."""
    device = _device(model)
    routing = None
    if replay:
        if micro.routing_NLK is None:
            raise ValueError("routing replay needs the micro-batch's recorded routing (pack with routing_shape)")
        routing = micro.routing_NLK.to(device)
    hidden = model.forward_hidden(micro.input_ids_N.to(device), micro.batch, routing_NLK=routing)
    logits_KV = model.logits(hidden[micro.score_rows_K.to(device)])
    temps = logits_KV.new_full((logits_KV.shape[0], 1), 1.0 if temperature == 0.0 else temperature)
    logprobs = token_logprobs(logits_KV, micro.target_ids_K.to(device), temps)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            entropy = entropy_from_logits(logits_KV / temps)
    top = None if top_ids_KJ is None else student_logprobs_at(logits_KV, top_ids_KJ.to(device), temps)
    return logprobs, entropy, hidden if with_hidden else None, top


def micro_batch_logprobs(
    model: CausalLM, micro: MicroBatch, temperature: float = 1.0, replay: bool = False
) -> torch.Tensor:
    """float32 log-prob of each response token of the micro-batch (K,), sample by sample."""
    return micro_batch_forward(model, micro, temperature, replay=replay)[0]


def response_logprobs(
    model: CausalLM, micro: MicroBatch, temperature: float = 1.0, replay: bool = False
) -> list[torch.Tensor]:
    """Per sample of the micro-batch, the log-probs of its response tokens (in order)."""
    return micro.per_sample(micro_batch_logprobs(model, micro, temperature, replay))


def batch_logprobs(
    model: CausalLM,
    micro_batches: Sequence[MicroBatch],
    num_samples: int,
    num_passes: int,
    temperature: float = 1.0,
    replay: bool = False,
) -> list[list[float]]:
    """Per sample of the batch (`num_samples`, in its order), the log-probs of its response tokens. A sharded model's
    forwards are collectives: `num_passes` (the busiest rank's count) pads this rank's with repeats of its last
    micro-batch, whose results are dropped."""
    out: list[list[float]] = [[] for _ in range(num_samples)]
    for micro, weight in padded_passes(micro_batches, num_passes):
        values = response_logprobs(model, micro, temperature, replay)
        if weight:
            for i, row in zip(micro.sample_indices, values, strict=True):
                out[i] = row.tolist()
    return out


def _device(model: CausalLM) -> torch.device:
    return next(model.parameters()).device

"""The MTP draft's loss on the rollout batch, trained online in the policy's train step (docs/architecture.md,
"Auxiliary losses"). The trainer takes it through `miles_trainer.auxiliary.AuxLoss` (it may not import miles-spec).

For a sample with tokens T_0 .. T_n (prompt of P tokens, then the response) the trunk's row p holds token p. MTP
module i (0-based) at row p reads the previous depth's output at p and the token T_{p+1+i}, and predicts
T_{p+2+i}: the tokens are shifted by i + 1 for module i, the loss mask with them. A row trains module i when the
token it predicts exists, is a response token (p + 2 + i >= P: the prompt is excluded) and has loss mask 1.
Sequences are never shifted across a sample boundary: the MTP forward packs every sample's whole sequence on its
own (a group's shared prompt rows are read once from the trunk's packing and copied per sample).

    loss = coef / D * sum_i (sum over module i's trained rows of -log p_i(T_{p+2+i})) / N_i

with D the number of modules and N_i module i's trained rows in the whole global batch (so micro-batches and ranks
sum to the batch's loss). Gradient isolation: the trunk's hidden states, the embedding and the LM head enter
detached (`CausalLM.mtp_hidden(detach_trunk=True)`, `mtp_logits(detach_trunk=True)`), so the loss trains the
MTP modules' own parameters only and the policy's gradients are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from miles_contracts import Sample
from miles_kernels import CausalLM, build_packed_batch
from miles_trainer import MicroBatch

__all__ = ["MTPLoss", "mtp_targets"]


def mtp_targets(sample: Sample, module: int) -> tuple[list[int], list[int], list[bool]]:
    """For MTP module `module` over the sample's n = num_tokens - 1 rows: (the input token of each row, the token
    it predicts (0 where none), whether the row trains). See the module docstring for the rule."""
    tokens = sample.prompt_tokens + sample.response_tokens
    n, prompt = len(tokens) - 1, len(sample.prompt_tokens)
    mask = sample.effective_loss_mask()
    inputs, targets, trains = [], [], []
    for p in range(n):
        inputs.append(tokens[p + 1 + module] if p + 1 + module <= n else 0)
        target = p + 2 + module
        targets.append(tokens[target] if target <= n else 0)
        trains.append(prompt <= target <= n and mask[target - prompt] == 1)
    return inputs, targets, trains


def unpacked_samples(
    micro: MicroBatch, samples: Sequence[Sample], device: torch.device
) -> tuple[list[Sample], list[int], torch.Tensor]:
    """A micro-batch's samples, each one's rows (num_tokens - 1) and the packed row of every one of them, sample
    after sample (a group's shared prompt rows repeated per sample): where a draft's loss reads the trunk's rows."""
    mine = [samples[i] for i in micro.sample_indices]
    rows = torch.tensor([r for seq in micro.sequence_rows for r in seq], dtype=torch.int64, device=device)
    return mine, [s.num_tokens - 1 for s in mine], rows


class MTPLoss:
    """`AuxLoss` of the model's MTP modules (all of them, chained: module i reads module i - 1's output)."""

    name = "mtp"

    def __init__(self, coef: float = 1.0) -> None:
        if coef <= 0:
            raise ValueError(f"the MTP loss coefficient must be > 0, got {coef}")
        self.coef = coef

    def parameters(self, model: CausalLM) -> list[nn.Parameter]:
        """The MTP modules' own weights (the embedding and LM head they share with the trunk excluded)."""
        if not model.mtp_layers:
            raise ValueError(
                "the model has no MTP modules (num_nextn_predict_layers = 0 in its config.json): there is no draft "
                "to train"
            )
        return model.mtp_parameters()

    def counts(self, model: CausalLM, samples: Sequence[Sample]) -> list[int]:
        """Trained rows per MTP module of `model`, over `samples`."""
        return [sum(sum(mtp_targets(s, i)[2]) for s in samples) for i in range(len(model.mtp_layers))]

    def __call__(
        self,
        model: CausalLM,
        micro: MicroBatch,
        hidden_NH: torch.Tensor,
        samples: Sequence[Sample],
        global_counts: Sequence[int],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        device = hidden_NH.device
        mine, lengths, rows = unpacked_samples(micro, samples, device)
        kernel = model.kernel
        batch = build_packed_batch(lengths, kernel.page_size, kernel.attention_query_tile, device)
        hidden = hidden_NH.detach()[rows]
        loss = hidden_NH.new_zeros((), dtype=torch.float32)
        metrics: dict[str, torch.Tensor] = {}
        depth = len(model.mtp_layers)
        for module in range(depth):
            per_sample = [mtp_targets(s, module) for s in mine]
            inputs = torch.tensor([t for x, _, _ in per_sample for t in x], dtype=torch.int64, device=device)
            targets = torch.tensor([t for _, y, _ in per_sample for t in y], dtype=torch.int64, device=device)
            trains = torch.tensor([t for _, _, m in per_sample for t in m], dtype=torch.bool, device=device)
            hidden = model.mtp_hidden(hidden, inputs, batch, module, detach_trunk=True)
            logprobs = torch.log_softmax(model.mtp_logits(hidden, detach_trunk=True), dim=-1)
            picked = logprobs.gather(-1, targets[:, None]).squeeze(-1)
            total = max(int(global_counts[module]), 1)
            loss = loss + torch.where(trains, -picked, torch.zeros_like(picked)).sum() / total
            with torch.no_grad():
                kept = trains.sum().clamp(min=1)
                correct = (logprobs.argmax(-1) == targets) & trains
                metrics[f"mtp_accuracy_{module}"] = correct.sum() / kept
        return self.coef / max(depth, 1) * loss, metrics

"""The EAGLE-3 draft's loss on the rollout batch (or on offline rows), trained in the policy's step with its own
optimizer: SpecForge's training-time test (TTT) on the policy's features from the forward that step already runs
(docs/speculative-training.md, "EAGLE-3"). The trainer takes it through `miles_trainer.auxiliary.AuxLoss`.

For a sample with tokens T_0 .. T_n (prompt of P tokens, then the response), the trunk's row p holds token p. TTT
step k (0 .. K - 1) runs the draft at every row p on step k - 1's output there (the projected features of the
trunk's three feature layers for k = 0) and the token T_{p+1+k}: the engine's draft k tokens past the target's row
p (`Eagle3Draft.forward`, `ttt_attention`). Its logits over the draft vocabulary predict T_{p+2+k}, and the target is
the policy's own distribution there (SpecForge's soft labels): softmax of the policy's logits at row p + 1 + k over
the draft vocabulary's tokens, computed without autograd from the hidden states of the forward. A row trains step k
when T_{p+2+k} exists, is a response token with loss mask 1 (prompt and tool-output tokens are excluded; nothing
shifts across a sample boundary) and the policy's most likely token there is in the draft vocabulary (SpecForge's
position mask; always, with the full vocabulary):

    loss = coef * sum_k 0.8^k * (sum over step k's trained rows of -sum_d p_d log q_d) / N_k

with q the draft's softmax, 0.8^k SpecForge's step weights, and N_k the rows of step k whose token trains in the
whole global batch (micro-batches and ranks sum to the batch's loss). Gradient isolation: features, hidden states
and the embedding enter detached, the draft's parameters are its own (`model.eagle3`), so the policy's update is
bitwise the same with and without it. Metrics: `eagle3_accuracy_{k}`, the share of step k's trained rows where the
draft's most likely token is the policy's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from miles_contracts import Sample
from miles_kernels import CausalLM, Eagle3Draft
from miles_spec.mtp_loss import unpacked_samples
from miles_trainer import MicroBatch

__all__ = ["STEP_WEIGHT", "Eagle3Loss", "eagle3_targets"]

STEP_WEIGHT = 0.8  # SpecForge's ploss_weight: step k's loss counts 0.8^k


def eagle3_targets(sample: Sample, step: int) -> tuple[list[int], list[int], list[bool]]:
    """For TTT step `step` over the sample's n = num_tokens - 1 rows: (the input token of each row, the row whose
    policy distribution is its target (0 where none), whether the row trains). See the module docstring."""
    tokens = sample.prompt_tokens + sample.response_tokens
    n, prompt = len(tokens) - 1, len(sample.prompt_tokens)
    mask = sample.effective_loss_mask()
    inputs, target_rows, trains = [], [], []
    for p in range(n):
        inputs.append(tokens[p + 1 + step] if p + 1 + step <= n else 0)
        predicted = p + 2 + step
        target_rows.append(p + 1 + step if predicted <= n else 0)
        trains.append(prompt <= predicted <= n and mask[predicted - prompt] == 1)
    return inputs, target_rows, trains


class Eagle3Loss:
    """`AuxLoss` of the model's attached EAGLE-3 draft over `ttt_length` TTT steps."""

    name = "eagle3"

    def __init__(self, coef: float = 1.0, ttt_length: int = 7) -> None:
        if coef <= 0:
            raise ValueError(f"the EAGLE-3 loss coefficient must be > 0, got {coef}")
        if ttt_length < 1:
            raise ValueError(f"ttt_length must be >= 1, got {ttt_length}")
        self.coef = coef
        self.ttt_length = ttt_length

    @staticmethod
    def _draft(model: CausalLM) -> Eagle3Draft:
        if model.eagle3 is None:
            raise ValueError(
                "the model has no EAGLE-3 draft attached (FSDP2Backend(eagle3_draft=...)): nothing to train"
            )
        return model.eagle3

    def parameters(self, model: CausalLM) -> list[nn.Parameter]:
        """The attached draft's weights (it embeds with the trunk's embedding, which it does not train)."""
        return list(self._draft(model).parameters())

    def counts(self, model: CausalLM, samples: Sequence[Sample]) -> list[int]:
        """Rows per TTT step whose token trains, over `samples`."""
        return [sum(sum(eagle3_targets(s, k)[2]) for s in samples) for k in range(self.ttt_length)]

    def __call__(
        self,
        model: CausalLM,
        micro: MicroBatch,
        hidden_NH: torch.Tensor,
        samples: Sequence[Sample],
        global_counts: Sequence[int],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        draft = self._draft(model)
        if model.last_draft_features is None:
            raise RuntimeError("the trunk's forward kept no EAGLE-3 features: attach the draft before the forward")
        device = hidden_NH.device
        mine, lengths, rows = unpacked_samples(micro, samples, device)
        features = model.last_draft_features.detach()[rows]
        starts = torch.tensor([0, *lengths[:-1]], device=device).cumsum(0).tolist()
        per_step = [[eagle3_targets(s, k) for s in mine] for k in range(self.ttt_length)]
        ids = torch.tensor([[t for x, _, _ in step for t in x] for step in per_step], dtype=torch.int64, device=device)
        embedded = model.token_embeddings(ids.flatten()).view(*ids.shape, -1)
        logits_steps = draft(features, embedded, lengths)
        with torch.no_grad():  # the policy's distributions over the draft vocabulary, at every row
            target_logits = model.logits(hidden_NH.detach()[rows])
            draft_ids = draft.target_ids
            target_logp = torch.log_softmax(target_logits[:, draft_ids], dim=-1)
            target_top = target_logits.argmax(-1)
            in_draft = draft.t2d[target_top]
        loss = hidden_NH.new_zeros((), dtype=torch.float32)
        metrics: dict[str, torch.Tensor] = {}
        for k, (step, logits) in enumerate(zip(per_step, logits_steps, strict=True)):
            target_rows = torch.tensor([start + r for start, (_, t, _) in zip(starts, step, strict=True) for r in t],
                                       dtype=torch.int64, device=device)  # fmt: skip
            trains = torch.tensor([m for _, _, mask in step for m in mask], dtype=torch.bool, device=device)
            trains &= in_draft[target_rows]
            logq = torch.log_softmax(logits, dim=-1)
            cross = -(target_logp[target_rows].exp() * logq).sum(-1)
            total = max(int(global_counts[k]), 1)
            loss = loss + STEP_WEIGHT**k * torch.where(trains, cross, torch.zeros_like(cross)).sum() / total
            with torch.no_grad():
                proposed = draft_ids[logits.argmax(-1)]
                correct = (proposed == target_top[target_rows]) & trains
                metrics[f"eagle3_accuracy_{k}"] = correct.sum() / trains.sum().clamp(min=1)
        return self.coef * loss, metrics

"""Auxiliary losses: extra terms of the train step that train their own parameters (docs/architecture.md,
"Auxiliary losses"), e.g. the MTP draft's loss that miles-spec provides (the trainer may not import miles-spec, so
it takes such losses through this interface).

An auxiliary loss runs on every micro-batch of the policy's step, on the trunk's hidden states of that forward
(one forward for both), and must keep to gradient isolation: whatever it reads of the policy (hidden states,
embedding, LM head) enters detached, so the policy's gradients are bitwise those of a step without it. The
parameters it trains (`parameters`) leave the policy's optimizer and gradient clipping and get their own AdamW and
clipping (`FSDP2Backend(aux_losses=..., aux_optimizer=...)`; `MegatronBackend`'s likewise, where they train the MTP
modules beside the last pipeline stage: megatron_mtp.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from miles_contracts import Sample
from miles_kernels import CausalLM
from miles_trainer.packing import MicroBatch

__all__ = ["AuxLoss"]


@runtime_checkable
class AuxLoss(Protocol):
    """An auxiliary loss of the train step (see the module docstring)."""

    name: str

    def parameters(self, model: CausalLM) -> list[nn.Parameter]:
        """The parameters this loss trains (their names stay the model's; none of the policy's)."""
        ...

    def counts(self, model: CausalLM, samples: Sequence[Sample]) -> list[int]:
        """This rank's normalizers (e.g. tokens per term); the step sums them over ranks and passes the totals."""
        ...

    def __call__(
        self,
        model: CausalLM,
        micro: MicroBatch,
        hidden_NH: torch.Tensor,
        samples: Sequence[Sample],
        global_counts: Sequence[int],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss of this micro-batch, normalized by `global_counts` so micro-batches sum to the batch's loss;
        token-mean metrics of this micro-batch). `hidden_NH`: the trunk's final-norm hidden states of every packed
        row; `samples`: the step's samples (`micro.sample_indices` index them)."""
        ...

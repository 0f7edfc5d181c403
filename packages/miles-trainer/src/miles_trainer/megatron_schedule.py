"""The Megatron backend's micro-batch loop: megatron-core's schedule (`get_forward_backward_func`) over the packed
micro-batches (docs/megatron.md, "How a step runs").

With one pipeline stage that is a forward and a backward per micro-batch; with PP stages megatron-core's 1F1B
schedule (interleaved over the model chunks with virtual stages) sends each micro-batch's hidden states from stage
to stage (their shapes first: packed micro-batches differ in shape) and its gradients back. A micro-batch's loss (or
its log-probs) is computed on the last stage, by the FSDP2 backend's step code (`policy_step.PolicyStep`), from the
final-norm hidden states the schedule hands it: `LastStageOutput` serves them to that code as a model would (and
the MTP modules beside the last stage to an auxiliary loss, `megatron_mtp.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from miles_trainer.megatron_model import MegatronCausalLM, PaddedBatch
from miles_trainer.megatron_moe import StagePass
from miles_trainer.packing import MicroBatch

Pass = tuple[MicroBatch, float]  # a micro-batch and its weight (0: a padding pass, its results dropped)
# on the last stage: (the micro-batch's output there, the micro-batch, its weight) -> the loss to backpropagate
LastStageFn = Callable[["LastStageOutput", MicroBatch, float], torch.Tensor]


class LastStageOutput:
    """The last stage's hidden states of one micro-batch, served as a model's `forward_hidden` (the step code's
    interface), with the chunk's output layer for the logits, and its MTP modules (`mtp_layers`, `mtp_hidden`,
    `mtp_logits`: `CausalLM`'s interface) run on the micro-batch's padded layout."""

    def __init__(self, chunk: MegatronCausalLM, hidden_NH: torch.Tensor, padded: PaddedBatch | None = None) -> None:
        self.chunk, self.hidden_NH, self.config, self.kernel = chunk, hidden_NH, chunk.config, chunk.kernel
        self.padded = padded

    def forward_hidden(self, input_ids_N: torch.Tensor, batch: Any, routing_NLK: Any = None) -> torch.Tensor:
        return self.hidden_NH  # routing replay, if any, ran in the stages' forwards (`run_schedule`'s stage_pass)

    def logits(self, hidden_KH: torch.Tensor) -> torch.Tensor:
        return self.chunk.logits(hidden_KH)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.chunk.parameters()

    def moe_layers(self) -> dict[int, Any]:
        return self.chunk.moe_layers()

    @property
    def mtp_layers(self) -> list[Any]:
        return self.chunk.mtp.mtp_layers if self.chunk.mtp is not None else []

    def mtp_hidden(self, hidden_NH: torch.Tensor, next_ids_N: torch.Tensor, batch: Any, module: int = 0,
                   detach_trunk: bool = False) -> torch.Tensor:  # fmt: skip
        out: torch.Tensor = self.chunk.mtp.hidden(self.chunk, self.padded, hidden_NH, next_ids_N, batch, module,
                                                  detach_trunk)  # fmt: skip
        return out

    def mtp_logits(self, hidden_NH: torch.Tensor, detach_trunk: bool = False) -> torch.Tensor:
        return self.chunk.logits(hidden_NH, detach_weight=detach_trunk)


def run_schedule(
    chunks: Sequence[MegatronCausalLM], passes: Sequence[Pass], last_stage: LastStageFn, forward_only: bool,
    stage_pass: StagePass | None = None,
) -> None:  # fmt: skip
    """Every pass through this rank's model chunks in megatron-core's schedule; `last_stage` makes each pass's loss
    where the output layer is (its backward runs when the schedule says, unless `forward_only`). `stage_pass` wraps
    each pass's forward through a chunk (the MoE routers' replay, losses and metrics: megatron_moe.py). Every rank of
    the pipeline calls this with the same passes."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    by_module = {id(chunk.gpt_ddp): chunk for chunk in chunks}
    no_tokens = torch.zeros((), dtype=torch.int)  # the losses are normalized already: nothing for Megatron to count

    def forward_step(data: Iterator[Pass], module: torch.nn.Module) -> tuple[torch.Tensor, Callable[..., Any]]:
        chunk = by_module[id(module)]
        micro, weight = next(data)
        device = next(chunk.parameters()).device
        padded = chunk.padded_batch(micro.input_ids_N.to(device), micro.batch)
        with stage_pass(chunk, micro, weight, padded) if stage_pass else contextlib.nullcontext():
            hidden_SBH = chunk.stage_forward(padded)

        def loss_func(output_SBH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            output = LastStageOutput(chunk, chunk.hidden_rows(output_SBH, padded), padded)
            return last_stage(output, micro, weight), no_tokens, {}

        return hidden_SBH, loss_func

    iterators = [iter(passes) for _ in chunks]
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=[chunk.gpt_ddp for chunk in chunks], num_microbatches=len(passes), seq_length=1, micro_batch_size=1,
        forward_only=forward_only,
    )  # fmt: skip


def from_last_stage(values: list[list[float]], device: torch.device) -> list[list[float]]:
    """`values` (per-sample lists, filled on the last pipeline stage) on every stage: broadcast over the pipeline
    group as float32, the dtype of the log-probs they hold (the other stages pass lists of the right lengths)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return values
    flat = torch.tensor([v for row in values for v in row], dtype=torch.float32, device=device)
    dist.broadcast(flat, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    out, start = [], 0
    for row in values:
        out.append(flat[start : start + len(row)].tolist())
        start += len(row)
    return out

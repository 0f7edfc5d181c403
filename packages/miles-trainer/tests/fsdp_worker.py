"""One rank of the FSDP2 test (run as its own process by test_fsdp.py; RANK / WORLD_SIZE / MASTER_* set).

Takes every WORLD_SIZE-th sample of a fixed batch, runs one FSDP2 optimizer step, and (rank 0) writes the
full parameters and the step metrics to OUT_DIR.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from miles_contracts import Sample
from miles_kernels import KernelConfig
from miles_trainer.fsdp import FSDP2Backend, OptimizerConfig, export_hf, load_checkpoint, save_checkpoint
from miles_trainer.step import PolicyLossConfig

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)


def batch() -> tuple[list[Sample], list[float]]:
    generator = torch.Generator().manual_seed(0)
    samples, advantages = [], []
    for i in range(8):
        num_prompt, num_response = 4 + (5 * i) % 11, 3 + (3 * i) % 7
        tokens = torch.randint(0, 256, (num_prompt + num_response,), generator=generator).tolist()
        samples.append(Sample(
            index=i, group_index=i // 4, prompt="", prompt_tokens=tokens[:num_prompt],
            response_tokens=tokens[num_prompt:],
            rollout_logprobs=(-torch.rand(num_response, generator=generator) - 4.0).tolist(),
        ))  # fmt: skip
        advantages.append(float(torch.randn(1, generator=generator)))
    return samples, advantages


def main(model_dir: str, out_dir: str, mode: str = "step") -> None:
    """mode: `step` (one step), `two-steps` (step, checkpoint, step), `resume` (load checkpoint, step)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = FSDP2Backend(
        model_dir, KERNEL, OptimizerConfig(lr=1e-3, max_grad_norm=1e9, warmup_steps=2),
        PolicyLossConfig(agg_mode="seq-mean-token-mean"), max_tokens_per_micro_batch=24,
    )  # fmt: skip
    samples, advantages = batch()
    checkpoint = os.path.join(os.path.dirname(out_dir), "checkpoint")
    if mode == "resume":
        load_checkpoint(backend, checkpoint)
    else:
        metrics = backend.train_step(samples[rank::world], advantages[rank::world])
    if mode == "two-steps":
        save_checkpoint(backend, checkpoint)
    if mode in ("two-steps", "resume"):
        advantages = [-a for a in advantages]  # a different second step
        metrics = backend.train_step(samples[rank::world], advantages[rank::world])
        export_hf(backend, os.path.join(out_dir, "hf"))
    state = backend.full_state_dict()
    if rank == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "params.safetensors"))
        with open(os.path.join(out_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f)
    # Leave together: a rank that exits while another still holds gloo connections to it can abort that rank.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])

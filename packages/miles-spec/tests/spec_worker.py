"""One rank of the multi-rank MTP test (run as its own process by test_mtp_loss.py; RANK / WORLD_SIZE / MASTER_*
set): two FSDP2 steps with the MTP loss on this rank's share of a fixed batch; rank 0 writes the metrics and the
full parameters."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from miles_contracts import Sample
from miles_kernels import KernelConfig
from miles_spec import MTPLoss
from miles_trainer import BackendConfig, FSDP2Backend, OptimizerConfig, PolicyLossConfig


def main(model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    kernel = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)
    backend = FSDP2Backend(model_dir, kernel, OptimizerConfig(lr=1e-2), PolicyLossConfig(),
                           BackendConfig(max_tokens_per_micro_batch=24), aux_losses=[MTPLoss()],
                           aux_optimizer=OptimizerConfig(lr=5e-2))  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    samples = []
    for i in range(8):
        tokens = torch.randint(0, 256, (6 + i + 4 + i % 3,), generator=generator).tolist()
        samples.append(Sample(index=i, group_index=i, prompt="", prompt_tokens=tokens[: 6 + i],
                              response_tokens=tokens[6 + i :], rollout_logprobs=[-2.0] * (4 + i % 3)))  # fmt: skip
    advantages = [float(i % 3) - 1.0 for i in range(8)]
    metrics = {}
    for _ in range(2):
        metrics = backend.train_step(samples[rank::world], advantages[rank::world])
    state = backend.full_state_dict()
    if rank == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, str(Path(out_dir) / "params.safetensors"))
        (Path(out_dir) / "metrics.json").write_text(json.dumps(metrics))
    dist.barrier()
    dist.destroy_process_group()
    # Skip the interpreter's teardown, where a rare gloo-thread abort was seen in CI (miles-trainer's
    # tests/fsdp_worker.py, leave_together): the outputs are closed and both ranks are done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])

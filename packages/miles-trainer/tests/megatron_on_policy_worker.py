"""One rank of test_megatron_on_policy.py (its own process; RANK / WORLD_SIZE / MASTER_* set), on the CPU inside
`megatron_on_cpu()`.

The Megatron backend in deterministic mode (the Miles layers, `megatron_kernels`) with the layout in
MILES_TEST_MEGATRON (`MegatronConfig` fields as JSON), in MILES_TEST_DTYPE (default float32), computes the log-probs
of its data-parallel share of the rollout in `samples.json` (beside the model directory) at two micro-batch token
budgets (different packings), then makes one training step measuring the train / rollout mismatch on the same share,
and reports the kernel fingerprint the on-policy guard compares with the engine's; rank 0 writes every rank's
results to `out_dir/results.json`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from miles_contracts import Sample
from miles_kernels import KernelConfig
from miles_trainer import BackendConfig, MegatronBackend, OptimizerConfig, PolicyLossConfig, megatron_on_cpu
from miles_trainer.config import MegatronConfig

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)


def kernel(dtype: str = "float32") -> KernelConfig:
    """The tests' kernel config in `dtype` (MILES_TEST_DTYPE for the ranks)."""
    return KERNEL.model_copy(update={"dtype": dtype})


BUDGETS = (40, 1000)  # tokens per micro-batch: several samples per micro-batch, or all of a rank's in one


def main(model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    layout = MegatronConfig(**json.loads(os.environ["MILES_TEST_MEGATRON"]))
    raw = json.loads((Path(model_dir).parent / "samples.json").read_text())
    samples = [Sample(**sample) for sample in raw]
    with megatron_on_cpu():
        backend = MegatronBackend(
            model_dir, kernel(os.environ.get("MILES_TEST_DTYPE", "float32")), OptimizerConfig(lr=1e-3),
            PolicyLossConfig(),
            BackendConfig(name="megatron", megatron=layout, max_tokens_per_micro_batch=BUDGETS[0]),
        )  # fmt: skip
        rank, size = backend.data_parallel
        mine = samples[rank::size]
        logprobs = {}
        for budget in BUDGETS:
            backend.max_tokens = budget
            logprobs[budget] = backend.compute_logprobs(mine)
        advantages = [1.0 if i % 2 else -1.0 for i in range(len(mine))]
        metrics = backend.train_step(mine, advantages, measure_mismatch=True)
    mine_result = {"indices": [s.index for s in mine], "logprobs": logprobs, "metrics": metrics,
                   "layers": type(backend.model.gpt.decoder.layers[0].self_attention).__name__,
                   "fingerprint": backend.kernel_fingerprint("cpu")}  # fmt: skip
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine_result)
    if dist.get_rank() == 0:
        (Path(out_dir) / "results.json").write_text(json.dumps(gathered))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

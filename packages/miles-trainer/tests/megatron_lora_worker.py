"""One rank of test_megatron_lora.py (its own process; RANK / WORLD_SIZE / MASTER_* set), on the CPU inside
`megatron_on_cpu()`: the Megatron backend with LoRA (`megatron_lora`), layout MILES_TEST_MEGATRON (`MegatronConfig`
fields as JSON), kernel mode MILES_TEST_MODE (deterministic: the Miles layers; fast: megatron-core's), dtype
MILES_TEST_DTYPE (float32 by default).

Modes:
- `on-policy`: an engine model in this process (the base, `add_lora`, each sync loaded and merged by
  `fold_adapters`, as the engine does) samples; the trainer's log-probs of its data-parallel share must equal the
  rollout's bit for bit; a step; sync; three times. Records whether the frozen base moved, which parameters train,
  sync sizes, the checksum against the engine's, and whether the reference log-probs (kept: `keep_reference`) are
  the base model's, bit for bit, with no reference copy.
- `step`: two steps on fsdp_worker's batch (its data-parallel share; the second with the advantages negated), then
  the adapters (HF names) to adapters.safetensors.
- `two-steps`: as `step` with a checkpoint between the steps and a Hugging Face export (`final/`: the PEFT adapter
  and merged/) after them; `resume`: load the checkpoint, the second step -> adapters.safetensors.
Rank 0 writes results.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from fsdp_worker import batch
from safetensors.torch import save_file
from test_true_on_policy import rollout

from miles_kernels import (
    KernelConfig,
    add_lora,
    checkpoint_tensors,
    fold_adapters,
    load_model,
    load_state,
    weights_checksum,
)
from miles_trainer import (
    BackendConfig,
    LoraTrainConfig,
    MegatronBackend,
    OptimizerConfig,
    PolicyLossConfig,
    export_hf,
    load_checkpoint,
    megatron_on_cpu,
    save_checkpoint,
)
from miles_trainer.config import MegatronConfig

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4,
                      dtype=os.environ.get("MILES_TEST_DTYPE", "float32"))  # fmt: skip
LORA = LoraTrainConfig(rank=4, alpha=8, export_merged=True)
OPTIMIZER = {"lr": 1e-2, "max_grad_norm": 1e9}  # MILES_TEST_OPTIMIZER (JSON) overrides these fields


def make_backend(model_dir: str, keep_reference: bool = False) -> MegatronBackend:
    layout = MegatronConfig(**{"moe_token_dispatcher": "alltoall"} | json.loads(os.environ["MILES_TEST_MEGATRON"]))
    kernel = KERNEL.model_copy(update={"mode": os.environ.get("MILES_TEST_MODE", "deterministic")})
    return MegatronBackend(
        model_dir, kernel, OptimizerConfig(**OPTIMIZER | json.loads(os.environ.get("MILES_TEST_OPTIMIZER", "{}"))),
        PolicyLossConfig(agg_mode="seq-mean-token-mean"),
        BackendConfig(name="megatron", max_tokens_per_micro_batch=64, megatron=layout), lora=LORA,
        keep_reference=keep_reference,
    )  # fmt: skip


def on_policy(backend: MegatronBackend, model_dir: str) -> dict:
    engine = load_model(model_dir, KERNEL)
    add_lora(engine, LORA.adapters())
    base = {n: p.detach().clone() for c in backend.chunks for n, p in c.gpt.named_parameters() if not p.requires_grad}
    trained = sorted(n for c in backend.chunks for n, p in c.gpt.named_parameters() if p.requires_grad)
    result: dict = {"trained": trained, "equal": [], "mismatch": [], "sync_bytes": []}

    def sync() -> None:
        tensors = backend.weights.export_weights()
        result["sync_bytes"].append(sum(t.numel() * t.element_size() for t in tensors.values()))
        result["sync_names"] = sorted(tensors)
        load_state(engine, tensors)
        fold_adapters(engine)

    sync()
    engine_checksum = weights_checksum(checkpoint_tensors(engine, mtp_copies=False).items())
    result["checksum_matches"] = backend.weights.checksum() == engine_checksum
    rank, size = backend.data_parallel
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        prompts = [torch.randint(0, 256, (4 + i,), generator=generator).tolist() for i in range(4)]
        samples = rollout(engine, prompts, num_new=5, temperature=1.0)[rank::size]
        advantages = [1.0 if i % 2 else -1.0 for i in range(len(samples))]
        result["equal"].append(backend.compute_logprobs(samples) == [s.rollout_logprobs for s in samples])
        metrics = backend.train_step(samples, advantages, measure_mismatch=True)
        result["mismatch"].append(metrics["train_rollout_logprob_abs_diff_max"])
        sync()
    result["base_moved"] = [n for c in backend.chunks for n, p in c.gpt.named_parameters()
                            if n in base and not torch.equal(p, base[n])]  # fmt: skip
    ids = {id(p) for c in backend.chunks for p in c.gpt.parameters() if p.requires_grad}
    masters = {id(m) for m in backend.masters}  # the adapters themselves in float32, their float32 masters in bf16
    result["optimizer_is_adapters"] = {id(p) for p in backend.params} == ids and (
        {id(p) for p in backend.optimizer.state} == masters
    )
    base_engine = load_model(model_dir, KERNEL)  # the base: a LoRA run's KL reference, with no copy kept
    prompts = [[5, 9, 200, 31], [7, 7, 1, 90, 2, 4]]
    samples = rollout(base_engine, prompts, num_new=5, temperature=1.0)[rank::size]
    result["reference_is_base"] = backend.compute_logprobs(samples, reference=True) == [
        s.rollout_logprobs for s in samples
    ]
    result["reference_chunks"] = backend.reference_chunks is not None
    result["adapters_moved"] = any(bool(t.abs().sum() > 0) for n, t in backend.full_state_dict().items()
                                   if n.endswith("lora_B"))  # fmt: skip
    return result


def main(model_dir: str, out_dir: str, mode: str, checkpoint: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    with megatron_on_cpu():
        backend = make_backend(model_dir, keep_reference=mode == "on-policy")
        result: dict = {}
        if mode == "on-policy":
            result = on_policy(backend, model_dir)
        else:
            samples, advantages = batch()
            rank, size = backend.data_parallel
            mine, my_advantages = samples[rank::size], advantages[rank::size]
            if mode == "resume":
                load_checkpoint(backend, checkpoint)
            else:
                backend.train_step(mine, my_advantages)
            if mode == "two-steps":
                save_checkpoint(backend, checkpoint)
            backend.train_step(mine, [-a for a in my_advantages])
            if mode == "two-steps":
                export_hf(backend, os.path.join(out_dir, "final"))
            adapters = {n: t for n, t in backend.full_state_dict().items() if n.endswith(("lora_A", "lora_B"))}
            if dist.get_rank() == 0:
                save_file(
                    {k: v.contiguous() for k, v in adapters.items()}, os.path.join(out_dir, "adapters.safetensors")
                )
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])

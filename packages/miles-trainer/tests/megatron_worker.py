"""One rank of the Megatron backend tests (run as its own process by test_megatron.py; RANK / WORLD_SIZE /
MASTER_* set), on the CPU inside `megatron_on_cpu()`.

MILES_TEST_MEGATRON is the layout as JSON (`MegatronConfig` fields; by default megatron-core's own modules,
`layer_spec: megatron`, whatever the kernel mode). The rank takes its data-parallel share of
fsdp_worker's batch (TP peers the same samples), records the log-probs before the step, runs one optimizer step with
fsdp_worker's optimizer and loss settings, and rank 0 writes the full parameters (HF names) and the metrics. Modes
(fsdp_worker's): `step`; `two-steps` (step, checkpoint, a second step with the advantages negated, then a Hugging
Face export); `resume` (load the checkpoint, the second step);
`offload` (step, offload, onload, the second step: must equal `two-steps`).
MILES_TEST_MTP=1 trains the model's MTP modules online (fsdp_worker's `mtp_losses`); `two-steps` then first makes
the same step without them (`plain.safetensors`, `plain_metrics.json`: gradient isolation), records the first
step (`step1.*`) and offloads / onloads before the second.
MILES_TEST_MOE: fsdp_worker's (routing replay and the MoE losses). MILES_TEST_CRITIC (and
MILES_TEST_CRITIC_WARMUP): fsdp_worker's PPO critic, its tensors and values (`critic.safetensors`, `critic.json`).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from fsdp_worker import (
    KERNEL,
    batch,
    critic_config,
    critic_step,
    moe_options,
    mtp_losses,
    recorded_experts,
    write_critic,
)
from safetensors.torch import save_file

from miles_trainer import (
    BackendConfig,
    MegatronBackend,
    OptimizerConfig,
    PolicyLossConfig,
    export_hf,
    load_checkpoint,
    megatron_on_cpu,
    save_checkpoint,
)
from miles_trainer.config import MegatronConfig


def main(model_dir: str, out_dir: str, mode: str, checkpoint: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    defaults = {"moe_token_dispatcher": "allgather", "layer_spec": "megatron"}  # megatron-core's own modules
    layout = MegatronConfig(**defaults | json.loads(os.environ["MILES_TEST_MEGATRON"]))
    aux = mtp_losses()
    with megatron_on_cpu():
        samples, advantages = batch()
        samples = recorded_experts(samples, moe_options(model_dir)[2])
        if aux and mode == "two-steps":  # the same step without the MTP loss, in a backend of its own
            plain = make_backend(model_dir, layout, [])
            rank, size = plain.data_parallel
            torch.manual_seed(1000 + dist.get_rank())
            write_step(out_dir, "plain", plain, plain.train_step(samples[rank::size], advantages[rank::size],
                                                                 measure_mismatch=True))  # fmt: skip
            del plain
        backend = make_backend(model_dir, layout, aux)
        rank, size = backend.data_parallel
        mine, my_advantages = samples[rank::size], advantages[rank::size]
        logprobs = backend.compute_logprobs(mine)
        values: dict[str, list[list[float]]] = {}  # the critic's, before and after the last step
        if mode == "resume":
            torch.manual_seed(7)  # overwritten by the checkpoint's RNG state
            load_checkpoint(backend, checkpoint)
        else:
            torch.manual_seed(1000 + dist.get_rank())
            metrics = critic_step(backend, mine, my_advantages, values, measure_mismatch=True)
            if aux and mode == "two-steps":
                write_step(out_dir, "step1", backend, metrics)
        if mode == "two-steps":
            save_checkpoint(backend, checkpoint, extra={"data_position": 8})
        if mode == "offload" or (aux and mode == "two-steps"):  # with MTP: resume must equal the round trip too
            offloaded = backend.offload()
            assert backend.is_offloaded and backend.onload() == offloaded  # the gradient buffers come back zeroed
        if mode in ("two-steps", "resume", "offload"):
            metrics = critic_step(backend, mine, [-a for a in my_advantages], values)
            metrics["rng_draw"] = float(torch.rand(1))
        if mode == "two-steps":
            export_hf(backend, os.path.join(out_dir, "hf"))
        state = backend.full_state_dict()
        checksum = backend.weights.checksum()
        if backend.critic_config is not None:
            write_critic(out_dir, backend.critic.full_state_dict(), values)
    gathered: list[object] = [None] * dist.get_world_size()
    layers = sum(len(chunk.gpt.decoder.layers) for chunk in backend.chunks)  # this rank's decoder layers
    dist.all_gather_object(gathered, (rank, logprobs, layers))
    if dist.get_rank() == 0:
        by_sample: dict[int, list[float]] = {}
        for dp_rank, rows, _ in gathered:  # type: ignore[misc]
            for sample, row in zip(samples[dp_rank::size], rows, strict=True):
                by_sample[sample.index] = row
        metrics["checksum_matches"] = float(checksum == weights_of(state))
        metrics["rank_layers"] = [count for _, _, count in gathered]  # type: ignore[misc]
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "params.safetensors"))
        with open(os.path.join(out_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f)
        with open(os.path.join(out_dir, "logprobs.json"), "w") as f:
            json.dump([by_sample[i] for i in sorted(by_sample)], f)
    # Not fsdp_worker.leave_together's os._exit: megatron-core's checkpoint writer processes must be reaped by
    # multiprocessing's exit handler, or they outlive the rank holding its output pipe open (the test then hangs).
    dist.barrier()
    dist.destroy_process_group()


def make_backend(model_dir: str, layout: MegatronConfig, aux_losses: list) -> MegatronBackend:
    moe, routing_replay, _ = moe_options(model_dir)
    return MegatronBackend(
        model_dir, KERNEL, OptimizerConfig(lr=1e-3, max_grad_norm=1e9, warmup_steps=2),
        PolicyLossConfig(agg_mode="seq-mean-token-mean", **moe),  # type: ignore[arg-type]
        BackendConfig(name="megatron", max_tokens_per_micro_batch=24, megatron=layout), aux_losses=aux_losses,
        routing_replay=routing_replay, critic=critic_config(),
    )  # fmt: skip


def write_step(out_dir: str, name: str, backend: MegatronBackend, metrics: dict[str, float]) -> None:
    """The full parameters (HF names) and the metrics after a step: `name`.safetensors, `name`_metrics.json."""
    state = backend.full_state_dict()
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, f"{name}.safetensors"))
        with open(os.path.join(out_dir, f"{name}_metrics.json"), "w") as f:
            json.dump(metrics, f)


def weights_of(state: dict[str, torch.Tensor]) -> str:
    from miles_kernels import weights_checksum

    return weights_checksum((k, v if k.endswith("e_score_correction_bias") else v.to(KERNEL.torch_dtype))
                            for k, v in state.items())  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:5])

"""One rank of the FSDP2 tests (run as its own process by test_fsdp.py; RANK / WORLD_SIZE / MASTER_* set).

Takes every WORLD_SIZE-th sample of a fixed batch and runs FSDP2 optimizer steps; rank 0 writes the full
parameters and the last step's metrics to OUT_DIR. Modes:
- `step`: one step.
- `two-steps`: step, checkpoint, step.
- `kill`: step, checkpoint, step, then a second checkpoint that is SIGKILLed half-way through the save.
- `resume`: load the checkpoint, step (the second step of `two-steps`).
- `offload`: step, offload, onload, step (must equal `two-steps`); writes the bytes freed and RSS change.
- `buckets`: peak RSS growth while iterating the weight buckets, and the decoded buckets vs the full weights.
- `zero-advantages`: one step whose advantages are all zero (the update must be skipped).
- `bf16-logprobs`: bf16 kernel: the sharded trainer's log-probs vs an unsharded bf16 model's (bitwise).
- `host-peak`: after a step, the peak growth of live tensor bytes (counted from the tensors: `miles_memory.PeakMeter`)
  during offload, onload, a checkpoint save, the weight file's first and later writes and the weight buckets.
- `oom-retry`: one step in which rank 0 alone runs out of memory (injected: its activation meter reports an overrun
  while micro-batches hold more than 12 tokens); both ranks must agree and retry with 12 (must equal `step`).
- `oom-fatal`: rank 1 hits an allocator OOM (injected: raised mid-forward, as CUDA raises it); rank 0 waits in a
  collective until the process group's timeout (MILES_TEST_PG_TIMEOUT seconds) ends it.

MILES_TEST_DEVICE=cuda runs the rank on the GPU (NCCL for device tensors, gloo for host ones).
MILES_TEST_CRITIC=separate|value_head adds PPO's critic: every step also trains it on fixed returns, and the
metrics carry the sum of its values over the whole batch afterwards (`critic_values_sum`); MILES_TEST_CRITIC_WARMUP:
its warm-up steps (default 0). Rank 0 also writes the critic's tensors (`critic.safetensors`: a separate critic's
model under HF names, the head as `value_head.score.*`) and the last step's values before and after it
(`critic.json`); megatron_worker.py does the same.
MILES_TEST_MOE (JSON: PolicyLossConfig's MoE fields and `routing_replay`) gives the samples recorded experts
(`recorded_experts`) and trains an MoE step with those settings (megatron_worker.py reads it too).
MILES_TEST_MTP=1 trains the model's MTP modules online beside the policy (miles-spec's `MTPLoss`, an import only then).
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import miles_trainer.checkpoint
import miles_trainer.memory
import miles_trainer.weight_sender
from miles_contracts import Sample
from miles_kernels import BucketAssembler, KernelConfig, ModelConfig, load_model, read_model_config
from miles_memory import OOMReport, PeakMeter
from miles_memory.config import MemoryConfig
from miles_trainer import (
    BackendConfig,
    CriticConfig,
    FSDP2Backend,
    LoraTrainConfig,
    OptimizerConfig,
    PolicyLossConfig,
    export_hf,
    load_checkpoint,
    pack_samples,
    response_logprobs,
    save_checkpoint,
)

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)


def batch() -> tuple[list[Sample], list[float]]:
    generator = torch.Generator().manual_seed(0)
    samples, advantages = [], []
    for i in range(8):
        num_prompt, num_response = 4 + (5 * i) % 11, 3 + (3 * i) % 7
        tokens = torch.randint(0, 256, (num_prompt + num_response,), generator=generator).tolist()
        samples.append(Sample(
            index=i, group_index=i // 4, prompt="", prompt_tokens=tokens[:num_prompt],
            response_tokens=tokens[num_prompt:], reward=float(i % 2),
            rollout_logprobs=(-torch.rand(num_response, generator=generator) - 4.0).tolist(),
        ))  # fmt: skip
        advantages.append(float(torch.randn(1, generator=generator)))
    return samples, advantages


def moe_options(model_dir: str) -> tuple[dict[str, object], bool, ModelConfig | None]:
    """MILES_TEST_MOE: (PolicyLossConfig fields, routing_replay, the model config whose routing the samples record;
    None without the variable)."""
    if "MILES_TEST_MOE" not in os.environ:
        return {}, False, None
    options = json.loads(os.environ["MILES_TEST_MOE"])
    return options, bool(options.pop("routing_replay", False)), read_model_config(model_dir)


def recorded_experts(samples: list[Sample], config: ModelConfig | None) -> list[Sample]:
    """The samples with the routing an engine would record (SGLang's base64 int32, (tokens - 1, layers, top_k),
    dense layers 0): random distinct experts, mostly not those the trainer's router picks (replay must show)."""
    if config is None:
        return samples
    generator = torch.Generator().manual_seed(1)
    dense = [i for i in range(config.num_hidden_layers) if not config.is_moe_layer(i)]
    out = []
    for sample in samples:
        scores = torch.rand(sample.num_tokens - 1, config.num_hidden_layers, config.num_experts, generator=generator)
        ids = scores.argsort(dim=-1)[..., : config.num_experts_per_tok].to(torch.int32).contiguous()
        ids[:, dense] = 0
        out.append(sample.model_copy(update={"routed_experts": base64.b64encode(ids.numpy().tobytes()).decode()}))
    return out


def rss_bytes(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def device_bytes(device: str) -> int:
    """Bytes the CUDA caching allocator holds in live tensors (0 on a CPU run)."""
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def kill_after_dcp_save() -> None:
    """Make the next checkpoint die half-way: the sharded files are written, the rest of the save never runs."""
    real_save = miles_trainer.checkpoint.dcp.save

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)

    miles_trainer.checkpoint.dcp.save = save_then_die


def inject_oom(mode: str, rank: int) -> None:
    """Fault injection through the trainer's activation meter (miles_trainer.memory uses it for every step)."""
    real = miles_trainer.memory.ActivationMeter

    class InjectedMeter(real):  # type: ignore[misc, valid-type]
        def _pack(self, tensor: torch.Tensor) -> object:
            if mode == "oom-retry" and rank == 0 and self.overrun is None and INJECT["max_tokens"] > 12:
                self.overrun = OOMReport("injected transient OOM", 1, 1, 0, {})
            if mode == "oom-fatal" and rank == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (injected on rank 1)")
            return super()._pack(tensor)

    miles_trainer.memory.ActivationMeter = InjectedMeter
    real_retry = miles_trainer.memory.TrainerMemory.with_oom_retry

    def with_oom_retry(self, max_tokens, accumulate, drop_grads):  # records the budget each attempt runs with
        def tracked(tokens: int):
            INJECT["max_tokens"] = tokens
            return accumulate(tokens)

        return real_retry(self, max_tokens, tracked, drop_grads)

    miles_trainer.memory.TrainerMemory.with_oom_retry = with_oom_retry


INJECT = {"max_tokens": 0}


def mtp_losses() -> list:
    """MILES_TEST_MTP=1: the online MTP draft's loss, trained with the policy's optimizer settings; else none."""
    if os.environ.get("MILES_TEST_MTP") != "1":
        return []
    from miles_spec import MTPLoss

    return [MTPLoss()]


def main(model_dir: str, out_dir: str, mode: str, checkpoint: str) -> None:
    torch.set_num_threads(1)
    device = os.environ.get("MILES_TEST_DEVICE", "cpu")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["RANK"]))
    timeout = datetime.timedelta(seconds=float(os.environ.get("MILES_TEST_PG_TIMEOUT", "600")))
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode.startswith("oom-"):
        inject_oom(mode, rank)
    critic_kind = os.environ.get("MILES_TEST_CRITIC")
    moe, routing_replay, recording = moe_options(model_dir)
    kernel = KernelConfig(**{**KERNEL.model_dump(), "dtype": "bfloat16"}) if mode == "bf16-logprobs" else KERNEL
    backend = FSDP2Backend(
        model_dir, kernel,
        OptimizerConfig(**{"lr": 1e-3, "max_grad_norm": 1e9, "warmup_steps": 2,
                           **json.loads(os.environ.get("MILES_TEST_OPTIMIZER", "{}"))}),
        PolicyLossConfig(agg_mode="seq-mean-token-mean", **moe),  # type: ignore[arg-type]
        BackendConfig(max_tokens_per_micro_batch=24, device=device), offload_dir=out_dir,
        routing_replay=routing_replay,
        critic=critic_config(),
        # OOM modes: a budget no step reaches (ranks agree on OOMs only under one), and room to halve 24 tokens to 12
        memory=MemoryConfig(limit_bytes=1 << 40, min_tokens_per_micro_batch=4) if mode.startswith("oom-") else None,
        aux_losses=mtp_losses(),
        lora=LoraTrainConfig(rank=int(os.environ["MILES_TEST_LORA"]), alpha=8) if "MILES_TEST_LORA" in os.environ
        else None,
    )  # fmt: skip
    samples, advantages = batch()
    samples = recorded_experts(samples, recording)
    mine, my_advantages = samples[rank::world], advantages[rank::world]

    values: dict[str, list[list[float]]] = {}

    def train_step(advantages: list[float], **kwargs) -> dict[str, float]:
        return critic_step(backend, mine, advantages, values, **kwargs)

    metrics: dict[str, float] = {}
    torch.manual_seed(1000 + rank)
    if mode == "resume":
        torch.manual_seed(7)  # overwritten by the checkpoint's RNG state
        load_checkpoint(backend, checkpoint)
    elif mode in ("step", "two-steps", "kill", "offload", "oom-retry", "oom-fatal"):
        metrics = train_step(my_advantages, measure_mismatch=True)
        tokens = torch.tensor([backend.max_tokens, -backend.max_tokens])
        dist.all_reduce(tokens, op=dist.ReduceOp.MAX)
        metrics["max_tokens_max"], metrics["max_tokens_min"] = float(tokens[0]), float(-tokens[1])
        torch.rand(3)  # the run draws random numbers between steps: the checkpoint must capture the RNG
    if mode in ("two-steps", "kill"):
        save_checkpoint(backend, checkpoint, extra={"data_position": 8})
    offload_metrics = {}
    if mode == "offload":
        rss_before, device_before = rss_bytes(), device_bytes(device)
        offload_metrics["offloaded_bytes"] = float(backend.offload())
        offload_metrics["rss_drop_bytes"] = float(rss_before - rss_bytes())
        offload_metrics["device_drop_bytes"] = float(device_before - device_bytes(device))
        local = [p.to_local() if hasattr(p, "to_local") else p for p in backend.model.parameters()]
        offload_metrics["empty_storages"] = float(all(p.untyped_storage().nbytes() == 0 for p in local))
        backend.onload()
    if mode in ("two-steps", "kill", "resume", "offload"):
        advantages = [-a for a in advantages]  # a different second step
        metrics = train_step(advantages[rank::world])
        metrics["rng_draw"] = float(torch.rand(1))
        metrics.update(offload_metrics)
    if mode == "kill":
        kill_after_dcp_save()
        save_checkpoint(backend, checkpoint, extra={"data_position": 16})
    if mode in ("two-steps", "resume"):
        export_hf(backend, os.path.join(out_dir, "hf"))
    if mode == "zero-advantages":  # every group's rewards equal: no signal, so no update
        metrics = backend.train_step(mine, [0.0] * len(mine))
    if mode == "buckets":
        metrics = measure_buckets(backend)
    if mode == "host-peak":
        train_step(my_advantages)
        metrics = measure_host_peaks(backend, Path(out_dir), Path(checkpoint))
    if mode == "bf16-logprobs":
        sharded = backend.compute_logprobs(mine)
        plain = load_model(model_dir, kernel, device)  # the engine's load: checkpoint cast to bf16
        expected = [
            row.tolist() for micro in pack_samples(mine, kernel, 24) for row in response_logprobs(plain, micro)
        ]
        metrics = {"equal": float(sharded == expected), "num_tokens": float(sum(len(r) for r in sharded))}
    state = backend.full_state_dict()
    if critic_kind:
        write_critic(out_dir, fsdp_critic_state(backend), values)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "params.safetensors"))
        with open(os.path.join(out_dir, "optimizer.json"), "w") as f:  # which optimizer, and where the shards live
            json.dump(describe_optimizer(backend), f)
        with open(os.path.join(out_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f)
    leave_together()


def describe_optimizer(backend: FSDP2Backend) -> dict[str, object]:
    layer = backend.model.model.layers[0]
    group = layer._get_fsdp_state()._fsdp_param_group if hasattr(layer, "_get_fsdp_state") else None
    policy = type(group.offload_policy).__name__ if group is not None else None
    state = [v for s in backend.optimizer.state.values() for v in s.values() if v.dim() > 0]
    return {"class": type(backend.optimizer).__name__, "offload_policy": policy,
            "moments_dtype": str(state[0].dtype) if state else None}  # fmt: skip


def critic_config() -> CriticConfig | None:
    """MILES_TEST_CRITIC's critic (None without it), with MILES_TEST_CRITIC_WARMUP warm-up steps."""
    kind = os.environ.get("MILES_TEST_CRITIC")
    warmup = int(os.environ.get("MILES_TEST_CRITIC_WARMUP", "0"))
    return CriticConfig(kind=kind, optimizer=OptimizerConfig(lr=1e-2), warmup_steps=warmup) if kind else None


def critic_step(backend, mine: list[Sample], advantages: list[float], values: dict, **kwargs) -> dict[str, float]:
    """One train step of `backend` (either backend) on this rank's samples. With a critic it also trains on fixed
    returns (the sample's reward on every token, discounted from the end); `values` then takes the whole batch's
    values before and after the step, and the metrics their sum after it (`critic_values_sum`)."""
    if backend.critic_config is None:
        return backend.train_step(mine, advantages, **kwargs)
    kwargs["old_values"] = backend.compute_values(mine)
    kwargs["returns"] = [[s.reward * 0.9 ** (len(s.response_tokens) - 1 - t) for t in range(len(s.response_tokens))]
                         for s in mine]  # fmt: skip
    metrics = backend.train_step(mine, advantages, **kwargs)
    values["before"] = gathered_rows(mine, kwargs["old_values"])
    values["after"] = gathered_rows(mine, backend.compute_values(mine))
    metrics["critic_values_sum"] = float(sum(sum(row) for row in values["after"]))
    return metrics


def gathered_rows(mine: list[Sample], rows: list[list[float]]) -> list[list[float]]:
    """Every rank's per-sample rows in the batch's order (ranks holding the same samples give the same rows)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [(sample.index, row) for sample, row in zip(mine, rows, strict=True)])
    by_index = {index: row for part in everyone for index, row in part}
    return [by_index[index] for index in sorted(by_index)]


def fsdp_critic_state(backend: FSDP2Backend) -> dict[str, torch.Tensor]:
    """The critic's full tensors: a separate critic's model under HF names, the head as value_head.score.*."""
    if backend.critic_model is None:
        assert backend.value_head is not None
        return {f"value_head.{name}": t.detach().clone() for name, t in backend.value_head.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(backend.critic_model, options=options)
    out = {name.removeprefix("backbone."): tensor for name, tensor in state.items()}
    if backend.model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def write_critic(out_dir: str, state: dict[str, torch.Tensor], values: dict[str, list[list[float]]]) -> None:
    """Rank 0 writes the critic's tensors (`critic.safetensors`) and the last step's values (`critic.json`)."""
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "critic.safetensors"))
        with open(os.path.join(out_dir, "critic.json"), "w") as f:
            json.dump(values, f)


def leave_together() -> None:
    """End the rank: barrier, destroy the group, exit without the interpreter's teardown.

    The barrier: a rank that exits while another still holds gloo connections to it can abort that rank. The exit:
    three CI runs failed when one rank ended with SIGABRT and only "terminate called without an active exception"
    (C++ std::terminate with no exception: a thread torn down while Python finalizes, as torch's own issues report
    for gloo); it did not recur in 100 runs under load here, so where it struck is not known. Every file this rank
    writes is closed by now, so os._exit loses nothing and skips that teardown. run_ranks sets PYTHONFAULTHANDLER,
    so an abort anywhere else prints its stacks.
    """
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def measure_host_peaks(backend: FSDP2Backend, out_dir: Path, checkpoint: Path) -> dict[str, float]:
    """Growth of live tensor bytes above the start of each transfer, sampled at every storage / tensor / bucket it
    moves (a sampling thread for the checkpoint save, whose steps are DCP's). Largest over ranks."""
    real_gathered = miles_trainer.weight_sender._gathered
    largest = max(p.numel() * p.element_size() for p in backend.model.parameters())  # one full tensor
    out: dict[str, float] = {"largest_tensor_bytes": float(largest), "model_bytes": float(sum(
        p.numel() * p.element_size() for p in backend.model.parameters()))}  # fmt: skip

    def measured(name: str, run, meter_hook=None) -> None:  # type: ignore[no-untyped-def]
        meter = PeakMeter()
        if meter_hook is not None:
            meter_hook(meter)
        run()
        meter.sample()
        out[f"{name}_growth_bytes"] = float(meter.growth)
        out[f"{name}_samples"] = float(meter.num_samples)

    manager = backend.memory.manager
    resident = float(sum(manager.resident_bytes().values()))
    measured("offload", backend.offload, lambda m: setattr(manager, "progress", m.sample))
    out["resident_bytes"] = resident
    measured("onload", backend.onload, lambda m: setattr(manager, "progress", m.sample))
    manager.progress = None

    def sampling_gather(meter: PeakMeter):  # type: ignore[no-untyped-def]
        def gathered(*args, **kwargs):  # type: ignore[no-untyped-def]
            tensor = real_gathered(*args, **kwargs)
            meter.sample()
            return tensor

        miles_trainer.weight_sender._gathered = gathered

    file = out_dir / "weights.safetensors"
    is_writer = dist.get_rank() == 0
    measured("weights_file_first", lambda: backend.weights.write_weights(file, write=is_writer), sampling_gather)
    measured("weights_file_streamed", lambda: backend.weights.write_weights(file, write=is_writer), sampling_gather)
    miles_trainer.weight_sender._gathered = real_gathered
    bucket_bytes = 1 << 16

    held = [0]  # the encoded bucket the caller holds (Python bytes, which the census does not see)
    meter = PeakMeter(extra=lambda: held[0])
    longest = 0
    for data in backend.weights.iter_weight_buckets(version=1, bucket_bytes=bucket_bytes):
        held[0] = len(data)
        longest = max(longest, len(data))
        meter.sample()
    held[0] = 0
    out["buckets_growth_bytes"], out["bucket_bytes"] = float(meter.growth), float(bucket_bytes)
    out["encoded_bucket_max_bytes"] = float(longest)  # a bucket's tensors and its safetensors header
    meter, done = PeakMeter(), threading.Event()

    def sample_until_done() -> None:
        while not done.is_set():
            meter.sample()
            time.sleep(0.002)

    sampler = threading.Thread(target=sample_until_done, daemon=True)
    sampler.start()
    try:
        save_checkpoint(backend, checkpoint)
    finally:  # the sampler stops whatever happens, so a failed save ends the process
        done.set()
        sampler.join()
    out["checkpoint_growth_bytes"], out["checkpoint_samples"] = float(meter.growth), float(meter.num_samples)
    values = torch.tensor(list(out.values()), dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(out, values.tolist(), strict=True))


def measure_buckets(backend: FSDP2Backend) -> dict[str, float]:
    bucket_bytes = 1 << 20
    model_bytes = sum(p.numel() * p.element_size() for p in backend.model.parameters())
    for _ in backend.weights.iter_weight_buckets(version=2, bucket_bytes=bucket_bytes):
        pass  # warm-up: first-call allocations (lazy imports, caches) are not the sync's working memory
    baseline = rss_bytes()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS counter (VmHWM) to the current RSS
    sizes = []

    for data in backend.weights.iter_weight_buckets(version=3, bucket_bytes=bucket_bytes):
        sizes.append(len(data))
    peak_growth = rss_bytes("VmHWM") - baseline
    # Correctness, after the measurement: the decoded buckets hold exactly the full weights.
    assembler = BucketAssembler()
    for data in backend.weights.iter_weight_buckets(version=3, bucket_bytes=bucket_bytes):
        assembler.add(data)
    full = backend.full_state_dict()
    received = assembler.tensors
    equal = received.keys() == full.keys() and all(torch.equal(received[k], full[k]) for k in full)
    return {
        "bucket_bytes": float(bucket_bytes), "model_bytes": float(model_bytes),
        "peak_growth_bytes": float(peak_growth), "num_buckets": float(len(sizes)),
        "max_bucket_len": float(max(sizes)), "equal": float(equal),
    }  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])

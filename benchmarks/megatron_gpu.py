"""The Megatron backend on a CUDA GPU, against the FSDP2 backend and the engine's model (docs/megatron.md).

One process, one GPU (TP = EP = 1: the layouts one GPU holds; TP / EP / ETP / DP are checked against FSDP2 on CPU
ranks in packages/miles-trainer/tests/test_megatron.py):

1. step parity: one optimizer step of tiny Qwen3 dense and Qwen3-MoE models (random weights made here) with the
   Megatron backend and with the FSDP2 backend, float32 and bfloat16 (fast kernels): loss, gradient norm, the largest
   parameter difference after the step;
2. log-prob mismatch: the Megatron backend's log-probs of the batch against the engine's model (miles-kernels, the
   same weights, the same dtype): mean and max |difference| (0 is not expected across different kernels; TIS / MIS
   corrects it);
3. true on-policy: the Megatron backend in deterministic mode (the Miles layers, docs/true-on-policy.md) against
   the engine's model on the same packed batch, float32 and bfloat16: equal bit for bit is the claim checked
   (`bitwise_equal`, and the largest |difference| if not);
4. `--rl-steps N`: an N-step GRPO run of the default example with the Megatron trainer (`miles-orchestrator run`,
   local cluster, engine and trainer on the device; kernel.mode=fast, TIS; bfloat16 on a GPU), its metrics per step;
   `--rl-deterministic-steps M`: the same in deterministic mode (the mismatch must be 0 at every step).

`--device cpu` is the dry run on this machine (the Megatron backend's CPU device mode; the RL run in float32).

    uv run --extra megatron python benchmarks/megatron_gpu.py --out benchmarks/results/megatron_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from host import host_info

from miles_contracts import Sample
from miles_kernels import KernelConfig, load_model, save_model
from miles_kernels.testing import random_model, tiny_config
from miles_trainer import (
    BackendConfig,
    FSDP2Backend,
    MegatronBackend,
    MegatronConfig,
    OptimizerConfig,
    PolicyLossConfig,
    ensure_process_group,
    pack_samples,
    response_logprobs,
)


def batch(vocab: int, count: int = 16) -> tuple[list[Sample], list[float]]:
    generator = torch.Generator().manual_seed(0)
    samples, advantages = [], []
    for i in range(count):
        num_prompt, num_response = 8 + (5 * i) % 23, 4 + (7 * i) % 41
        tokens = torch.randint(0, vocab, (num_prompt + num_response,), generator=generator).tolist()
        samples.append(Sample(
            index=i, group_index=i // 4, prompt="", prompt_tokens=tokens[:num_prompt],
            response_tokens=tokens[num_prompt:], reward=float(i % 2),
            rollout_logprobs=(-torch.rand(num_response, generator=generator) - 4.0).tolist(),
        ))  # fmt: skip
        advantages.append(float(torch.randn(1, generator=generator)))
    return samples, advantages


def step_parity(kind: str, dtype: str, device: str, root: Path) -> dict[str, Any]:
    """One step of each backend on the same model and batch, and the Megatron log-probs against the engine's."""
    config = tiny_config(kind, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32)  # fmt: skip
    model_dir = save_model(random_model(config, seed=1), root / f"{kind}-model")
    kernel = KernelConfig(dtype=dtype, mode="fast")  # type: ignore[arg-type]
    optimizer = OptimizerConfig(lr=1e-4, max_grad_norm=1e9)
    loss = PolicyLossConfig(agg_mode="token-mean")
    samples, advantages = batch(config.vocab_size)
    layout = MegatronConfig(moe_token_dispatcher="allgather" if device == "cpu" else "alltoall")
    megatron = MegatronBackend(model_dir, kernel, optimizer, loss,
                               BackendConfig(name="megatron", device=device, megatron=layout))  # fmt: skip
    engine = load_model(model_dir, kernel, device)  # the engine's model: its weights cast to the kernel dtype
    expected = [row for micro in pack_samples(samples, kernel, 4096) for row in response_logprobs(engine, micro)]
    got = megatron.compute_logprobs(samples)
    diffs = torch.cat([(torch.tensor(g) - w.float().cpu()).abs() for g, w in zip(got, expected, strict=True)])
    started = time.perf_counter()
    meg = megatron.train_step(samples, advantages)
    meg_time = time.perf_counter() - started
    meg_params = megatron.full_state_dict()
    del megatron, engine
    fsdp = FSDP2Backend(model_dir, kernel, optimizer, loss, BackendConfig(device=device))
    started = time.perf_counter()
    ref = fsdp.train_step(samples, advantages)
    fsdp_time = time.perf_counter() - started
    ref_params = fsdp.full_state_dict()
    param_diff = max(float((meg_params[n].float() - ref_params[n].float().cpu()).abs().max()) for n in ref_params)
    del fsdp
    return {
        "kind": kind, "dtype": dtype, "num_tokens": ref["num_tokens"],
        "loss": {"megatron": meg["loss"], "fsdp2": ref["loss"]},
        "grad_norm": {"megatron": meg["grad_norm"], "fsdp2": ref["grad_norm"]},
        "max_param_abs_diff_after_step": param_diff, "lr": optimizer.lr,
        "logprob_abs_diff_vs_engine": {"mean": float(diffs.mean()), "max": float(diffs.max())},
        "step_time_s": {"megatron": meg_time, "fsdp2": fsdp_time},
    }  # fmt: skip


def on_policy_parity(kind: str, dtype: str, device: str, root: Path) -> dict[str, Any]:
    """The Miles layers' log-probs (deterministic mode) against the engine's model on the same batch."""
    config = tiny_config(kind, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32)  # fmt: skip
    model_dir = save_model(random_model(config, seed=1), root / f"{kind}-miles-model")
    kernel = KernelConfig(dtype=dtype)  # type: ignore[arg-type]
    samples, _ = batch(config.vocab_size)
    megatron = MegatronBackend(model_dir, kernel, OptimizerConfig(), PolicyLossConfig(),
                               BackendConfig(name="megatron", device=device))  # fmt: skip
    engine = load_model(model_dir, kernel, device)
    expected = [row for micro in pack_samples(samples, kernel, 4096) for row in response_logprobs(engine, micro)]
    got = megatron.compute_logprobs(samples)
    diffs = torch.cat([(torch.tensor(g) - w.float().cpu()).abs() for g, w in zip(got, expected, strict=True)])
    layers = type(megatron.model.gpt.decoder.layers[0].self_attention).__name__
    del megatron, engine
    return {"kind": kind, "dtype": dtype, "layers": layers, "bitwise_equal": bool((diffs == 0).all()),
            "logprob_abs_diff_vs_engine": {"mean": float(diffs.mean()), "max": float(diffs.max())}}  # fmt: skip


def rl_run(steps: int, device: str, mode: str = "fast") -> dict[str, Any]:
    """The default example for `steps` GRPO steps with the Megatron trainer on `device` (`mode`: the kernel mode;
    fast with TIS); its per-step metrics."""
    run_dir = Path(tempfile.mkdtemp(prefix="megatron_rl_run_"))  # the metrics go into the JSON, not the run
    command = [
        "miles-orchestrator", "run", "--quiet", f"run.num_steps={steps}", f"run.run_dir={run_dir}",
        "run.cluster=local", "trainer.backend.name=megatron", f"trainer.backend.device={device}",
        f"rollout.engine.device={device}", f"kernel.mode={mode}",
        *(["trainer.loss.is_mode=truncate"] if mode == "fast" else []),
        *(["kernel.dtype=bfloat16"] if device == "cuda" else []),
    ]  # fmt: skip
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    rows = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        keep = ("step", "reward_mean", "pass_rate", "loss", "grad_norm", "train_rollout_logprob_abs_diff",
                "train_rollout_logprob_abs_diff_max", "step_time_s")  # fmt: skip
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            rows.append({k: row[k] for k in keep if k in row})
    return {"returncode": result.returncode, "wall_s": time.perf_counter() - started, "steps": rows,
            "stderr_tail": result.stderr[-3000:]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rl-steps", type=int, default=20)
    parser.add_argument("--rl-deterministic-steps", type=int, default=10)
    args = parser.parse_args()
    ensure_process_group()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (dry run)",
                           "torch": torch.__version__, "host": host_info()}  # fmt: skip
    import megatron.core

    out["megatron_core"] = megatron.core.__version__
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out["step_parity"] = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("dense", "moe"):
            for dtype in ("float32", "bfloat16"):
                out["step_parity"].append(step_parity(kind, dtype, args.device, Path(tmp)))
                args.out.write_text(json.dumps(out, indent=2) + "\n")  # after each case: a run cut short keeps it
        out["miles_layers_on_policy"] = []
        for kind in ("dense", "moe"):
            for dtype in ("float32", "bfloat16"):
                out["miles_layers_on_policy"].append(on_policy_parity(kind, dtype, args.device, Path(tmp)))
                args.out.write_text(json.dumps(out, indent=2) + "\n")
    if args.rl_steps:
        out["rl_run"] = rl_run(args.rl_steps, args.device)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    if args.rl_deterministic_steps:
        out["rl_run_deterministic"] = rl_run(args.rl_deterministic_steps, args.device, "deterministic")
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

"""True on-policy with the Megatron trainer, layout by layout: the train / rollout log-prob mismatch, and what the
exact modes cost (docs/true-on-policy.md, "Megatron").

For each case (a model family, a Megatron layout, the layers it is built from: `miles` = the Miles layers running
the engine's kernels, `megatron` = megatron-core's own modules; with tp > 1 the Miles layers' `tp_reduce`), on
random weights of the built-in policy's shapes (`miles_orchestrator.data.bootstrap.policy_config`; float32):
the embedded engine (deterministic kernels) samples `--prompts` x `--samples` responses with their log-probs, then
the Megatron backend on real gloo rank processes (this script again, `--worker`; the CPU device mode) scores them
and makes one training step measuring `train_rollout_logprob_abs_diff`. Reported per case: `mismatch_mean` /
`mismatch_max` over every response token, `exact` (max == 0), and on the slowest rank the seconds of a log-prob pass
(the median of 3 after the measured one) and of a training step (the second), for the cost of the exact TP mode
against megatron-core's partial sums and of the Miles layers against megatron-core's modules (the `qwen3-wide`
cases, a wider dense model). Each rank runs one thread.

    uv run python benchmarks/megatron_on_policy.py --out benchmarks/results/megatron_on_policy.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from host import host_info

# (family, world, layout): layout holds MegatronConfig fields (layer_spec and tp_reduce included)
CASES: list[tuple[str, int, dict[str, Any]]] = [
    ("qwen3", 1, {"layer_spec": "megatron"}),
    ("qwen3", 1, {"layer_spec": "miles"}),
    ("qwen3", 2, {"layer_spec": "megatron", "tp": 2}),
    ("qwen3", 2, {"layer_spec": "miles", "tp": 2, "tp_reduce": "all_reduce"}),
    ("qwen3", 2, {"layer_spec": "miles", "tp": 2, "tp_reduce": "exact"}),
    ("qwen3", 2, {"layer_spec": "miles", "pp": 2}),
    ("qwen3_moe", 2, {"layer_spec": "megatron", "ep": 2}),
    ("qwen3_moe", 2, {"layer_spec": "miles", "ep": 2}),
    ("glm4_moe", 4, {"layer_spec": "megatron", "pp": 2, "ep": 2}),
    ("glm4_moe", 4, {"layer_spec": "miles", "pp": 2, "ep": 2}),
    ("glm4_moe", 4, {"layer_spec": "megatron", "ep": 2, "etp": 2, "moe_token_dispatcher": "allgather"}),
    # the cost of the exact modes, on a wider dense model (hidden 1024, intermediate 3072, 16 / 8 heads of 64)
    ("qwen3-wide", 1, {"layer_spec": "megatron"}),
    ("qwen3-wide", 1, {"layer_spec": "miles"}),
    ("qwen3-wide", 2, {"layer_spec": "megatron", "tp": 2}),
    ("qwen3-wide", 2, {"layer_spec": "miles", "tp": 2, "tp_reduce": "all_reduce"}),
    ("qwen3-wide", 2, {"layer_spec": "miles", "tp": 2, "tp_reduce": "exact"}),
]
WIDE = {"hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 64}  # fmt: skip


def model_config(family: str) -> Any:
    """The built-in policy's shape of `family` (`-wide`: the dense one widened to WIDE)."""
    from miles_orchestrator.data.bootstrap import policy_config

    config = policy_config(264, family.removesuffix("-wide"))
    return dataclasses.replace(config, **WIDE) if family.endswith("-wide") else config


def case_name(family: str, layout: dict[str, Any]) -> str:
    parts = [f"{key}{value}" for key, value in layout.items() if key in ("tp", "pp", "ep", "etp")] or ["1 rank"]
    reduce = f" ({layout['tp_reduce']})" if "tp_reduce" in layout else ""
    return f"{family} {' x '.join(parts)} {layout['layer_spec']}{reduce}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def worker(model_dir: str, samples_file: str, out_file: str, layout_json: str) -> None:
    """One rank: its data-parallel share scored (a warm-up pass, then a timed one) and one timed training step."""
    import torch.distributed as dist

    from miles_contracts import Sample
    from miles_kernels import KernelConfig
    from miles_trainer import BackendConfig, MegatronBackend, OptimizerConfig, PolicyLossConfig, megatron_on_cpu
    from miles_trainer.config import MegatronConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    samples = [Sample(**raw) for raw in json.loads(Path(samples_file).read_text())]
    with megatron_on_cpu():
        backend = MegatronBackend(
            model_dir, KernelConfig(), OptimizerConfig(lr=1e-5), PolicyLossConfig(),
            BackendConfig(name="megatron", megatron=MegatronConfig(**json.loads(layout_json)),
                          max_tokens_per_micro_batch=2048),
        )  # fmt: skip
        rank, size = backend.data_parallel
        mine = samples[rank::size]
        logprobs = backend.compute_logprobs(mine)  # the first pass also warms up
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            backend.compute_logprobs(mine)
            seconds.append(time.perf_counter() - start)
        logprob_seconds = sorted(seconds)[1]
        advantages = [1.0 if i % 2 else -1.0 for i in range(len(mine))]
        metrics = backend.train_step(mine, advantages, measure_mismatch=True)  # on the rollout's weights
        start = time.perf_counter()
        backend.train_step(mine, advantages)
        step_seconds = time.perf_counter() - start
    result = {"indices": [s.index for s in mine], "logprobs": logprobs, "logprob_seconds": logprob_seconds,
              "step_seconds": step_seconds,
              "step_mismatch_max": metrics["train_rollout_logprob_abs_diff_max"]}  # fmt: skip
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        Path(out_file).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def run_case(model_dir: Path, samples_file: Path, world: int, layout: dict[str, Any], tmp: Path) -> list[Any]:
    out_file = tmp / "ranks.json"
    out_file.unlink(missing_ok=True)
    port = str(free_port())
    processes = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}  # fmt: skip
        command = [sys.executable, __file__, "--worker", str(model_dir), str(samples_file), str(out_file),
                   json.dumps(layout)]  # fmt: skip
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))  # fmt: skip
    outputs = [process.communicate(timeout=1800)[0] for process in processes]
    if any(process.returncode for process in processes):
        raise RuntimeError("a rank failed:\n" + "\n".join(text[-3000:] for text in outputs))
    ranks: list[Any] = json.loads(out_file.read_text())
    return ranks


def summarize(samples: list[Any], ranks: list[Any]) -> dict[str, Any]:
    scored: dict[int, list[float]] = {}  # each sample's log-probs (TP / PP peers return the same ones)
    for rank in ranks:
        for index, got in zip(rank["indices"], rank["logprobs"], strict=True):
            if scored.setdefault(index, got) != got:
                raise RuntimeError(f"two ranks returned different log-probs for sample {index}")
    if set(scored) != set(range(len(samples))):
        raise RuntimeError("a sample was not scored")
    diffs = [abs(a - b) for index, got in scored.items()
             for a, b in zip(got, samples[index].rollout_logprobs, strict=True)]  # fmt: skip
    diff = torch.tensor(diffs, dtype=torch.float64)
    return {
        "exact": bool((diff == 0).all()), "mismatch_mean": float(diff.mean()), "mismatch_max": float(diff.max()),
        "tokens_equal_fraction": float((diff == 0).double().mean()), "response_tokens": len(diffs),
        "step_mismatch_max": max(rank["step_mismatch_max"] for rank in ranks),
        "logprob_seconds": round(max(rank["logprob_seconds"] for rank in ranks), 3),
        "step_seconds": round(max(rank["step_seconds"] for rank in ranks), 3),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/megatron_on_policy.json")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="run the cases whose name contains this")
    args = parser.parse_args()
    from routing_replay import rollout

    from miles_kernels import KernelConfig
    from miles_kernels.testing import save_random_model

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        rolled: dict[str, tuple[Path, Path, list[Any]]] = {}
        for family, world, layout in CASES:
            name = case_name(family, layout)
            if args.only and args.only not in name:
                continue
            if family not in rolled:
                model_dir = tmp / family
                save_random_model(str(model_dir), model_config(family), seed=args.seed, dtype="float32")
                samples = rollout(str(model_dir), KernelConfig(), args, routed_experts="moe" in family)
                samples_file = tmp / f"{family}.json"
                samples_file.write_text(json.dumps([s.model_dump() for s in samples]))
                rolled[family] = (model_dir, samples_file, samples)
            model_dir, samples_file, samples = rolled[family]
            results[name] = {"family": family, "ranks": world, "layout": layout,
                             **summarize(samples, run_case(model_dir, samples_file, world, layout, tmp))}  # fmt: skip
            print(name, json.dumps(results[name]), flush=True)
    report = {
        "script_command": "python benchmarks/megatron_on_policy.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
        "torch": torch.__version__, "host": host_info(), "rank_threads": 1,
        "weights": "random (miles_kernels.testing.save_random_model), the built-in policy's shapes, float32",
        "engine": "the embedded engine, kernel.mode=deterministic (KernelConfig defaults)",
        "results": results,
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:6])
    else:
        main()

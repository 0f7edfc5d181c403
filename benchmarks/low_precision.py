"""Low-precision rollout, measured: the engine's weight bytes, weight-sync bytes and time, and RL runs per weight
format (`kernel`, `fp8_block`, `fp8_channel`, `int4_group`) side by side, as JSON.

Bytes and sync, in one process, per model shape (lora_sync.py's: the built-in example's policy, and Qwen3-0.6B's
layers and vocabulary with 8 of its layers) and per kernel dtype (float32, the default, and bfloat16): an FSDP2
trainer on one gloo rank with `weight_quant` set to the format, and an embedded engine (`miles_rollout.Engine`)
storing `weight_dtype` = the format. Reported: the engine's stored tensors (its model's checkpoint tensors, split
into the trunk's linear layers, which the format quantizes, and the rest: embeddings, LM head, norms, which stay in
the kernel dtype), its `/server_info` `memory_bytes` and `kv_bytes_per_token` (the KV cache stays in the kernel
dtype: the weight format does not change it), the bytes a sync sends (the exported tensors, and the encoded weight
buckets), and the median seconds of `--repeats` syncs through the two paths the orchestrator's transports use
(`iter_weight_buckets` -> the engine's `add_bucket`: `run.sync_transport=http` minus the socket; `export_weights`
-> `load_tensors`: `run.cluster=local`). After every sync the trainer's checksum must equal the engine's. Ratios
(`bytes_ratio_vs_kernel`, `speedup_vs_kernel`: kernel's / the format's, so above 1 is fewer bytes or a faster sync)
are against the `kernel` format of the same dtype (bfloat16's are the ones users compare: FP8 about 2x fewer bytes,
INT4 about 3.5x fewer).

Training, `miles-orchestrator run` on the built-in task in a subprocess (`run.cluster=local`), `--steps` steps with
an evaluation every 20: full precision (the default config), and per quantized format the off-policy recipe
(`rollout.engine.weight_dtype=F trainer.loss.is_mode=truncate`: the trainer recomputes the old log-probs and TIS
corrects the mismatch) and quantization-aware training (`rollout.engine.weight_dtype=F trainer.qat=true`: the
mismatch is exactly 0). Per run: held-out greedy pass@1 at every evaluation, the train/rollout log-prob mismatch
(the mean over steps of the per-step mean, and the largest token of any step), the importance weights' spread
(the `is_weight_*` metrics: raw max over steps, the means' range), the bytes each sync sent and its median time,
the engine's bytes, the wall time, and the 1-minute load average before and after (the VM's other load).

    uv run python benchmarks/low_precision.py --out benchmarks/results/low_precision.json   # ~15 min
    uv run python benchmarks/low_precision.py --steps 4 --formats fp8_block                  # a quick check
    uv run python benchmarks/low_precision.py --skip-training --shapes example_policy        # bytes and sync only
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from default_run import metric_lines
from host import host_info, write_results
from lora_sync import SHAPES

from miles_kernels import KernelConfig, checkpoint_tensors
from miles_kernels.config import WeightQuantConfig
from miles_kernels.testing import build_tokenizer, save_random_model, tiny_config
from miles_rollout import Engine
from miles_rollout.config import EngineConfig
from miles_trainer import FSDP2Backend, ensure_process_group

FORMATS = ("kernel", "fp8_block", "fp8_channel", "int4_group")
DTYPES = ("float32", "bfloat16")
EVAL_EVERY = 20


def engine_bytes(engine: Engine) -> dict[str, Any]:
    """The engine's stored tensors: all of them, the trunk's linear layers (the ones a format quantizes) and the
    rest; its own memory accounting and KV bytes per token."""
    trunk = tuple(f"{name}." for name in engine.model.trunk_linears())
    sizes = {name: t.numel() * t.element_size() for name, t in checkpoint_tensors(engine.model, False).items()}
    linear = sum(size for name, size in sizes.items() if name.startswith(trunk))
    info = engine.server_info()
    return {
        "weight_bytes": sum(sizes.values()), "trunk_linear_bytes": linear,
        "other_bytes": sum(sizes.values()) - linear, "memory_bytes": info["memory_bytes"],
        "kv_bytes_per_token": info["kv_bytes_per_token"],
    }  # fmt: skip


def measure(model_dir: Path, kernel: KernelConfig, weight_format: str, repeats: int) -> dict[str, Any]:
    """One trainer and its engine in `weight_format`: the engine's bytes, then `repeats` syncs per path, each
    checked (trainer checksum == engine checksum)."""
    quant = WeightQuantConfig(format=weight_format)
    backend = FSDP2Backend(model_dir, kernel, weight_quant=quant if quant.is_enabled else None)
    engine = Engine(str(model_dir), kernel, EngineConfig(num_kv_pages=8, weight_dtype=weight_format))
    loop = asyncio.new_event_loop()

    def on_engine(fn: Any) -> Any:
        return loop.run_until_complete(engine.control(fn, needs_idle=True))

    version = [0]
    bucket_bytes = [0]

    def buckets() -> None:
        version[0] += 1
        bucket_bytes[0] = 0
        for data in backend.weights.iter_weight_buckets(version[0], bucket_bytes=64 << 20):
            bucket_bytes[0] += len(data)
            on_engine(lambda data=data: engine.weights.add_bucket(data))

    def copy() -> None:
        version[0] += 1
        tensors = backend.weights.export_weights()
        on_engine(lambda: engine.weights.load_tensors(tensors, version[0]))

    def checked_median(sync: Any) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            sync()
            times.append(time.perf_counter() - start)
            assert backend.weights.checksum() == on_engine(engine.weights.checksum), f"{weight_format}: checksums"
        return statistics.median(times)

    result = engine_bytes(engine) | {"load_average_1min": round(os.getloadavg()[0], 2)}
    buckets()  # warm-up, and the version-0 check the orchestrator makes
    assert backend.weights.checksum() == on_engine(engine.weights.checksum), f"{weight_format}: checksums"
    exported = backend.weights.export_weights()
    result |= {
        "sync_bytes": sum(t.numel() * t.element_size() for t in exported.values()),
        "sync_dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in exported.values()}),
        "bucket_bytes": bucket_bytes[0],
        "buckets_s": checked_median(buckets),
        "in_process_s": checked_median(copy),
        "num_synced_checked": 2 * repeats + 1,
    }  # fmt: skip
    engine.shutdown()
    loop.close()
    return result


def bytes_and_sync(shapes: list[str], formats: list[str], repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in shapes:
            model_dir = Path(tmp) / name
            save_random_model(model_dir, tiny_config("dense", **SHAPES[name]), tokenizer=build_tokenizer())
            out[name] = {"shape": SHAPES[name], "dtypes": {}}
            for dtype in DTYPES:
                kernel = KernelConfig(dtype=dtype)
                rows = {}
                for fmt in formats:
                    rows[fmt] = measure(model_dir, kernel, fmt, repeats)
                    gc.collect()  # the last trainer and engine go before the next are built (1 GB each at Qwen's)
                base = rows.get("kernel")
                for fmt, row in rows.items():
                    if base is not None:  # kernel / this: >1 is fewer bytes, a faster sync
                        row["bytes_ratio_vs_kernel"] = {
                            key: round(base[key] / row[key], 3)
                            for key in ("weight_bytes", "trunk_linear_bytes", "sync_bytes", "bucket_bytes")
                        }
                        row["speedup_vs_kernel"] = {
                            key: round(base[key] / row[key], 3) for key in ("buckets_s", "in_process_s")
                        }
                    print(f"{name} {dtype} {fmt}: engine {row['weight_bytes'] / 1e6:.2f} MB (linear "
                          f"{row['trunk_linear_bytes'] / 1e6:.2f} MB), kv {row['kv_bytes_per_token']} B/token, sync "
                          f"{row['sync_bytes'] / 1e6:.2f} MB, buckets {row['buckets_s']:.3f} s, in-process "
                          f"{row['in_process_s']:.3f} s", flush=True)  # fmt: skip
                kv_sizes = {row["kv_bytes_per_token"] for row in rows.values()}
                # the KV cache stays in the kernel dtype whatever the weights' format
                out[name]["dtypes"][dtype] = {"formats": rows, "is_kv_same_for_every_format": len(kv_sizes) == 1}
    return out


def run_config(label: str, overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """One `miles-orchestrator run` with `overrides`, summarized from its metrics.jsonl."""
    command = ["miles-orchestrator", "run", *overrides, f"run.run_dir={run_dir}"]
    # the console script of this interpreter's environment, whether or not it is on PATH
    executable = shutil.which(command[0]) or str(Path(sys.executable).parent / command[0])
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    result = subprocess.run([executable, *command[1:]], capture_output=True, text=True)
    wall = time.perf_counter() - began
    if result.returncode != 0:
        sys.exit(f"{label}: {' '.join(command)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    lines = metric_lines(run_dir)
    steps = [line for line in lines if line["step"] > 0]
    summary: dict[str, Any] = {
        "command": " ".join(command),
        "wall_time_s": round(wall, 1),
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # before, after: other load
        "num_steps": len(steps),
        "median_step_time_s": round(statistics.median(line["step_time_s"] for line in steps), 4),
        "eval_pass_at_1": {line["step"]: line["eval_pass@1"] for line in lines if "eval_pass@1" in line},
        "reward_mean_first_10_steps": round(statistics.mean(line["reward_mean"] for line in steps[:10]), 4),
        "reward_mean_last_10_steps": round(statistics.mean(line["reward_mean"] for line in steps[-10:]), 4),
        "sync_bytes_per_step": max((line.get("sync_bytes", 0.0) for line in steps), default=None),
        "median_sync_time_s": round(statistics.median(line.get("sync_time_s", 0.0) for line in steps), 4),
        "engine_bytes": max((line.get("mem_engine_bytes", 0.0) for line in steps), default=None),
    }
    evals = list(summary["eval_pass_at_1"].values())
    summary["eval_pass_at_1_first"], summary["eval_pass_at_1_last"] = (evals[0], evals[-1]) if evals else (None, None)
    mean_key, max_key = "train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff_max"
    mean_diff = [line[mean_key] for line in steps if mean_key in line]
    max_diff = [line[max_key] for line in steps if max_key in line]
    summary["mismatch"] = {
        "num_steps_measured": len(mean_diff),
        "logprob_abs_diff_mean_over_steps": statistics.mean(mean_diff) if mean_diff else None,
        "logprob_abs_diff_max_over_steps": max(max_diff) if max_diff else None,
    }
    is_keys = sorted({key for line in steps for key in line if key.startswith("is_weight_")})
    summary["is_weights"] = {
        key: {"min_over_steps": min(values), "max_over_steps": max(values), "mean_over_steps": statistics.mean(values)}
        for key in is_keys
        if (values := [line[key] for line in steps if key in line])
    }
    return summary


def training(formats: list[str], num_steps: int, work: Path) -> dict[str, Any]:
    common = [f"run.num_steps={num_steps}", f"run.eval_every={EVAL_EVERY}", "run.cluster=local"]
    configs = {"full_precision": []}
    for fmt in formats:
        if fmt != "kernel":
            configs[f"{fmt}_off_policy_tis"] = [f"rollout.engine.weight_dtype={fmt}", "trainer.loss.is_mode=truncate"]
            configs[f"{fmt}_qat"] = [f"rollout.engine.weight_dtype={fmt}", "trainer.qat=true"]
    runs = {}
    for label, overrides in configs.items():
        runs[label] = run_config(label, common + overrides, work / label)
        row = runs[label]
        print(f"{label}: pass@1 {row['eval_pass_at_1']}, mismatch {row['mismatch']}, sync "
              f"{row['sync_bytes_per_step']} B, {row['wall_time_s']} s", flush=True)  # fmt: skip
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/low_precision.json")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--training-formats", nargs="+", default=None, choices=list(FORMATS),
                        help="the formats the training runs use (default: --formats)")  # fmt: skip
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-sync", action="store_true", help="leave out the bytes and sync measurements")
    parser.add_argument("--notes", default=None, help="a note for the JSON (e.g. why a subset ran)")
    args = parser.parse_args()
    began = time.perf_counter()
    formats = list(dict.fromkeys(["kernel", *args.formats]))  # the ratios' baseline always runs
    results: dict[str, Any] = {
        "script_command": " ".join(["python", *sys.argv]),
        "host": host_info(),
        "formats": formats,
        "repeats": args.repeats,
        "notes": args.notes,
    }
    if not args.skip_sync:
        ensure_process_group()
        results["bytes_and_sync"] = bytes_and_sync(args.shapes, formats, args.repeats)
    if not args.skip_training:
        with tempfile.TemporaryDirectory(prefix="miles-low-precision-") as tmp:
            results["training"] = {
                "num_steps": args.steps, "eval_every": EVAL_EVERY,
                "runs": training(args.training_formats or args.formats, args.steps, Path(tmp)),
            }  # fmt: skip
    write_results(args.out, results, began)


if __name__ == "__main__":
    main()

"""Weight sync of a LoRA run against a full fine-tuning run, side by side in one process, as JSON.

For each model shape, two FSDP2 trainers on one gloo rank (full fine-tuning, and LoRA on every linear layer), each
with an embedded engine (`miles_rollout.Engine`; the LoRA one with `policy_lora`, so it keeps its base and merges
each adapter update): a sync is timed through the two paths the orchestrator's transports use, end to end on both
sides: weight buckets (`iter_weight_buckets`: gather, cast, safetensors encode; the engine's `add_bucket`: decode,
load, merge: what `run.sync_transport=http` carries, minus the socket) and the in-process copy (`export_weights` ->
`load_tensors`: `run.cluster=local`). Each sync is checked: the trainer's checksum equals the engine's (base
included). Reported per shape: bytes sent, median seconds of `--repeats` syncs, and the full / LoRA ratios; the
merge's own share (the engine's `fold_adapters`) separately. The trainer trains nothing: a sync's cost depends on
shapes only.

    uv run python benchmarks/lora_sync.py --out benchmarks/results/lora_sync.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from host import host_info

from miles_kernels import KernelConfig, fold_adapters
from miles_kernels.testing import build_tokenizer, save_random_model, tiny_config
from miles_rollout import Engine
from miles_rollout.config import EngineConfig
from miles_trainer import FSDP2Backend, LoraTrainConfig, ensure_process_group

SHAPES = {
    # the built-in example's policy (miles_orchestrator.data.bootstrap.policy_config), without its MTP module
    "example_policy": {"vocab_size": 320, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                       "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32},
    # Qwen3-0.6B's layer shapes and vocabulary, 8 of its 28 layers
    "qwen3_0.6b_8_layers": {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
                            "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
                            "head_dim": 128, "tie_word_embeddings": True},
}  # fmt: skip
KERNEL = KernelConfig()


def median_time(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model_dir: Path, lora: LoraTrainConfig | None, repeats: int) -> dict[str, Any]:
    backend = FSDP2Backend(model_dir, KERNEL, lora=lora)
    policy_lora = (lora or LoraTrainConfig()).adapters()
    engine = Engine(str(model_dir), KERNEL, EngineConfig(num_kv_pages=8, policy_lora=policy_lora))
    loop = asyncio.new_event_loop()

    def on_engine(fn: Any) -> Any:
        return loop.run_until_complete(engine.control(fn, needs_idle=True))

    version = [0]

    def buckets() -> None:
        version[0] += 1
        for data in backend.weights.iter_weight_buckets(version[0], bucket_bytes=64 << 20):
            on_engine(lambda data=data: engine.weights.add_bucket(data))

    def copy() -> None:
        version[0] += 1
        tensors = backend.weights.export_weights()
        on_engine(lambda: engine.weights.load_tensors(tensors, version[0]))

    buckets()  # warm-up, and the version-0 check the orchestrator makes
    assert backend.weights.checksum() == on_engine(engine.weights.checksum)
    result = {
        "sync_bytes": sum(t.numel() * t.element_size() for t in backend.weights.export_weights().values()),
        "trainable_params": sum(p.numel() for p in backend.policy_params),
        "buckets_s": median_time(buckets, repeats),
        "in_process_s": median_time(copy, repeats),
        "merge_s": median_time(lambda: on_engine(lambda: fold_adapters(engine.model)), repeats) if lora else 0.0,
    }
    assert backend.weights.checksum() == on_engine(engine.weights.checksum)
    engine.shutdown()
    loop.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/lora_sync.json")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    ensure_process_group()
    lora = LoraTrainConfig(rank=args.rank, alpha=2 * args.rank)
    results: dict[str, Any] = {
        "host": host_info(), "kernel": KERNEL.model_dump(), "lora": lora.adapters().model_dump(),
        "repeats": args.repeats, "shapes": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            model_dir = Path(tmp) / name
            vocab = SHAPES[name]["vocab_size"]
            save_random_model(model_dir, tiny_config("dense", **SHAPES[name]), tokenizer=build_tokenizer())
            full, adapters = measure(model_dir, None, args.repeats), measure(model_dir, lora, args.repeats)
            results["shapes"][name] = {
                "shape": SHAPES[name], "vocab_size": vocab, "full": full, "lora": adapters,
                "bytes_ratio": full["sync_bytes"] / adapters["sync_bytes"],
                "buckets_speedup": full["buckets_s"] / adapters["buckets_s"],
                "in_process_speedup": full["in_process_s"] / adapters["in_process_s"],
            }  # fmt: skip
            row = results["shapes"][name]
            print(f"{name}: {full['sync_bytes'] / 1e6:.1f} MB -> {adapters['sync_bytes'] / 1e6:.2f} MB "
                  f"({row['bytes_ratio']:.0f}x); buckets {full['buckets_s']:.3f} s -> {adapters['buckets_s']:.3f} s "
                  f"({row['buckets_speedup']:.1f}x); in-process {full['in_process_s']:.3f} s -> "
                  f"{adapters['in_process_s']:.3f} s ({row['in_process_speedup']:.1f}x); merge "
                  f"{adapters['merge_s']:.3f} s")  # fmt: skip
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    torch.set_num_threads(torch.get_num_threads())
    main()

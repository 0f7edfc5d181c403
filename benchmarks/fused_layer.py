"""Benchmark: the engine's decode step with each dense layer's attention half in one native call
(`miles_kernels.fused_layer`, native/fused.cpp: the default where it applies) vs every op through the model's modules,
side by side in one process.

Models (random weights, float32, saved with a tokenizer): the built-in example's policy (Qwen3, hidden 256, 4 layers,
the model `vs_trl.py` trains) and the miles-kernels benchmark model (`BENCHMARK_MODEL`: Qwen3, hidden 512, 8 layers).
Workload per batch size B in `--rows`: one 32-token prompt of random ids sampled B times (`n`), `--new-tokens` tokens
each with `ignore_eos`, temperature 1.0, a fixed seed, in a deterministic engine in this process. A decode step is a
scheduler step with B running sequences (the prefill step is left out); its time is read around
`Scheduler.step`. Per model and B the two forms alternate `--repeats` times (fused, modules, fused, ...), one request
each, so a slow stretch of the machine hits both; the modules form is the engine with `attention_half` answering
None (what it does where the fused call does not apply). Reported: the median decode-step time of each form over all
its repeats, their ratio, and whether both generated the same tokens (they must: the same bits).

    uv run python benchmarks/fused_layer.py --out benchmarks/results/fused_layer_<cpu>.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from host import host_info

from miles_contracts import GenerateRequest, SamplingParams
from miles_kernels import KernelConfig, model, native
from miles_kernels.testing import BENCHMARK_MODEL, build_tokenizer, save_random_model, tiny_config
from miles_rollout import Engine, EngineConfig, scheduler

# The built-in example's policy (miles_orchestrator.data.bootstrap.policy_config, its 264-token vocabulary)
EXAMPLE_POLICY = {
    "vocab_size": 264, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": 512,
}  # fmt: skip
MODELS = {"example_policy": EXAMPLE_POLICY, "benchmark_model": BENCHMARK_MODEL}
PROMPT_TOKENS = 32


@contextmanager
def modules_only() -> Iterator[None]:
    """The engine with every layer through its modules: the fused call declines (`attention_half` returns None)."""
    fused = model.attention_half
    model.attention_half = lambda *args, **kwargs: None
    try:
        yield
    finally:
        model.attention_half = fused


class StepTimer:
    """Times `Scheduler.step`, keeping the steps that ran `rows` sequences."""

    def __init__(self) -> None:
        self.rows = 0
        self.times: list[float] = []
        self._step = scheduler.Scheduler.step

    def __enter__(self) -> StepTimer:
        timer, step = self, self._step

        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return step(self, *args, **kwargs)
            finally:
                if len(self._running) == timer.rows:
                    timer.times.append(time.perf_counter() - start)

        scheduler.Scheduler.step = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        scheduler.Scheduler.step = self._step  # type: ignore[method-assign]


def run_once(
    engine: Engine, timer: StepTimer, prompt: list[int], rows: int, new_tokens: int
) -> tuple[list[float], Any]:
    """One request of `rows` samples: its decode steps' times (seconds) and the generated ids."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, sampling_seed=7, n=rows)
    timer.rows, timer.times = rows, []
    results = asyncio.run(engine.generate(GenerateRequest(input_ids=prompt, sampling_params=params)))
    return timer.times[1:], [r.output_ids for r in results]  # the first B-row step samples the prompt's token


def bench_model(name: str, shape: dict[str, Any], rows_list: list[int], new_tokens: int, repeats: int) -> dict:
    prompt = torch.randint(0, shape["vocab_size"], (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))
    out: dict[str, Any] = {"model": {k: shape[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size")}}
    with tempfile.TemporaryDirectory() as tmp:
        save_random_model(tmp, tiny_config(**shape), seed=0, tokenizer=build_tokenizer(save_dir=Path(tmp)))
        pages = max(rows_list) * (-(-(PROMPT_TOKENS + new_tokens) // 16) + 1) + 16
        engine = Engine(tmp, KernelConfig(), EngineConfig(num_kv_pages=pages))
        try:
            with StepTimer() as timer:
                run_once(engine, timer, prompt.tolist(), 1, 4)  # warm-up: packing, first-touch pages
                with modules_only():
                    run_once(engine, timer, prompt.tolist(), 1, 4)
                for rows in rows_list:
                    fused: list[float] = []
                    modules: list[float] = []
                    same = True
                    for _ in range(repeats):
                        times, ids_fused = run_once(engine, timer, prompt.tolist(), rows, new_tokens)
                        fused += times
                        with modules_only():
                            times, ids_modules = run_once(engine, timer, prompt.tolist(), rows, new_tokens)
                        modules += times
                        same = same and ids_fused == ids_modules
                    f, m = statistics.median(fused), statistics.median(modules)
                    out[f"rows_{rows}"] = {
                        "fused_step_ms": round(1000 * f, 3), "modules_step_ms": round(1000 * m, 3),
                        "fused_over_modules": round(f / m, 3), "steps_each": len(fused),
                        "same_tokens": same,
                    }  # fmt: skip
                    print(name, rows, out[f"rows_{rows}"], flush=True)
        finally:
            engine.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    settings = {"rows": args.rows, "new_tokens": args.new_tokens, "repeats": args.repeats,
                "prompt_tokens": PROMPT_TOKENS, "native_isa": native.isa()}  # fmt: skip
    result: dict[str, Any] = {
        "script_command": "python benchmarks/fused_layer.py" + (f" --out {args.out}" if args.out else ""),
        "host": host_info(),
        "settings": settings,
    }
    for name, shape in MODELS.items():
        result[name] = bench_model(name, shape, args.rows, args.new_tokens, args.repeats)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

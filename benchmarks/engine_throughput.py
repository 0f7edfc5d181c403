"""Benchmark: the embedded engine's throughput in this process (no HTTP, no server), for comparing two versions of
the engine's code side by side: run it alternately in each checkout (one run at a time) and compare the medians.

Workload: `benchmarks/rollout.py`'s (the miles-kernels benchmark model with random weights, 64 prompts of random
token ids with lengths spread over 32..256, 128 new tokens each with `ignore_eos`, temperature 1.0, sampling seeds
1000 + prompt index), one warm-up request (the first prompt's first 8 tokens), then every prompt at once through
`Engine.generate`; a deterministic engine, then a fast one. Prints one JSON line: tokens/s per mode and a digest of
the generated ids (equal digests: the same tokens, bit for bit).

    uv run python benchmarks/engine_throughput.py
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import tempfile
import time

import torch

from miles_contracts import GenerateRequest, SamplingParams
from miles_kernels import KernelConfig
from miles_kernels.testing import BENCHMARK_MODEL, save_random_model, tiny_config
from miles_rollout import Engine, EngineConfig

NEW_TOKENS = 128
PAGE_SIZE = 16


def make_prompts(num_prompts: int = 64, min_len: int = 32, max_len: int = 256) -> list[list[int]]:
    """rollout.py's prompts: random ids, lengths spread evenly over min_len..max_len in a fixed shuffled order."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(min_len, max_len, num_prompts).round().long()
    lengths = lengths[torch.randperm(num_prompts, generator=generator)]
    vocab = BENCHMARK_MODEL["vocab_size"]
    return [torch.randint(0, vocab, (int(n),), generator=generator).tolist() for n in lengths]


def request(prompt: list[int], new_tokens: int, seed: int) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, sampling_seed=seed)
    return GenerateRequest(input_ids=prompt, sampling_params=params)


async def measure(engine: Engine, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    """Tokens/s of every prompt at once (after one warm-up request) and the generated ids."""
    await engine.generate(request(prompts[0][:8], NEW_TOKENS, seed=1000))
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(request(p, NEW_TOKENS, 1000 + i)) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - start
    return sum(len(r[0].output_ids) for r in results) / wall, [r[0].output_ids for r in results]


def main() -> None:
    prompts = make_prompts()
    num_kv_pages = len(prompts) * (-(-(max(map(len, prompts)) + NEW_TOKENS) // PAGE_SIZE) + 1) + 16
    result: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_random_model(tmp, tiny_config(**BENCHMARK_MODEL), seed=0)
        for mode in ("deterministic", "fast"):
            engine = Engine(tmp, KernelConfig(mode=mode), EngineConfig(num_kv_pages=num_kv_pages))
            try:
                tokens_per_s, ids = asyncio.run(measure(engine, prompts))
            finally:
                engine.shutdown()
            result[mode] = round(tokens_per_s, 1)
            result[f"{mode}_digest"] = hashlib.sha256(str(ids).encode()).hexdigest()[:12]
    print(json.dumps(result))


if __name__ == "__main__":
    main()

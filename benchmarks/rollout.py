"""Benchmark: end-to-end rollout throughput of the miles server (fast and deterministic mode) vs Hugging Face
`transformers` `model.generate`, side by side in one run.

Model: the miles-kernels benchmark model (`miles_kernels.testing.BENCHMARK_MODEL`: Qwen3, hidden 512, 8 layers,
vocab 8192, float32, random weights, seed 0) saved with a tokenizer. Workload: `--num-prompts` prompts of random
token ids, lengths spread evenly over `--min-prompt`..`--max-prompt` (fixed seed), `--new-tokens` new tokens each
with `ignore_eos` (so every request generates exactly that many), temperature 1.0, one fixed seed per prompt.
- miles fast / miles deterministic: a real `miles-rollout serve` subprocess each (the machine's thread count, KV
  pages sized to hold every sequence at once), one warm-up request, then one concurrent HTTP `/generate` per prompt;
  wall time runs from the first send to the last response. Tokens/s = sum of `completion_tokens` / wall time.
- HF: `model.generate` in this process after both servers have stopped (they never compete for cores), on
  left-padded batches of `--hf-batch-size` prompts with an attention mask, sampling with temperature 1.0 and no
  top-k / top-p, `min_new_tokens` = `max_new_tokens` so every row generates exactly `--new-tokens` tokens.
  Padding every row to the longest prompt of its batch is HF's usual batched cost and is counted; tokens/s =
  num_prompts * new_tokens / wall time.
Ratios: miles_fast / hf and miles_deterministic / hf tokens/s, and the deterministic overhead fast / det - 1.

    uv run python benchmarks/rollout.py --out benchmarks/results/rollout.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shlex
import tempfile
import time
from pathlib import Path

import httpx
import torch
from host import host_info
from transformers import AutoModelForCausalLM

from miles_kernels.testing import BENCHMARK_MODEL, build_tokenizer, save_random_model, tiny_config
from miles_rollout import launch_server

PAGE_SIZE = 16  # the server's default --page-size
PAD_ID = 0  # <|endoftext|> of the miles tokenizer


def make_prompts(num_prompts: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """Random token ids; lengths spread evenly over min_len..max_len, in a shuffled (fixed) order."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(min_len, max_len, num_prompts).round().long()
    lengths = lengths[torch.randperm(num_prompts, generator=generator)]
    vocab = BENCHMARK_MODEL["vocab_size"]
    return [torch.randint(0, vocab, (int(n),), generator=generator).tolist() for n in lengths]


def generate_payload(prompt: list[int], new_tokens: int, seed: int) -> dict[str, object]:
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True, "sampling_seed": seed}
    return {"input_ids": prompt, "sampling_params": params}


async def send_all(url: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float], list[dict]]:
    """Warm up with one small request, then send every prompt at once; returns wall time, latencies, responses."""
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(3600.0)) as client:
        warmup = await client.post("/generate", json=generate_payload(prompts[0][:8], 4, seed=12345))
        warmup.raise_for_status()

        async def one(i: int, prompt: list[int]) -> tuple[float, dict]:
            response = await client.post("/generate", json=generate_payload(prompt, new_tokens, seed=1000 + i))
            if response.status_code != 200:
                raise RuntimeError(f"/generate for prompt {i} answered {response.status_code}: {response.text}")
            return time.perf_counter(), response.json()

        start = time.perf_counter()
        done = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        wall = max(t for t, _ in done) - start
        return wall, [t - start for t, _ in done], [r for _, r in done]


def bench_server(
    model_dir: Path, log: Path, prompts: list[list[int]], new_tokens: int, is_deterministic: bool,
    extra_flags: list[str],
) -> tuple[dict[str, object], list[list[int]]]:  # fmt: skip
    load_before = os.getloadavg()[0]
    num_kv_pages = len(prompts) * (-(-(max(map(len, prompts)) + new_tokens) // PAGE_SIZE) + 1) + 16
    started = time.perf_counter()
    flags = ["--page-size", str(PAGE_SIZE), "--num-kv-pages", str(num_kv_pages)]
    flags += (["--deterministic"] if is_deterministic else []) + extra_flags
    with launch_server(model_dir, *flags, log_path=log, startup_timeout=300) as url:
        startup = time.perf_counter() - started
        wall, latencies, responses = asyncio.run(send_all(url, prompts, new_tokens))
        info = httpx.get(f"{url}/get_server_info", timeout=10.0).json()
    completion = [r["meta_info"]["completion_tokens"] for r in responses]
    reasons = collections.Counter((r["meta_info"].get("finish_reason") or {}).get("type") for r in responses)
    log_text = log.read_text()
    result = {
        "mode": "deterministic" if is_deterministic else "fast",
        "extra_flags": extra_flags,
        "num_kv_pages": num_kv_pages,
        "startup_seconds": startup,
        "wall_seconds": wall,
        "output_tokens": sum(completion),
        "output_tokens_per_second": sum(completion) / wall,
        "request_latency_seconds": {
            "min": min(latencies),
            "mean": sum(latencies) / len(latencies),
            "max": max(latencies),
        },
        "finish_reasons": dict(reasons),
        "num_requests_not_exactly_new_tokens": sum(c != new_tokens for c in completion),
        "engine_steps_with_warmup": info.get("num_steps"),
        "kernel_config": info.get("kernel_config"),
        "load_average_1min_before": load_before,  # the cores may be shared: a high load skews the timing
        "load_average_1min_after": os.getloadavg()[0],
        "server_log_error_lines": sum(("Traceback" in line or " ERROR " in line) for line in log_text.splitlines()),
    }
    return result, [r["output_ids"] for r in responses]


def bench_hf(model_dir: Path, prompts: list[list[int]], new_tokens: int, batch_size: int) -> dict[str, object]:
    load_before = os.getloadavg()[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    padded = []
    for batch in batches:  # left padding: every row's last prompt token sits at the same position
        width = max(map(len, batch))
        ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        padded.append((ids, mask))
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "pad_token_id": PAD_ID}
    lengths = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    with torch.no_grad():
        hf.generate(padded[0][0][:1, -8:], max_new_tokens=4, min_new_tokens=4, **sampling)  # warm-up, not timed
        torch.manual_seed(0)
        start = time.perf_counter()
        generated = [hf.generate(ids, attention_mask=mask, **lengths, **sampling) for ids, mask in padded]
        wall = time.perf_counter() - start
    num_new = [out.shape[1] - ids.shape[1] for out, (ids, _) in zip(generated, padded, strict=True)]
    output_tokens = len(prompts) * new_tokens
    return {
        "batch_size": batch_size,
        "num_batches": len(batches),
        "padded_prompt_tokens": sum(ids.numel() for ids, _ in padded),
        "wall_seconds": wall,
        "output_tokens": output_tokens,
        "output_tokens_per_second": output_tokens / wall,
        "new_tokens_per_batch": num_new,
        "load_average_1min_before": load_before,
        "load_average_1min_after": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/rollout.json", help="JSON output path")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32, help="shortest prompt, tokens")
    parser.add_argument("--max-prompt", type=int, default=256, help="longest prompt, tokens")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--hf-batch-size", type=int, default=64, help="prompts per HF generate call")
    parser.add_argument("--skip-hf", action="store_true", help="measure only the miles server")
    parser.add_argument("--fast-flags", default="", help="more `miles-rollout serve` flags for the fast server")
    parser.add_argument(
        "--deterministic-flags",
        default="",
        help="more flags for the deterministic server (e.g. '--attention-backend native')",
    )
    args = parser.parse_args()
    if not 1 <= args.min_prompt <= args.max_prompt:
        parser.error("need 1 <= --min-prompt <= --max-prompt")

    prompts = make_prompts(args.num_prompts, args.min_prompt, args.max_prompt)
    results: dict[str, object] = {
        "model": BENCHMARK_MODEL,
        "dtype": "float32",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "cpu_count": os.cpu_count(),
        "host": host_info(),
        "workload": {
            "num_prompts": args.num_prompts,
            "min_prompt_tokens": args.min_prompt,
            "max_prompt_tokens": args.max_prompt,
            "prompt_tokens": sum(map(len, prompts)),
            "new_tokens_per_prompt": args.new_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "prompt_seed": 0,
            "sampling_seeds": "1000 + prompt index (miles); torch.manual_seed(0) (hf)",
        },
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        tokenizer = build_tokenizer(save_dir=model_dir)
        save_random_model(model_dir, tiny_config("dense", **BENCHMARK_MODEL), seed=0, tokenizer=tokenizer)
        fast_flags, det_flags = shlex.split(args.fast_flags), shlex.split(args.deterministic_flags)
        fast, fast_ids = bench_server(model_dir, Path(tmp) / "fast.log", prompts, args.new_tokens, False, fast_flags)
        print(f"miles fast: {fmt(fast)}", flush=True)
        det, det_ids = bench_server(model_dir, Path(tmp) / "det.log", prompts, args.new_tokens, True, det_flags)
        print(f"miles deterministic: {fmt(det)}", flush=True)
        results["miles_fast"] = fast
        results["miles_deterministic"] = det
        # Same seeds, different kernels: sampled tokens may diverge once float rounding tips a draw.
        results["num_outputs_identical_fast_vs_deterministic"] = sum(
            a == b for a, b in zip(fast_ids, det_ids, strict=True)
        )
        ratios = {"deterministic_overhead": fast["output_tokens_per_second"] / det["output_tokens_per_second"] - 1}
        if not args.skip_hf:
            hf = bench_hf(model_dir, prompts, args.new_tokens, args.hf_batch_size)
            print(f"hf generate: {fmt(hf)}", flush=True)
            results["hf"] = hf
            ratios["miles_fast_over_hf_tokens_per_second"] = (
                fast["output_tokens_per_second"] / hf["output_tokens_per_second"]
            )
            ratios["miles_deterministic_over_hf_tokens_per_second"] = (
                det["output_tokens_per_second"] / hf["output_tokens_per_second"]
            )
        results["ratios"] = ratios
    print(" | ".join(f"{name} {value:.2f}" for name, value in ratios.items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


def fmt(result: dict) -> str:
    return (
        f"{result['output_tokens']} tokens in {result['wall_seconds']:.2f} s"
        f" = {result['output_tokens_per_second']:.1f} tokens/s"
    )


if __name__ == "__main__":
    main()

"""After `benchmarks/spec.py`: the end-of-run policy's rollout speed with no draft, its frozen draft and its online
draft, measured side by side, interleaved, without the RL loop around it.

`spec.py --keep DIR` leaves each mode's final policy in DIR/{off,frozen,online}/final: the same trunk (the runs train
the policy identically), with the bootstrapped MTP module (frozen) or the one trained online (online). This script
serves each in an in-process engine in deterministic mode, `--concurrency` sequences at a time (as in the runs),
and generates the same requests (`--prompts` task prompts x `--samples`, up to `--max-new-tokens`, temperature 1):
off (online/final without a draft), frozen (frozen/final, drafting) and online (online/final, drafting), one after
the other, `--reps` rounds, after a warm-up request. The outputs are the same tokens in all three (checked), so the
ratio of the median tokens/s is the speed-up. What the in-run numbers add on top (reward scoring, weight sync,
memory release and resume around each rollout) is left out here.

    uv run python benchmarks/spec.py --keep /tmp/spec --out benchmarks/results/spec.json
    uv run python benchmarks/spec_final_drafts.py --runs /tmp/spec --out benchmarks/results/spec_final_drafts.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import spec_task
import torch
from host import host_info
from transformers import AutoTokenizer

from miles_contracts import GenerateRequest, SamplingParams
from miles_kernels import KernelConfig
from miles_rollout import Engine, EngineConfig, InProcessClient


def measure(model_dir: Path, draft: bool, request: GenerateRequest, args: Any) -> dict[str, Any]:
    spec = {"speculative_algorithm": "NEXTN", "speculative_num_steps": args.num_draft_steps} if draft else {}
    engine = Engine(str(model_dir), KernelConfig(page_size=16),
                    EngineConfig(num_kv_pages=512, max_running_requests=args.concurrency, **spec))  # type: ignore[arg-type]  # fmt: skip
    client = InProcessClient(engine)
    try:
        asyncio.run(client.generate(request))  # warm-up
        began = time.perf_counter()
        responses = asyncio.run(client.generate(request))
        seconds = time.perf_counter() - began
    finally:
        engine.shutdown()
    tokens = sum(len(r.output_ids) for r in responses)
    verify = sum(r.meta_info.spec_verify_ct or 0 for r in responses)
    return {
        "tokens_per_s": tokens / seconds,
        "accept_length": tokens / verify if verify else None,
        "outputs": [r.output_ids for r in responses],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", required=True, help="the --keep directory of a benchmarks/spec.py run")
    parser.add_argument("--out", default="benchmarks/results/spec_final_drafts.json")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-draft-steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    runs = Path(args.runs)
    sides = {"off": (runs / "online" / "final", False), "frozen": (runs / "frozen" / "final", True),
             "online": (runs / "online" / "final", True)}  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(str(sides["off"][0]))
    rows = spec_task.prompt_rows(args.prompts, seed=12345)  # prompts the runs did not train on
    request = GenerateRequest(
        input_ids=[tokenizer.encode(row["prompt"]) for row in rows for _ in range(args.samples)],
        sampling_params=SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, sampling_seed=7),
    )
    results: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for rep in range(args.reps):
        for side, (model_dir, draft) in sides.items():
            results[side].append(measure(model_dir, draft, request, args))
            print(rep, side, {k: v for k, v in results[side][-1].items() if k != "outputs"}, flush=True)
    outputs = {side: [r["outputs"] for r in reps] for side, reps in results.items()}
    same = all(o == outputs["off"][0] for side in outputs for o in outputs[side])
    median = {side: statistics.median(r["tokens_per_s"] for r in reps) for side, reps in results.items()}
    out = {
        "what": "the end-of-run policy's rollout tokens/s with no draft, its frozen and its online draft, interleaved",
        "command": " ".join(["python", *sys.argv]),
        "settings": vars(args),
        "host": host_info(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "identical_outputs": same,
        "median_tokens_per_s": median,
        "accept_length": {side: reps[0]["accept_length"] for side, reps in results.items()},
        "tokens_per_s_per_rep": {side: [r["tokens_per_s"] for r in reps] for side, reps in results.items()},
        "speedup": {
            "online_vs_frozen": median["online"] / median["frozen"],
            "online_vs_off": median["online"] / median["off"],
            "frozen_vs_off": median["frozen"] / median["off"],
        },
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("identical_outputs", "median_tokens_per_s", "accept_length", "speedup")},
                     indent=2))  # fmt: skip


if __name__ == "__main__":
    main()

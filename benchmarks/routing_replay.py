"""Routing flips between the rollout engine and the trainer, and what routing replay (R3) does about them, measured.

For each MoE family (Qwen3-MoE, GLM-4.5 MoE; the built-in policy's shapes, `miles_orchestrator.data.bootstrap
.policy_config`) and each kernel mode (`fast`: plain torch; `deterministic`: batch-invariant), in `--dtype`
(bfloat16 by default): the embedded engine generates `--prompts` x `--samples` responses with their log-probs and
routed experts (SGLang's `return_routed_experts`), then the trainer's path (sequence packing, one packed forward,
`miles_trainer.micro_batch_forward`) scores them on the same weights, once routing by itself and once replaying the
engine's experts. Reported per (family, mode):
- `routing_flip_frac`: the fraction of (token, MoE layer) pairs whose expert set the trainer's router chose
  differently from the engine (`miles_trainer.moe.routing_metrics`);
- `mismatch_mean` / `mismatch_max`: |trainer log-prob - rollout log-prob| over response tokens, without and with
  replay;
- `replay_bitwise_equal`: whether the log-probs with replay equal those without, bit for bit (deterministic mode:
  the engine's routing is the trainer's own, so replay must change nothing).
Weights: `--model-dir` (e.g. a bootstrapped MoE policy), else random ones (`miles_kernels.testing.random_model`).

    uv run python benchmarks/routing_replay.py --out benchmarks/results/routing_replay.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from host import host_info

from miles_contracts import GenerateRequest, Sample, SamplingParams
from miles_kernels import KernelConfig, load_model
from miles_kernels.testing import save_random_model
from miles_orchestrator.data.bootstrap import policy_config
from miles_rollout import Engine, EngineConfig, InProcessClient
from miles_trainer import pack_samples
from miles_trainer.logprobs import micro_batch_forward
from miles_trainer.moe import moe_shape, routing_metrics


def rollout(model_dir: str, kernel: KernelConfig, args: Any, routed_experts: bool = True) -> list[Sample]:
    """`args.prompts` random prompts x `args.samples` responses of `args.max_new_tokens` tokens from the embedded
    engine, with their log-probs (and routed experts, for an MoE model)."""
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, 250, (int(n),), generator=generator).tolist()
               for n in torch.randint(6, 24, (args.prompts,), generator=generator)]  # fmt: skip
    engine = Engine(model_dir, kernel, EngineConfig(num_kv_pages=1024, enable_return_routed_experts=routed_experts))
    client = InProcessClient(engine)
    requests = [
        GenerateRequest(
            input_ids=prompt, return_logprob=True, return_routed_experts=routed_experts,
            sampling_params=SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, n=args.samples,
                                           sampling_seed=args.seed * 1000 + group, ignore_eos=True),
        )
        for group, prompt in enumerate(prompts)
    ]  # fmt: skip

    async def generate_all() -> list[Any]:
        return list(await asyncio.gather(*(client.generate(r) for r in requests)))

    try:
        groups = asyncio.run(generate_all())
    finally:
        engine.shutdown()
    samples: list[Sample] = []
    for group, (prompt, responses) in enumerate(zip(prompts, groups, strict=True)):
        for response in responses:
            meta = response.meta_info
            samples.append(Sample(
                index=len(samples), group_index=group, prompt="", prompt_tokens=prompt,
                response_tokens=list(response.output_ids), routed_experts=meta.routed_experts,
                rollout_logprobs=[float(e[0] or 0.0) for e in meta.output_token_logprobs or []],
            ))  # fmt: skip
    return samples


def score(model_dir: str, kernel: KernelConfig, samples: list[Sample]) -> dict[str, Any]:
    model = load_model(model_dir, kernel)
    rollout_lp = torch.tensor([lp for s in samples for lp in s.rollout_logprobs or []], dtype=torch.float32)
    out: dict[str, Any] = {}
    logprobs: dict[bool, torch.Tensor] = {}
    flips = pairs = 0.0
    for replay in (False, True):
        parts = []
        for micro in pack_samples(samples, kernel, 4096, routing_shape=moe_shape(model), require_routing=True):
            with torch.no_grad():
                parts.append(micro_batch_forward(model, micro, 1.0, replay=replay)[0])
            if not replay:
                value, count = routing_metrics(model, micro.routing_NLK)["moe_routing_flip_frac"]
                flips, pairs = flips + value * count, pairs + count
        logprobs[replay] = torch.cat(parts)
        diff = (logprobs[replay] - rollout_lp).abs()
        name = "with_replay" if replay else "without_replay"
        out[name] = {"mismatch_mean": float(diff.mean()), "mismatch_max": float(diff.max()),
                     "tokens_equal_fraction": float((diff == 0).double().mean())}  # fmt: skip
    out["routing_flip_frac"] = flips / pairs
    out["routing_pairs"] = int(pairs)
    out["replay_bitwise_equal"] = bool(torch.equal(logprobs[False], logprobs[True]))
    out["response_tokens"] = int(rollout_lp.numel())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/routing_replay.json")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--model-dir", default=None, help="an MoE model directory (default: random weights)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("qwen3_moe", "glm4_moe"):
            model_dir = args.model_dir
            if model_dir is None:
                model_dir = str(Path(tmp) / family)
                save_random_model(model_dir, policy_config(264, family), seed=args.seed, dtype=args.dtype)
            for mode in ("fast", "deterministic"):
                kernel = KernelConfig(mode=mode, dtype=args.dtype)
                samples = rollout(model_dir, kernel, args)
                results[f"{family}/{mode}"] = score(model_dir, kernel, samples)
                print(family, mode, json.dumps(results[f"{family}/{mode}"]), flush=True)
            if args.model_dir is not None:
                break
    report = {
        "script_command": "python benchmarks/routing_replay.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "host": host_info(),
        "weights": args.model_dir or "random (miles_kernels.testing.random_model, std 0.05)",
        "results": results,
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

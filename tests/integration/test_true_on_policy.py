"""Integration tier: true on-policy across packages. A real `miles-rollout serve --deterministic` subprocess
generates over HTTP (log-probs travel as JSON numbers); miles-trainer packs the samples and recomputes the
log-probs with the same kernels — they must be bitwise equal (mismatch exactly 0), for dense and MoE, on the CPU
and (`gpu` marker) on a CUDA device, where server and trainer both run on the GPU."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles_contracts import GenerateRequest, Sample, SamplingParams
from miles_kernels import KernelConfig, load_model
from miles_kernels.testing import build_tokenizer, save_random_model, tiny_config
from miles_rollout import Client, launch_server
from miles_trainer import train_rollout_logprob_abs_diff
from miles_trainer.logprobs import response_logprobs
from miles_trainer.packing import pack_samples

PAGE_SIZE = 16


CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kind", ["dense", "moe", "glm", "qwen2", "llama"])
def test_engine_and_trainer_logprobs_are_bitwise_equal(tmp_path, kind: str, device: str) -> None:
    model_dir = tmp_path / kind
    save_random_model(
        model_dir, tiny_config(kind, vocab_size=512), seed=5, tokenizer=build_tokenizer(save_dir=model_dir)
    )
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (4, 40, 13, 70)]
    temperature = 1.0

    async def generate(url: str) -> list[Sample]:
        async with Client(url) as client:
            requests = [
                GenerateRequest(input_ids=p, return_logprob=True, sampling_params=SamplingParams(
                    max_new_tokens=12, temperature=temperature, sampling_seed=1000 + 10 * i, n=2))
                for i, p in enumerate(prompts)
            ]  # fmt: skip
            results = await asyncio.gather(*(client.generate(r) for r in requests))  # concurrent: mixed batches
        samples = []
        for i, responses in enumerate(results):
            for response in responses:
                samples.append(Sample(
                    index=len(samples), group_index=i, prompt="", prompt_tokens=prompts[i],
                    response_tokens=response.output_ids,
                    rollout_logprobs=[entry[0] for entry in response.meta_info.output_token_logprobs or []],
                ))  # fmt: skip
        return samples

    with launch_server(model_dir, "--deterministic", "--page-size", str(PAGE_SIZE), "--device", device) as url:
        samples = asyncio.run(generate(url))
    kernel = KernelConfig(page_size=PAGE_SIZE)  # the server's kernel config: same fingerprint
    model = load_model(model_dir, kernel, device)
    total_diff = []
    for micro in pack_samples(samples, kernel, max_tokens=96):
        with torch.no_grad():
            got = [row.cpu() for row in response_logprobs(model, micro, temperature)]
        for local, i in enumerate(micro.sample_indices):
            rollout = torch.tensor(samples[i].rollout_logprobs, dtype=torch.float32)
            assert torch.equal(got[local], rollout), f"sample {i}"
            total_diff.append(
                train_rollout_logprob_abs_diff(
                    got[local][None], rollout[None], torch.ones(1, len(rollout), dtype=torch.bool)
                )
            )
    assert all(float(d["max"]) == 0.0 for d in total_diff)

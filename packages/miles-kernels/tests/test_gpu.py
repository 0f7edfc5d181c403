"""GPU tier (`@pytest.mark.gpu`, run by `nox -s gpu` where CUDA is present): the same model code runs on CUDA,
matches the CPU within tolerance, and is batch-invariant on the GPU too."""

from __future__ import annotations

import pytest
import torch

from miles_kernels import KernelConfig, PagedRunner, packed_logits, random_model, tiny_config

pytestmark = pytest.mark.gpu

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@requires_cuda
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_cuda_model_is_batch_invariant_and_matches_cpu(kind: str) -> None:
    kernel = KernelConfig(page_size=16, attention_query_tile=4, linear_tile=8, moe_tile=8)
    cpu = random_model(tiny_config(kind), kernel, seed=0)
    gpu = random_model(tiny_config(kind), kernel, seed=0).to("cuda")
    generator = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=generator) for n in (5, 33, 17, 1)]
    reference = packed_logits(gpu, [s.cuda() for s in seqs])
    for got, want in zip(reference, packed_logits(cpu, seqs), strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-4)
    runner = PagedRunner(gpu)
    runner.step({i: s[:-1].cuda() for i, s in enumerate(seqs) if len(s) > 1})
    last = runner.step({i: s[-1:].cuda() for i, s in enumerate(seqs) if len(s) > 1})
    for i, logits in last.items():
        assert torch.equal(logits, reference[i][-1:]), f"seq {i}: CUDA decode differs from CUDA prefill"

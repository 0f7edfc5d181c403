"""GPU tier (`@pytest.mark.gpu`, run by `nox -s gpu` where CUDA is present): the same model code runs on CUDA,
matches the CPU within tolerance, and is batch-invariant on the GPU too — also at the shapes of a real model
(hidden 4096), where cuBLAS's `bmm` and torch's row reduction both change a row's bits with the batch size."""

from __future__ import annotations

import pytest
import torch

from miles_kernels import KernelConfig, rms_norm, tiled_matmul
from miles_kernels.testing import PagedRunner, packed_logits, random_model, tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


@pytest.mark.parametrize("kind", ["dense", "moe", "glm", "qwen2", "llama", "deepseek"])
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_linear_and_norm_rows_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 4096, device="cuda", dtype=dtype, generator=generator)
    weight = torch.randn(4096, 4096, device="cuda", dtype=dtype, generator=generator) / 64
    norm_weight = torch.randn(4096, device="cuda", dtype=dtype, generator=generator)
    alone = [(tiled_matmul(x[r : r + 1], weight, 16), rms_norm(x[r : r + 1], norm_weight, 1e-6)) for r in range(3)]
    for m in (2, 3, 17, 64, 300):
        out, normed = tiled_matmul(x[:m], weight, 16), rms_norm(x[:m], norm_weight, 1e-6)
        for r in range(min(m, 3)):
            assert torch.equal(out[r : r + 1], alone[r][0]), f"linear row {r} with M={m}"
            assert torch.equal(normed[r : r + 1], alone[r][1]), f"norm row {r} with M={m}"


def assert_decode_equals_prefill(
    model, seqs: list[torch.Tensor], dtype: str, reference: list[torch.Tensor] | None = None
) -> None:
    """Each sequence's last token decoded in one batched step after its prefill gives the logits of its packed
    forward (or of `reference`, another model's packed logits), bit for bit."""
    reference = reference or packed_logits(model, seqs)
    runner = PagedRunner(model)
    runner.step({i: s[:-1] for i, s in enumerate(seqs)})
    last = runner.step({i: s[-1:] for i, s in enumerate(seqs)})
    for i, logits in last.items():
        assert torch.equal(logits, reference[i][-1:]), f"seq {i}: CUDA decode differs from CUDA prefill ({dtype})"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_decode_equals_prefill_at_real_head_shapes(dtype: str) -> None:
    """Head dim 128, 8 query / 2 KV heads, hidden 1024, prompts over several key blocks: each sequence's decode
    step (batched with the others) gives the logits of one packed prefill, bit for bit."""
    kernel = KernelConfig(dtype=dtype, page_size=16)
    config = tiny_config(
        "dense", vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, num_hidden_layers=2, max_position_embeddings=1024,
    )  # fmt: skip
    model = random_model(config, kernel, seed=1).to("cuda")
    generator = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 1024, (n,), generator=generator).cuda() for n in (5, 100, 37, 260, 64)]
    assert_decode_equals_prefill(model, seqs, dtype)


@pytest.mark.parametrize("attention_backend", ["torch-blocked", "triton"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_mla_decode_equals_prefill_at_deepseek_v3_latent_width(dtype: str, attention_backend: str) -> None:
    """DeepSeek-V3's attention widths (a 512 + 64 latent, query / key heads of 128 + 64, value heads of 128; 16
    heads, YaRN, interleaved rotary, two dense layers): the absorbed attention over the latent cache, each sequence's
    decode step batched with the others, gives the logits of one packed prefill, bit for bit, with the blocked and the
    Triton attention (whose head width pads 576 to 1024)."""
    kernel = KernelConfig(dtype=dtype, page_size=16, attention_backend=attention_backend)
    config = tiny_config(
        "deepseek", vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_attention_heads=16,
        num_key_value_heads=16, head_dim=64, q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, num_hidden_layers=2, first_k_dense_replace=2,
        max_position_embeddings=1024,
    )  # fmt: skip
    model = random_model(config, kernel, seed=2).to("cuda")
    generator = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 1024, (n,), generator=generator).cuda() for n in (5, 100, 37, 260, 64)]
    assert_decode_equals_prefill(model, seqs, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_lora_merged_each_forward_equals_the_engines_folded_weights(dtype: str) -> None:
    """LoRA on CUDA (docs/lora.md): the trainer's forward, merging W + s·B·A at every call with gradients on, gives the
    logits of the engine's model, which merged once (`fold_adapters`) and decodes after a prefill, bit for bit, at
    hidden 1024 with rank 16 on every linear layer."""
    from miles_kernels import add_lora, build_packed_batch, fold_adapters, load_state
    from miles_kernels.config import LoraConfig
    from miles_kernels.testing import random_adapter

    kernel = KernelConfig(dtype=dtype, page_size=16, attention_query_tile=4, linear_tile=16, moe_tile=16)
    config = tiny_config("dense", hidden_size=1024, intermediate_size=2048, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=128)  # fmt: skip
    lora = LoraConfig(rank=16, alpha=32)
    trainer, engine = (random_model(config, kernel, seed=1).to("cuda") for _ in range(2))
    add_lora(trainer, lora)
    adapters = random_adapter(trainer, lora, seed=2, std=0.02)
    load_state(trainer, adapters)
    add_lora(engine, lora)
    load_state(engine, adapters)
    fold_adapters(engine)
    generator = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=generator).cuda() for n in (40, 17, 65)]
    lens = [len(s) for s in seqs]
    batch = build_packed_batch(lens, kernel.page_size, kernel.attention_query_tile, seqs[0].device)
    for name, param in trainer.named_parameters():
        param.requires_grad_(name.endswith(("lora_A", "lora_B")))
    trained = torch.split(trainer.logits(trainer.forward_hidden(torch.cat(seqs), batch)), lens)  # autograd on
    assert_decode_equals_prefill(engine, seqs, dtype, reference=[t.detach() for t in trained])

"""CPU numerics tier: miles_memory's FLOPs model (flops.py) against the FLOPs torch counts (torch.utils.flop_counter)
over real forwards and backwards of miles-kernels' small random models: dense Qwen3, Qwen3-MoE, GLM-4.5 (MoE with
a shared expert, a dense first layer and biases) and DeepSeek-V3 (MLA), built from the same config.json the
planner reads. Here because the check needs both packages (miles-memory's tests install neither miles-kernels nor
its models, and miles-kernels may not import miles-memory).

Fast kernels with the torch attention and linear layers (`KernelConfig(mode="fast", attention_backend="torch-hybrid",
linear_backend="torch")`: the native kernels are no op torch counts): linear layers are plain GEMMs (deterministic
mode tiles and pads rows)
and the trainer's packed attention is one SDPA per sequence over its keys padded to whole KV pages. The CPU's SDPA
op has no formula in torch's counter, so the test counts it with torch's own `sdpa_flop_count`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from miles_kernels import AttentionBatch, CausalLM, KernelConfig, build_packed_batch
from miles_kernels.testing import random_model, tiny_config
from miles_memory import ModelShape, model_flops

aten = torch.ops.aten
SDPA = aten._scaled_dot_product_flash_attention_for_cpu
SDPA_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward
Shape = tuple[int, ...]
LENGTHS = [64, 72]  # each >= 48 tokens, so the fast attention runs SDPA (ops/attention.py, HYBRID_SDPA_FROM_TOKENS)


def _sdpa(q: Shape, k: Shape, v: Shape, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """The CPU SDPA op's FLOPs as torch counts its CUDA SDPA ops' (QK^T and AV over every query-key pair)."""
    return int(sdpa_flop_count(q, k, v))


def _sdpa_backward(grad: Shape, q: Shape, k: Shape, v: Shape, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(grad, q, k, v))


def counted(model: CausalLM, ids: torch.Tensor, batch: AttentionBatch, backward: bool) -> tuple[int, int, int]:
    """(matmul FLOPs, SDPA forward FLOPs, SDPA backward FLOPs) of one forward (and backward) of `ids`."""
    mapping = {SDPA: _sdpa, SDPA_BACKWARD: _sdpa_backward}
    with torch.set_grad_enabled(backward), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        logits = model.logits(model.forward_hidden(ids, batch))
        if backward:
            logits.logsumexp(-1).sum().backward()
    ops = counter.get_flop_counts()["Global"]
    unknown = set(ops) - {aten.mm, aten.addmm, SDPA, SDPA_BACKWARD}
    assert not unknown, f"ops the test does not attribute: {unknown}"
    return ops.get(aten.mm, 0) + ops.get(aten.addmm, 0), ops.get(SDPA, 0), ops.get(SDPA_BACKWARD, 0)


@pytest.mark.parametrize("kind", ["dense", "moe", "glm", "deepseek"])
def test_flop_counter_matches_model_flops(kind: str) -> None:
    config = tiny_config(kind)
    kernel = KernelConfig(mode="fast", attention_backend="torch-hybrid", linear_backend="torch")  # ops torch counts
    model = random_model(config, kernel, seed=1)
    shape = ModelShape.from_hf(config.to_hf())
    flops = model_flops(shape)
    batch = build_packed_batch(LENGTHS, kernel.page_size, kernel.attention_query_tile, torch.device("cpu"))
    ids = torch.randint(0, config.vocab_size, (sum(LENGTHS),), generator=torch.Generator().manual_seed(0))

    matmul, attention, _ = counted(model, ids, batch, backward=False)
    # the matmuls exactly: every linear layer, the router and the k routed experts each token runs, the LM head
    assert matmul == flops.matmul * sum(LENGTHS)

    # SDPA counts every query against its sequence's keys padded to whole pages (no causal discount), QK^T over the
    # query width and AV over the value width; MLA's expanded form pads v to the q / k width (v_head_dim 12 -> 24)
    keys = [-(-n // kernel.page_size) * kernel.page_size for n in LENGTHS]
    pairs = sum(n * k for n, k in zip(LENGTHS, keys, strict=True))
    if shape.is_mla:
        qk = shape.qk_nope_head_dim + shape.qk_rope_head_dim
        padding = 2 * shape.num_attention_heads * (max(qk, shape.v_head_dim) - shape.v_head_dim)
        assert attention == pairs * (flops.attention_per_key + shape.num_hidden_layers * padding)
    else:
        assert attention == pairs * flops.attention_per_key

    model.train()
    matmul_train, attention_fwd, attention_bwd = counted(model, ids, batch, backward=True)
    # a training pass is 3 x the forward for the matmuls: each backward GEMM pair (input and weight gradients)
    assert matmul_train == 3 * matmul
    # SDPA's backward recomputes QK^T (half the forward's FLOPs) before its 2 x forward: torch counts 3.5 x in all,
    # model FLOPs 3 x (recompute is not counted)
    assert attention_fwd + attention_bwd - attention_fwd // 2 == 3 * attention


def test_mtp_module_flops() -> None:
    """A dense model with one MTP module: the trunk's forward plus the module's (its decoder layer, eh_proj, the
    shared LM head) is `model_flops(include_mtp=True)`."""
    config = tiny_config("dense", num_nextn_predict_layers=1)
    kernel = KernelConfig(mode="fast", attention_backend="torch-hybrid", linear_backend="torch")  # ops torch counts
    model = random_model(config, kernel, seed=1)
    shape = ModelShape.from_hf(config.to_hf())
    assert shape.num_nextn_predict_layers == 1
    lengths = [64]
    batch = build_packed_batch(lengths, kernel.page_size, kernel.attention_query_tile, torch.device("cpu"))
    ids = torch.randint(0, config.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping={SDPA: _sdpa}) as counter:
        hidden = model.forward_hidden(ids, batch)
        model.logits(hidden)
        model.mtp_logits(model.mtp_hidden(hidden, torch.roll(ids, -1), batch))
    ops = counter.get_flop_counts()["Global"]
    matmul = ops.get(aten.mm, 0) + ops.get(aten.addmm, 0)
    flops = model_flops(shape, include_mtp=True)
    assert matmul == flops.matmul * 64
    assert ops[SDPA] == 64 * 64 * flops.attention_per_key
    assert flops.matmul > model_flops(shape).matmul

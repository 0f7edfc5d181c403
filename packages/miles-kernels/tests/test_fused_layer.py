"""The engine's decoder layer with its attention half in one native call (miles_kernels/fused_layer.py, fused.cpp):
the bits of the module path at every step of a chunked prefill and a decode, on every dense family's layer options,
and the module path wherever the fused call does not apply."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from miles_kernels import KernelConfig, fused_layer, native
from miles_kernels.kv_cache import KVStore
from miles_kernels.ops.attention_batch import build_attention_batch
from miles_kernels.testing import PagedRunner, random_model, tiny_config

CONFIGS = {
    "qwen3 (QK-norm)": ("dense", {}),
    "qwen2.5 (q/k/v biases, a sliding window)": (
        "qwen2",
        {"sliding_window": 4, "layer_types": ("full_attention", "sliding_attention")},
    ),
    "llama (RoPE scaling)": ("llama", {}),
    "glm (partial rotary, biases, QK-norm; MoE layers unfused)": ("glm", {}),
}


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    run = native.decoder_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(fused_layer.native, "decoder_attention", counted)
    return calls


def steps(model) -> list[torch.Tensor]:
    """Logits of a chunked prefill (two sequences, one in two chunks), then four decode steps of both."""
    runner = PagedRunner(model, num_pages=32)
    prompts = {0: torch.arange(3, 14), 1: torch.tensor([5, 9, 2, 7, 7])}
    out = [torch.cat(list(runner.step({0: prompts[0][:7], 1: prompts[1]}).values()))]
    out.append(torch.cat(list(runner.step({0: prompts[0][7:]}).values())))
    for i in range(4):
        out.append(torch.cat(list(runner.step({0: torch.tensor([20 + i]), 1: torch.tensor([30 + i])}).values())))
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_the_fused_attention_half_has_the_module_paths_bits(name: str, fused_calls: list[int]) -> None:
    kind, overrides = CONFIGS[name]
    config = tiny_config(kind, **overrides)
    engine, modules = random_model(config, KernelConfig(), seed=0), random_model(config, KernelConfig(), seed=0)
    native.hold_packed_weights(engine.parameters())  # held packed, as an engine's: the fused call applies
    fused = steps(engine)
    assert fused_calls, "the fused call never ran"
    count = len(fused_calls)
    reference = steps(modules)  # not held: every layer through the modules
    assert len(fused_calls) == count
    for a, b in zip(fused, reference, strict=True):
        assert torch.equal(a, b)


def test_the_fused_call_stores_k_v_and_a_draft_trees_copy_writes_as_the_modules_do(fused_calls: list[int]) -> None:
    """A forward with copy writes (a draft tree's: tokens 0 and 2 also stored at page 7): the hidden states and every
    page of the K / V store equal the module path's (`write_kv`), the copies included."""
    config = tiny_config("dense")
    kernel = KernelConfig()
    batch = build_attention_batch([3, 1, 5], [0, 0, 0], [[1, 2], [3, 4], [5, 6]], kernel.page_size,
                                  kernel.attention_query_tile, "cpu")  # fmt: skip
    batch = replace(batch, copy_tokens_C=torch.tensor([0, 2]), copy_pages_C=torch.tensor([7, 7]),
                    copy_offsets_C=torch.tensor([1, 2]))  # fmt: skip
    ids = torch.arange(9) * 7 % config.vocab_size
    outs, stores, calls = [], [], []
    for held in (True, False):
        model = random_model(config, kernel, seed=0)
        if held:
            native.hold_packed_weights(model.parameters())
        store = KVStore.allocate(config, 16, kernel.page_size, torch.float32, "cpu")
        with torch.no_grad():
            outs.append(model.forward_hidden(ids, batch, store))
        stores.append(store.tensors())
        calls.append(len(fused_calls))
    assert calls == [config.num_hidden_layers] * 2  # every layer fused in the held model, none in the other
    assert torch.equal(outs[0], outs[1])
    for fused, modules in zip(*stores, strict=True):
        assert torch.equal(fused, modules) and fused[7].any()


def test_the_modules_run_where_the_fused_call_does_not_apply(fused_calls: list[int]) -> None:
    config = tiny_config("dense")
    model = random_model(config, KernelConfig(), seed=0)
    native.hold_packed_weights(model.parameters())
    want = steps(model)
    fused = len(fused_calls)
    seen: list[torch.Tensor] = []
    handle = model.trunk_layers[0].self_attn.k_proj.register_forward_hook(lambda _m, _a, out: seen.append(out))
    for a, b in zip(steps(model), want, strict=True):  # a hooked layer runs its modules, and the hook sees them
        assert torch.equal(a, b)
    assert len(seen) == 6 and len(fused_calls) - fused == 6 * (config.num_hidden_layers - 1)
    handle.remove()
    bf16 = random_model(config, KernelConfig(dtype="bfloat16"), seed=0)
    native.hold_packed_weights(bf16.parameters())
    before = len(fused_calls)
    steps(bf16)  # bfloat16 rounds between the ops: the modules
    assert len(fused_calls) == before

"""The DeepSeek-V3 family (multi-head latent attention over a paged latent cache) served by the engine: the server's
log-probs are transformers' within 1e-4 in both kernel modes, and in deterministic mode the engine's every
feature that touches the cache — chunked prefill, the prefix cache, page copies for n > 1, speculative decoding with
the MTP draft, routed-experts return, memory release — gives the trainer's packed forward's bits."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from miles_contracts import GenerateRequest, SamplingParams
from miles_kernels import KernelConfig, build_packed_batch, load_model
from miles_kernels.testing import build_tokenizer, save_random_model, tiny_config
from miles_memory import ModelShape, embedded_engine_bytes
from miles_rollout import Engine, EngineConfig, InProcessClient

KERNEL = KernelConfig(mode="deterministic", page_size=16)
LONG = [(5 * i + 2) % 500 for i in range(40)]
PROMPTS = [LONG, [7, 8, 9], [(11 * i) % 500 for i in range(32)]]  # 32: whole pages


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("deepseek")
    config = tiny_config("deepseek", vocab_size=512, max_position_embeddings=512, num_nextn_predict_layers=1)
    save_random_model(directory, config, seed=2, tokenizer=build_tokenizer(save_dir=directory))
    return directory


def generate(engine: Engine, prompts: list[list[int]], start_len: int = 0, **params: Any) -> list:
    """`start_len`: the first prompt position whose log-prob is returned (-1: none; only those past it may come from
    the prefix cache, as in SGLang)."""
    sampling = {"max_new_tokens": 20, "temperature": 1.0, "sampling_seed": 5, "ignore_eos": True, **params}
    request = GenerateRequest(
        input_ids=prompts, sampling_params=SamplingParams(**sampling), return_logprob=True,
        logprob_start_len=start_len, return_routed_experts=True,
    )  # fmt: skip
    return asyncio.run(InProcessClient(engine).generate(request))


def packed(model: Any, tokens: list[int]) -> tuple[torch.Tensor, np.ndarray]:
    """The trainer's packed forward of one sample: log-prob of each token after the first, and the routing of rows
    [0, seqlen - 1)."""
    batch = build_packed_batch([len(tokens)], KERNEL.page_size, KERNEL.attention_query_tile)
    ids = torch.tensor(tokens)
    with torch.no_grad():
        logits = model.logits(model.forward_hidden(ids, batch))
    routing = model.last_routing()
    logprobs = logits[:-1].log_softmax(-1).gather(1, ids[1:, None])[:, 0]
    return logprobs, routing[: len(tokens) - 1].numpy()


def check_against_the_trainer(responses: list, prompts: list[list[int]], model: Any) -> None:
    n = len(responses) // len(prompts)
    for i, response in enumerate(responses):
        tokens = prompts[i // n] + response.output_ids
        want_logprobs, want_routing = packed(model, tokens)
        meta = response.meta_info
        scored = [lp for lp, _, _ in (meta.input_token_logprobs or []) + meta.output_token_logprobs if lp is not None]
        got = torch.tensor(scored, dtype=torch.float32)
        assert torch.equal(got, want_logprobs[len(want_logprobs) - len(got) :]), f"response {i} log-probs"
        flat = np.frombuffer(base64.b64decode(meta.routed_experts), dtype=np.int32)
        np.testing.assert_array_equal(flat.reshape(want_routing.shape), want_routing, err_msg=f"response {i}")


def test_the_engines_cache_features_give_the_trainers_bits(deepseek_dir: Path) -> None:
    model = load_model(str(deepseek_dir), KERNEL)
    config = EngineConfig(num_kv_pages=64, max_prefill_tokens=16, enable_return_routed_experts=True)
    engine = Engine(str(deepseek_dir), KERNEL, config)
    try:
        info = engine.server_info()
        config_ = model.config  # one latent store a layer: (kv_lora_rank + qk_rope_head_dim) float32 values a token
        assert info["kv_bytes_per_token"] == config_.num_hidden_layers * config_.kv_cache_width * 4
        shape = ModelShape.from_hf(json.loads((deepseek_dir / "config.json").read_text()))
        planned = embedded_engine_bytes(shape, "float32", 64, 16)
        assert planned == {tag: info["memory_bytes"][tag] for tag in planned}, (planned, info["memory_bytes"])
        # Chunked prefill (16-token steps with decode rows mixed in) and n = 2 (the partial prompt page is copied).
        responses = generate(engine, PROMPTS, n=2)
        check_against_the_trainer(responses, PROMPTS, model)
        # A prefix-cache hit reads the cached latents.
        extended = [LONG + responses[0].output_ids[:10] + [1, 2]]
        cached = generate(engine, extended, start_len=-1, max_new_tokens=5)
        assert cached[0].meta_info.cached_tokens >= 48
        check_against_the_trainer(cached, extended, model)
        # Memory release: the latent cache and the weights go and come back; the same bits follow.
        released = asyncio.run(InProcessClient(engine).release_memory_occupation())
        assert released["success"], released
        asyncio.run(InProcessClient(engine).resume_memory_occupation())
        asyncio.run(InProcessClient(engine).update_weights_from_disk(str(deepseek_dir)))  # released weights: reload
        again = generate(engine, PROMPTS, n=2)
        assert [r.output_ids for r in again] == [r.output_ids for r in responses]
        check_against_the_trainer(again, PROMPTS, model)
    finally:
        engine.shutdown()


def test_speculative_decoding_with_the_mtp_draft_changes_no_token(deepseek_dir: Path) -> None:
    """The MTP module drafts through its own layer of the latent cache (at the sequence's pages); outputs are the
    plain engine's, token for token and log-prob for log-prob."""
    plain = Engine(str(deepseek_dir), KERNEL, EngineConfig(num_kv_pages=128, enable_return_routed_experts=True))
    try:
        reference = generate(plain, PROMPTS, temperature=0.0, max_new_tokens=30)
    finally:
        plain.shutdown()
    spec = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3}
    config = EngineConfig(num_kv_pages=128, enable_return_routed_experts=True, **spec)  # type: ignore[arg-type]
    engine = Engine(str(deepseek_dir), KERNEL, config)
    try:
        assert len(engine.runner.store.tensors()) == engine.model.config.num_hidden_layers + 1  # the draft's layer
        responses = generate(engine, PROMPTS, temperature=0.0, max_new_tokens=30)
    finally:
        engine.shutdown()
    for got, want in zip(responses, reference, strict=True):
        assert got.output_ids == want.output_ids
        assert got.meta_info.output_token_logprobs == want.meta_info.output_token_logprobs
        assert got.meta_info.routed_experts == want.meta_info.routed_experts
    assert sum(r.meta_info.spec_verify_ct for r in responses) > 0


@pytest.mark.parametrize("mode", ["deterministic", "fast"])
def test_the_server_scores_as_transformers(deepseek_dir: Path, mode: str, start_server: Any) -> None:
    """`miles-rollout serve` (a real server process) against transformers' DeepseekV3ForCausalLM, float32."""
    hf = AutoModelForCausalLM.from_pretrained(deepseek_dir, dtype=torch.float32).eval()
    flags = ("--deterministic",) if mode == "deterministic" else ()
    with start_server(deepseek_dir, *flags) as url:
        body = {"input_ids": PROMPTS, "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}  # fmt: skip
        response = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert response.status_code == 200, response.text
    for prompt, out in zip(PROMPTS, response.json(), strict=True):
        tokens = prompt + out["output_ids"]
        with torch.no_grad():
            logprobs = hf(torch.tensor([tokens])).logits[0, :-1].log_softmax(-1)
        want = logprobs.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
        meta = out["meta_info"]
        got = [lp for lp, _, _ in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]
        torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=1e-4)

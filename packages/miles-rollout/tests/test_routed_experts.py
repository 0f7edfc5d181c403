"""CPU tier, in-process engines and one server process: routed experts (routing replay, "R3") as SGLang 0.5.23
returns them (`return_routed_experts`, `routed_experts_start_len`, `--enable-return-routed-experts`).

What a trainer relies on: decoded the way SGLang's clients decode `meta_info.routed_experts` (numpy frombuffer
int32, reshaped to (-1, layers, top_k)), a sample's routing equals the routing of the trainer's own packed forward
of its prompt + response tokens (`build_packed_batch` + `forward_hidden`, then `last_routing()`), rows
[start_len, seqlen - 1), in deterministic mode — for Qwen3-MoE and GLM-4.5 (a dense first layer), through chunked
prefill, n > 1 forks, prefix-cache hits, speculative decoding (accepted runs and rejected drafts), a retract whose
KV is recomputed on other pages, and an abort. Requests the engine cannot serve are named 400s.
"""

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

from miles_contracts import GenerateRequest, Sample, SamplingParams
from miles_kernels import KernelConfig, build_packed_batch, load_model
from miles_kernels.testing import build_tokenizer, save_random_model, tiny_config
from miles_rollout import Engine, EngineConfig, InProcessClient, create_app
from miles_rollout.batching import _merge_key
from miles_rollout.cli import parse_serve

KERNEL = KernelConfig(mode="deterministic", page_size=16)
LONG = [(7 * i + 3) % 500 for i in range(40)]  # 2.5 pages: a chunked prefill, a partial page copied per sample
PROMPTS = [LONG, [7, 8, 9], [(11 * i) % 500 for i in range(32)]]  # 32: whole pages


def routed_experts(response: Any, model: Any) -> np.ndarray:
    """SGLang's client-side decoding (`extract_routed_experts_from_meta_info`, then a reshape)."""
    assert isinstance(response.meta_info.routed_experts, str)
    config = model.config
    flat = np.frombuffer(base64.b64decode(response.meta_info.routed_experts), dtype=np.int32)
    return flat.reshape(-1, config.num_hidden_layers, config.num_experts_per_tok)


def packed_routing(model: Any, tokens: list[int]) -> np.ndarray:
    """The trainer's routing of a sample: one packed sequence, `last_routing()` of rows [0, seqlen - 1)."""
    with torch.no_grad():
        batch = build_packed_batch([len(tokens)], KERNEL.page_size, KERNEL.attention_query_tile)
        model.forward_hidden(torch.tensor(tokens), batch)
    routing = model.last_routing()
    assert routing is not None
    return routing[: len(tokens) - 1].numpy()


def check(responses: list, prompts: list[list[int]], model: Any, start_len: int = 0) -> None:
    """Each response's routing is the packed forward's from `start_len` on."""
    n = len(responses) // len(prompts)
    for i, response in enumerate(responses):
        tokens = prompts[i // n] + response.output_ids
        got = routed_experts(response, model)
        assert got.shape == (len(tokens) - 1 - start_len, model.config.num_hidden_layers,
                             model.config.num_experts_per_tok)  # fmt: skip
        np.testing.assert_array_equal(got, packed_routing(model, tokens)[start_len:], err_msg=f"response {i}")


def generate(engine: Engine, prompts: list[list[int]], **options: Any) -> list:
    params = {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 5, "ignore_eos": True}
    request = GenerateRequest(
        input_ids=prompts, sampling_params=SamplingParams(**{**params, **options.pop("params", {})}),
        return_routed_experts=True, **options,
    )  # fmt: skip
    return asyncio.run(InProcessClient(engine).generate(request))


def save_model(directory: Path, kind: str, **overrides: Any) -> Path:
    config = tiny_config(kind, vocab_size=512, max_position_embeddings=512, **overrides)
    save_random_model(directory, config, seed=1, tokenizer=build_tokenizer(save_dir=directory))
    return directory


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(tmp_path_factory.mktemp("glm"), "glm")


@pytest.mark.parametrize("kind", ["moe", "glm"])
def test_routing_equals_the_trainers_packed_forward(kind: str, moe_dir: Path, glm_dir: Path) -> None:
    directory = moe_dir if kind == "moe" else glm_dir
    model = load_model(str(directory), KERNEL)
    config = EngineConfig(num_kv_pages=64, max_prefill_tokens=16, enable_return_routed_experts=True)
    engine = Engine(str(directory), KERNEL, config)
    try:
        # Chunked prefill (16-token steps, decode rows mixed in) and n = 2: the partial prompt page is copied.
        responses = generate(engine, PROMPTS, params={"n": 2})
        check(responses, PROMPTS, model)
        if kind == "glm":  # the dense first layer's entries are 0, as in SGLang's zeroed buffer
            assert not routed_experts(responses[0], model)[:, 0].any()
        # A prefix-cache hit: the cached pages' routing is the one recorded when their KV was computed.
        extended = [LONG + responses[0].output_ids[:10] + [1, 2]]
        cached = generate(engine, extended, params={"max_new_tokens": 5})
        assert cached[0].meta_info.cached_tokens >= 48
        check(cached, extended, model)
        # routed_experts_start_len: rows [start, seqlen - 1); at the prompt's length only the output's.
        for start in (17, len(LONG)):
            check(generate(engine, [LONG], routed_experts_start_len=start), [LONG], model, start_len=start)
        # No new token: the prompt's rows but its last.
        empty = generate(engine, [LONG], params={"max_new_tokens": 0})
        assert empty[0].output_ids == [] and routed_experts(empty[0], model).shape[0] == len(LONG) - 1
        # Without return_routed_experts nothing is returned; the trainer's Sample takes the string as it is.
        plain = asyncio.run(InProcessClient(engine).generate(GenerateRequest(input_ids=[7, 8], sampling_params={})))
        assert plain[0].meta_info.routed_experts is None
        Sample(index=0, group_index=0, prompt="p", prompt_tokens=LONG, response_tokens=responses[0].output_ids,
               routed_experts=responses[0].meta_info.routed_experts)  # fmt: skip
        layers, top_k = model.config.num_hidden_layers, model.config.num_experts_per_tok
        assert engine.server_info()["memory_bytes"]["routed_experts"] == 64 * 16 * layers * top_k * 4
    finally:
        engine.shutdown()


def test_an_aborted_sequence_returns_the_routing_of_its_tokens(moe_dir: Path) -> None:
    model = load_model(str(moe_dir), KERNEL)
    engine = Engine(str(moe_dir), KERNEL, EngineConfig(num_kv_pages=64, enable_return_routed_experts=True))

    async def scenario() -> list:
        request = GenerateRequest(
            input_ids=PROMPTS, sampling_params=SamplingParams(max_new_tokens=200, ignore_eos=True, sampling_seed=1),
            return_routed_experts=True,
        )  # fmt: skip
        task = asyncio.create_task(InProcessClient(engine).generate(request))
        await engine.wait_until(lambda s: s["num_running"] == 3 and s["num_generated_tokens"] >= 3 * 5)
        await engine.abort(None)
        return await task

    try:
        responses = asyncio.run(scenario())
        assert all(r.meta_info.finish_reason.type == "abort" and r.output_ids for r in responses)
        check(responses, PROMPTS, model)
    finally:
        engine.shutdown()


def test_tree_drafting_records_every_tokens_routing(tmp_path: Path, oracle_trees) -> None:  # type: ignore[no-untyped-def]
    """Draft trees whose accepted paths run through later branches: the accepted tokens' routing, written by the
    tree's own rows and copy writes and carried by its page copies, is the packed forward's."""
    model = load_model(str(save_model(tmp_path, "moe", num_nextn_predict_layers=1)), KERNEL)
    spec = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3, "speculative_eagle_topk": 2}
    engine = Engine(str(tmp_path), KERNEL, EngineConfig(num_kv_pages=96, enable_return_routed_experts=True, **spec))
    try:
        first = generate(engine, PROMPTS, params={"n": 2})
        check(first, PROMPTS, model)
        continuations = {(tuple(PROMPTS[i // 2]), i % 2): r.output_ids for i, r in enumerate(first)}
        engine.scheduler.drafter = oracle_trees(engine.scheduler.drafter, continuations)
        oracle = generate(engine, PROMPTS, params={"n": 2})
        assert [r.output_ids for r in oracle] == [r.output_ids for r in first]
        assert sum(r.meta_info.spec_num_correct_drafts for r in oracle) > 0
        check(oracle, PROMPTS, model)
    finally:
        engine.shutdown()


def test_speculative_decoding_and_a_recomputing_retract(tmp_path: Path, oracle_drafter) -> None:
    model = load_model(str(save_model(tmp_path, "moe", num_nextn_predict_layers=1)), KERNEL)
    spec = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3}
    engine = Engine(str(tmp_path), KERNEL, EngineConfig(num_kv_pages=96, enable_return_routed_experts=True, **spec))
    try:
        first = generate(engine, PROMPTS, params={"n": 2})
        check(first, PROMPTS, model)
        draft = engine.scheduler.drafter
        assert draft is not None
        continuations = {(tuple(PROMPTS[i // 2]), i % 2): r.output_ids for i, r in enumerate(first)}
        engine.scheduler.drafter = oracle_drafter(draft, continuations, lambda sample, p: p % 3 == 0)
        oracle = generate(engine, PROMPTS, params={"n": 2})
        assert [r.output_ids for r in oracle] == [r.output_ids for r in first]
        counts = [r.meta_info for r in oracle]
        assert 0 < sum(m.spec_num_correct_drafts for m in counts) < sum(m.spec_num_proposed_drafts for m in counts)
        check(oracle, PROMPTS, model)

        async def retracted_midway() -> list:
            request = GenerateRequest(
                input_ids=PROMPTS, sampling_params=SamplingParams(max_new_tokens=40, ignore_eos=True, sampling_seed=9,
                                                                  n=2),
                return_routed_experts=True,
            )  # fmt: skip
            task = asyncio.create_task(InProcessClient(engine).generate(request))
            await engine.wait_until(lambda s: s["num_running"] == 6 and s["num_generated_tokens"] >= 6 * 8)
            assert await engine.control(lambda: engine.pause_generation("retract"), needs_idle=False) == 3
            # No request holds a page now: drop the cached ones too, so every token's KV (and routing) is
            # recomputed, on whatever pages are free.
            await engine.control(engine.scheduler.radix.reset, needs_idle=False)
            await engine.control(engine.continue_generation, needs_idle=False)
            return await task

        engine.scheduler.drafter = draft
        retracted = asyncio.run(retracted_midway())
        assert all(len(r.output_ids) == 40 for r in retracted)
        check(retracted, PROMPTS, model)
    finally:
        engine.shutdown()


def test_refusals_at_start_up_and_in_process(dense_dir: Path, moe_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"has no MoE layer.*drop --enable-return-routed-experts"):
        Engine(str(dense_dir), KERNEL, EngineConfig(num_kv_pages=16, enable_return_routed_experts=True))
    config = parse_serve(["--model-path", str(moe_dir), "--enable-return-routed-experts"])
    assert config.engine.enable_return_routed_experts
    assert not parse_serve(["--model-path", str(moe_dir)]).engine.enable_return_routed_experts
    # Requests that differ in their routed-experts options are not merged into one batch.
    base = GenerateRequest(input_ids=[1, 2])
    variants = [{}, {"return_routed_experts": True}, {"return_routed_experts": True, "routed_experts_start_len": 1}]
    keys = {_merge_key(base.model_copy(update=variant)) for variant in variants}
    assert len(keys) == 3


def http_refusals(engine: Engine, body: dict[str, Any]) -> httpx.Response:
    """POST /generate to the engine's FastAPI app (real HTTP encoding and status codes, no process)."""

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.post("/generate", json=body)

    return asyncio.run(post())


def test_requests_the_engine_cannot_serve_are_named_400s(dense_dir: Path, moe_dir: Path) -> None:
    wanted = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True}
    for directory, message in [(dense_dir, "has no MoE layer"), (moe_dir, "--enable-return-routed-experts")]:
        engine = Engine(str(directory), KERNEL, EngineConfig(num_kv_pages=16))
        try:
            refused = http_refusals(engine, wanted)
            assert refused.status_code == 400 and message in refused.json()["detail"], refused.text
            assert "return_routed_experts" in refused.json()["detail"]
            assert http_refusals(engine, {**wanted, "return_routed_experts": False}).status_code == 200
        finally:
            engine.shutdown()


def test_a_server_with_the_flag_over_http(moe_dir: Path, start_server: Any) -> None:
    """`miles-rollout serve --enable-return-routed-experts`: the routing is a JSON string, bad starts are 400s
    naming the field, and the server keeps serving."""
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_routed_experts": True, "routed_experts_start_len": 1}  # fmt: skip
    with start_server(moe_dir, "--deterministic", "--enable-return-routed-experts") as url:
        for bad, message in [(5, "routed_experts_start_len=5 is past prompt 0 (4 tokens)"),
                             (-1, "routed_experts_start_len=-1 is negative")]:  # fmt: skip
            refused = httpx.post(f"{url}/generate", json={**body, "routed_experts_start_len": bad}, timeout=60)
            assert refused.status_code == 400 and message in refused.json()["detail"], refused.text
        answer = httpx.post(f"{url}/generate", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        meta = json.loads(answer.content)["meta_info"]
        assert isinstance(meta["routed_experts"], str)
        routing = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(-1, 2, 2)
        assert routing.shape[0] == 4 + 3 - 1 - 1
        info = httpx.get(f"{url}/get_server_info", timeout=60).json()
        assert info["enable_return_routed_experts"] and info["memory_bytes"]["routed_experts"] == 512 * 16 * 2 * 2 * 4

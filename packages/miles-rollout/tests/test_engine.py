"""CPU tier, in-process engine: chunked prefill, n samples prefilled once, admission under a small KV bound,
and abort-all — checked against the engine's own unchunked run in deterministic mode (bitwise)."""

from __future__ import annotations

import asyncio
import shutil
import threading

import pytest
import torch

from miles_contracts import GenerateRequest, SamplingParams
from miles_kernels import KernelConfig, load_model
from miles_rollout import Engine, EngineConfig, InProcessClient
from miles_rollout import engine as engine_module

REQUEST = GenerateRequest(
    input_ids=[[(7 * i) % 500 for i in range(90)], [1, 2, 3]],
    sampling_params=SamplingParams(max_new_tokens=8, temperature=1.0, sampling_seed=11, n=3),
    return_logprob=True,
    logprob_start_len=0,
)


def run(model_dir, request: GenerateRequest, **config) -> tuple[list, dict]:
    engine = Engine(str(model_dir), KernelConfig(page_size=16), EngineConfig(**config))
    try:
        responses = asyncio.run(InProcessClient(engine).generate(request))
        return responses, engine.server_info()
    finally:
        engine.shutdown()


def summary(responses) -> list:
    return [
        (
            r.output_ids,
            [e[0] for e in r.meta_info.output_token_logprobs],
            [e[0] for e in r.meta_info.input_token_logprobs],
        )
        for r in responses
    ]


def test_chunked_prefill_and_n_samples(moe_dir) -> None:
    whole, info_whole = run(moe_dir, REQUEST, num_kv_pages=256)
    chunked, info_chunked = run(moe_dir, REQUEST, num_kv_pages=256, max_prefill_tokens=16)
    assert summary(chunked) == summary(whole)  # bitwise, whatever the chunking
    assert info_chunked["num_steps"] > info_whole["num_steps"]
    # Each prompt is prefilled once for its 3 samples: 90 + 3 prompt tokens, not 3 * 93.
    assert info_whole["num_prefill_tokens"] == 93
    assert len(whole) == 6 and len({tuple(r.output_ids) for r in whole[:3]}) == 3  # seeds 11, 12, 13 differ


def test_admission_waits_under_a_small_kv_bound(moe_dir) -> None:
    # Room for only a few requests at a time: the rest wait and all complete, with the same results.
    many = GenerateRequest(
        input_ids=[[i, i + 1, i + 2] * 10 for i in range(12)],
        sampling_params=SamplingParams(max_new_tokens=20, temperature=0.0),
    )
    small, _ = run(moe_dir, many, num_kv_pages=8)
    large, _ = run(moe_dir, many, num_kv_pages=256)
    assert [r.output_ids for r in small] == [r.output_ids for r in large]


def test_abort_all(moe_dir) -> None:
    engine = Engine(str(moe_dir), KernelConfig(page_size=16), EngineConfig(num_kv_pages=256))
    client = InProcessClient(engine)

    async def scenario() -> list:
        long = GenerateRequest(
            input_ids=[[1, 2], [3, 4]], sampling_params=SamplingParams(max_new_tokens=400, ignore_eos=True)
        )
        task = asyncio.create_task(client.generate(long))
        await engine.wait_until(lambda s: s["num_running"] == 2)  # both are decoding
        await client.abort_request(abort_all=True)
        return await task

    try:
        responses = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert [r.meta_info.finish_reason.type for r in responses] == ["abort", "abort"]


def test_a_model_that_fails_to_load_raises_on_the_callers_thread(moe_dir, tmp_path) -> None:
    # The model loads on the engine's own thread; its error must still reach the caller, with no thread left.
    broken = tmp_path / "broken"
    shutil.copytree(moe_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(Exception, match=r"safetensors|weights|checkpoint"):
        Engine(str(broken), KernelConfig(page_size=16))
    assert "miles-rollout-engine" not in {t.name for t in threading.enumerate()} - before  # joined before raising


def test_the_engine_runs_torch_on_its_own_thread_with_the_callers_thread_count(moe_dir, monkeypatch) -> None:
    loaded_on = []

    def recording_load(*args, **kwargs):
        loaded_on.append(threading.current_thread().name)
        return load_model(*args, **kwargs)

    monkeypatch.setattr(engine_module, "load_model", recording_load)
    original = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(str(moe_dir), KernelConfig(page_size=16))
        try:
            threads = asyncio.run(engine.control(torch.get_num_threads, needs_idle=False))
            assert (loaded_on, threads) == (["miles-rollout-engine"], 1)  # the model too is loaded on its thread
            assert asyncio.run(InProcessClient(engine).generate(REQUEST))
        finally:
            engine.shutdown()
    finally:
        torch.set_num_threads(original)

"""CPU numerics and the HTTP routes (in process, one real server): LoRA adapters served per request, SGLang's
multi-LoRA API. Two adapters and the base model in one batch each give what that request gives served alone, bit
for bit in deterministic mode, and what a model with the adapter merged into its weights gives (merged here with
plain torch from the PEFT files, within fp32 rounding); the prefix cache never hands one adapter's K/V to another;
`/load_lora_adapter`, `/unload_lora_adapter`, `/generate`'s `lora_path` and the OpenAI routes' `model` take the
bodies SGLang's clients send, and a bad adapter or name is a 400 that says why."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_contracts import GenerateRequest, GenerateResponse, SamplingParams
from miles_kernels import KernelConfig, load_model, save_peft_adapter
from miles_kernels.config import LoraConfig
from miles_kernels.testing import random_adapter
from miles_rollout import (
    Client,
    CoalescingClient,
    Engine,
    EngineConfig,
    EngineError,
    InProcessClient,
    RolloutClientError,
    create_app,
)
from miles_rollout.cli import main, parse_serve
from miles_rollout.config import ServedLoraConfig
from miles_rollout.page_allocator import PageAllocator
from miles_rollout.radix_cache import RadixCache

KERNEL = KernelConfig(mode="deterministic", page_size=16)
URL = "http://127.0.0.1:30000"
PROMPT = list(range(5, 45))  # 40 tokens: two full pages to cache
SAMPLING: dict[str, Any] = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 7}


def make_adapter(directory: Path, model_dir: Path, seed: int, targets: list[str], rank: int) -> Path:
    """A PEFT adapter directory for the model in `model_dir`: random A and B (B nonzero: it changes the output)."""
    model = load_model(str(model_dir), KernelConfig(), "cpu")
    config = LoraConfig(rank=rank, alpha=8.0, target_modules=targets)
    return save_peft_adapter(directory, config, random_adapter(model, config, seed))


def merge_copy(model_dir: Path, adapter_dir: Path, out: Path) -> Path:
    """A copy of the model with the adapter merged into its weights, read from the PEFT files with safetensors and
    merged in plain torch (W + lora_alpha / r * B @ A), independently of the engine's code."""
    shutil.copytree(model_dir, out)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    lora = load_file(str(adapter_dir / "adapter_model.safetensors"))
    for file in out.glob("*.safetensors"):
        tensors = load_file(str(file))
        for key in list(tensors):
            a = lora.get(f"base_model.model.{key.removesuffix('.weight')}.lora_A.weight")
            if a is not None:
                b = lora[f"base_model.model.{key.removesuffix('.weight')}.lora_B.weight"]
                tensors[key] = tensors[key] + (scaling * (b.double() @ a.double())).float()
        save_file(tensors, str(file), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def adapters(dense_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    a = make_adapter(root / "a", dense_dir, 1, ["q_proj", "v_proj", "down_proj"], rank=4)
    b = make_adapter(root / "b", dense_dir, 2, ["k_proj", "o_proj", "gate_proj", "up_proj"], rank=2)
    dora = Path(shutil.copytree(a, root / "dora"))
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    return {"a": a, "b": b, "dora": dora, "missing": root / "missing"}


@pytest.fixture(scope="module")
def engine(dense_dir: Path, adapters: dict[str, Path]) -> Iterator[Engine]:
    lora = ServedLoraConfig(lora_paths=[f"a={adapters['a']}", f"b={adapters['b']}"])
    engine = Engine(str(dense_dir), KERNEL, EngineConfig(num_kv_pages=128), lora)
    yield engine
    engine.shutdown()


async def generate(engine: Engine, lora_path: Any, prompts: Any = PROMPT) -> list[GenerateResponse]:
    params = SamplingParams.model_validate(SAMPLING)
    request = GenerateRequest(input_ids=prompts, sampling_params=params, lora_path=lora_path, return_logprob=True)
    responses: list[GenerateResponse] = await engine.generate(request)
    return responses


def same(x: GenerateResponse, y: GenerateResponse) -> bool:
    """The same tokens and the same log-prob bits."""
    return x.output_ids == y.output_ids and x.meta_info.output_token_logprobs == y.meta_info.output_token_logprobs


@pytest.fixture
async def http(engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url=URL, timeout=60) as client:
        yield client


# -- numerics ------------------------------------------------------------------------------------------------------


async def test_each_request_gets_its_adapter_in_a_mixed_batch(
    engine: Engine, adapters: dict[str, Path], dense_dir: Path, tmp_path: Path
) -> None:
    """Adapters a and b and the base model in one batch: each equals its request served alone (bitwise), and the
    adapter's tokens score the same under a model whose weights merge the adapter (fp32 rounding)."""
    names = ["a", "b", None]
    together = await generate(engine, names, [PROMPT] * 3)
    alone = [(await generate(engine, name))[0] for name in names]
    assert all(same(x, y) for x, y in zip(together, alone, strict=True))
    assert len({tuple(r.output_ids) for r in together}) == 3  # each adapter changes the output: the test sees it
    for name in ("a", "b"):
        merged = Engine(str(merge_copy(dense_dir, adapters[name], tmp_path / name)), KERNEL,
                        EngineConfig(num_kv_pages=32))  # fmt: skip
        try:
            response = together[names.index(name)]
            scored = await merged.generate(GenerateRequest(
                input_ids=PROMPT + response.output_ids, return_logprob=True, logprob_start_len=len(PROMPT),
                sampling_params=SamplingParams(max_new_tokens=0, temperature=1.0),
            ))  # fmt: skip
        finally:
            merged.shutdown()
        want = [entry[0] for entry in scored[0].meta_info.input_token_logprobs or []]
        got = [entry[0] for entry in response.meta_info.output_token_logprobs or []]
        assert len(want) == len(got) == 8
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)


async def test_the_prefix_cache_never_shares_kv_between_adapters(engine: Engine) -> None:
    """A prompt cached under one adapter is computed afresh under another (SGLang keys its radix tree by lora_id)
    and reused under the same one; the output does not depend on what was cached."""
    prompt = list(range(100, 140))
    first = (await generate(engine, "a", prompt))[0]
    again = (await generate(engine, "a", prompt))[0]
    other, base = (await generate(engine, "b", prompt))[0], (await generate(engine, None, prompt))[0]
    assert first.meta_info.cached_tokens == 0 and again.meta_info.cached_tokens == 32 and same(first, again)
    assert other.meta_info.cached_tokens == 0 and base.meta_info.cached_tokens == 0
    assert (await generate(engine, "b", prompt))[0].meta_info.cached_tokens == 32


def test_radix_cache_keeps_a_tree_per_adapter() -> None:
    allocator = PageAllocator(16)
    cache = RadixCache(allocator, page_size=2)
    pages = allocator.allocate(2)
    cache.insert([1, 2, 3, 4], pages, "x")
    allocator.release(pages)
    assert cache.match([1, 2, 3, 4]) == [] and cache.match([1, 2, 3, 4], "y") == []
    hit = cache.match([1, 2, 3, 4], "x")
    assert hit == pages
    allocator.release(hit)
    assert cache.num_evictable() == 2
    cache.forget_adapter("x")
    assert cache.num_cached_pages == 0 and allocator.num_used == 0 and cache.match([1, 2], "x") == []


async def test_max_loras_per_batch_bounds_each_step(
    dense_dir: Path, adapters: dict[str, Path], engine: Engine
) -> None:
    """With --max-loras-per-batch 2 no step holds three adapters (the base counted, as SGLang counts it); the request
    that waits is served as it is alone."""
    lora = ServedLoraConfig(lora_paths=[f"a={adapters['a']}", f"b={adapters['b']}"], max_loras_per_batch=2)
    bounded = Engine(str(dense_dir), KERNEL, EngineConfig(num_kv_pages=128), lora)
    steps: list[set[str | None]] = []
    forward = bounded.runner.forward

    def recording(parts: Any) -> Any:
        steps.append({part.adapter for part in parts})
        return forward(parts)

    bounded.runner.forward = recording  # type: ignore[method-assign]
    try:
        responses = await generate(bounded, ["a", "b", None], [PROMPT] * 3)
    finally:
        bounded.shutdown()
    assert max(len(s) for s in steps) == 2 and len(set().union(*steps)) == 3
    expected = await generate(engine, ["a", "b", None], [PROMPT] * 3)
    assert all(same(x, y) for x, y in zip(responses, expected, strict=True))


async def test_speculative_decoding_keeps_each_requests_adapter(tmp_path: Path) -> None:
    """The MTP draft runs unadapted (SGLang's draft does too) while the trunk verifies each row with its request's
    adapter: the outputs equal decoding without a draft, bit for bit."""
    from miles_kernels.testing import build_tokenizer, save_random_model, tiny_config

    config = tiny_config("dense", vocab_size=512, max_position_embeddings=512, num_nextn_predict_layers=1)
    model_dir = save_random_model(
        tmp_path / "mtp", config, seed=1, tokenizer=build_tokenizer(save_dir=tmp_path / "mtp")
    )
    adapter = make_adapter(tmp_path / "adapter", model_dir, 3, ["q_proj", "o_proj", "down_proj"], rank=4)
    lora = ServedLoraConfig(lora_paths=[f"x={adapter}"])
    outputs = []
    for spec in ({}, {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3}):
        served = Engine(str(model_dir), KERNEL, EngineConfig(num_kv_pages=64, **spec), lora)  # type: ignore[arg-type]
        try:
            outputs.append(await generate(served, ["x", None], [PROMPT, PROMPT]))
        finally:
            served.shutdown()
    plain, speculative = outputs
    assert all(same(x, y) for x, y in zip(plain, speculative, strict=True))
    assert plain[0].output_ids != plain[1].output_ids
    assert (speculative[0].meta_info.spec_verify_ct or 0) > 0  # drafts were verified


# -- loading and unloading -----------------------------------------------------------------------------------------


async def test_unload_waits_for_the_requests_that_use_it(engine: Engine, adapters: dict[str, Path]) -> None:
    """SGLang's unload: new requests naming the adapter are refused at once, the call returns once the ones in
    flight are done, and the adapter's cached K/V goes with it. A name loaded again is a new adapter."""
    await engine.load_lora_adapter("c", str(adapters["a"]))  # a's directory under another name: a's outputs
    long = SamplingParams.model_validate({**SAMPLING, "max_new_tokens": 48, "ignore_eos": True})
    request = GenerateRequest(input_ids=PROMPT, sampling_params=long, lora_path="c", return_logprob=True)
    running = asyncio.create_task(engine.generate(request))
    await engine.wait_until(lambda stats: stats["num_running"] > 0)
    unloading = asyncio.create_task(engine.unload_lora_adapter("c"))
    await asyncio.sleep(0)  # the name is unregistered before the call first waits
    with pytest.raises(EngineError, match=r"'c' is not loaded; loaded adapters: \['a', 'b'\]"):
        await generate(engine, "c")
    cached = engine.scheduler.stats()["num_cached_pages"]
    assert await unloading == {"a": str(adapters["a"]), "b": str(adapters["b"])}
    assert running.done()  # it finished with its adapter before the adapter went
    assert engine.scheduler.stats()["num_cached_pages"] < cached
    with_a = GenerateRequest(input_ids=PROMPT, sampling_params=long, lora_path="a", return_logprob=True)
    assert same((await running)[0], (await engine.generate(with_a))[0])


async def test_load_and_unload_routes_take_sglang_bodies(http: httpx.AsyncClient, adapters: dict[str, Path]) -> None:
    """The bodies SGLang's clients post, SGLang's `LoRAUpdateOutput` back; /generate's `lora_path` (a string or one
    per prompt) names the loaded adapter."""
    loaded = {"a": str(adapters["a"]), "b": str(adapters["b"])}
    reply = await http.post("/load_lora_adapter", json={"lora_name": "d", "lora_path": str(adapters["b"])})
    assert reply.status_code == 200
    assert reply.json() == {
        "success": True,
        "error_message": "",
        "loaded_adapters": {**loaded, "d": str(adapters["b"])},
    }
    body = {"input_ids": [PROMPT, PROMPT], "sampling_params": SAMPLING, "return_logprob": True}
    both = (await http.post("/generate", json={**body, "lora_path": ["d", "b"]})).json()
    assert both[0]["output_ids"] == both[1]["output_ids"]
    one = await http.post("/generate", json={"input_ids": PROMPT, "sampling_params": SAMPLING, "lora_path": "d"})
    assert one.json()["output_ids"] == both[0]["output_ids"]
    reply = await http.post("/unload_lora_adapter", json={"lora_name": "d"})
    assert reply.status_code == 200 and reply.json() == {
        "success": True,
        "error_message": "",
        "loaded_adapters": loaded,
    }
    info = (await http.get("/server_info")).json()
    assert info["enable_lora"] is True and info["max_loras_per_batch"] == 8 and info["max_lora_rank"] is None
    assert [ref["lora_name"] for ref in info["loaded_lora_adapters"]] == ["a", "b"]
    assert info["lora_paths"][0] == {"lora_name": "a", "lora_path": str(adapters["a"]), "pinned": False}


async def test_bad_adapters_and_names_are_a_400_that_says_why(
    http: httpx.AsyncClient, adapters: dict[str, Path]
) -> None:
    loaded = {"a": str(adapters["a"]), "b": str(adapters["b"])}
    cases = [
        ({"lora_name": "x", "lora_path": str(adapters["missing"])}, "is not a PEFT adapter directory"),
        ({"lora_name": "x", "lora_path": str(adapters["dora"])}, "use_dora=True is not supported"),
        ({"lora_name": "a", "lora_path": str(adapters["b"])}, "Failed to load LoRA adapter a because it is already"),
    ]
    for body, needle in cases:
        reply = await http.post("/load_lora_adapter", json=body)
        assert reply.status_code == 400, reply.text
        assert reply.json()["success"] is False and needle in reply.json()["error_message"], reply.text
        assert reply.json()["loaded_adapters"] == loaded
    tensors = {"lora_name": "x", "config_dict": {}, "serialized_named_tensors": ["gASV"]}  # SGLang's pickled body
    reply = await http.post("/load_lora_adapter_from_tensors", json=tensors)
    assert reply.status_code == 400 and "never unpickles" in reply.json()["error_message"]
    reply = await http.post("/unload_lora_adapter", json={"lora_name": "nope"})
    assert reply.status_code == 400 and "'nope' is not loaded; loaded adapters: ['a', 'b']" in reply.text
    reply = await http.post("/load_lora_adapter", json={"lora_path": str(adapters["a"])})
    assert reply.status_code == 400 and "lora_name" in reply.json()["detail"]
    reply = await http.post("/generate", json={"input_ids": PROMPT, "lora_path": "nope"})
    assert reply.status_code == 400 and "'nope' is not loaded; loaded adapters: ['a', 'b']" in reply.json()["detail"]
    reply = await http.post("/generate", json={"input_ids": [PROMPT, PROMPT], "lora_path": ["a"]})
    assert reply.status_code == 400 and "lora_path has 1 entries for 2 prompts" in reply.json()["detail"]
    assert (await http.post("/generate", json={"input_ids": PROMPT, "lora_path": "a"})).status_code == 200


async def test_the_adapter_routes_need_the_admin_key(engine: Engine, adapters: dict[str, Path]) -> None:
    app = create_app(engine, api_key="user", admin_key="admin")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=URL) as client:
        body = {"lora_name": "h", "lora_path": str(adapters["a"])}
        for path, key in [("/load_lora_adapter", "user"), ("/unload_lora_adapter", "user")]:
            reply = await client.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
            assert reply.status_code == 401 and "admin key" in reply.text
        admin = {"Authorization": "Bearer admin"}
        assert (await client.post("/load_lora_adapter", json=body, headers=admin)).status_code == 200
        assert (await client.post("/unload_lora_adapter", json={"lora_name": "h"}, headers=admin)).status_code == 200


async def test_a_server_without_lora_refuses_adapters_by_name(tmp_path: Path, adapters: dict[str, Path]) -> None:
    from miles_kernels.testing import save_random_model, tiny_config

    save_random_model(tmp_path, tiny_config("dense", vocab_size=512, max_position_embeddings=512))
    plain = Engine(str(tmp_path), KERNEL, EngineConfig(num_kv_pages=32))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(plain)), base_url=URL) as client:
            generate_reply = await client.post("/generate", json={"input_ids": [1, 2], "lora_path": "a"})
            load_reply = await client.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(
                adapters["a"])})  # fmt: skip
            info = (await client.get("/server_info")).json()
    finally:
        plain.shutdown()
    assert generate_reply.status_code == 400 and "start it with --enable-lora or --lora-paths" in generate_reply.text
    assert load_reply.status_code == 400 and "LoRA is not enabled" in load_reply.json()["error_message"]
    assert info["enable_lora"] is False


async def test_adapters_on_moe_experts_are_refused(moe_dir: Path, tmp_path: Path) -> None:
    """Per-row adapters cannot reach the experts (the MoE layer reads their weights directly): a 400 naming them; an
    attention adapter of the same model is served."""
    experts = make_adapter(tmp_path / "experts", moe_dir, 1, ["q_proj", "up_proj"], rank=2)
    attention = make_adapter(tmp_path / "attention", moe_dir, 1, ["q_proj", "o_proj"], rank=2)
    moe = Engine(str(moe_dir), KERNEL, EngineConfig(num_kv_pages=32), ServedLoraConfig(enable_lora=True))
    try:
        with pytest.raises(EngineError, match=r"experts\.0\.up_proj cannot take a per-request adapter here"):
            await moe.load_lora_adapter("experts", str(experts))
        assert await moe.load_lora_adapter("attention", str(attention)) == {"attention": str(attention)}
        base, adapted = await generate(moe, [None, "attention"], [PROMPT, PROMPT])
    finally:
        moe.shutdown()
    assert base.output_ids != adapted.output_ids


# -- clients -------------------------------------------------------------------------------------------------------


async def test_the_openai_client_picks_the_adapter_by_model(engine: Engine, adapters: dict[str, Path]) -> None:
    """SGLang's `base:adapter`, an adapter's /v1/models id alone, and the body's `lora_path`; /v1/models lists the
    adapters with the served model as `parent`."""
    served = engine.model_path
    transport = httpx.ASGITransport(app=create_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url=URL, timeout=60) as http_client:
        client = openai.AsyncOpenAI(base_url=f"{URL}/v1", api_key="unused", http_client=http_client, max_retries=0)
        cards = (await client.models.list()).data
        assert [(c.id, getattr(c, "parent", None), getattr(c, "root", None)) for c in cards] == [
            (served, None, served), ("a", served, str(adapters["a"])), ("b", served, str(adapters["b"]))]  # fmt: skip
        assert (await client.models.retrieve("a")).id == "a"
        texts = {}
        for model, extra in [("a", {}), (f"{served}:b", {}), ("default:a", {}), ("default", {"lora_path": "b"}),
                             (served, {})]:  # fmt: skip
            completion = await client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                                         seed=7, extra_body=extra)  # fmt: skip
            texts[model] = completion.choices[0].text
        chat = await client.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=4, seed=3)  # fmt: skip
        assert chat.choices[0].message.content is not None
        with pytest.raises(openai.NotFoundError, match="LoRA adapters"):
            await client.completions.create(model="nope", prompt=PROMPT, max_tokens=1)
        with pytest.raises(openai.BadRequestError, match="'nope' is not loaded"):
            await client.completions.create(model="default:nope", prompt=PROMPT, max_tokens=1)
    native = {name: (await generate(engine, name))[0].text for name in ("a", "b", None)}
    assert texts["a"] == texts["default:a"] == native["a"]
    assert texts[f"{served}:b"] == texts["default"] == native["b"] and texts[served] == native[None]


async def test_clients_load_and_unload(engine: Engine, adapters: dict[str, Path]) -> None:
    transport = httpx.ASGITransport(app=create_app(engine))
    async with Client(URL, transport=transport) as client:
        reply = await client.load_lora_adapter("e", str(adapters["a"]), pinned=True)
        assert reply["loaded_adapters"]["e"] == str(adapters["a"])
        with pytest.raises(RolloutClientError, match="already loaded") as error:
            await client.load_lora_adapter("e", str(adapters["a"]))
        assert error.value.status_code == 400
        assert "e" not in (await client.unload_lora_adapter("e"))["loaded_adapters"]
    local = InProcessClient(engine)
    assert (await local.load_lora_adapter("f", str(adapters["b"])))["loaded_adapters"]["f"] == str(adapters["b"])
    assert (await local.unload_lora_adapter("f"))["loaded_adapters"] == {"a": str(adapters["a"]),
                                                                         "b": str(adapters["b"])}  # fmt: skip
    with pytest.raises(RolloutClientError, match="is not a PEFT adapter directory") as error:
        await local.load_lora_adapter("g", str(adapters["missing"]))
    assert error.value.status_code == 400


async def test_coalesced_requests_keep_their_adapters(engine: Engine) -> None:
    """`CoalescingClient` merges concurrent calls naming different adapters into one batch, each prompt with its own
    `lora_path`, and hands each caller what it gets alone."""
    client = CoalescingClient(InProcessClient(engine))
    names = ["a", None, "b"]
    requests = [GenerateRequest(input_ids=PROMPT, sampling_params=SamplingParams.model_validate(SAMPLING),
                                lora_path=name, return_logprob=True) for name in names]  # fmt: skip
    merged = await asyncio.gather(*(client.generate(request) for request in requests))
    assert client.num_requests_sent == 1
    for name, responses in zip(names, merged, strict=True):
        assert same(responses[0], (await generate(engine, name))[0])


# -- flags and the real server -------------------------------------------------------------------------------------


def test_lora_flags_follow_sglang(capsys: pytest.CaptureFixture[str]) -> None:
    """`--lora-paths` takes SGLang's three forms; a config file may also give SGLang's {name: path}."""
    config = parse_serve(["--model-path", "m", "--lora-paths", "x=/p/x", "/p/y",
                          '{"lora_name": "z", "lora_path": "/p/z", "pinned": true}', "--max-loras-per-batch", "2",
                          "--max-lora-rank", "16"])  # fmt: skip
    assert [tuple(spec) for spec in config.lora.adapters()] == [("x", "/p/x", False), ("/p/y", "/p/y", False),
                                                               ("z", "/p/z", True)]  # fmt: skip
    assert config.lora.is_enabled and config.lora.max_loras_per_batch == 2 and config.lora.max_lora_rank == 16
    assert not parse_serve(["--model-path", "m"]).lora.is_enabled
    assert parse_serve(["--model-path", "m", "--enable-lora"]).lora.is_enabled
    assert ServedLoraConfig(lora_paths={"x": "/p/x"}).adapters() == [("x", "/p/x", False)]  # type: ignore[arg-type]
    for bad, needle in [(["x=/p", "x=/q"], "names ['x'] more than once"), (["=/p"], "empty name or path"),
                        (['{"lora_name": "x"}'], "lacks string lora_name and lora_path")]:  # fmt: skip
        assert main(["serve", "--model-path", "m", "--lora-paths", *bad]) == 2
        assert needle in " ".join(capsys.readouterr().err.replace("│", " ").split())  # tyro's box, unwrapped


def test_a_bad_adapter_given_at_start_up_stops_the_server(
    dense_dir: Path, adapters: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--page-size", "16", "--num-kv-pages", "32", "--lora-paths", f"x={adapters['dora']}"]
    assert main(["serve", "--model-path", str(dense_dir), *flags]) == 2
    assert "--lora-paths x: cannot load LoRA adapter 'x'" in capsys.readouterr().err


def test_a_real_server_serves_lora_paths_to_the_openai_client(
    start_server: Any, dense_dir: Path, adapters: dict[str, Path], engine: Engine
) -> None:
    """`miles-rollout serve --lora-paths a=DIR`, as SGLang is started, driven by the `openai` client: the adapter's
    completion equals the in-process engine's, bit for bit (deterministic mode)."""
    with start_server(dense_dir, "--deterministic", "--lora-paths", f"a={adapters['a']}") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        completion = client.completions.create(model="a", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7,
                                               logprobs=0)  # fmt: skip
    expected = asyncio.run(generate(engine, "a"))[0]
    assert completion.choices[0].logprobs is not None
    assert completion.choices[0].logprobs.token_logprobs == [
        e[0] for e in expected.meta_info.output_token_logprobs or []
    ]

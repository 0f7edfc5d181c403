"""Shared fixtures for miles-rollout tests: small random models (with a tokenizer), real server processes, and a
fake SGLang-shaped server for the client tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from miles_kernels import BucketAssembler, decode_bucket
from miles_kernels.testing import build_tokenizer, save_random_model, tiny_config
from miles_rollout.client import Client
from miles_rollout.draft_tree import DraftTree
from miles_rollout.launch import launch_server
from miles_rollout.speculative import Drafter

TEST_PAGE_SIZE = "16"


def make_model(directory: Path, kind: str, seed: int = 0) -> Path:
    tokenizer = build_tokenizer(save_dir=directory)
    config = tiny_config(kind, vocab_size=512, max_position_embeddings=512)
    save_random_model(directory, config, seed=seed, tokenizer=tokenizer)
    return directory


@pytest.fixture(scope="session")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("dense"), "dense")


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("moe"), "moe")


@contextlib.contextmanager
def running_server(model_dir: Path, *extra: str) -> Iterator[str]:
    """A test server: small pages and a bounded KV store, one thread so concurrent tests share the cores."""
    flags = ("--page-size", TEST_PAGE_SIZE, "--num-kv-pages", "512", *extra)
    with launch_server(model_dir, *flags, env={"OMP_NUM_THREADS": "1"}) as url:
        yield url


@pytest.fixture(scope="module")
def dense_server(dense_dir: Path) -> Iterator[str]:
    with running_server(dense_dir, "--deterministic") as url:
        yield url


async def _wait_for_engine(url: str, condition: Callable[[dict[str, Any]], bool], timeout: float = 60.0) -> None:
    """Wait for an engine event of a server process (a request admitted, tokens generated): its counters in
    `/get_server_info` are read until `condition` holds; the HTTP form of `Engine.wait_until`."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        deadline = asyncio.get_running_loop().time() + timeout
        while not condition((await client.get("/get_server_info")).json()):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the engine at {url} did not reach the awaited state in {timeout} s")
            await asyncio.sleep(0.005)  # a poll interval, not an ordering: the condition decides


@pytest.fixture(scope="session")
def wait_for_engine() -> Callable[..., Any]:
    """`_wait_for_engine(url, condition)`: wait until a server's engine counters satisfy `condition`."""
    return _wait_for_engine


@pytest.fixture(scope="session")
def start_server():
    """The `running_server` context manager, for tests that need a server with their own flags."""
    return running_server


# -- a fake SGLang-shaped server for the client tests -------------------------------------------------------------
# A FastAPI app that records every request (method, path, headers, body) and answers with the JSON shapes SGLang's
# native API uses. Clients reach it through `httpx.ASGITransport`, so requests go through real HTTP encoding,
# routing and status codes; nothing inside the client is mocked. Connection failures are injected by a transport
# that raises `httpx.ConnectError` before handing requests to the ASGI app.

BASE_URL = "http://engine.test"


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class FakeEngine:
    """State of the fake server, which tests read and steer."""

    requests: list[Recorded] = field(default_factory=list)
    weight_version: Any = "default"
    busy: bool = False
    is_healthy: bool = True
    generate_delay: float = 0.0
    assembler: BucketAssembler = field(default_factory=BucketAssembler)

    def last(self, path: str) -> Recorded:
        return [r for r in self.requests if r.path == path][-1]


def _one_response(i: int, version: int | None = 7) -> dict[str, Any]:
    return {
        "text": f"out{i}",
        "output_ids": [10 + i, 11 + i],
        "meta_info": {
            "id": f"req-{i}",
            "finish_reason": {"type": "length", "length": 2},
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "weight_version": None if version is None else str(version),
            "output_token_logprobs": [[-0.5, 10 + i, None], [-0.25, 11 + i, None]],
            "e2e_latency": 0.01,  # servers add fields of their own
        },
    }


def make_app(engine: FakeEngine) -> FastAPI:
    app = FastAPI()

    async def record(request: Request) -> bytes:
        body = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        engine.requests.append(Recorded(request.method, path, dict(request.headers), body))
        return body

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        await record(request)
        payload = await request.json()
        if engine.generate_delay:
            await asyncio.sleep(engine.generate_delay)
        params = payload.get("sampling_params", {})
        if params.get("top_k", -1) > 100:
            # A value the schema allows but this server refuses, in the shape FastAPI servers use.
            return JSONResponse({"detail": "sampling_params.top_k: 1000 exceeds the vocabulary size 100"}, 400)
        if payload.get("text") == "boom":
            return JSONResponse({"error": {"message": "engine crashed"}}, status_code=500)
        prompts = payload["input_ids"] if "input_ids" in payload else payload["text"]
        is_batch = isinstance(prompts, list) and not isinstance(prompts[0], int)
        num = (len(prompts) if is_batch else 1) * params.get("n", 1)
        if num == 1 and not is_batch:  # SGLang answers a single sequence with an object, anything else with a list
            return JSONResponse(_one_response(0))
        return JSONResponse([_one_response(i) for i in range(num)])

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> Response:
        body = await record(request)
        if request.headers.get("content-type") != "application/octet-stream":
            return JSONResponse({"detail": "expected application/octet-stream"}, status_code=415)
        bucket = decode_bucket(body)
        engine.assembler.add(bucket)
        return JSONResponse(
            {"success": True, "message": "ok", "bucket_index": bucket.index, "weight_version": str(bucket.version)}
        )

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        await record(request)
        payload = await request.json()
        if payload["model_path"] == "/missing":
            return JSONResponse({"success": False, "message": "x: no checkpoint at /missing"})
        engine.weight_version = payload["weight_version"]
        return JSONResponse(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

    async def succeed(request: Request) -> Response:
        await record(request)
        return JSONResponse({"success": True, "message": "done"})

    for path in (
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/release_memory_occupation",
        "/resume_memory_occupation",
    ):
        app.add_api_route(path, succeed, methods=["POST"])

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        if engine.busy:  # SGLang: requests queued or running
            await record(request)
            return PlainTextResponse("Flush cache failed: there are running requests.\n", status_code=400)
        await record(request)
        return PlainTextResponse("Cache flushed.\n")  # SGLang answers this one in plain text

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        await record(request)
        return Response(status_code=200)  # and this one with an empty body

    @app.get("/model_info")  # SGLang 0.5.23: the weight version is reported here (no /get_weight_version)
    async def model_info(request: Request) -> Response:
        await record(request)
        return JSONResponse({"model_path": "/models/tiny", "is_generation": True,
                             "weight_version": engine.weight_version})  # fmt: skip

    @app.get("/server_info")
    async def server_info(request: Request) -> Response:
        await record(request)
        return JSONResponse({"kernel_config_hash": "abc123", "version": "0.1.0", "tp_size": 1, "dp_size": 1})

    @app.get("/health")
    async def health(request: Request) -> Response:
        await record(request)
        return Response(status_code=200 if engine.is_healthy else 503)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        await record(request)
        return Response(status_code=200 if engine.is_healthy else 503)

    return app


class FlakyTransport(httpx.AsyncBaseTransport):
    """Raises ConnectError for the first `num_failures` requests, then hands them to `inner`."""

    def __init__(self, inner: httpx.AsyncBaseTransport, num_failures: int) -> None:
        self.inner = inner
        self.num_failures = num_failures
        self.num_attempts = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.num_attempts += 1
        if self.num_attempts <= self.num_failures:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        return await self.inner.handle_async_request(request)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def transport(engine: FakeEngine) -> httpx.ASGITransport:
    return httpx.ASGITransport(app=make_app(engine))


@pytest.fixture
async def client(transport: httpx.ASGITransport) -> AsyncIterator[Client]:
    async with Client(BASE_URL, api_key="user-key", admin_key="admin-key", transport=transport) as c:
        yield c


@pytest.fixture
def flaky_transport(engine: FakeEngine) -> Callable[[int], FlakyTransport]:
    """`make(num_failures)`: a transport to a fresh app over `engine` that refuses its first `num_failures` calls."""

    def make(num_failures: int) -> FlakyTransport:
        return FlakyTransport(httpx.ASGITransport(app=make_app(engine)), num_failures=num_failures)

    return make


class OracleDrafter(Drafter):
    """Runs the real draft (its K/V and recursion), then proposes the reference continuation instead, wrong (the
    right token + 1) where `is_wrong(sample index, position)`: accepted runs and rejected drafts on demand."""

    def __init__(
        self,
        base: Drafter,
        reference: dict[tuple[tuple[int, ...], int], list[int]],
        is_wrong: Callable[[int, int], bool],
    ) -> None:
        super().__init__(
            base.model, base.num_steps, base.page_size, base.query_tile, base.device, base.eos_ids, base.kind
        )
        self.reference = reference
        self.is_wrong = is_wrong

    def propose(self, store, seqs, budgets):  # type: ignore[no-untyped-def]
        drafts = super().propose(store, seqs, budgets)
        for seq, tokens in zip(seqs, drafts, strict=True):
            continuation = self.reference[(tuple(seq.group.prompt_ids), seq.sample_index)]
            for j in range(len(tokens)):
                p = len(seq.output_ids) + j
                right = continuation[p] if p < len(continuation) else 0
                tokens[j] = (right + 1) % 512 if self.is_wrong(seq.sample_index, p) else right
        return drafts


@pytest.fixture
def oracle_drafter() -> type[OracleDrafter]:
    """`OracleDrafter(base, reference, is_wrong)`: a drafter whose proposals a test chooses."""
    return OracleDrafter


class OracleTrees(Drafter):
    """Runs the real tree drafting (its beams, scratch pages and K/V), then proposes its own tree, as deep as allowed:
    at every level a wrong token first and the reference continuation last (wrong too where `is_wrong`), so that
    accepted paths go through the later branches."""

    def __init__(self, base: Drafter, reference: dict[tuple[tuple[int, ...], int], list[int]]) -> None:
        super().__init__(base.model, base.num_steps, base.page_size, base.query_tile, base.device, base.eos_ids,
                         base.kind)  # fmt: skip
        self.reference = reference

    def propose_trees(self, store, seqs, budgets, topk, num_nodes, take, release):  # type: ignore[no-untyped-def]
        trees = super().propose_trees(store, seqs, budgets, topk, num_nodes, take, release)
        out = []
        for seq, tree, budget in zip(seqs, trees, budgets, strict=True):
            continuation = self.reference[(tuple(seq.group.prompt_ids), seq.sample_index)]
            tokens, parents, spine = [tree.tokens[0]], [-1], 0
            for level in range(budget if tree.depth else 0):  # as deep as the step allows
                p = len(seq.output_ids) + level
                right = continuation[p] if p < len(continuation) else 0
                tokens.append((right + 1) % 512)  # a wrong sibling (a leaf), before the spine
                parents.append(spine)
                tokens.append((right + 2) % 512 if (seq.sample_index + p) % 5 == 0 else right)
                parents.append(spine)
                spine = len(tokens) - 1
            out.append(DraftTree(tokens, parents))
        return out


@pytest.fixture
def oracle_trees() -> type[OracleTrees]:
    """`OracleTrees(base, reference)`: a tree drafter whose accepted paths run through later branches."""
    return OracleTrees

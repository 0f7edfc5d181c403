"""The SGLang-compatible HTTP server of the embedded engine (FastAPI), and `serve(config)`: what `miles-rollout
serve` runs (one engine here, `--dp-size N` engines behind sglang-router through serve_many.py).

Endpoints use SGLang's names and JSON fields, so SGLang clients (and `miles_rollout.Client`) drive it unchanged.
Security: with `api_key` set every endpoint needs `Authorization: Bearer <key>`; weight, memory and control
endpoints need the admin key when one is set, and without one they answer only when the server is bound to a
loopback address (`serve` refuses a non-loopback bind without an admin key). The Host allow-list, cross-site,
content-type and body-size guards run before any route (http_guards.py). Bad input is a 4xx that names the field,
malformed bytes included; an engine failure answers that request with an error and leaves the server running.
Nothing received over HTTP is unpickled: weight buckets are safetensors bytes.
"""

from __future__ import annotations

import hmac
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import TypeAdapter
from starlette.datastructures import Headers

from miles_contracts import GenerateRequest, GenerateResponse, SamplingParams, version_string
from miles_rollout import __version__
from miles_rollout.admin_routes import ADMIN_PATHS, BUCKET_PATH, register_admin_routes
from miles_rollout.config import ServeConfig
from miles_rollout.disconnect import ClientGone, unless_disconnected
from miles_rollout.engine import Engine
from miles_rollout.engine_error import EngineError
from miles_rollout.http_guards import BodyRefused, HttpGuards, effective_hosts, is_loopback
from miles_rollout.metrics import ServerMetrics
from miles_rollout.openai_api import OpenAIError, register_openai_routes, sse
from miles_rollout.request_body import describe_errors, parse_body
from miles_rollout.serve_many import serve_behind_router
from miles_rollout.streaming import ResponseSoFar, StreamEvent

logger = logging.getLogger("miles_rollout.server")
PROG = "miles-rollout"

_RESPONSES = TypeAdapter(list[GenerateResponse])
HEALTH_PATHS = {"/health", "/health_generate"}
OPENAI_PREFIX = "/v1/"  # the OpenAI routes (openai_api.py) answer errors in OpenAI's body


def _refused(path: str, status: int, message: str) -> Response:
    """A refusal in the route's error body: OpenAI's under `/v1/`, FastAPI's `{"detail": ...}` elsewhere."""
    if path.startswith(OPENAI_PREFIX):
        return OpenAIError(message, status).response()
    return JSONResponse({"detail": message}, status)


async def _native_stream(
    events: AsyncIterator[StreamEvent], indexed: bool, observe: Callable[[GenerateResponse], None]
) -> AsyncIterator[bytes]:
    """SGLang's `/generate` stream: an event per new token of a sample (fewer, merged, for a client that reads
    slower than the engine writes) with its response so far (text and output ids so far, `meta_info`; `index` first
    when the request has several prompts or samples), the final response as the sample's last event, then
    `data: [DONE]`. The engine hands over deltas; the responses so far are built here. An engine failure mid-stream
    is an `error` event."""
    so_far: dict[int, ResponseSoFar] = {}
    try:
        async for event in events:
            if event.final is not None:
                response = event.final
                observe(response)
            else:
                assert event.delta is not None
                response = so_far.setdefault(event.index, ResponseSoFar()).add(event.delta)
            body = response.model_dump_json()
            yield sse(f'{{"index": {event.index}, {body[1:]}' if indexed else body)
    except EngineError as error:
        yield sse(json.dumps({"error": {"message": error.message, "code": error.status_code}}))
    yield sse("[DONE]")


# How long the server keeps an idle connection open (uvicorn's `timeout_keep_alive`). Above the idle expiry of
# common clients' pools (httpx and the OpenAI SDK: 5 s, miles' `Client`: 2 s): a client that reuses a connection at
# the instant the server closes it loses that request in transit (measured: 1 in 60 requests spaced at the boundary).
KEEP_ALIVE_S = 65


def create_app(
    engine: Engine,
    *,
    api_key: str | None = None,
    admin_key: str | None = None,
    host: str = "127.0.0.1",
    allow_client_chat_template: bool = False,
    allowed_hosts: list[str] | None = None,
    max_request_bytes: int = ServeConfig.model_fields["max_request_bytes"].default,
    max_bucket_bytes: int = ServeConfig.model_fields["max_bucket_bytes"].default,
) -> FastAPI:
    """The FastAPI app serving `engine`; `allow_client_chat_template`: /v1/chat/completions may bring its own
    `chat_template`; `allowed_hosts`, `max_request_bytes`, `max_bucket_bytes`: the HTTP guards (http_guards.py).
    Each is ServeConfig's field of that name."""
    app = FastAPI(title="miles-rollout", description="SGLang-compatible rollout server of the Miles engine")
    is_loopback_bind = is_loopback(host)
    metrics = ServerMetrics(engine, engine.model_path)
    # Compared as bytes: hmac.compare_digest refuses str with non-ASCII characters (a TypeError, so a 500).
    api_key_bytes = None if api_key is None else api_key.encode()
    admin_key_bytes = None if admin_key is None else admin_key.encode()

    def _refusal(path: str, headers: Headers) -> tuple[int, str] | None:
        """(status, reason) when the request's key does not open its endpoint, else None."""
        # Starlette decodes header values as latin-1: encoding them back gives the bytes the client sent.
        token = headers.get("authorization", "").removeprefix("Bearer ").strip().encode("latin-1")
        is_admin_path = path in ADMIN_PATHS
        if is_admin_path and admin_key_bytes is not None:
            if not hmac.compare_digest(token, admin_key_bytes):
                return 401, "this endpoint needs the admin key (Authorization: Bearer ...)"
        elif is_admin_path and not is_loopback_bind:
            return 403, "admin endpoints are disabled: no admin key and not a loopback bind"
        elif path in HEALTH_PATHS:
            pass  # routers probe health without a key, as SGLang lets them
        elif api_key_bytes is not None and not (
            hmac.compare_digest(token, api_key_bytes)
            or (admin_key_bytes is not None and hmac.compare_digest(token, admin_key_bytes))
        ):
            return 401, "missing or wrong API key (Authorization: Bearer <api key>)"
        return None

    app.add_middleware(
        HttpGuards,
        refuse=_refused,
        authorize=_refusal,
        allowed_hosts=effective_hosts(allowed_hosts, host),
        exempt_paths=HEALTH_PATHS,
        admin_paths=ADMIN_PATHS,
        bucket_path=BUCKET_PATH,
        max_request_bytes=max_request_bytes,
        max_bucket_bytes=max_bucket_bytes,
    )

    @app.exception_handler(BodyRefused)
    async def body_refused(request: Request, error: BodyRefused) -> Response:
        return _refused(request.url.path, error.status, error.message)

    @app.exception_handler(EngineError)
    async def engine_error(_: Request, error: EngineError) -> JSONResponse:
        return JSONResponse({"detail": error.message}, error.status_code, headers=error.headers)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": describe_errors(error)}, 400)

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body: GenerateRequest = await parse_body(request, GenerateRequest)
        if body.stream:
            events = await engine.generate_stream(body)  # bad input raises here: a 4xx, not a broken stream
            indexed = body.is_batch or body.params_for(0).n > 1
            return StreamingResponse(_native_stream(events, indexed, metrics.observe), media_type="text/event-stream")
        responses = await unless_disconnected(request, engine.generate(body))
        for response in responses:
            metrics.observe(response)
        # Serialized by pydantic-core in one call (FastAPI's generic encoder took ~5 ms for 64 responses).
        many = body.is_batch or body.params_for(0).n > 1
        content = _RESPONSES.dump_json(responses) if many else responses[0].model_dump_json()
        return Response(content, media_type="application/json")

    register_admin_routes(app, engine)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return engine.model_info()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return engine.server_info()

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        return [engine.load()]

    @app.get("/v1/loads")
    async def loads() -> dict[str, Any]:
        return {"timestamp": time.time(), "version": __version__, "loads": [engine.load()]}

    @app.get("/get_weight_version")
    async def weight_version() -> dict[str, Any]:
        return {"weight_version": version_string(engine.weight_version)}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_alive() else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if not engine.is_alive():
            return Response(status_code=503)
        if not engine.may_generate:  # paused on purpose: healthy, and a probe would wait for /continue_generation
            return Response(status_code=200)
        probe = GenerateRequest(input_ids=[0], sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
        await engine.generate(probe)
        return Response(status_code=200)

    register_openai_routes(app, engine, observe=metrics.observe, allow_client_chat_template=allow_client_chat_template)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus metrics (metrics.py): SGLang's names, the served model as `model_name`."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/")
    async def root() -> dict[str, Any]:
        return {"name": "miles-rollout", "torch": torch.__version__,
                "weight_version": version_string(engine.weight_version)}  # fmt: skip

    return app


def serve(config: ServeConfig) -> int:
    """Serve `config` (its keys resolved already: cli.py) until stopped: one engine, or `--dp-size` engines behind
    sglang-router (serve_many.py); the exit status."""
    if config.dp_size > 1:
        return serve_behind_router(config, serve_one)
    return serve_one(config)


def serve_one(config: ServeConfig) -> int:
    """Serve `config.model_path` with one engine on `config.host:port` until stopped; 2 (with the reason on stderr)
    for a config that cannot start: a non-loopback bind without an admin key, or a model the engine cannot load."""
    if not is_loopback(config.host) and not config.admin_key:
        print(
            f"refusing to bind {config.host} without --admin-key: the weight and memory endpoints would be open "
            "to the network. Give an admin key (--admin-key-file FILE or MILES_ADMIN_KEY; and an API key for "
            "generation: --api-key-file or MILES_API_KEY), or bind 127.0.0.1.",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        engine = Engine(config.model_path, config.kernel, config.engine, config.lora)
    except (ValueError, FileNotFoundError) as error:
        print(f"{PROG} serve: {error}", file=sys.stderr)
        return 2
    app = create_app(engine, api_key=config.api_key, admin_key=config.admin_key, host=config.host,
                     allow_client_chat_template=config.allow_client_chat_template,
                     allowed_hosts=config.allowed_hosts, max_request_bytes=config.max_request_bytes,
                     max_bucket_bytes=config.max_bucket_bytes)  # fmt: skip
    print(f"{PROG} serving {config.model_path} on http://{config.host}:{config.port} ({config.kernel.mode} mode)",
          flush=True)  # fmt: skip
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level, timeout_keep_alive=KEEP_ALIVE_S)
    engine.shutdown()
    return 0

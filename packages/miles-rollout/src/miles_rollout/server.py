"""The SGLang-compatible HTTP server of the embedded engine (FastAPI).

Endpoints use SGLang's names and JSON fields, so SGLang clients (and `miles_rollout.Client`) drive it unchanged.
Security: with `api_key` set every endpoint needs `Authorization: Bearer <key>`; weight, memory and control
endpoints need the admin key when one is set, and without one they answer only when the server is bound to a
loopback address (the CLI refuses a non-loopback bind without an admin key). The Host allow-list, cross-site,
content-type and body-size guards run before any route (http_guards.py). Bad input is a 4xx that names the field,
malformed bytes included; an engine failure answers that request with an error and leaves the server running.
Nothing received over HTTP is unpickled: weight buckets are safetensors bytes.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

import torch
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from starlette.datastructures import Headers

from miles_contracts import GenerateRequest, GenerateResponse, SamplingParams, version_string, weight_version_value
from miles_rollout.config import ServeConfig
from miles_rollout.disconnect import ClientGone, unless_disconnected
from miles_rollout.engine import Engine
from miles_rollout.engine_error import EngineError
from miles_rollout.http_guards import BodyRefused, HttpGuards, effective_hosts, is_loopback
from miles_rollout.metrics import ServerMetrics
from miles_rollout.openai_api import OpenAIError, register_openai_routes, sse
from miles_rollout.streaming import ResponseSoFar, StreamEvent

logger = logging.getLogger("miles_rollout.server")

_RESPONSES = TypeAdapter(list[GenerateResponse])

ADMIN_PATHS = {
    "/weights_checksum",
    "/weight_buckets",
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/update_weights_from_distributed",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weight_version",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/flush_cache",
    "/abort_request",
    "/pause_generation",
    "/continue_generation",
}

BUCKET_PATH = "/update_weights_from_tensor"  # its body is a weight bucket: octet-stream, max_bucket_bytes
BUSY_COUNTERS = ("num_running", "num_prefilling", "num_waiting", "num_retracted")
HEALTH_PATHS = {"/health", "/health_generate"}
OPENAI_PREFIX = "/v1/"  # the OpenAI routes (openai_api.py) answer errors in OpenAI's body
# A weight version as SGLang takes it: any string, reported back unchanged ("default" until one is named); digits are
# the orchestrator's policy step (kept as an int), an int >= 0 is accepted as those digits.
Version = Annotated[int | str | None, BeforeValidator(weight_version_value)]
LOAD_FORMATS = (None, "auto", "safetensors")


def _no_draft(selector: str) -> str:
    if selector == "draft":
        raise ValueError("selector=draft: this server has no draft model (speculative decoding lands with miles-spec)")
    return selector


class UpdateFromDisk(BaseModel):
    """SGLang's `UpdateWeightFromDiskReqInput`, each field honoured or refused."""

    model_config = ConfigDict(extra="forbid")
    model_path: str = Field(min_length=1)
    weight_version: Version = None
    abort_all_requests: bool = False
    load_format: str | None = None
    flush_cache: bool = True  # the radix cache is always flushed: cached K/V came from the old weights
    is_async: bool = False
    keep_pause: bool = False
    torch_empty_cache: bool = False  # accepted: no CUDA caching allocator to empty on this engine's CPU path
    recapture_cuda_graph: bool = False  # accepted: no CUDA graphs
    token_step: int = 0  # accepted: SGLang's bookkeeping only
    manifest: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported(self) -> UpdateFromDisk:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r}: this server loads safetensors checkpoints (auto)")
        if self.is_async:
            raise ValueError("is_async=true is not supported: the update is applied before the reply")
        if self.manifest:
            raise ValueError("manifest is not supported: give a checkpoint directory")
        return self


class InitGroup(BaseModel):
    model_config = ConfigDict(extra="forbid")
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str | None = Field(default=None, description="gloo or nccl; default: nccl on a GPU, gloo on the CPU")


class GroupName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_name: str = "weight_update_group"


class UpdateFromDistributed(BaseModel):
    """SGLang's `UpdateWeightsFromDistributedReqInput`: one call may carry any subset of the weights."""

    model_config = ConfigDict(extra="forbid")
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: Version = None
    flush_cache: bool = True  # the radix cache is always flushed: cached K/V came from the old weights
    abort_all_requests: bool = False
    load_format: str | None = None
    selector: str = "all"

    @model_validator(mode="after")
    def _supported(self) -> UpdateFromDistributed:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r}: tensors are loaded as they are sent (auto)")
        _no_draft(self.selector)
        return self


class WeightUpdateBracket(BaseModel):
    model_config = ConfigDict(extra="forbid")
    selector: str = "all"
    weight_version: Version = None

    @model_validator(mode="after")
    def _supported(self) -> WeightUpdateBracket:
        _no_draft(self.selector)
        return self


class NewWeightVersion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    new_version: Version = Field(description="Any string (SGLang's); digits are the orchestrator's step.")
    abort_all_requests: bool = True


class PauseGeneration(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGeneration(BaseModel):
    model_config = ConfigDict(extra="forbid")
    torch_empty_cache: bool = True  # accepted: nothing to empty on this engine's CPU path


class MemoryTags(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tags: list[str] | None = None


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rid: str = ""
    abort_all: bool = False


def _describe(error: ValidationError | RequestValidationError) -> str:
    """Pydantic errors as `field.path: message`, without union-branch noise (`list[SamplingParams]` etc.)."""
    items = list(error.errors())
    specific = [
        i
        for i in items
        if not str(i.get("msg", "")).startswith(("Input should be a valid list", "Input should be a valid dictionary"))
    ]
    parts = []
    for item in specific or items:
        location = [str(p) for p in item.get("loc", ()) if p != "body" and not (str(p)[:1].isupper() or "[" in str(p))]
        message = str(item.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{'.'.join(location)[:200] or 'body'}: {message}")  # a location may be a client's dict key
    return "; ".join(dict.fromkeys(parts[:20]))


async def _parse(request: Request, model: type[BaseModel], allow_empty: bool = False) -> Any:
    raw = await request.body()
    if not raw.strip() and allow_empty:
        return model()
    try:
        payload = json.loads(raw)
    except RecursionError as error:
        raise HTTPException(400, "request body is nested too deeply") from error
    except ValueError as error:  # not JSON, not UTF-8, or an integer of over 4300 digits (Python's limit)
        raise HTTPException(400, f"request body is not valid JSON: {error}") from error
    try:
        parsed = model.model_validate(payload)
    except ValidationError as error:
        raise HTTPException(400, _describe(error)) from error
    except RecursionError as error:
        raise HTTPException(400, "request body is nested too deeply") from error
    if model is GenerateRequest and isinstance(payload, dict):
        _log_ignored(GenerateRequest.ignored_keys(payload))
    return parsed


_IGNORED_LOGGED: set[str] = set()


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


def _log_ignored(keys: list[str]) -> None:
    """SGLang ignores top-level keys it does not know (routers add their own, e.g. `model`); so does this server,
    saying so once per key at debug level."""
    for key in keys:
        if key not in _IGNORED_LOGGED:
            _IGNORED_LOGGED.add(key)
            logger.debug("ignoring the /generate field %r, unknown to SGLang's API", key)


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
        return JSONResponse({"detail": _describe(error)}, 400)

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body: GenerateRequest = await _parse(request, GenerateRequest)
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

    @app.post("/update_weights_from_disk")
    async def update_from_disk(request: Request) -> dict[str, Any]:
        body: UpdateFromDisk = await _parse(request, UpdateFromDisk)
        if body.abort_all_requests:
            await engine.abort(None)
        version = await engine.control(
            lambda: engine.weights.load_from_disk(body.model_path, body.weight_version), needs_idle=True
        )
        if body.keep_pause and engine.paused is None:
            await engine.control(lambda: engine.pause_generation("in_place"), needs_idle=False)
        return {"success": True, "message": f"loaded {body.model_path}", "weight_version": version_string(version),
                "num_paused_requests": 0}  # fmt: skip

    @app.post(BUCKET_PATH)
    async def update_from_tensor(request: Request) -> dict[str, Any]:
        data = await request.body()
        if not data:
            raise HTTPException(400, "empty body: send one weight bucket (safetensors bytes)")
        if data.lstrip()[:1] == b"{":  # SGLang's JSON body: `serialized_named_tensors`, pickled tensors
            raise HTTPException(400, "this server never unpickles network data, so SGLang's serialized_named_tensors "
                                "body is refused: send one safetensors weight bucket as the body (miles_kernels."
                                "encode_bucket, Content-Type application/octet-stream), or use "
                                "/update_weights_from_distributed or /update_weights_from_disk")  # fmt: skip
        result = await engine.control(lambda: engine.weights.add_bucket(data), needs_idle=True)
        return {"success": True, "message": "bucket received", **result,
                "weight_version": version_string(result["weight_version"])}  # fmt: skip

    @app.post("/init_weights_update_group")
    async def init_group(request: Request) -> dict[str, Any]:
        body: InitGroup = await _parse(request, InitGroup)
        backend = body.backend or ("nccl" if str(engine.config.device).startswith("cuda") else "gloo")
        await engine.weights.init_group(body.master_address, body.master_port, body.rank_offset, body.world_size,
                                        body.group_name, backend)  # fmt: skip
        return {"success": True, "message": f"joined group {body.group_name!r} as rank {body.rank_offset}"}

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(request: Request) -> dict[str, Any]:
        body: UpdateFromDistributed = await _parse(request, UpdateFromDistributed)
        if not (len(body.names) == len(body.dtypes) == len(body.shapes)):
            raise HTTPException(400, "names, dtypes and shapes need one entry per tensor")
        if body.abort_all_requests:
            await engine.abort(None)
        version = await engine.weights.receive_distributed(
            body.group_name, body.names, body.dtypes, body.shapes, body.weight_version
        )
        return {"success": True, "message": f"received {len(body.names)} tensors",
                "weight_version": version_string(version)}  # fmt: skip

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request) -> dict[str, Any]:
        body: GroupName = await _parse(request, GroupName, allow_empty=True)
        await engine.weights.destroy_group(body.group_name)
        return {"success": True, "message": f"left group {body.group_name!r}"}

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request) -> dict[str, Any]:
        await _parse(request, WeightUpdateBracket, allow_empty=True)
        await engine.control(engine.begin_weight_update, needs_idle=True)
        return {"success": True, "message": "weight update open: generation waits until /end_weight_update"}

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request) -> dict[str, Any]:
        body: WeightUpdateBracket = await _parse(request, WeightUpdateBracket, allow_empty=True)
        version = await engine.control(lambda: engine.end_weight_update(body.weight_version), needs_idle=False)
        return {"success": True, "message": "weight update closed", "weight_version": version_string(version)}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict[str, Any]:
        body: NewWeightVersion = await _parse(request, NewWeightVersion)
        if body.abort_all_requests:
            await engine.abort(None)
        await engine.control(lambda: engine.commit_weights(body.new_version), needs_idle=True)
        return {"success": True, "message": f"weight version updated to {body.new_version}",
                "new_version": version_string(body.new_version)}  # fmt: skip

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict[str, Any]:
        body: PauseGeneration = await _parse(request, PauseGeneration, allow_empty=True)
        count = await engine.control(lambda: engine.pause_generation(body.mode), needs_idle=False)
        return {"message": "Generation paused successfully.", "status": "ok", "mode": body.mode,
                "num_paused_requests": count}  # fmt: skip

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> dict[str, Any]:
        await _parse(request, ContinueGeneration, allow_empty=True)
        await engine.control(engine.continue_generation, needs_idle=False)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/release_memory_occupation")
    async def release(request: Request) -> dict[str, Any]:
        body: MemoryTags = await _parse(request, MemoryTags, allow_empty=True)
        released = await engine.control(lambda: engine.release_memory(body.tags), needs_idle=True)
        return {"success": True, "message": "released", "released": released}

    @app.post("/resume_memory_occupation")
    async def resume(request: Request) -> dict[str, Any]:
        body: MemoryTags = await _parse(request, MemoryTags, allow_empty=True)
        released = await engine.control(lambda: engine.resume_memory(body.tags), needs_idle=True)
        return {"success": True, "message": "resumed", "released": released}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = Query(0.0, ge=0.0)) -> dict[str, Any]:
        """SGLang's: a 400 while requests are queued or running, unless they finish within `timeout` seconds."""
        if timeout > 0:
            with contextlib.suppress(TimeoutError):
                await engine.wait_until(lambda stats: not any(stats[k] for k in BUSY_COUNTERS), timeout)
        await engine.control(engine.flush_cache, needs_idle=False)
        return {"success": True, "message": "cache flushed"}

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        body: AbortRequest = await _parse(request, AbortRequest, allow_empty=True)
        if not body.abort_all and not body.rid:
            raise HTTPException(400, "give `rid` or set `abort_all: true`")
        await engine.abort(None if body.abort_all else body.rid)
        return {"success": True, "message": "abort requested"}

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
        return {"timestamp": time.time(), "version": engine.server_info()["version"], "loads": [engine.load()]}

    @app.get("/weights_checksum")
    async def checksum() -> dict[str, Any]:
        value = await engine.control(engine.weights.checksum, needs_idle=False)
        return {"checksum": value, "weight_version": version_string(engine.weight_version)}

    @app.get("/weight_buckets")
    async def weight_buckets(index: int = Query(0, ge=0), bucket_bytes: int = Query(512 << 20, gt=0)) -> Response:
        """Miles' own (admin): bucket `index` of the served weights as safetensors bytes (miles_kernels'
        bucket format, the served version in its metadata), the number of buckets in `X-Bucket-Count`. A restarted
        engine is loaded from a healthy one this way, bucket by bucket (`/update_weights_from_tensor`)."""
        data, count = await engine.control(lambda: engine.weights.bucket(index, bucket_bytes), needs_idle=False)
        return Response(data, media_type="application/octet-stream", headers={"X-Bucket-Count": str(count)})

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

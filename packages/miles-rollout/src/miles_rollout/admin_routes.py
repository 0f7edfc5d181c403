"""The admin routes of the server (SGLang's names and bodies): weight updates (from disk, a weight bucket, a
`torch.distributed` broadcast, the begin/end bracket, a new version label), the weights' checksum and buckets, pause
and continue, memory release and resume, cache flush and aborts, and loading / unloading LoRA adapters
(served_loras.py). They need the admin key (server.py); each body is SGLang's request type, every field honoured or
refused with a 400.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from miles_contracts import version_string, weight_version_value
from miles_rollout.engine import Engine
from miles_rollout.engine_error import EngineError
from miles_rollout.profiling import ProfileRequest
from miles_rollout.request_body import parse_body

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
    "/load_lora_adapter",
    "/load_lora_adapter_from_tensors",
    "/unload_lora_adapter",
    "/start_profile",  # it writes a file where the body says
    "/stop_profile",
}

BUCKET_PATH = "/update_weights_from_tensor"  # its body is a weight bucket: octet-stream, max_bucket_bytes
BUSY_COUNTERS = ("num_running", "num_prefilling", "num_waiting", "num_retracted")
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


class LoadLoraAdapter(BaseModel):
    """SGLang's `LoadLoRAAdapterReqInput`: a PEFT adapter directory served as `lora_name`."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    pinned: bool = False  # accepted and reported: adapters are never evicted here, so pinning changes nothing
    lora_id: str | None = None  # SGLang's server assigns it and overwrites a given one; so does this one


class UnloadLoraAdapter(BaseModel):
    """SGLang's `UnloadLoRAAdapterReqInput`."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_id: str | None = None  # ignored, as above


async def lora_update(engine: Engine, call: Callable[[], Awaitable[dict[str, str]]]) -> JSONResponse:
    """SGLang's `LoRAUpdateOutput` of a load or unload: 200 {success: true, error_message: "", loaded_adapters},
    or 400 {success: false, error_message: why, loaded_adapters} for an adapter or name the engine refuses."""
    try:
        loaded = await call()
    except EngineError as error:
        if error.status_code >= 500:
            raise
        current = engine.loras.loaded() if engine.loras is not None else None
        return JSONResponse({"success": False, "error_message": error.message, "loaded_adapters": current}, 400)
    return JSONResponse({"success": True, "error_message": "", "loaded_adapters": loaded})


def register_admin_routes(app: FastAPI, engine: Engine) -> None:
    """Add the admin routes serving `engine` to `app` (their key check is the app's, server.py)."""

    @app.post("/update_weights_from_disk")
    async def update_from_disk(request: Request) -> dict[str, Any]:
        body: UpdateFromDisk = await parse_body(request, UpdateFromDisk)
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
        body: InitGroup = await parse_body(request, InitGroup)
        backend = body.backend or ("nccl" if str(engine.config.device).startswith("cuda") else "gloo")
        await engine.weights.init_group(body.master_address, body.master_port, body.rank_offset, body.world_size,
                                        body.group_name, backend)  # fmt: skip
        return {"success": True, "message": f"joined group {body.group_name!r} as rank {body.rank_offset}"}

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(request: Request) -> dict[str, Any]:
        body: UpdateFromDistributed = await parse_body(request, UpdateFromDistributed)
        if not (len(body.names) == len(body.dtypes) == len(body.shapes)):
            raise HTTPException(400, "names, dtypes and shapes need one entry per tensor")
        if body.abort_all_requests:
            await engine.abort(None)
        version = await engine.update_weights_from_distributed(
            body.group_name, body.names, body.dtypes, body.shapes, body.weight_version
        )
        return {"success": True, "message": f"received {len(body.names)} tensors",
                "weight_version": version_string(version)}  # fmt: skip

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request) -> dict[str, Any]:
        body: GroupName = await parse_body(request, GroupName, allow_empty=True)
        await engine.weights.destroy_group(body.group_name)
        return {"success": True, "message": f"left group {body.group_name!r}"}

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request) -> dict[str, Any]:
        await parse_body(request, WeightUpdateBracket, allow_empty=True)
        await engine.control(engine.begin_weight_update, needs_idle=True)
        return {"success": True, "message": "weight update open: generation waits until /end_weight_update"}

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request) -> dict[str, Any]:
        body: WeightUpdateBracket = await parse_body(request, WeightUpdateBracket, allow_empty=True)
        version = await engine.control(lambda: engine.end_weight_update(body.weight_version), needs_idle=False)
        return {"success": True, "message": "weight update closed", "weight_version": version_string(version)}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict[str, Any]:
        body: NewWeightVersion = await parse_body(request, NewWeightVersion)
        if body.abort_all_requests:
            await engine.abort(None)
        await engine.control(lambda: engine.commit_weights(body.new_version), needs_idle=True)
        return {"success": True, "message": f"weight version updated to {body.new_version}",
                "new_version": version_string(body.new_version)}  # fmt: skip

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict[str, Any]:
        body: PauseGeneration = await parse_body(request, PauseGeneration, allow_empty=True)
        count = await engine.control(lambda: engine.pause_generation(body.mode), needs_idle=False)
        return {"message": "Generation paused successfully.", "status": "ok", "mode": body.mode,
                "num_paused_requests": count}  # fmt: skip

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> dict[str, Any]:
        await parse_body(request, ContinueGeneration, allow_empty=True)
        await engine.control(engine.continue_generation, needs_idle=False)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/release_memory_occupation")
    async def release(request: Request) -> dict[str, Any]:
        body: MemoryTags = await parse_body(request, MemoryTags, allow_empty=True)
        released = await engine.control(lambda: engine.release_memory(body.tags), needs_idle=True)
        return {"success": True, "message": "released", "released": released}

    @app.post("/resume_memory_occupation")
    async def resume(request: Request) -> dict[str, Any]:
        body: MemoryTags = await parse_body(request, MemoryTags, allow_empty=True)
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
        body: AbortRequest = await parse_body(request, AbortRequest, allow_empty=True)
        if not body.abort_all and not body.rid:
            raise HTTPException(400, "give `rid` or set `abort_all: true`")
        await engine.abort(None if body.abort_all else body.rid)
        return {"success": True, "message": "abort requested"}

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        body: LoadLoraAdapter = await parse_body(request, LoadLoraAdapter)
        return await lora_update(engine, lambda: engine.load_lora_adapter(body.lora_name, body.lora_path, body.pinned))

    @app.post("/load_lora_adapter_from_tensors")
    async def load_lora_adapter_from_tensors() -> JSONResponse:
        message = ("this server never unpickles network data, so SGLang's serialized_named_tensors (pickled tensors) "
                   "are refused: write the adapter as a PEFT directory (miles_kernels.save_peft_adapter) and POST "
                   "/load_lora_adapter with its path")  # fmt: skip
        loaded = engine.loras.loaded() if engine.loras is not None else None
        return JSONResponse({"success": False, "error_message": message, "loaded_adapters": loaded}, 400)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        """Waits until the requests that use the adapter are done, as SGLang's does; new ones naming it get a 400."""
        body: UnloadLoraAdapter = await parse_body(request, UnloadLoraAdapter)
        return await lora_update(engine, lambda: engine.unload_lora_adapter(body.lora_name))

    @app.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(request: Request) -> Response:
        """SGLang's: a torch.profiler trace of the engine thread until /stop_profile (profiling.py)."""
        body: ProfileRequest = await parse_body(request, ProfileRequest, allow_empty=True)
        await engine.control(lambda: engine.profiler.start_request(body), needs_idle=False)
        return Response("Start profiling.\n")

    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile() -> Response:
        path = await engine.control(engine.profiler.stop, needs_idle=False)
        return Response(f"Stop profiling. This will take some time.\nTrace: {path}\n")

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

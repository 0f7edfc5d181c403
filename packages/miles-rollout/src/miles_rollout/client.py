"""Async HTTP client for a rollout server that speaks SGLang's native API.

The orchestrator's Ray cluster reaches its engine through this client (the local cluster through `InProcessClient`,
the same interface): the rollout function asks it for responses (step 2, `/generate`); the driver tells the engine
to load the weight file a trainer rank wrote in /dev/shm (step 7, `/update_weights_from_disk`), or trainer rank 0
posts weight buckets with a client of its own (`/update_weights_from_tensor`); and the driver releases and resumes
engine memory around training and checks health. The embedded `miles-rollout serve` server and an SGLang server
(or sglang-router in front of several) answer the same requests (docs/architecture.md, "Weight sync").

Failure policy, so that a caller can reason about what happened on the server:

- Only connection failures are retried (the request never reached the server, so it never ran), and only for
  calls that are safe to repeat: GET endpoints, `/generate` and `/flush_cache`. A weight update is never retried:
  the caller owns the weight version and decides whether to resend the whole sync.
- A request that got an HTTP response is never retried; a 4xx/5xx, or a 200 whose JSON says `"success": false`
  (SGLang reports some failures that way), raises `RolloutClientError` with the server's own message.
- A timeout raises `RolloutClientError` naming the endpoint; the server may still be working on the request.

Weights travel as safetensors bucket bytes (`miles_kernels.encode_bucket`), never pickle.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Self

import httpx
from pydantic import TypeAdapter, ValidationError

from miles_contracts import GenerateRequest, GenerateResponse, WeightVersion, reported_weight_version
from miles_rollout.client_wire import MAX_MESSAGE_CHARS, int_version, server_message, version_field
from miles_rollout.client_wire import RolloutClientError as RolloutClientError

logger = logging.getLogger(__name__)

# Failures that happen before the server has seen the request, so repeating a safe call cannot run it twice.
# RemoteProtocolError without a response is mostly a kept-alive connection the server closed just as it was reused.
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError)
_RESPONSES = TypeAdapter(list[GenerateResponse])


# Idle pooled connections are dropped after this long, well before servers close them (uvicorn, so SGLang too, after
# 5 s): a request sent on a connection the server is closing at that instant fails in transit and is not retried
# (measured: 1 in 60 requests spaced at the server's keep-alive boundary; 0 with the client's expiry below it).
KEEPALIVE_EXPIRY_S = 2.0


@functools.cache
def shared_ssl_context() -> ssl.SSLContext:
    """One TLS context (certifi's CA bundle) for every client of this process. httpx builds a new one per client
    by default, ~30 ms of loading certificates even for a plain-http URL: too slow for a client per call."""
    return httpx.create_ssl_context()


class Client:
    """Async client for one rollout server (embedded miles engine, SGLang, or a router in front of several).

    Use it as `async with Client(url) as client: ...`, or call `aclose()` when done. `api_key` is sent with
    every request; admin endpoints (weights, memory, cache, abort) send `admin_key` instead when one is given.
    `timeout` is the whole-request deadline in seconds. `max_connections` caps concurrent connections; the default
    (None) leaves the cap to the caller's own concurrency limit, so that requests never wait in a hidden pool
    queue and time out there.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        admin_key: str | None = None,
        timeout: float = 600.0,
        connect_retries: int = 3,
        retry_backoff: float = 0.5,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if connect_retries < 0:
            raise ValueError(f"connect_retries must be >= 0, got {connect_retries!r}")
        if retry_backoff < 0:
            raise ValueError(f"retry_backoff must be >= 0 seconds, got {retry_backoff!r}")
        self._base_url = base_url.rstrip("/")
        self._api_key = api_key
        self._admin_key = admin_key
        self._timeout = timeout
        self._connect_retries = connect_retries
        self._retry_backoff = retry_backoff
        self._http = httpx.AsyncClient(
            base_url=self._base_url,
            timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_EXPIRY_S
            ),
            transport=transport,
            verify=shared_ssl_context(),
        )

    @property
    def base_url(self) -> str:
        """The server's URL, without a trailing slash."""
        return self._base_url

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    # -- transport -------------------------------------------------------------------------------------------

    def _auth_headers(self, admin: bool) -> dict[str, str]:
        key = (self._admin_key or self._api_key) if admin else self._api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _request(
        self,
        method: str,
        endpoint: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        params: dict[str, Any] | None = None,
        admin: bool = False,
        retry: bool = False,
    ) -> httpx.Response:
        """Send one request; return a successful response or raise RolloutClientError."""
        request_headers = self._auth_headers(admin) | (headers or {})
        num_attempts = 1 + (self._connect_retries if retry else 0)
        attempt = 0
        while True:
            attempt += 1
            try:
                # httpx's timeout bounds each connect/read/write, not the whole exchange: a server that trickles
                # bytes, or an in-process ASGI app, would never trip it. This deadline does.
                async with asyncio.timeout(self._timeout):
                    response = await self._http.request(
                        method, endpoint, json=json, content=content, headers=request_headers, params=params
                    )
            except _CONNECT_ERRORS as exc:
                if attempt < num_attempts:
                    delay = self._retry_backoff * 2 ** (attempt - 1)
                    logger.warning(
                        "%s %s%s: %s; retry %d/%d in %.2f s",
                        method,
                        self._base_url,
                        endpoint,
                        type(exc).__name__,
                        attempt,
                        num_attempts - 1,
                        delay,
                    )
                    await asyncio.sleep(delay)
                    continue
                raise RolloutClientError(
                    f"could not reach {self._base_url} after {attempt} attempt(s): {type(exc).__name__}: {exc}",
                    endpoint=endpoint,
                ) from exc
            except (TimeoutError, httpx.TimeoutException) as exc:
                raise RolloutClientError(
                    f"{method} {endpoint} timed out after {self._timeout:g} s (the client's timeout); "
                    "the server may still be working on it",
                    endpoint=endpoint,
                ) from exc
            except httpx.HTTPError as exc:
                # The connection broke mid-exchange: the server may have run the request, so never retry.
                raise RolloutClientError(
                    f"{method} {endpoint} failed in transit: {type(exc).__name__}: {exc}", endpoint=endpoint
                ) from exc
            if response.is_error:
                raise RolloutClientError(server_message(response), endpoint=endpoint, status_code=response.status_code)
            return response

    async def _call(self, method: str, endpoint: str, **kwargs: Any) -> dict[str, Any]:
        """`_request`, then the reply as a dict; a `"success": false` reply raises.

        SGLang answers some control endpoints with plain text or an empty body; those become `{"message": text}`
        and `{}`. Generate replies skip this path so their (large) JSON is parsed once.
        """
        response = await self._request(method, endpoint, **kwargs)
        if not response.content:
            return {}
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return {"message": response.text.strip()}
        # SGLang answers some failed control calls with HTTP 200 and {"success": false, "message": ...}.
        if body.get("success") is False:
            message = body.get("message") or body.get("error_message")
            message = message or 'the server replied "success": false without a message'
            raise RolloutClientError(str(message), endpoint=endpoint, status_code=response.status_code)
        return body

    async def _check(self, endpoint: str, *, retry: bool) -> str | None:
        """None when `endpoint` answers 200, else why not. Never raises a client error."""
        try:
            response = await self._request("GET", endpoint, retry=retry)
        except RolloutClientError as exc:
            return str(exc)
        # Redirects are not followed, so a 3xx lands here: it is not a healthy engine.
        return None if response.status_code == 200 else f"{endpoint} answered HTTP {response.status_code}"

    # -- generation ------------------------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> list[GenerateResponse]:
        """POST /generate; one response per generated sequence (a batch or `n > 1` gives several)."""
        if request.stream:
            raise ValueError("Client.generate does not read streamed responses; send the request with stream=False")
        # Safe to retry: a request that never connected never ran, and the sampling seed makes a rerun identical.
        response = await self._request(
            "POST", "/generate", json=request.model_dump(mode="json", exclude_none=True), retry=True
        )
        content = response.content
        try:
            if content.lstrip()[:1] == b"[":  # a batch or n > 1: parsed and validated in one pydantic-core call
                return _RESPONSES.validate_json(content)
            return [GenerateResponse.model_validate_json(content)]
        except ValidationError as exc:
            if any(error["type"] == "json_invalid" for error in exc.errors()):
                raise RolloutClientError(
                    f"response is not JSON: {response.text[:MAX_MESSAGE_CHARS]!r}", endpoint="/generate"
                ) from None
            raise RolloutClientError(
                f"response does not match the SGLang generate schema: {exc}", endpoint="/generate"
            ) from exc

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> dict[str, Any]:
        """POST /abort_request: stop request `rid`, or every request with `abort_all=True`."""
        return await self._call("POST", "/abort_request", json={"rid": rid or "", "abort_all": abort_all}, admin=True)

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """POST /pause_generation: stop generating until `continue_generation`. `abort` ends the requests in flight
        (finish reason abort), `retract` frees their KV and continues them afterwards (recomputing it with the
        weights then served), `in_place` keeps them where they are (SGLang's three modes)."""
        return await self._call("POST", "/pause_generation", json={"mode": mode}, admin=True)

    async def continue_generation(self) -> dict[str, Any]:
        """POST /continue_generation: generate again after `pause_generation`."""
        return await self._call("POST", "/continue_generation", json={}, admin=True)

    # -- weights ---------------------------------------------------------------------------------------------

    async def update_weights_from_disk(self, model_path: str, weight_version: WeightVersion = None) -> dict[str, Any]:
        """POST /update_weights_from_disk: load a Hugging Face checkpoint directory as weight `weight_version`."""
        body = {"model_path": model_path, "weight_version": version_field(weight_version)}
        return int_version(await self._call("POST", "/update_weights_from_disk", json=body, admin=True))

    async def update_weights_from_tensor(self, bucket: bytes) -> dict[str, Any]:
        """POST /update_weights_from_tensor with one safetensors weight bucket as the raw body (miles engine only).

        The version and bucket index/count travel inside the bucket's metadata. SGLang's endpoint of this name
        unpickles its payload, so SGLang engines get weights from disk or by broadcast instead.
        """
        if not isinstance(bucket, bytes | bytearray | memoryview):
            raise TypeError(f"a weight bucket is bytes (miles_kernels.encode_bucket), got {type(bucket).__name__}")
        reply = await self._call(
            "POST",
            "/update_weights_from_tensor",
            content=bytes(bucket),
            headers={"Content-Type": "application/octet-stream"},
            admin=True,
        )
        return int_version(reply)

    async def update_weights_from_buckets(self, buckets: Iterable[bytes]) -> dict[str, Any]:
        """Send each bucket in order (consuming a lazy iterator one bucket at a time); return the last reply."""
        last: dict[str, Any] | None = None
        for bucket in buckets:
            last = await self.update_weights_from_tensor(bucket)
        if last is None:
            raise ValueError("update_weights_from_buckets got no buckets; a weight sync sends at least one")
        return last

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str | None = None,
    ) -> dict[str, Any]:
        """POST /init_weights_update_group: join the trainer's process group for broadcast weight updates.
        `backend` None lets the server choose: SGLang takes NCCL (GPU tensors), a CPU miles engine gloo."""
        body: dict[str, Any] = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
        }
        if backend is not None:
            body["backend"] = backend
        return await self._call("POST", "/init_weights_update_group", json=body, admin=True)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        """POST /destroy_weights_update_group: leave the process group `group_name` (before joining a rebuilt one)."""
        return await self._call("POST", "/destroy_weights_update_group", json={"group_name": group_name}, admin=True)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        weight_version: WeightVersion = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """POST /update_weights_from_distributed: receive the named tensors by broadcast over `group_name`."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"names, dtypes and shapes describe the same tensors; got {len(names)}, {len(dtypes)} and "
                f"{len(shapes)} entries"
            )
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "weight_version": version_field(weight_version),
            "flush_cache": flush_cache,
        }
        return int_version(await self._call("POST", "/update_weights_from_distributed", json=body, admin=True))

    async def begin_weight_update(self) -> dict[str, Any]:
        """POST /begin_weight_update (miles engine): open an update made of several calls (e.g. one
        `/update_weights_from_distributed` per bucket); no request runs until `end_weight_update`."""
        return await self._call("POST", "/begin_weight_update", json={}, admin=True)

    async def end_weight_update(self, weight_version: WeightVersion = None) -> dict[str, Any]:
        """POST /end_weight_update: serve the weights loaded since `begin_weight_update`, as `weight_version`."""
        body = {"weight_version": version_field(weight_version)}
        return int_version(await self._call("POST", "/end_weight_update", json=body, admin=True))

    async def get_weight_bucket(self, index: int, bucket_bytes: int = 512 << 20) -> tuple[bytes, int]:
        """GET /weight_buckets (admin; miles engines): bucket `index` of the served weights (post it to another
        engine's `update_weights_from_tensor`) and how many buckets there are."""
        response = await self._request("GET", "/weight_buckets", params={"index": index, "bucket_bytes": bucket_bytes},
                                       admin=True, retry=True)  # fmt: skip
        return response.content, int(response.headers["X-Bucket-Count"])

    async def weights_checksum(self) -> str:
        """GET /weights_checksum (admin; miles engines): `miles_kernels.weights_checksum` of the served weights."""
        body = await self._call("GET", "/weights_checksum", admin=True, retry=True)
        return str(body["checksum"])

    async def get_weight_version(self) -> WeightVersion:
        """The served weight version, from GET /model_info (SGLang 0.5.23 reports it there): the policy step (an
        int), another client's label (a str), or None while none was named (SGLang's "default")."""
        body = await self._call("GET", "/model_info", retry=True)
        return reported_weight_version(body.get("weight_version"))

    # -- LoRA adapters ---------------------------------------------------------------------------------------

    async def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, Any]:
        """POST /load_lora_adapter (SGLang's): serve the PEFT adapter directory `lora_path` (a path on the server's
        machine) as `lora_name`, which requests then name (`GenerateRequest.lora_path`, or `model` on the OpenAI
        routes). The reply's `loaded_adapters` maps each loaded name to its path; a refused adapter raises."""
        body = {"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned}
        return await self._call("POST", "/load_lora_adapter", json=body, admin=True)

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """POST /unload_lora_adapter (SGLang's): stop serving `lora_name`; the server answers once the requests
        that use it are done."""
        return await self._call("POST", "/unload_lora_adapter", json={"lora_name": lora_name}, admin=True)

    # -- memory and cache ------------------------------------------------------------------------------------

    async def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """POST /release_memory_occupation: free the engine's `tags` (e.g. "kv_cache", "weights"); None: all."""
        return await self._call("POST", "/release_memory_occupation", json={"tags": tags}, admin=True)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """POST /resume_memory_occupation: take back what `release_memory_occupation` freed."""
        return await self._call("POST", "/resume_memory_occupation", json={"tags": tags}, admin=True)

    async def start_profile(self, output_dir: str, profile_id: str | None = None) -> dict[str, Any]:
        """POST /start_profile (admin): a torch.profiler trace on the server until `stop_profile`, written to
        `output_dir` on the server's machine (SGLang's and this engine's alike)."""
        body = {"output_dir": output_dir, **({"profile_id": profile_id} if profile_id is not None else {})}
        return await self._call("POST", "/start_profile", json=body, admin=True)

    async def stop_profile(self) -> dict[str, Any]:
        """POST /stop_profile (admin): the server writes its trace."""
        return await self._call("POST", "/stop_profile", admin=True)

    async def flush_cache(self, timeout: float = 0.0) -> dict[str, Any]:
        """POST /flush_cache: drop the prefix cache (stale after a weight update). SGLang refuses (HTTP 400) while
        requests are queued or running unless they finish within `timeout` seconds; that raises
        `RolloutClientError`."""
        params = {"timeout": timeout} if timeout > 0 else None
        return await self._call("POST", "/flush_cache", params=params, admin=True, retry=True)

    # -- info and health -------------------------------------------------------------------------------------

    async def get_model_info(self) -> dict[str, Any]:
        """GET /model_info (SGLang 0.5.23's name; `/get_model_info` is its deprecated alias)."""
        return await self._call("GET", "/model_info", retry=True)

    async def get_server_info(self) -> dict[str, Any]:
        """GET /server_info (the miles engine reports its kernel config and fingerprint here)."""
        return await self._call("GET", "/server_info", retry=True)

    async def health(self) -> bool:
        """GET /health: True on 200; False on any other status or when the server cannot be reached."""
        return await self._check("/health", retry=True) is None

    async def health_generate(self) -> bool:
        """GET /health_generate (the server runs a one-token generation): True on 200, else False."""
        return await self._check("/health_generate", retry=True) is None

    async def check_health(self, generate: bool = False) -> str | None:
        """None when GET /health (or /health_generate, a one-token generation) answers 200 within the client's
        timeout, else why not (no connection, a timeout, another status); one attempt, never raises a client error."""
        return await self._check("/health_generate" if generate else "/health", retry=False)

    async def wait_until_healthy(self, timeout: float = 60.0, interval: float = 0.2) -> None:
        """Poll /health every `interval` seconds until it answers 200; RolloutClientError after `timeout`."""
        if not timeout > 0 or interval < 0:
            raise ValueError(
                f"need timeout > 0 and interval >= 0 seconds, got timeout={timeout!r}, interval={interval!r}"
            )
        reason = "no answer yet"
        try:
            async with asyncio.timeout(timeout):
                # No per-probe retries: this loop is the retry, and its deadline must hold.
                while (reason_or_none := await self._check("/health", retry=False)) is not None:
                    reason = reason_or_none
                    await asyncio.sleep(interval)
        except TimeoutError:
            raise RolloutClientError(
                f"server at {self._base_url} not healthy after {timeout:g} s; last probe: {reason}",
                endpoint="/health",
            ) from None

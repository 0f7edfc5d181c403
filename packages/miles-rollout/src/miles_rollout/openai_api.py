"""The OpenAI-compatible routes of the rollout server: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Each request (its body: openai_requests.py) becomes one native `GenerateRequest` and runs through the same engine
call as `/generate`, so a `/v1` output has the native route's sampling and determinism guarantees (deterministic
mode: the same request and `seed` give the same output, whatever else the server runs). Response shapes follow
SGLang's OpenAI layer (SGLang 0.5.23, `sglang/srt/entrypoints/openai/protocol.py`). Chat prompts go through the
tokenizer's chat template (transformers' `apply_chat_template`, with `chat_template_kwargs`). `stream: true` answers
with server-sent events (OpenAI's chunk objects, `data: [DONE]` last); a client that disconnects aborts the request,
which frees its KV pages. Completions' `echo` puts the prompt's text, and with `logprobs` its tokens' log-probs, in
front of each choice's (completion_layout.py; what lm-evaluation-harness' `local-completions` model sends to score
a continuation).

A request the models refuse, or this module does, gets a 400 that names the field. Every error uses OpenAI's body,
`{"error": {"message", "type", "param", "code"}}`, so the `openai` client raises its typed errors
(`BadRequestError`, `NotFoundError`, ...). The model name must be the served one (`/v1/models`) or SGLang's
default, `default`; with LoRA adapters served (served_loras.py), SGLang's `base:adapter` names an adapter, as does a
loaded adapter's name alone (its `/v1/models` id), else the request's `lora_path` does (`adapter_of`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from miles_contracts import GenerateRequest, GenerateResponse
from miles_rollout.completion_layout import completion_logprobs, echo_texts, with_prompt
from miles_rollout.disconnect import unless_disconnected
from miles_rollout.engine import Engine
from miles_rollout.engine_error import EngineError
from miles_rollout.openai_requests import DEFAULT_MODEL_NAME, ChatCompletionRequest, CompletionRequest
from miles_rollout.streaming import StreamEvent

# `chat_template_kwargs` a request may set: the switches models' templates read (Qwen3's enable_thinking, DeepSeek
# V3.1's thinking, gpt-oss' reasoning_effort). Anything else could reach into the template's rendering.
TEMPLATE_SWITCHES = ("enable_thinking", "thinking", "reasoning_effort")


def sse(payload: bytes | str) -> bytes:
    """One server-sent event carrying `payload` (JSON text, or `[DONE]`)."""
    return b"data: " + (payload.encode() if isinstance(payload, str) else payload) + b"\n\n"


class OpenAIError(Exception):
    """A request the `/v1` routes refuse; answered in OpenAI's error body."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.status_code, self.param, self.code = message, status_code, param, code
        self.headers = headers or {}

    @classmethod
    def of(cls, error: EngineError) -> OpenAIError:
        """The engine's refusal in OpenAI's body (a 429 keeps its Retry-After)."""
        return cls(error.message, error.status_code, headers=error.headers)

    def response(self) -> JSONResponse:
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
            self.status_code, "invalid_request_error" if self.status_code < 500 else "server_error"
        )
        body = {"message": self.message, "type": kind, "param": self.param, "code": self.code or self.status_code}
        return JSONResponse({"error": body}, self.status_code, headers=self.headers)


def _describe(error: ValidationError) -> tuple[str, str | None]:
    """(message, the first offending field) of a validation error."""
    parts, param = [], None
    for item in error.errors():
        location = ".".join(str(p) for p in item.get("loc", ()) if not str(p)[:1].isupper())
        param = param or location or None
        message = str(item.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{location}: {message}" if location else message)
    return "; ".join(dict.fromkeys(parts)), param


async def _parse(request: Request, model: type[CompletionRequest | ChatCompletionRequest]) -> Any:
    try:
        payload = json.loads(await request.body())
    except RecursionError as error:
        raise OpenAIError("the request body is nested too deeply") from error
    except ValueError as error:  # not JSON, not UTF-8, or an integer of over 4300 digits (Python's limit)
        raise OpenAIError(f"the request body is not valid JSON: {error}") from error
    if not isinstance(payload, dict):
        raise OpenAIError("the request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        message, param = _describe(error)
        raise OpenAIError(message, param=param) from error
    except RecursionError as error:
        raise OpenAIError("the request body is nested too deeply") from error


def _native(**fields: Any) -> GenerateRequest:
    """The native request; a value the native API refuses (e.g. `top_k: 0`) is the client's 400."""
    try:
        return GenerateRequest.model_validate(fields)
    except ValidationError as error:
        message, param = _describe(error)
        raise OpenAIError(message, param=param) from error


def _usage(responses: list[GenerateResponse], n: int) -> dict[str, int]:
    """OpenAI's usage: each prompt counted once (its n samples share it), every sample's completion tokens."""
    prompt = sum(r.meta_info.prompt_tokens for r in responses[::n])
    completion = sum(r.meta_info.completion_tokens for r in responses)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish(response: GenerateResponse) -> tuple[str | None, int | str | None]:
    finish = response.meta_info.finish_reason
    return (finish.type, finish.matched) if finish is not None else (None, None)


def _new_logprobs(response: GenerateResponse, start: int) -> tuple[list[Any], list[Any]]:
    """The response's output log-prob entries and top alternatives from token `start` on."""
    entries = response.meta_info.output_token_logprobs or []
    tops = response.meta_info.output_top_logprobs or [None] * len(entries)
    return list(entries[start:]), list(tops[start:])


def _chat_logprobs(entries: list[Any], tops: list[Any]) -> dict[str, Any]:
    """The chat layout: per token {token, bytes, logprob, top_logprobs: [{token, bytes, logprob}]}."""

    def item(logprob: float | None, text: str | None) -> dict[str, Any]:
        token = text or ""
        return {"token": token, "bytes": list(token.encode("utf-8")), "logprob": logprob}

    return {
        "content": [
            {**item(logprob, text), "top_logprobs": [item(lp, t) for lp, _, t in top or []]}
            for (logprob, _, text), top in zip(entries, tops, strict=True)
        ]
    }


async def _openai_stream(
    events: AsyncIterator[StreamEvent],
    body: CompletionRequest | ChatCompletionRequest,
    chat: bool,
    observe: Callable[[GenerateResponse], None],
    echo: list[str] | None = None,
) -> AsyncIterator[bytes]:
    """OpenAI's stream: per new token of a sample (or several, for a client that reads slower than the engine
    writes) a chunk with its text delta (chat: `delta.content`, the first one with `role`) and, when asked, the new
    tokens' log-probs; its last chunk has `finish_reason`; with `stream_options.include_usage`, a chunk with `usage`
    and no choices; then `data: [DONE]`. The engine's events are deltas already; a sample's last one, its final
    response, sends what its deltas did not. With `echo` (each prompt's text), a sample's first chunk starts with
    its prompt: the text, and the prompt's log-prob entries (its first delta, or its final response, holds them)."""
    chunk_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    head = {"id": chunk_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": body.model}  # fmt: skip
    wants_logprobs = bool(body.logprobs) if chat else body.logprobs is not None
    sent_text: dict[int, list[str]] = {}  # each sample's text sent so far, in pieces (joined once, at its end)
    sent_tokens: dict[int, int] = {}
    sent_chars: dict[int, int] = {}
    started: set[int] = set()
    finals: dict[int, GenerateResponse] = {}
    try:
        async for event in events:
            index, response = event.index, event.final
            pieces = sent_text.setdefault(index, [])
            start = sent_tokens.get(index, 0)
            if response is None:
                assert event.delta is not None
                delta = event.delta.text
                entries = event.delta.output_token_logprobs or []
                tops: list[Any] = event.delta.output_top_logprobs or [None] * len(entries)
                finish: tuple[str | None, int | str | None] = (None, None)
            else:
                done = "".join(pieces)
                delta = response.text[len(done) :] if response.text.startswith(done) else ""  # streamed: a prefix
                entries, tops = _new_logprobs(response, start)
                finish = _finish(response)
                finals[index] = response
                observe(response)
            pieces.append(delta)
            sent_tokens[index] = start + len(entries)
            echoed = echo[index // body.n] if echo is not None and index not in started else None
            offset = sent_chars.get(index, len(echoed or ""))
            sent_chars[index] = offset + sum(len(text or "") for _, _, text in entries)
            if response is None and not delta and not entries and echoed is None:  # an echoing first chunk goes
                continue
            choice: dict[str, Any] = {"index": index, "finish_reason": finish[0], "matched_stop": finish[1]}
            if chat:
                role = {} if index in started else {"role": "assistant"}  # in the sample's first chunk
                choice["delta"] = {**role, "content": delta}
                choice["logprobs"] = _chat_logprobs(entries, tops) if wants_logprobs else None
            else:
                choice["text"] = delta if echoed is None else echoed + delta
                logprobs = completion_logprobs(entries, tops, offset) if wants_logprobs else None
                if logprobs is not None and echoed is not None:
                    logprobs = with_prompt(event.delta if response is None else response.meta_info, logprobs)
                choice["logprobs"] = logprobs
            started.add(index)
            yield sse(json.dumps({**head, "choices": [choice]}))
        if body.stream_options is not None and body.stream_options.include_usage:
            ordered = [finals[i] for i in sorted(finals)]
            yield sse(json.dumps({**head, "choices": [], "usage": _usage(ordered, body.n)}))
    except EngineError as error:
        yield sse(json.dumps({"error": {"message": error.message, "type": "server_error", "param": None,
                                        "code": error.status_code}}))  # fmt: skip
    yield sse("[DONE]")


def template_kwargs(given: dict[str, Any] | None, allow_client_chat_template: bool) -> dict[str, Any]:
    """The `chat_template_kwargs` passed to the template: the switches in `TEMPLATE_SWITCHES`, as scalars, and a
    client's own `chat_template` only where the server allows it; anything else is a 400 naming the key."""
    kwargs: dict[str, Any] = {}
    for key, value in (given or {}).items():
        if key == "chat_template":
            if not allow_client_chat_template:
                raise OpenAIError(
                    "chat_template_kwargs.chat_template: this server renders its model's own chat template; a "
                    "client's template needs a server started with --allow-client-chat-template",
                    param="chat_template_kwargs",
                )
            if not isinstance(value, str):
                raise OpenAIError("chat_template_kwargs.chat_template must be a string", param="chat_template_kwargs")
        elif key not in TEMPLATE_SWITCHES:
            raise OpenAIError(
                f"chat_template_kwargs.{key[:64]} is not a template switch this server passes on; use "
                f"{', '.join(TEMPLATE_SWITCHES)}",
                param="chat_template_kwargs",
            )
        elif not (
            value is None or isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= 64)
        ):
            raise OpenAIError(f"chat_template_kwargs.{key} must be a boolean, a number or a short string",
                              param="chat_template_kwargs")  # fmt: skip
        kwargs[key] = value
    return kwargs


def register_openai_routes(
    app: FastAPI,
    engine: Engine,
    model_name: str | None = None,
    observe: Callable[[GenerateResponse], None] | None = None,
    allow_client_chat_template: bool = False,
) -> None:
    """Add the `/v1` routes to `app`; `model_name`: the served model name (default: the model path); `observe`:
    called with each finished sample (the server's metrics); `allow_client_chat_template`: requests may bring
    their own `chat_template` in `chat_template_kwargs`."""
    count = observe or (lambda _: None)
    served = model_name or engine.model_path
    created = int(time.time())

    def loaded() -> dict[str, str]:
        return engine.loras.loaded() if engine.loras is not None else {}

    def not_found(name: str) -> OpenAIError:
        adapters = f" and the LoRA adapters {sorted(loaded())}" if loaded() else ""
        return OpenAIError(f"the model {name!r} does not exist: this server serves {served!r}{adapters} "
                           "(GET /v1/models)", 404, param="model", code="model_not_found")  # fmt: skip

    def check_model(name: str) -> None:
        if name not in (served, DEFAULT_MODEL_NAME):
            raise not_found(name)

    def adapter_of(body: CompletionRequest | ChatCompletionRequest) -> str | list[str | None] | None:
        """The LoRA adapter a request names, SGLang's rule (`_parse_model_parameter`): `model` as `base:adapter`
        (the served name matched whole first, so one with a colon still works) wins over the body's `lora_path`.
        Miles also takes a loaded adapter's name alone (its `/v1/models` id, as vLLM does; SGLang serves the base
        model then). Another model is a 404; an adapter that is not loaded, the engine's 400 naming the loaded ones."""
        name = body.model
        if name in (served, DEFAULT_MODEL_NAME):
            return body.lora_path
        if name in loaded():
            return name
        if ":" not in name:
            raise not_found(name)
        base, adapter = (served, name[len(served) + 1 :]) if name.startswith(f"{served}:") else name.split(":", 1)
        if base.strip() not in (served, DEFAULT_MODEL_NAME):
            raise not_found(name)
        return adapter.strip() or body.lora_path

    async def run(request: Request, body: GenerateRequest) -> list[GenerateResponse]:
        try:
            responses = await unless_disconnected(request, engine.generate(body))
        except EngineError as error:
            raise OpenAIError.of(error) from error
        for response in responses:
            count(response)
        return responses

    async def answer(
        request: Request,
        native: GenerateRequest,
        body: CompletionRequest | ChatCompletionRequest,
        echo: list[str] | None = None,
    ) -> Response:
        """The route's answer to `native`: a stream, or one completion object with a choice per sample; `echo`: each
        prompt's text, to put in front of its choices' (with their prompt's log-probs, when asked)."""
        if body.stream:
            return await stream(native, body, echo)
        responses = await run(request, native)
        chat = isinstance(body, ChatCompletionRequest)
        choices = []
        for index, response in enumerate(responses):
            finish, matched = _finish(response)
            choice: dict[str, Any] = {"index": index, "finish_reason": finish, "matched_stop": matched}
            entries, tops = _new_logprobs(response, 0)
            if chat:
                choice["message"] = {"role": "assistant", "content": response.text}
                choice["logprobs"] = _chat_logprobs(entries, tops) if body.logprobs else None
            else:
                echoed = echo[index // body.n] if echo is not None else ""
                choice["text"] = echoed + response.text
                logprobs = completion_logprobs(entries, tops, len(echoed)) if body.logprobs is not None else None
                if logprobs is not None and echo is not None:
                    logprobs = with_prompt(response.meta_info, logprobs)
                choice["logprobs"] = logprobs
            choices.append(choice)
        return JSONResponse({
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": body.model, "choices": choices, "usage": _usage(responses, body.n),
        })  # fmt: skip

    async def stream(
        native: GenerateRequest, body: CompletionRequest | ChatCompletionRequest, echo: list[str] | None
    ) -> StreamingResponse:
        try:
            events = await engine.generate_stream(native)  # bad input raises here: a 4xx, not a broken stream
        except EngineError as error:
            raise OpenAIError.of(error) from error
        chat = isinstance(body, ChatCompletionRequest)
        return StreamingResponse(_openai_stream(events, body, chat, count, echo), media_type="text/event-stream")

    def card() -> dict[str, Any]:
        return {"id": served, "object": "model", "created": created, "owned_by": "miles", "root": engine.model_path,
                "parent": None, "max_model_len": engine.context_length}  # fmt: skip

    def adapter_card(name: str, path: str) -> dict[str, Any]:
        """A loaded LoRA adapter, as SGLang lists one: its directory as `root`, the served model as `parent`."""
        return {"id": name, "object": "model", "created": created, "owned_by": "miles", "root": path,
                "parent": served, "max_model_len": None}  # fmt: skip

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, error: OpenAIError) -> JSONResponse:
        return error.response()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card(), *(adapter_card(name, path) for name, path in loaded().items())]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        adapters = loaded()
        if name in adapters:
            return adapter_card(name, adapters[name])
        check_model(name)
        return card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = await _parse(request, CompletionRequest)
        adapter = adapter_of(body)
        prompt = body.prompt
        if isinstance(prompt, list) and not prompt:
            raise OpenAIError("prompt is empty; send a string, a list of strings or token ids", param="prompt")
        kind = "input_ids" if isinstance(prompt, list) and isinstance(prompt[0], (int, list)) else "text"
        # echo with logprobs: the prompt's log-probs too, from its first token (SGLang's logprob_start_len)
        native = _native(**{kind: prompt}, sampling_params=body.sampling_params(body.max_tokens),
                         return_logprob=body.logprobs is not None, top_logprobs_num=body.logprobs or 0,
                         logprob_start_len=0 if body.echo and body.logprobs is not None else -1,
                         return_text_in_logprobs=True, rid=body.rid, lora_path=adapter)  # fmt: skip
        try:  # before the generation starts: a prompt that cannot be echoed is refused, not half-streamed
            echo = await echo_texts(engine, prompt, body.skip_special_tokens) if body.echo else None
        except EngineError as error:
            raise OpenAIError.of(error) from error
        return await answer(request, native, body, echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        adapter = adapter_of(body)
        if engine.tokenizer is None:
            raise OpenAIError("this model has no tokenizer, so chat messages cannot be rendered: use /generate")
        if not getattr(engine.tokenizer, "chat_template", None):
            raise OpenAIError("the model's tokenizer has no chat template: use /v1/completions with a prompt")
        kwargs = template_kwargs(body.chat_template_kwargs, allow_client_chat_template)
        messages = [m.as_template_input() for m in body.messages]

        def render(tokenizer: Any) -> Any:
            return tokenizer.apply_chat_template(
                messages,
                tokenize=True,
                add_generation_prompt=not body.continue_final_message,
                continue_final_message=body.continue_final_message,
                return_dict=False,
                **kwargs,
            )

        try:  # in the intake pool, off the event loop, within the intake time limit
            input_ids = await engine.intake.run_in_pool(render, "rendering the chat template")
        except EngineError as error:
            raise OpenAIError.of(error) from error
        except Exception as error:  # a template that raises on these messages is the request's problem
            raise OpenAIError(f"the chat template cannot render these messages: {error}", param="messages") from error
        max_tokens = body.max_completion_tokens or body.max_tokens
        native = _native(input_ids=list(input_ids), sampling_params=body.sampling_params(max_tokens),
                         return_logprob=body.logprobs, top_logprobs_num=body.top_logprobs or 0,
                         return_text_in_logprobs=True, rid=body.rid, lora_path=adapter)  # fmt: skip
        return await answer(request, native, body)

"""What a rollout server's replies look like to `Client` (client.py): `RolloutClientError`, the server's own error
text out of FastAPI's, SGLang's or a proxy's bodies, and weight versions as SGLang writes them (strings on the wire,
"default" before the first named update)."""

from __future__ import annotations

import functools
from typing import Any

import httpx

from miles_contracts import WeightVersion, reported_weight_version, weight_version_value

# Error pages (an HTML 502 from a proxy) can be large; the message only needs their start.
MAX_MESSAGE_CHARS = 2000


class RolloutClientError(RuntimeError):
    """A rollout-server call failed: an HTTP error, a `"success": false` reply, a timeout or no connection.

    `status_code` is None when no HTTP response arrived. `message` is the server's own message when it sent one.
    """

    def __init__(self, message: str, *, endpoint: str, status_code: int | None = None) -> None:
        self.message = message
        self.endpoint = endpoint
        self.status_code = status_code
        status = f" (HTTP {status_code})" if status_code is not None else ""
        super().__init__(f"{endpoint} failed{status}: {message}")

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # The default reduce re-calls __init__ with the formatted text only; keep the fields when the error is
        # pickled (e.g. raised inside a Ray actor that calls an engine).
        rebuild = functools.partial(type(self), endpoint=self.endpoint, status_code=self.status_code)
        return rebuild, (self.message,)


def format_detail(detail: Any) -> str:
    # FastAPI's 422 puts a list of {"loc": [...], "msg": ...} under "detail"; name each field it complains about.
    if isinstance(detail, list):
        parts = []
        for item in detail:
            if isinstance(item, dict) and "msg" in item:
                loc = ".".join(str(part) for part in item.get("loc", ()))
                parts.append(f"{loc}: {item['msg']}" if loc else str(item["msg"]))
            else:
                parts.append(str(item))
        return "; ".join(parts)
    return str(detail)


def server_message(response: httpx.Response) -> str:
    """The server's own error text: `detail` (FastAPI), `message`, `error_message` or `error.message` (SGLang), else
    the raw body."""
    try:
        body = response.json()
    except ValueError:
        body = None
    message: str | None = None
    if isinstance(body, dict):
        error = body.get("error")
        if body.get("detail") is not None:
            message = format_detail(body["detail"])
        elif isinstance(body.get("message"), str):
            message = body["message"]
        elif isinstance(body.get("error_message"), str):  # SGLang's LoRAUpdateOutput
            message = body["error_message"]
        elif isinstance(error, dict) and isinstance(error.get("message"), str):
            message = error["message"]
        elif isinstance(error, str):
            message = error
    if message is None:
        message = response.text.strip() or response.reason_phrase or "(empty response)"
    return message[:MAX_MESSAGE_CHARS]


def int_version(reply: dict[str, Any]) -> dict[str, Any]:
    """A weight-update reply with its `weight_version` (a string on the wire, as in SGLang) parsed."""
    if "weight_version" in reply:
        reply["weight_version"] = reported_weight_version(reply["weight_version"])
    return reply


def version_field(version: WeightVersion) -> str | None:
    # SGLang declares weight_version as Optional[str] and its request parsing does not turn numbers into strings;
    # a decimal string is accepted by SGLang and by a server that parses the field as an int.
    value = weight_version_value(version)
    return None if value is None else str(value)

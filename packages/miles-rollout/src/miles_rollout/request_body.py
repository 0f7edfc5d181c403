"""Request bodies of the native (SGLang) routes: JSON parsed into a pydantic model, and every way it can be wrong
answered as a 400 that names the field (`parse_body`), never a 500: not JSON, not UTF-8, nested too deeply, an
integer past Python's digit limit, a field of the wrong type.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from miles_contracts import GenerateRequest

logger = logging.getLogger("miles_rollout.server")
_IGNORED_LOGGED: set[str] = set()


def describe_errors(error: ValidationError | RequestValidationError) -> str:
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


async def parse_body(request: Request, model: type[BaseModel], allow_empty: bool = False) -> Any:
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
        raise HTTPException(400, describe_errors(error)) from error
    except RecursionError as error:
        raise HTTPException(400, "request body is nested too deeply") from error
    if model is GenerateRequest and isinstance(payload, dict):
        _log_ignored(GenerateRequest.ignored_keys(payload))
    return parsed


def _log_ignored(keys: list[str]) -> None:
    """SGLang ignores top-level keys it does not know (routers add their own, e.g. `model`); so does this server,
    saying so once per key at debug level."""
    for key in keys:
        if key not in _IGNORED_LOGGED:
            _IGNORED_LOGGED.add(key)
            logger.debug("ignoring the /generate field %r, unknown to SGLang's API", key)

"""Weight versions as SGLang's API carries them (a string, "default" before the first named update) and as Miles
counts them (the orchestrator's policy step, an int): reading a client's, reading a server's, writing one."""

from __future__ import annotations

from typing import Any

WeightVersion = int | str | None  # the orchestrator's policy step, another client's label, or None ("default")
MAX_WEIGHT_VERSION_CHARS = 256  # a weight version label's length limit (SGLang sets none)


def weight_version_value(value: Any) -> WeightVersion:
    """A weight version as a client names it (SGLang: any string): None or "default" (unnamed), an int >= 0 or a
    string of digits as the int (the orchestrator's policy step), any other label as it is; a ValueError otherwise."""
    if value is None or value == "default":
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"weight_version must be a string (or an int >= 0), got {value!r}")
    if isinstance(value, int) or (value.isascii() and value.isdigit()):
        if int(value) < 0:
            raise ValueError(f"weight_version must be a string or an int >= 0, got {value!r}")
        return int(value)
    if not value or len(value) > MAX_WEIGHT_VERSION_CHARS or not value.isprintable():
        raise ValueError(
            f"weight_version must be 1 to {MAX_WEIGHT_VERSION_CHARS} printable characters, got {len(value)} characters"
        )
    return value


def reported_weight_version(value: Any) -> WeightVersion:
    """A weight version as a server reports it (SGLang: a string, "default" until the first named update): digits
    as the int (the orchestrator's policy step), "default" as None, any other label as it is; anything else
    (a bool, a malformed body) None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        return None if value == "default" else int(value) if value.isascii() and value.isdigit() else value
    return None


def version_string(version: WeightVersion) -> str:
    """A weight version as SGLang's API carries it: a string, "default" before the first named update."""
    return "default" if version is None else str(version)

"""`EngineError`: a request the engine refuses, with the HTTP status the server answers."""

from __future__ import annotations


class EngineError(Exception):
    """A request the engine cannot serve; `status_code` is the HTTP status the server answers with."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code

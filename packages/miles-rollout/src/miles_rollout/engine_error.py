"""`EngineError`: a request the engine refuses, with the HTTP status the server answers."""

from __future__ import annotations


class EngineError(Exception):
    """A request the engine cannot serve; `status_code` is the HTTP status the server answers with."""

    def __init__(self, message: str, status_code: int = 400, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.retry_after_s = retry_after_s  # a 429's Retry-After (seconds)

    @property
    def headers(self) -> dict[str, str]:
        """The HTTP headers the answer carries (Retry-After on a 429)."""
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}

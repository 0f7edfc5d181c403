"""The rollout server's HTTP guards: an ASGI middleware in front of every route of `create_app` (server.py) that
checks a request before any route reads it, in this order:

1. Host allow-list (400): stops DNS rebinding, where a web page whose name resolves to 127.0.0.1 reads the server
   as its own origin (`/weight_buckets`, `/generate`). Health probes are exempt.
2. Keys (401 / 403): the server's `authorize` check (which key opens which route).
3. Cross-site browser requests (403) to state-changing routes (every non-GET method, and the admin GETs): an
   `Origin` that is neither the request's own host nor an allowed host, or `Sec-Fetch-Site: cross-site / same-site`.
   Programmatic clients (httpx, requests, sglang-router, the openai client) send neither header.
4. Content type (415): a POST with a body is JSON (`application/json`), the weight-bucket route's body
   `application/octet-stream`. A POST with an empty body and no content type passes (SGLang's clients send
   `/flush_cache`, `/pause_generation` and the like bare). A browser page cannot send JSON or octet-stream to another
   origin without a CORS preflight, which this server never grants.
5. Body size (413): `Content-Length` up front, then the bytes as they arrive (a chunked body): nothing past the limit
   is buffered.

Refusals go through `refuse(path, status, message)`, so the `/v1` routes answer in OpenAI's error body.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Collection
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

Refuse = Callable[[str, int, str], Response]
Authorize = Callable[[str, Headers], tuple[int, str] | None]

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
JSON_TYPE = "application/json"
BUCKET_TYPE = "application/octet-stream"
CROSS_SITE = frozenset({"cross-site", "same-site"})  # Sec-Fetch-Site values of a page on another origin


class BodyRefused(Exception):
    """A request body refused while it is read (too large, or a body where none was announced); answered with
    `status` by the server's exception handler."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def is_loopback(host: str) -> bool:
    """Whether a bind address (or Host name) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_authority(authority: str) -> tuple[str, str | None]:
    """A Host header (or allow-list entry) as (name, port): `[::1]:8000` -> (`::1`, `8000`), `Example.com` ->
    (`example.com`, None)."""
    authority = authority.strip().lower()
    if authority.startswith("["):  # an IPv6 literal
        name, _, rest = authority[1:].partition("]")
        return name, rest.removeprefix(":") or None
    if authority.count(":") == 1:
        name, _, port = authority.partition(":")
        return name, port or None
    return authority, None  # a name, or a bare IPv6 address in an allow-list entry


HostList = tuple[tuple[str, str | None], ...]  # (name, port); a port of None: any port


def effective_hosts(allowed_hosts: Collection[str] | None, bind_host: str) -> HostList | None:
    """The Host allow-list as (name, port or None for any port); None: any host. `allowed_hosts` None: the loopback
    names and the bound address on a loopback bind, any host otherwise; `["*"]`: any host."""
    if allowed_hosts is None:
        if not is_loopback(bind_host):
            return None
        names = dict.fromkeys([*LOOPBACK_NAMES, split_authority(bind_host)[0]])  # e.g. 127.0.0.2
        return tuple((name, None) for name in names)
    if "*" in allowed_hosts:
        return None
    return tuple(split_authority(entry) for entry in allowed_hosts)


def host_matches(authority: str, allowed: HostList) -> bool:
    name, port = split_authority(authority)
    return any(name == allowed_name and allowed_port in (None, port) for allowed_name, allowed_port in allowed)


class HttpGuards:
    """The ASGI middleware (see the module docstring). `admin_paths`: the admin GET routes that count as
    state-changing; `bucket_path`: the route whose body is a weight bucket (`max_bucket_bytes`, octet-stream)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        refuse: Refuse,
        authorize: Authorize,
        allowed_hosts: HostList | None,
        exempt_paths: Collection[str],
        admin_paths: Collection[str],
        bucket_path: str,
        max_request_bytes: int,
        max_bucket_bytes: int,
    ) -> None:
        self.app, self.refuse, self.authorize = app, refuse, authorize
        self.allowed_hosts, self.exempt_paths, self.admin_paths = allowed_hosts, exempt_paths, admin_paths
        self.bucket_path = bucket_path
        self.max_request_bytes, self.max_bucket_bytes = max_request_bytes, max_bucket_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method, headers = scope["path"], scope["method"], Headers(scope=scope)
        refused = self.check(path, method, headers)
        if refused is not None:
            await self.refuse(path, *refused)(scope, receive, send)
            return
        await self.app(scope, self.counted(path, method, headers, receive), send)

    def check(self, path: str, method: str, headers: Headers) -> tuple[int, str] | None:
        """(status, reason) of a refusal decided from the request line and headers, else None."""
        is_state_changing = method not in SAFE_METHODS or path in self.admin_paths
        return (
            self.wrong_host(path, headers)
            or self.authorize(path, headers)
            or (self.cross_site(headers) if is_state_changing else None)
            or (self.content_type(path, headers) if method == "POST" else None)
            or self.too_large(path, headers)
        )

    def wrong_host(self, path: str, headers: Headers) -> tuple[int, str] | None:
        host = headers.get("host")  # absent only from a non-browser HTTP/1.0 client
        if self.allowed_hosts is None or host is None or path in self.exempt_paths:
            return None
        if host_matches(host, self.allowed_hosts):
            return None
        names = ", ".join(f"[{name}]" if ":" in name else name for name, _ in self.allowed_hosts)
        return 400, (
            f"Host {host[:100]!r} is not one this server answers (DNS rebinding guard): connect by one of {names}, "
            "or start the server with --allowed-hosts"
        )

    def too_large(self, path: str, headers: Headers) -> tuple[int, str] | None:
        length, limit = headers.get("content-length", ""), self.limit(path)
        if length.isdigit() and int(length) > limit:
            return 413, f"the request body is {int(length)} bytes, over this route's limit of {limit} bytes"
        return None

    def cross_site(self, headers: Headers) -> tuple[int, str] | None:
        """A 403 for a browser request from a page of another site (the browser says so in `Sec-Fetch-Site`, or in
        an `Origin` that is not this server)."""
        if headers.get("sec-fetch-site", "").lower() in CROSS_SITE:
            return 403, "cross-site browser requests are refused on this route (Sec-Fetch-Site)"
        origin = headers.get("origin")
        if origin is None:
            return None
        authority = urlsplit(origin).netloc if origin != "null" else ""
        is_own = authority != "" and authority.lower() == headers.get("host", "").lower()
        is_allowed = authority != "" and self.allowed_hosts is not None and host_matches(authority, self.allowed_hosts)
        if is_own or is_allowed:
            return None
        return 403, f"cross-origin browser requests are refused on this route (Origin {origin[:100]!r})"

    def content_type(self, path: str, headers: Headers) -> tuple[int, str] | None:
        given = headers.get("content-type")
        if given is None:
            return None  # a body is refused as it arrives (`counted`): an empty POST passes
        media_type = given.partition(";")[0].strip().lower()
        # The bucket route also takes JSON, to refuse SGLang's pickled-tensor JSON body with its own 400.
        accepted = (BUCKET_TYPE, JSON_TYPE) if path == self.bucket_path else (JSON_TYPE,)
        if media_type in accepted:
            return None
        return 415, f"Content-Type {given[:100]!r} is not accepted here: send {accepted[0]}"

    def limit(self, path: str) -> int:
        return self.max_bucket_bytes if path == self.bucket_path else self.max_request_bytes

    def counted(self, path: str, method: str, headers: Headers, receive: Receive) -> Receive:
        """`receive`, raising `BodyRefused` once the body passes the route's limit, or when a POST without a content
        type turns out to have a body."""
        limit = self.limit(path)
        needs_type = method == "POST" and "content-type" not in headers
        expected = BUCKET_TYPE if path == self.bucket_path else JSON_TYPE
        num_bytes = 0

        async def receive_counted() -> Message:
            nonlocal num_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > limit:
                    raise BodyRefused(413, f"the request body is over this route's limit of {limit} bytes")
                if num_bytes and needs_type:
                    raise BodyRefused(415, f"a request body needs a Content-Type: send {expected}")
            return message

        return receive_counted

"""Multi-process tier: the rollout server's HTTP guards against real `miles-rollout serve` processes over real HTTP
— the Host allow-list (DNS rebinding), cross-site browser requests, content types, body-size limits
(Content-Length and chunked), keys from a file or the environment (and `--dp-size` passing them to its engines off
every command line), and malformed bytes that are a 4xx, never a 5xx. The guards' host and origin rules are also
checked as pure logic."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.datastructures import Headers

from miles_rollout import free_port
from miles_rollout.cli import parse_serve, resolve_keys
from miles_rollout.config import ServeConfig
from miles_rollout.http_guards import HttpGuards, effective_hosts, host_matches, split_authority
from miles_rollout.launch import launch_server

API_KEY, ADMIN_KEY = f"api-{secrets.token_hex(8)}", f"admin-{secrets.token_hex(8)}"
USER = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
JSON = {"Content-Type": "application/json"}
REQUEST_LIMIT, BUCKET_LIMIT = 100_000, 300_000
PROBE = {"input_ids": [3, 1, 4], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def key_file(directory: Path, key: str) -> Path:
    path = directory / "key"
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def guarded(dense_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server whose API key comes from a file and whose admin key from the environment, with small body limits."""
    flags = ("--page-size", "16", "--num-kv-pages", "512", "--deterministic",
             "--api-key-file", str(key_file(tmp_path_factory.mktemp("keys"), API_KEY)),
             "--max-request-bytes", str(REQUEST_LIMIT), "--max-bucket-bytes", str(BUCKET_LIMIT))  # fmt: skip
    with launch_server(dense_dir, *flags, env={"OMP_NUM_THREADS": "1"}, admin_key=ADMIN_KEY) as url:
        yield url


def post(url: str, path: str, content: bytes | Iterator[bytes] = b"", /, **headers: str) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=60)


def test_keys_from_a_file_and_the_environment(guarded: str) -> None:
    body = json.dumps(PROBE).encode()
    assert post(guarded, "/generate", body, **JSON).status_code == 401
    assert post(guarded, "/generate", body, **JSON, **USER).status_code == 200
    assert post(guarded, "/flush_cache", **USER).status_code == 401  # the API key is not the admin key
    assert post(guarded, "/flush_cache", **ADMIN).status_code == 200


@pytest.mark.parametrize("token", ["Bearer é".encode(), b"Bearer \xff\xfe", "Bearer ключ".encode()])
@pytest.mark.parametrize("path", ["/generate", "/flush_cache", "/v1/completions"])
def test_a_non_ascii_authorization_is_a_401(guarded: str, token: bytes, path: str) -> None:
    """hmac.compare_digest refuses str with non-ASCII characters (a TypeError: it was a 500)."""
    headers = {b"Content-Type": b"application/json", b"Authorization": token}
    response = httpx.post(f"{guarded}{path}", content=b"{}", headers=headers, timeout=60)
    assert response.status_code == 401, response.text
    assert ("error" if path.startswith("/v1/") else "detail") in response.json()


def test_resolve_keys_from_flag_file_or_environment(tmp_path: Path) -> None:
    base = ServeConfig(model_path="m")
    file = key_file(tmp_path, "from-file")
    assert resolve_keys(base.model_copy(update={"api_key": "flag"}), {"MILES_API_KEY": "env"}).api_key == "flag"
    from_file = resolve_keys(base.model_copy(update={"api_key_file": str(file)}), {"MILES_API_KEY": "env"})
    assert from_file.api_key == "from-file" and from_file.api_key_file is None
    from_env = resolve_keys(base, {"MILES_API_KEY": "env-key", "MILES_ADMIN_KEY": " admin "})
    assert (from_env.api_key, from_env.admin_key) == ("env-key", "admin")
    assert resolve_keys(base, {}).api_key is None
    with pytest.raises(ValueError, match="not both"):
        resolve_keys(base.model_copy(update={"admin_key": "a", "admin_key_file": str(file)}), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="first line is empty"):
        resolve_keys(base.model_copy(update={"api_key_file": str(tmp_path / "empty")}), {})
    with pytest.raises(ValueError, match="missing"):
        resolve_keys(base.model_copy(update={"api_key_file": str(tmp_path / "missing")}), {})
    with pytest.raises(ValueError, match="MILES_ADMIN_KEY is set but empty"):
        resolve_keys(base, {"MILES_ADMIN_KEY": ""})


def test_serve_refuses_a_bad_key_file_at_start_up(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "miles_rollout.cli", "serve", "--model", "m", "--api-key-file",
               str(tmp_path / "missing")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--api-key-file" in result.stderr
    help_text = subprocess.run([*command[:4], "--help"], capture_output=True, text=True, timeout=120).stdout
    assert "Visible in `ps`" in help_text and "MILES_API_KEY" in help_text


@pytest.mark.parametrize(
    ("path", "content", "content_type", "status"),
    [
        ("/generate", json.dumps(PROBE), "text/plain", 415),  # what a cross-site <form> or fetch may send
        ("/generate", json.dumps(PROBE), "application/x-www-form-urlencoded", 415),
        ("/generate", json.dumps(PROBE), None, 415),  # a body without a type (a fetch of a Blob sends that)
        ("/generate", json.dumps(PROBE), "application/json; charset=utf-8", 200),
        ("/generate", json.dumps(PROBE), "Application/JSON", 200),
        ("/v1/completions", json.dumps({"prompt": [1, 2], "max_tokens": 1}), "text/plain", 415),
        ("/flush_cache", "", None, 200),  # SGLang's clients send the control calls bare
        ("/flush_cache", "", "text/plain", 415),
        ("/update_weights_from_tensor", "not a bucket", "text/plain", 415),
        ("/update_weights_from_tensor", "not a bucket", None, 415),
        ("/update_weights_from_tensor", "not a bucket", "application/octet-stream", 400),
        ("/update_weights_from_tensor", '{"serialized_named_tensors": []}', "application/json", 400),
    ],
)
def test_content_types(guarded: str, path: str, content: str, content_type: str | None, status: int) -> None:
    headers = {**ADMIN, **({"Content-Type": content_type} if content_type else {})}
    response = httpx.post(f"{guarded}{path}", content=content.encode(), headers=headers, timeout=60)
    assert response.status_code == status, response.text
    if status == 415:
        assert ("error" if path.startswith("/v1/") else "detail") in response.json()


def test_bare_control_calls_pass(guarded: str) -> None:
    """SGLang's clients (sglang-router's fan-out, `requests.post(url)`) send these with no body and no type."""
    for path in ("/pause_generation", "/continue_generation", "/release_memory_occupation",
                 "/resume_memory_occupation", "/begin_weight_update", "/end_weight_update"):  # fmt: skip
        assert post(guarded, path, **ADMIN).status_code == 200, path
    assert post(guarded, "/generate", json.dumps(PROBE).encode(), **JSON, **USER).status_code == 200


def chunks(total: int, size: int = 10_000) -> Iterator[bytes]:
    """A body sent chunked (no Content-Length): the server counts its bytes as they arrive."""
    for start in range(0, total, size):
        yield b" " * min(size, total - start)


def test_body_size_limits(guarded: str) -> None:
    padded = json.dumps(PROBE).encode().ljust(REQUEST_LIMIT, b" ")  # at the limit: served
    assert post(guarded, "/generate", padded, **JSON, **USER).status_code == 200
    over = post(guarded, "/generate", padded + b" ", **JSON, **USER)
    assert over.status_code == 413 and str(REQUEST_LIMIT) in over.json()["detail"]
    assert post(guarded, "/generate", chunks(REQUEST_LIMIT + 1), **JSON, **USER).status_code == 413
    chat = post(guarded, "/v1/chat/completions", chunks(2 * REQUEST_LIMIT), **JSON, **USER)
    assert chat.status_code == 413 and chat.json()["error"]["code"] == 413
    # The bucket route takes up to max_bucket_bytes: a body over the JSON limit reaches the bucket decoder.
    bucket = {"Content-Type": "application/octet-stream", **ADMIN}
    assert post(guarded, "/update_weights_from_tensor", b"x" * (2 * REQUEST_LIMIT), **bucket).status_code == 400
    assert post(guarded, "/update_weights_from_tensor", b"x" * (BUCKET_LIMIT + 1), **bucket).status_code == 413
    assert post(guarded, "/update_weights_from_tensor", chunks(BUCKET_LIMIT + 1), **bucket).status_code == 413
    assert post(guarded, "/generate", json.dumps(PROBE).encode(), **JSON, **USER).status_code == 200


def test_host_allow_list(guarded: str) -> None:
    port = guarded.rsplit(":", 1)[1]

    def get(path: str, host: str) -> int:
        return httpx.get(f"{guarded}{path}", headers={**ADMIN, "Host": host}, timeout=60).status_code

    # DNS rebinding: a page of evil.example, its name pointed at 127.0.0.1, reads the weights as its own origin.
    assert get("/weight_buckets", f"evil.example:{port}") == 400
    assert get("/get_model_info", "evil.example") == 400
    rebound = post(guarded, "/generate", json.dumps(PROBE).encode(), **JSON, **USER, Host="evil.example")
    assert rebound.status_code == 400 and "--allowed-hosts" in rebound.json()["detail"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert get("/get_model_info", host) == 200, host
    assert get("/health", "evil.example") == 200  # probes are exempt


def test_cross_site_browser_requests(guarded: str) -> None:
    body = json.dumps(PROBE).encode()
    evil = {"Origin": "https://evil.example"}
    assert post(guarded, "/generate", body, **JSON, **USER, **evil).status_code == 403
    assert post(guarded, "/flush_cache", **ADMIN, **evil).status_code == 403
    assert post(guarded, "/flush_cache", **ADMIN, Origin="null").status_code == 403  # a sandboxed frame
    for site in ("cross-site", "same-site"):
        assert post(guarded, "/flush_cache", **ADMIN, **{"Sec-Fetch-Site": site}).status_code == 403
        checksum = httpx.get(f"{guarded}/weights_checksum", headers={**ADMIN, "Sec-Fetch-Site": site}, timeout=60)
        assert checksum.status_code == 403  # an admin GET changes nothing, but reads what a page must not
    # The server's own pages (FastAPI's /docs) and a user typing a URL pass; so do read-only routes.
    own = {"Origin": guarded, "Sec-Fetch-Site": "same-origin"}
    assert post(guarded, "/flush_cache", **ADMIN, **own).status_code == 200
    assert post(guarded, "/flush_cache", **ADMIN, Origin="http://localhost:1234").status_code == 200  # an allowed host
    none = {**ADMIN, "Sec-Fetch-Site": "none"}
    assert httpx.get(f"{guarded}/weights_checksum", headers=none, timeout=60).status_code == 200
    info = httpx.get(f"{guarded}/get_model_info", headers={**USER, **evil, "Sec-Fetch-Site": "cross-site"}, timeout=60)
    assert info.status_code == 200


def test_malformed_json_is_a_400(guarded: str) -> None:
    deep = 40_000  # json.loads: RecursionError
    bodies = [
        b"1" * 5000,  # json.loads: ValueError, an integer of over 4300 digits
        b'{"input_ids": [' + b"7" * 5000 + b"]}",
        b"[" * deep + b"]" * deep,
        b'{"text": "hi", "custom_params": {"a": ' + b"[" * deep + b"]" * deep + b"}}",
        b'{"text": "\xff\xfe"}',  # not UTF-8
    ]
    for body in bodies:
        for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"):
            response = post(guarded, path, body, **JSON, **ADMIN)
            assert response.status_code == 400, (path, body[:40], response.text)
            assert ("error" if path.startswith("/v1/") else "detail") in response.json()
    # Nesting that json.loads takes is validated as usual.
    nested = {**PROBE, "custom_params": {"a": json.loads("[" * 200 + "]" * 200)}}
    assert post(guarded, "/generate", json.dumps(nested).encode(), **JSON, **USER).status_code < 500


# -- the guards' rules as pure logic ---------------------------------------------------------------------------


def test_host_rules() -> None:
    assert split_authority("[::1]:8000") == ("::1", "8000") and split_authority("Example.COM") == ("example.com", None)
    assert split_authority("::1") == ("::1", None)
    assert effective_hosts(None, "0.0.0.0") is None and effective_hosts(["*"], "127.0.0.1") is None
    loopback = effective_hosts(None, "127.0.0.1")
    assert loopback is not None and host_matches("localhost:9", loopback) and not host_matches("a.example", loopback)
    other_loopback = effective_hosts(None, "127.0.0.2")  # the bound address is allowed too
    assert other_loopback is not None and host_matches("127.0.0.2:80", other_loopback)
    explicit = effective_hosts(["rollout.internal", "gpu-3:8080"], "0.0.0.0")
    assert explicit is not None
    assert host_matches("rollout.internal:1", explicit) and host_matches("GPU-3:8080", explicit)
    assert not host_matches("gpu-3:8081", explicit) and not host_matches("localhost", explicit)
    config = parse_serve(["--model", "m", "--allowed-hosts", "rollout.internal", "gpu-3:8080"])
    assert config.allowed_hosts == ["rollout.internal", "gpu-3:8080"]


def test_origin_rules() -> None:
    def check(method: str, path: str, allowed: list[str] | None, bind: str, **headers: str) -> int | None:
        guards = HttpGuards(
            lambda *_: None,  # type: ignore[arg-type,return-value]
            refuse=lambda *_: None,  # type: ignore[arg-type,return-value]
            authorize=lambda *_: None,
            allowed_hosts=effective_hosts(allowed, bind),
            exempt_paths={"/health"},
            admin_paths={"/weight_buckets"},
            bucket_path="/update_weights_from_tensor",
            max_request_bytes=10,
            max_bucket_bytes=20,
        )
        refused = guards.check(path, method, Headers({k.replace("_", "-"): v for k, v in headers.items()}))
        return None if refused is None else refused[0]

    # Any host allowed (a non-loopback bind): an Origin must be the request's own host.
    own = "10.0.0.5:30000"
    assert check("POST", "/flush_cache", None, "0.0.0.0", host=own, origin=f"http://{own}") is None
    assert check("POST", "/flush_cache", None, "0.0.0.0", host=own, origin="http://evil.example") == 403
    assert check("GET", "/weight_buckets", None, "0.0.0.0", host="10.0.0.5", origin="http://evil.example") == 403
    assert check("GET", "/get_model_info", None, "0.0.0.0", host="10.0.0.5", origin="http://evil.example") is None
    # An explicit list: Origins of allowed hosts pass.
    allowed = ["rollout.internal"]
    assert check("POST", "/generate", allowed, "0.0.0.0", host="rollout.internal", origin="https://rollout.internal",
                 content_type="application/json") is None  # fmt: skip
    assert check("POST", "/generate", allowed, "0.0.0.0", host="10.0.0.5") == 400
    assert check("GET", "/health", allowed, "0.0.0.0", host="10.0.0.5") is None
    # Limits by route, from Content-Length.
    assert check("POST", "/generate", ["*"], "0.0.0.0", content_type="application/json", content_length="11") == 413
    assert check("POST", "/update_weights_from_tensor", ["*"], "0.0.0.0", content_type="application/octet-stream",
                 content_length="20") is None  # fmt: skip


# -- --dp-size: keys reach the engines off every command line ---------------------------------------------------


def command_lines() -> Iterator[bytes]:
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                yield (proc / "cmdline").read_bytes()


def test_dp_size_passes_keys_to_its_engines_off_the_command_line(dense_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("sglang_router")
    port = free_port()
    command = [sys.executable, "-m", "miles_rollout.cli", "serve", "--model-path", str(dense_dir), "--port", str(port),
               "--dp-size", "2", "--page-size", "16", "--num-kv-pages", "256", "--log-level", "warning",
               "--api-key-file", str(key_file(tmp_path, API_KEY))]  # fmt: skip
    env = {**os.environ, "MILES_ADMIN_KEY": ADMIN_KEY, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            with contextlib.suppress(httpx.HTTPError, KeyError):
                workers = httpx.get(f"{url}/workers", timeout=2).json()["workers"]
                if len(workers) == 2 and all(w["is_healthy"] for w in workers):
                    break
            assert time.monotonic() < deadline, "the router did not come up with two engines"
            time.sleep(0.3)
        leaked = [line for line in command_lines() if API_KEY.encode() in line or ADMIN_KEY.encode() in line]
        assert not leaked, leaked
        body = json.dumps(PROBE).encode()
        assert post(url, "/generate", body, **JSON).status_code == 401  # the router forwards the client's key
        assert post(url, "/generate", body, **JSON, **USER).status_code == 200
        for engine in [w["url"] for w in workers]:
            assert post(engine, "/flush_cache", **USER).status_code == 401
            assert post(engine, "/flush_cache", **ADMIN).status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=60)

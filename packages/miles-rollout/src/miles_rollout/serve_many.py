"""`miles-rollout serve --dp-size N`: N engines on one machine behind sglang-router, one command.

Each engine is a `miles-rollout serve` process of its own (one engine thread and KV cache each) on a free
127.0.0.1 port, with the same model, kernels and engine settings; sglang-router (`pip install sglang-router`, the
router SGLang and slime deploy) listens on `--host`/`--port` with the cache-aware policy, so prompts that share a
prefix go to the engine that caches it. Requests go to the router; weight updates and other admin calls go to each
engine (the router's `/workers` lists them, and they are printed at start-up). If an engine or the router exits,
the rest are stopped and the command fails; SIGINT / SIGTERM stop them all.

Keys: each engine gets the API and admin keys inside its config, which reaches the child process through
multiprocessing's pipe, never its command line or environment. The router gets none: it forwards each client's
`Authorization` header to the engine it picks, so generation needs the API key as on one engine, and its own
fan-out calls (`/flush_cache` through the router) are refused by engines with an admin key: send admin calls to each
engine. The router's own control routes (`/workers`) take no key, so it binds loopback only.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from miles_rollout.config import ServeConfig
from miles_rollout.http_guards import is_loopback
from miles_rollout.launch import free_port, router_command

STARTUP_TIMEOUT_S = 300.0


def _exit_with(serve_one: Callable[[ServeConfig], int], config: ServeConfig) -> None:
    sys.exit(serve_one(config))


def _wait_healthy(url: str, alive: Any, what: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if not alive():
            raise RuntimeError(f"{what} exited during start-up")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not healthy after {STARTUP_TIMEOUT_S:.0f} s")
        time.sleep(0.3)


def serve_behind_router(config: ServeConfig, serve_one: Callable[[ServeConfig], int]) -> int:
    """Start `config.dp_size` engines (each a process running `serve_one`, `server.serve_one`) and sglang-router in
    front of them; return when one of them exits. `config`'s keys are resolved already (`cli.resolve_keys`): they
    travel to the engines inside their configs."""
    try:
        import sglang_router  # noqa: F401  (checked here, run as a subprocess below)
    except ImportError:
        print("miles-rollout serve --dp-size needs sglang-router: pip install sglang-router (or serve one engine "
              "with --dp-size 1)", file=sys.stderr)  # fmt: skip
        return 2
    if not is_loopback(config.host):
        print(f"refusing to bind the router to {config.host}: sglang-router's control routes (/workers) take no "
              "key; bind 127.0.0.1, or start the engines and the router yourself", file=sys.stderr)  # fmt: skip
        return 2
    spawn = multiprocessing.get_context("spawn")  # the config crosses to each child by local pickling, no network
    engines = []
    for _ in range(config.dp_size):
        engine_config = config.model_copy(update={"host": "127.0.0.1", "port": free_port(), "dp_size": 1})
        process = spawn.Process(target=_exit_with, args=(serve_one, engine_config), daemon=False)
        process.start()
        engines.append((process, f"http://127.0.0.1:{engine_config.port}"))
    router: subprocess.Popen[bytes] | None = None
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for i, (process, url) in enumerate(engines):
            _wait_healthy(url, process.is_alive, f"engine {i} ({url})")
            print(f"engine {i}: {url}", flush=True)
        urls = [url for _, url in engines]
        router = subprocess.Popen(router_command(urls, config.host, config.port, log_level=config.log_level))
        print(f"sglang-router on http://{config.host}:{config.port} in front of {len(urls)} engines", flush=True)
        while not stopping:
            if router.poll() is not None or not all(process.is_alive() for process, _ in engines):
                print("an engine or the router exited: stopping the others", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    except RuntimeError as error:
        print(f"miles-rollout serve --dp-size: {error}", file=sys.stderr)
        return 1
    finally:
        if router is not None and router.poll() is None:
            router.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                router.wait(timeout=30)
        for process, _ in engines:
            if process.is_alive():
                process.terminate()
        for process, _ in engines:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()

"""One embedded engine behind the SGLang-compatible HTTP server: what `miles-rollout serve` runs (and each engine of
`--dp-size N`, serve_many.py)."""

from __future__ import annotations

import logging
import sys

from miles_rollout.config import ServeConfig
from miles_rollout.http_guards import is_loopback

PROG = "miles-rollout"


def serve_one(config: ServeConfig) -> int:
    """Serve `config.model_path` on `config.host:port` until stopped; 2 (with the reason on stderr) for a config
    that cannot start. The keys are resolved already (`cli.resolve_keys`)."""
    if not is_loopback(config.host) and not config.admin_key:
        print(
            f"refusing to bind {config.host} without --admin-key: the weight and memory endpoints would be open "
            "to the network. Give an admin key (--admin-key-file FILE or MILES_ADMIN_KEY; and an API key for "
            "generation: --api-key-file or MILES_API_KEY), or bind 127.0.0.1.",
            file=sys.stderr,
        )
        return 2
    import uvicorn

    from miles_rollout.engine import Engine
    from miles_rollout.server import KEEP_ALIVE_S, create_app

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        engine = Engine(config.model_path, config.kernel, config.engine)
    except (ValueError, FileNotFoundError) as error:
        print(f"{PROG} serve: {error}", file=sys.stderr)
        return 2
    app = create_app(engine, api_key=config.api_key, admin_key=config.admin_key, host=config.host,
                     allow_client_chat_template=config.allow_client_chat_template,
                     allowed_hosts=config.allowed_hosts, max_request_bytes=config.max_request_bytes,
                     max_bucket_bytes=config.max_bucket_bytes)  # fmt: skip
    print(f"{PROG} serving {config.model_path} on http://{config.host}:{config.port} ({config.kernel.mode} mode)",
          flush=True)  # fmt: skip
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level, timeout_keep_alive=KEEP_ALIVE_S)
    engine.shutdown()
    return 0

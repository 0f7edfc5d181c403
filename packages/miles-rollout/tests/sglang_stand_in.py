"""A stand-in for `python -m sglang.launch_server` (test_sglang_launch.py): it takes `--config FILE` as SGLang does,
writes the ServerArgs fields it was given and its argv to `<FILE stem>.launched.json`, and serves conftest.py's
fake SGLang API on the config's host and port, with GET /_recorded listing the requests it got (method, path,
body)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import uvicorn
from conftest import FakeEngine, make_app


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] != "--config":
        sys.exit(f"usage: sglang_stand_in.py --config FILE (got {argv})")
    config_path = Path(argv[1])
    args = {key.replace("-", "_"): value for key, value in json.loads(config_path.read_text()).items()}
    config_path.with_suffix(".launched.json").write_text(json.dumps({"argv": argv, "server_args": args}))
    engine = FakeEngine()
    app = make_app(engine)

    @app.get("/_recorded")
    async def recorded() -> list[dict[str, str]]:
        return [{"method": r.method, "path": r.path, "body": r.body.decode(errors="replace")} for r in engine.requests]

    print(f"stand-in SGLang server on {args['host']}:{args['port']}", flush=True)
    uvicorn.run(app, host=args["host"], port=args["port"], log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1:])

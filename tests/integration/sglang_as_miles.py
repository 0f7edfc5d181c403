"""A stand-in for `python -m sglang.launch_server` on a CPU (test_sglang_backend.py): it reads the `--config FILE`
Miles writes for SGLang as SGLang does (each key a flag's name), records the ServerArgs fields it got beside it
(`<FILE stem>.launched.json`), and becomes `miles-rollout serve`, the drop-in SGLang server, with the same model,
address, admin key, dtype, seed and limits (fast kernels, as an SGLang engine's are not the trainer's)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] != "--config":
        sys.exit(f"usage: sglang_as_miles.py --config FILE (got {argv})")
    path = Path(argv[1])
    args = {key.replace("-", "_"): value for key, value in json.loads(path.read_text()).items()}
    path.with_suffix(".launched.json").write_text(json.dumps({"argv": argv, "server_args": args}))
    flags = [
        "--model-path", args["model_path"], "--host", args["host"], "--port", str(args["port"]), "--dtype",
        args["dtype"], "--mode", "fast", "--seed", str(args["random_seed"]), "--max-running-requests",
        str(args["max_running_requests"]), "--log-level", args["log_level"],
    ]  # fmt: skip
    if args.get("admin_api_key"):
        os.environ["MILES_ADMIN_KEY"] = args["admin_api_key"]  # off the command line, as SGLang's config file keeps it
    if args.get("context_length"):
        flags += ["--context-length", str(args["context_length"])]
    os.execv(sys.executable, [sys.executable, "-m", "miles_rollout.cli", "serve", *flags])


if __name__ == "__main__":
    main(sys.argv[1:])

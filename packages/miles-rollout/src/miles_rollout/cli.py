"""`miles-rollout` command line: `miles-rollout serve --model DIR` runs the embedded engine behind the
SGLang-compatible HTTP server."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles-rollout", description="Miles rollout engine: serve a policy over SGLang's HTTP API."
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = subcommands.add_parser(
        "serve",
        help="Serve a Hugging Face model directory over SGLang's /generate API",
        description="Serve a Qwen3 / Qwen3-MoE Hugging Face directory with the embedded engine (CPU or one GPU).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument("--model", required=True, help="Hugging Face model directory (config.json + safetensors)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind; non-loopback needs --admin-key")
    serve.add_argument("--port", type=int, default=30000, help="TCP port")
    serve.add_argument(
        "--deterministic", action="store_true",
        help="batch-invariant kernels: identical outputs and log-probs whatever the batch (true on-policy)",
    )  # fmt: skip
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model dtype")
    serve.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    serve.add_argument("--kv-pages", type=int, default=1024, help="KV-cache pages (memory bound of the cache)")
    serve.add_argument("--page-size", type=int, default=16, help="tokens per KV page (a power of two)")
    serve.add_argument("--max-running-requests", type=int, default=256, help="most sequences decoding at once")
    serve.add_argument("--max-prefill-tokens", type=int, default=2048, help="token budget of one engine step")
    serve.add_argument("--context-length", type=int, default=None, help="max prompt + output tokens (model's)")
    serve.add_argument("--seed", type=int, default=0, help="base seed for requests without sampling_seed")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint")
    serve.add_argument("--admin-key", default=None, help="key for weight, memory and control endpoints")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def serve(args: argparse.Namespace) -> int:
    if not _is_loopback(args.host) and not args.admin_key:
        print(
            f"refusing to bind {args.host} without --admin-key: the weight and memory endpoints would be open "
            "to the network. Pass --admin-key KEY (and --api-key KEY for generation), or bind 127.0.0.1.",
            file=sys.stderr,
        )
        return 2
    import uvicorn
    from pydantic import ValidationError

    from miles_kernels import KernelConfig
    from miles_rollout.engine import Engine
    from miles_rollout.engine_config import EngineConfig
    from miles_rollout.server import KEEP_ALIVE_S, create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        kernel = KernelConfig(
            dtype=args.dtype, mode="deterministic" if args.deterministic else "fast", page_size=args.page_size
        )
        config = EngineConfig(
            model_path=args.model, kernel=kernel, num_kv_pages=args.kv_pages,
            max_running_requests=args.max_running_requests, max_prefill_tokens=args.max_prefill_tokens,
            context_length=args.context_length, device=args.device, seed=args.seed,
        )  # fmt: skip
        engine = Engine(config)
    except (ValidationError, ValueError, FileNotFoundError) as error:
        print(f"miles-rollout serve: {error}", file=sys.stderr)
        return 2
    app = create_app(engine, api_key=args.api_key, admin_key=args.admin_key, host=args.host)
    print(f"miles-rollout serving {args.model} on http://{args.host}:{args.port} ({kernel.mode} mode)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=KEEP_ALIVE_S)
    engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())

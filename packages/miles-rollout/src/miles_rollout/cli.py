"""`miles-rollout` command line: `miles-rollout serve --model-path DIR` runs the embedded engine behind the
SGLang-compatible HTTP server. The CLI only parses (flags, keys) and dispatches to `server.serve`.

The flags are generated (tyro) from `miles_rollout.config.ServeConfig` and the models it nests (`KernelConfig`,
`EngineConfig`): each setting is defined once, with its description, default and allowed values, and a run config
nests the same `EngineConfig` as `rollout.engine`. A bad flag or value exits with status 2 and says what to fix.

Keys: `--api-key` / `--admin-key` work, but any user of the machine reads a command line (`ps`); `--api-key-file` /
`--admin-key-file` (the file's first line) or the environment variables `MILES_API_KEY` / `MILES_ADMIN_KEY` keep
them off it. A flag or file wins over the environment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import tyro

from miles_rollout.config import ServeConfig

PROG = "miles-rollout"

ServeArgs = Annotated[ServeConfig, tyro.conf.OmitArgPrefixes]
# Short forms kept from the hand-written flags: `--model DIR` is `--model-path DIR` (SGLang's name) and
# `--deterministic` is `--mode deterministic`.
ALIASES = {"--model": ["--model-path"], "--deterministic": ["--mode", "deterministic"]}
KEY_ENV = {"api_key": "MILES_API_KEY", "admin_key": "MILES_ADMIN_KEY"}


def resolve_keys(config: ServeConfig, environ: Mapping[str, str] = os.environ) -> ServeConfig:
    """`config` with `api_key` and `admin_key` read from their flag, else their file (`*_file`, the first line),
    else their environment variable (`KEY_ENV`); the file fields cleared. ValueError naming the flag on a conflict,
    an unreadable file or an empty key."""
    update: dict[str, str | None] = {}
    for field, variable in KEY_ENV.items():
        flag, file_name = field.replace("_", "-"), getattr(config, f"{field}_file")
        key = getattr(config, field)
        if key is not None and file_name is not None:
            raise ValueError(f"give --{flag} or --{flag}-file, not both")
        if file_name is not None:
            try:
                lines = Path(file_name).read_text().splitlines()
            except (OSError, UnicodeDecodeError) as error:
                raise ValueError(f"--{flag}-file {file_name}: {error}") from error
            key = lines[0].strip() if lines else ""
            if not key:
                raise ValueError(f"--{flag}-file {file_name}: the file's first line is empty; put the key there")
        elif key is None and variable in environ:
            key = environ[variable].strip()
            if not key:
                raise ValueError(f"{variable} is set but empty: give a key, or unset it")
        if key is not None and not key:
            raise ValueError(f"--{flag} is empty: give a key, or leave it out")
        update[field], update[f"{field}_file"] = key, None
    return config.model_copy(update=update)


def _expand(arg: str) -> list[str]:
    """A short form as the generated flags it stands for (`--model=DIR` keeps its value); anything else as is."""
    flag, sep, value = arg.partition("=")
    if flag not in ALIASES:
        return [arg]
    *head, last = ALIASES[flag]
    return [*head, f"{last}={value}"] if sep else ALIASES[flag]


def parse_serve(argv: list[str]) -> ServeConfig:
    """The serve config from command-line flags (exits with status 2 and a message on a bad one)."""
    config: ServeConfig = tyro.cli(
        ServeArgs,
        args=[expanded for arg in argv for expanded in _expand(arg)],
        prog=f"{PROG} serve",
        description="Serve a Qwen3 / Qwen3-MoE Hugging Face directory over SGLang's HTTP API with the embedded "
        "engine (CPU or one GPU).",
    )
    return config


USAGE = f"""usage: {PROG} COMMAND ...

Miles rollout engine: serve a policy over SGLang's HTTP API.

commands:
  serve    Serve a Hugging Face model directory over SGLang's /generate API ({PROG} serve --help)
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    if args[0] != "serve":
        print(f"{PROG}: unknown command {args[0]!r}; the command is 'serve' ({PROG} serve --help)", file=sys.stderr)
        return 2
    try:
        config = parse_serve(args[1:])
    except SystemExit as exit_:  # tyro printed the problem (or the help)
        return int(exit_.code or 0)
    try:
        config = resolve_keys(config)
    except ValueError as error:
        print(f"{PROG} serve: {error}", file=sys.stderr)
        return 2
    from miles_rollout.server import serve  # torch and the engine load here, not for --help or a bad flag

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())

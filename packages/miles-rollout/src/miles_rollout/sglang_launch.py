"""SGLang servers as rollout engines (docs/laptop-to-cluster.md): a run's settings as SGLang 0.5.23's `ServerArgs`
fields (`sglang_server_args`, a pure function), the config file that carries them to `python -m
sglang.launch_server --config FILE` (the admin key with them: never on a command line other users can read), and
`SGLangServer`, one server process: started in its own session, waited for until `/health` answers, stopped with
its children.

The embedded engine and SGLang speak the same HTTP API (packages/miles-rollout/README.md, "SGLang compatibility"),
so everything after the launch (generation, weight updates, pause / continue, memory release) goes through
`miles_rollout.Client` the same way for both.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_kernels.config import KernelConfig
from miles_rollout.config import EngineConfig, SGLangConfig

SGLANG_VERSION = "0.5.23"  # the release the mapping is written and tested against (the [sglang] extra's pin)
INSTALL_HINT = "uv sync --package miles-rollout --extra sglang (pip install 'miles-rollout[sglang]')"

# ServerArgs fields Miles sets from the run config: `SGLangConfig.server_args` may not override them
MANAGED = frozenset({
    "model_path", "host", "port", "tp_size", "dp_size", "ep_size", "dtype", "random_seed", "max_running_requests",
    "context_length", "mem_fraction_static", "attention_backend", "chunked_prefill_size", "log_level",
    "enable_deterministic_inference", "speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
    "speculative_num_draft_tokens", "speculative_draft_model_path", "enable_return_routed_experts",
    "enable_memory_saver", "admin_api_key", "api_key", "weight_version", "skip_tokenizer_init",
})  # fmt: skip


def sglang_server_args(
    model_path: str,
    kernel: KernelConfig,
    engine: EngineConfig,
    sglang: SGLangConfig,
    *,
    host: str,
    port: int,
    admin_key: str | None,
    memory_saver: bool,
) -> dict[str, Any]:
    """The `ServerArgs` fields of one SGLang engine of the run: its model and address, its parallel layout and memory
    share, the kernels' dtype, SGLang's deterministic inference when asked, the settings it shares with the
    embedded engine, speculative decoding with the model's MTP layers, SGLang's memory saver for a
    colocated run (release / resume of weights and KV cache), the admin key of the weight and control endpoints, and
    `sglang.server_args` on top. Raises ValueError for a setting SGLang cannot take."""
    clash = sorted(MANAGED & set(sglang.server_args))
    if clash:
        raise ValueError(
            f"rollout.sglang.server_args sets {clash}, which Miles sets from the run config: use rollout.sglang's "
            "own fields, rollout.engine or kernel (docs/laptop-to-cluster.md maps each)"
        )
    args: dict[str, Any] = {
        "model_path": model_path, "host": host, "port": port, "tp_size": sglang.tp_size, "dp_size": sglang.dp_size,
        "ep_size": sglang.ep_size, "dtype": kernel.dtype, "random_seed": engine.seed,
        "max_running_requests": engine.max_running_requests, "log_level": sglang.log_level, "weight_version": "0",
    }  # fmt: skip
    optional = {
        "context_length": engine.context_length,
        "mem_fraction_static": sglang.mem_fraction_static,
        "attention_backend": sglang.attention_backend,
        "chunked_prefill_size": sglang.chunked_prefill_size,
        "admin_api_key": admin_key,
    }
    args |= {name: value for name, value in optional.items() if value is not None}
    if sglang.deterministic_inference:
        args["enable_deterministic_inference"] = True
    if engine.speculative_algorithm is not None:
        steps = engine.num_draft_steps
        args |= {"speculative_algorithm": engine.speculative_algorithm, "speculative_num_steps": steps,
                 "speculative_eagle_topk": engine.speculative_eagle_topk or 1,
                 "speculative_num_draft_tokens": engine.num_draft_tokens}  # fmt: skip
        if engine.speculative_draft_model_path is not None:
            args["speculative_draft_model_path"] = engine.speculative_draft_model_path
    if engine.enable_return_routed_experts:
        args["enable_return_routed_experts"] = True
    if memory_saver:
        args["enable_memory_saver"] = True
    return args | sglang.server_args


def write_server_config(args: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """`args` (ServerArgs field names) as the YAML config file SGLang reads with `--config`: each key its flag's name
    (SGLang turns `key: value` into `--key value`), as JSON (a subset of YAML); readable by this user only (it holds
    the admin key)."""
    out = Path(path)
    if out.suffix not in (".yaml", ".yml"):
        raise ValueError(f"{out}: SGLang reads config files named *.yaml or *.yml")
    flags = {name.replace("_", "-"): value for name, value in args.items()}
    descriptor = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as f:
        json.dump(flags, f, indent=2, sort_keys=True)
    return out


def launch_command(sglang: SGLangConfig) -> list[str]:
    """The command before `--config FILE`: `rollout.sglang.launch_command`, else this Python's `-m
    sglang.launch_server` (ImportError with the install command when SGLang is not installed)."""
    if sglang.launch_command:
        return list(sglang.launch_command)
    if importlib.util.find_spec("sglang") is None:
        raise ImportError(f"rollout.backend=sglang needs SGLang {SGLANG_VERSION}: {INSTALL_HINT}")
    return [sys.executable, "-m", "sglang.launch_server"]


def require_cuda() -> None:
    """SGLang serves on CUDA GPUs: a clear error on a machine without one."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "rollout.backend=sglang needs a CUDA GPU for each engine (SGLang serves on GPUs) and this machine has "
            "none: use rollout.backend=embedded, which runs on CPUs too"
        )


def _terminate_with_parent() -> Callable[[], None] | None:
    """What the server's process runs before it starts (Linux): ask for SIGTERM when the process that launched it
    dies (PR_SET_PDEATHSIG), so a killed engine actor leaves no server holding its GPUs (SGLang's launcher then stops
    its own children). Resolved here, in the parent: the child only calls it (no import between fork and exec)."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None

    def ask() -> None:
        prctl(1, signal.SIGTERM)

    return ask


class SGLangServer:
    """One SGLang server process: `start()` launches it in its own session (its log in `log_path`), `wait_healthy()`
    polls `/health` until it answers, `stop()` ends it and every process it started."""

    def __init__(self, command: list[str], args: dict[str, Any], run_dir: str | os.PathLike[str]) -> None:
        self.command, self.args = command, args
        directory = Path(run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.config_path = write_server_config(args, directory / f"sglang-{args['port']}.yaml")
        self.log_path = directory / f"sglang-{args['port']}.log"
        self.process: subprocess.Popen[bytes] | None = None
        host = "127.0.0.1" if args["host"] in ("0.0.0.0", "::") else args["host"]
        self.url = f"http://{host}:{args['port']}"

    def start(self, env: dict[str, str] | None = None) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [*self.command, "--config", str(self.config_path)], stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})}, start_new_session=True, preexec_fn=_terminate_with_parent(),
            )  # fmt: skip

    def log_tail(self, limit: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-limit:]
        return ""

    async def wait_healthy(self, timeout: float, interval: float = 0.5) -> None:
        """Until `/health` answers 200; RuntimeError with the log's tail if the process exits or `timeout` passes."""
        from miles_rollout.client import Client

        deadline = time.monotonic() + timeout
        async with Client(self.url, timeout=5.0) as client:
            while True:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(
                        f"the SGLang server on port {self.args['port']} exited with {self.process.returncode} before "
                        f"it was healthy; its log ({self.log_path}) ends:\n{self.log_tail()}"
                    )
                if await client.check_health() is None:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the SGLang server on port {self.args['port']} did not answer /health within {timeout:.0f} "
                        f"s (rollout.sglang.startup_timeout_s); its log ({self.log_path}) ends:\n{self.log_tail()}"
                    )
                await asyncio.sleep(interval)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the server's process group (SGLang's scheduler and detokenizer processes too), SIGKILL after
        `timeout` seconds."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

"""An SGLang engine's launch (`SGLangEngineActor`, a plain class Ray makes an actor), with a stand-in server: a port
that was free when picked and taken before the server bound it is replaced by another; any other failure to start
is reported at once."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from miles_kernels import KernelConfig
from miles_kernels.testing import save_random_model, tiny_config
from miles_orchestrator.cluster.ray import sglang as sglang_engine
from miles_orchestrator.cluster.ray.sglang import PORT_ATTEMPTS, SGLangEngineActor
from miles_rollout import free_port
from miles_rollout.config import EngineConfig, SGLangConfig

# A stand-in for `python -m sglang.launch_server --config FILE`: binds the config's host and port (Python's own
# "[Errno 98] Address already in use" when it is taken), answers every GET with 200; exits 3 at once if told to.
STAND_IN = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = json.loads(open(sys.argv[2]).read())
if args.get("log-level") == "error":
    sys.exit(3)
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
HTTPServer((args["host"], int(args["port"])), Health).serve_forever()
"""


@pytest.fixture
def launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    model = save_random_model(tmp_path / "model", tiny_config("dense"))
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)

    def start(ports: list[int], log_level: str = "info") -> SGLangEngineActor:
        picks = iter(ports)
        monkeypatch.setattr(sglang_engine, "free_port", lambda: next(picks))
        sglang = SGLangConfig(launch_command=[sys.executable, str(script)], startup_timeout_s=60, log_level=log_level)
        return SGLangEngineActor(str(model), KernelConfig(), EngineConfig(), sglang, admin_key="key",
                                 host="127.0.0.1", memory_saver=False, run_dir=str(tmp_path))  # fmt: skip

    return start


def test_a_port_taken_before_the_server_binds_it_is_replaced(launch, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy, free = taken.getsockname()[1], free_port()
        actor = launch([busy, free])
        try:
            assert actor.get_url() == f"http://127.0.0.1:{free}"
            assert "address already in use" in (tmp_path / "engines" / f"sglang-{busy}.log").read_text().lower()
        finally:
            actor.shutdown()


def test_every_port_taken_or_another_failure_is_reported(launch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"(?s)port {busy} exited with 1 .*Address already in use"):
            launch([busy] * PORT_ATTEMPTS)
    with pytest.raises(RuntimeError, match="exited with 3"):  # not a port in use: no second attempt
        launch([free_port()], log_level="error")

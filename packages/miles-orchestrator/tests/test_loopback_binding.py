"""Multi-process tier (a local Ray, two trainer rank actors over gloo): a one-node run listens on loopback only.

With the default `run.bind_host` (127.0.0.1), the Ray head the run starts (GCS, raylet, its agents, every worker)
and the trainer ranks' rendezvous (MASTER_ADDR, rank 0's TCPStore, gloo's pairs) must listen on 127.0.0.1: nothing
of a one-node run is reachable from the network. A fresh interpreter does it (Ray stays initialized in a process);
it lists every TCP socket listening in itself and its descendants (psutil, a Ray dependency).
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles_orchestrator.config import RunConfig

SCRIPT = """
import json, sys
from pathlib import Path
import psutil, ray
from miles_kernels.testing import save_random_model, tiny_config
from miles_orchestrator.cluster.ray.actors import TrainerRankActor
from miles_orchestrator.cluster import trainer_settings
from miles_orchestrator.config import RunConfig
from miles_orchestrator.cluster.ray.cluster import start_ray

root = Path(sys.argv[1])
save_random_model(root / "model", tiny_config("dense"), seed=3)
cfg = RunConfig.model_validate({"run": {"run_dir": str(root / "run"), "num_threads": 1}})
start_ray(None, root / "run", 2, cfg.run.bind_host)
ranks = [ray.remote(num_cpus=0)(TrainerRankActor).remote(rank, 2, 1) for rank in range(2)]
master = ray.get(ranks[0].address.remote(True))
ray.get([rank.setup.remote(master, str(root / "model"), trainer_settings(cfg, root / "run")) for rank in ranks])
me = psutil.Process()
listening = sorted({
    (process.name(), connection.laddr.ip, connection.laddr.port)
    for process in [me, *me.children(recursive=True)]
    for connection in process.net_connections(kind="tcp")
    if connection.status == psutil.CONN_LISTEN
})
print(json.dumps({"master": master, "node_ip": ray.util.get_node_ip_address(), "listening": listening}))
ray.shutdown()
"""


@pytest.mark.slow
def test_a_one_node_run_listens_on_loopback_only(tmp_path: Path) -> None:
    assert RunConfig().run.bind_host == "127.0.0.1"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["node_ip"] == "127.0.0.1" and seen["master"][0] == "127.0.0.1", seen
    names = {name for name, _, _ in seen["listening"]}
    assert {"gcs_server", "raylet"} <= names, seen["listening"]
    assert seen["master"][1] in {port for _, _, port in seen["listening"]}  # rank 0's store
    exposed = [entry for entry in seen["listening"] if not is_loopback(entry[1])]
    assert not exposed, f"listening beyond loopback: {exposed}"


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # gRPC listens on [::ffff:127.0.0.1]
    return address.is_loopback


def test_bind_host_must_be_one_ip_address() -> None:
    for value in ("0.0.0.0", "::", "localhost", "node-1"):
        with pytest.raises(ValueError, match=r"run\.bind_host=.*give one IP address of this node"):
            RunConfig.model_validate({"run": {"bind_host": value}})
    assert RunConfig.model_validate({"run": {"bind_host": "10.0.0.5"}}).run.bind_host == "10.0.0.5"

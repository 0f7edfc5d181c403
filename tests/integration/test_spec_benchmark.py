"""The speculative-decoding benchmark's smoke version (`benchmarks/spec.py --smoke --arms all`): a tiny policy with an
MTP module, bootstrapped by SFT, and an EAGLE-3 draft trained offline for it run the same short RL job in every arm
(spec.mode off / frozen / online, MTP or EAGLE-3, chain or tree). In deterministic mode all must roll out and train
identically (rewards, losses, KL, final trunk weights); the draft must run in frozen and online (accept length > 1)
and train in online only. The full runs' numbers are in `benchmarks/results/spec.json` and `spec_drafts.json`
(benchmarks/README.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.timeout(600)
def test_spec_benchmark_smoke(tmp_path) -> None:
    out = tmp_path / "spec.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "spec.py"), "--smoke", "--arms", "all",
                             "--out", str(out)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["identical_rewards_losses_kl_per_step"] and data["identical_final_trunk_weights"]
    runs = data["runs"]
    for arm in ("frozen", "online", "online_tree", "eagle3_frozen", "eagle3_online", "eagle3_online_tree"):
        assert all(step["spec_accept_length"] > 1.0 for step in runs[arm]["per_step"]), arm
    assert all(step["spec_accept_length"] is None for step in runs["off"]["per_step"])
    assert all(step["mtp_loss"] is not None for step in runs["online"]["per_step"])
    assert all(step["mtp_loss"] is None for step in runs["frozen"]["per_step"])
    assert all(step["eagle3_loss"] is not None for step in runs["eagle3_online_tree"]["per_step"])
    assert all(step["eagle3_loss"] is None and step["mtp_loss"] is None for step in runs["eagle3_frozen"]["per_step"])
    assert 0 < data["multiply_adds_per_token"]["draft_to_target"] < 1

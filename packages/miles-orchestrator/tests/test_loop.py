"""Loop helpers that need no cluster."""

from __future__ import annotations

import pytest

from miles_orchestrator.loop import batch_keys


def test_trainer_reward_stats_do_not_overwrite_the_rollouts() -> None:
    rollout = {"reward_mean": 0.25, "pass_rate": 0.25}
    trained = batch_keys({"reward_mean": 0.5, "reward_max": 1.0, "advantage_mean": 0.0, "loss": 0.1})
    assert rollout | trained == {
        "reward_mean": 0.25, "pass_rate": 0.25, "batch_reward_mean": 0.5, "batch_reward_max": 1.0,
        "advantage_mean": 0.0, "loss": 0.1,
    }  # fmt: skip


def test_weight_sync_goes_through_shared_memory_only_when_it_can(tmp_path, monkeypatch) -> None:
    from miles_orchestrator import cluster

    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(cluster, "SHARED_MEMORY", shm)
    run_dir = tmp_path / "run"
    chosen = cluster.shared_sync_dir("auto", run_dir, same_node=True, weight_bytes=10 << 20)
    assert chosen is not None and chosen.parent == shm and chosen.is_dir()
    assert cluster.shared_sync_dir("auto", run_dir, True, 10 << 20) == chosen  # a resumed run: the same directory
    assert cluster.shared_sync_dir("http", run_dir, True, 10 << 20) is None
    assert cluster.shared_sync_dir("auto", run_dir, same_node=False, weight_bytes=10 << 20) is None
    assert cluster.shared_sync_dir("auto", run_dir, True, weight_bytes=2 << 30) is None  # too big for RAM twice
    assert cluster.shared_sync_dir("shm", run_dir, True, weight_bytes=2 << 30) == chosen  # asked for: used
    with pytest.raises(ValueError, match="sync_transport=shm needs the engine on trainer rank 0's node"):
        cluster.shared_sync_dir("shm", run_dir, same_node=False, weight_bytes=1)


def test_the_on_policy_guard_compares_kernels_device_kind_and_weights(monkeypatch) -> None:
    """`check_on_policy` after the version-0 sync: a deterministic run refuses an engine whose kernel fingerprint
    differs from the trainer's (here: the same config on a CUDA engine) or whose weights differ; equal ones pass."""
    from miles_kernels import KernelConfig
    from miles_orchestrator import loop
    from miles_orchestrator.config import RunConfig

    kernel = KernelConfig()

    class FakeCluster:
        trainer_fingerprint = kernel.fingerprint()
        sync_dir = None

        def sync_weights(self, version: int, bucket_bytes: int) -> dict[str, int]:
            return {"num_bytes": 0}

        def trainer_checksum(self) -> str:
            return "a" * 64

    def engine(described: dict[str, object], checksum: str = "a" * 64):
        async def info(cluster: object) -> dict[str, object]:
            return {"kernel_config": described, "checksum": checksum}

        return info

    cfg, logs = RunConfig(), []
    monkeypatch.setattr(loop, "_engine_info", engine(kernel.describe("cuda")))
    with pytest.raises(RuntimeError, match=r"true on-policy refused.*same kind of device"):
        loop.check_on_policy(cfg, FakeCluster(), version=0, log=logs.append)
    monkeypatch.setattr(loop, "_engine_info", engine(kernel.describe(), checksum="b" * 64))
    with pytest.raises(RuntimeError, match="weight sync check failed"):
        loop.check_on_policy(cfg, FakeCluster(), version=0, log=logs.append)
    monkeypatch.setattr(loop, "_engine_info", engine(kernel.describe()))
    loop.check_on_policy(cfg, FakeCluster(), version=0, log=logs.append)
    assert logs and "verified" in logs[-1] and kernel.fingerprint() in logs[-1]

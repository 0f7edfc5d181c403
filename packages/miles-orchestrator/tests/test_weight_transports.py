"""Pure-logic tier, with CPU tensors and no process group or engine (cluster/transport/): which transport a run takes,
the registry behind `run.sync_transport`, the calls a trainer rank's part in a transport accepts, and the broadcast
transport's engine protocol (the broadcast itself stubbed)."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any, get_args

import pytest
import torch

from miles_orchestrator.cluster import transport
from miles_orchestrator.cluster.transport import broadcast, file
from miles_orchestrator.config import load_config
from miles_orchestrator.config.sections import RunSection


def test_the_weight_transport_follows_where_the_engines_landed(tmp_path, monkeypatch) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(transport, "SHARED_MEMORY", shm)
    choose = transport.resolve_transport
    assert choose("auto", same_node=True, weight_bytes=10 << 20, num_engines=2) == "shm"
    assert choose("auto", same_node=True, weight_bytes=2 << 30, num_engines=1) == "http"  # too big for RAM twice
    assert choose("auto", same_node=False, weight_bytes=10 << 20, num_engines=1) == "http"
    assert choose("auto", same_node=False, weight_bytes=10 << 20, num_engines=3) == "distributed"
    assert choose("shm", same_node=True, weight_bytes=2 << 30, num_engines=1) == "shm"  # asked for: used
    assert choose("disk", same_node=False, weight_bytes=1, num_engines=2) == "disk"
    # SGLang engines: shm where it can, a broadcast where their layout allows it (never http), else a shared directory
    from miles_rollout.config import SGLangConfig

    assert SGLangConfig().network_transports(colocated=False) == ("distributed",)
    assert SGLangConfig().network_transports(colocated=True) == SGLangConfig(dp_size=2).network_transports(False) == ()
    assert choose("auto", same_node=True, weight_bytes=10 << 20, num_engines=1, network=("distributed",)) == "shm"
    assert choose("auto", same_node=False, weight_bytes=10 << 20, num_engines=1, network=("distributed",)) == (
        "distributed"
    )
    assert choose("auto", same_node=False, weight_bytes=10 << 20, num_engines=3, network=()) == "disk"
    assert broadcast.weight_group_backend(sglang_engines=True, trainer_device="cuda:0") == "nccl"
    assert broadcast.weight_group_backend(sglang_engines=True, trainer_device="cpu") == "gloo"
    assert broadcast.weight_group_backend(sglang_engines=False, trainer_device="cuda") == "gloo"
    with pytest.raises(ValueError, match="sync_transport=shm needs every engine on trainer rank 0's node"):
        choose("shm", same_node=False, weight_bytes=1, num_engines=1)
    run_dir = tmp_path / "run"
    # shm writes to a SharedMemoryDir of its own (test_shm_sync_dir.py), disk and the restart file to this
    assert file.sync_directory(run_dir, None) == run_dir / "sync" and (run_dir / "sync").is_dir()
    assert file.sync_directory(run_dir, str(tmp_path / "nfs")) == tmp_path / "nfs"


def _context(tmp_path: Path, engine_nodes: list[str]) -> transport.SyncContext:
    """A Ray run's context with nothing behind it (no transport call reaches a rank or an engine here)."""
    return transport.SyncContext(
        load_config(None, []), tmp_path, ranks=SimpleNamespace(), engines=SimpleNamespace(),  # type: ignore[arg-type]
        urls=list, admin_key="key", healthy_peer=lambda engine: None, log=print, rank0_node="a" * 56,
        engine_nodes=engine_nodes,
    )  # fmt: skip


def _implements_the_protocol(cls: type) -> bool:
    """Every member of `WeightTransport` is on `cls`, its methods as coroutine functions (checked on the class: a
    file transport's description names its directory, which exists once prepared)."""
    members = [name for name in vars(transport.WeightTransport) if not name.startswith("_")]
    methods = [name for name in members if inspect.iscoroutinefunction(vars(transport.WeightTransport)[name])]
    assert {"name", "description", "prepare", "send", "after_restart", "close"} <= set(members)
    return all(hasattr(cls, name) for name in members) and all(
        inspect.iscoroutinefunction(getattr(cls, name)) for name in methods
    )


def test_the_registry_holds_a_transport_for_every_sync_transport(tmp_path) -> None:
    """Every `run.sync_transport` but auto names a class of the registry, under its own name, implementing
    `WeightTransport`; its trainer-rank part declares calls it has. The local cluster's copy is one too."""
    names = set(get_args(RunSection.model_fields["sync_transport"].annotation)) - {"auto"}
    assert set(transport.TRANSPORTS) == names
    for name, cls in transport.TRANSPORTS.items():
        assert _implements_the_protocol(cls) and cls(_context(tmp_path, ["b" * 56])).name == name
        side = transport.rank_side(name)
        assert side.CALLS and all(callable(getattr(side, call, None)) for call in side.CALLS), name
    assert _implements_the_protocol(transport.InProcessTransport)
    local = transport.InProcessTransport(SimpleNamespace(), SimpleNamespace(), lambda fn: fn())  # type: ignore[arg-type]
    assert isinstance(local, transport.WeightTransport) and local.description == "an in-process copy"
    http = transport.TRANSPORTS["http"](_context(tmp_path, ["a" * 56, "b" * 56]))
    assert http.description == "HTTP buckets (Ray node aaaaaaaa) to 2 engines (Ray nodes aaaaaaaa, bbbbbbbb)"


class _Sender:
    """A trainer's `WeightSender` with two small buckets, recording the file writes it is asked for."""

    def __init__(self) -> None:
        self.writes: list[tuple[Path, bool]] = []

    def iter_weight_buckets(self, version: int, bucket_bytes: int) -> Any:
        return iter([b"x" * 3, b"y" * 4])

    def write_weights(self, path: Path, write: bool = True) -> int:
        self.writes.append((path, write))
        return 0


def test_a_trainer_rank_takes_only_the_calls_its_transport_declares(tmp_path, monkeypatch) -> None:
    from miles_orchestrator.cluster.ray.actors import TrainerRankActor

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the actor sets it; restored after the test
    actor = TrainerRankActor(rank=1, world_size=2, num_threads=torch.get_num_threads())
    sender = _Sender()
    actor.trainer = SimpleNamespace(backend=SimpleNamespace(weights=sender), model_dir=str(tmp_path))  # type: ignore[assignment]
    actor.open_weight_sync("http")
    try:
        # rank 1 holds no engine clients: it only gathers
        assert actor.weight_sync("send_weight_buckets", 3, 64) == {"num_buckets": 2, "num_bytes": 7}
        for call in ("write_weights", "engines", "__init__", "weights"):
            with pytest.raises(ValueError, match=rf"HttpRankSide takes no weight-sync call '{call}'"):
                actor.weight_sync(call)
    finally:
        actor._weight_sync.engines.loop.close()  # type: ignore[union-attr]
    actor.open_weight_sync("shm")
    assert actor.weight_sync("write_weights", str(tmp_path)) == 0
    assert sender.writes == [(tmp_path / "model.safetensors", False)]  # rank 1 joins the gathers, writes nothing
    with pytest.raises(ValueError, match="it takes write_weights"):
        actor.weight_sync("send_weight_buckets", 3, 64)


class _RecordingEngine:
    """An engine's client that records the weight-update calls it gets."""

    def __init__(self, calls: list[tuple]) -> None:
        self.calls = calls

    async def begin_weight_update(self) -> dict:
        self.calls.append(("begin",))
        return {}

    async def end_weight_update(self, version: int) -> dict:
        self.calls.append(("end", version))
        return {"weight_version": version}

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name, **stamp) -> dict:
        self.calls.append(("bucket", tuple(names), stamp))
        return {"success": True, "message": "Success"}  # SGLang's reply: no version


@pytest.mark.parametrize("sglang", [False, True])
def test_a_broadcast_sync_speaks_each_engines_protocol(sglang, monkeypatch) -> None:
    """Miles engines: one begin / end bracket around the buckets, which carry no version; SGLang engines (whose
    routes of those names serve quantized weights): no bracket, the last bucket carries the version and flushes the
    cache, as slime's trainer sends them."""
    buckets = [{"a": torch.zeros(2)}, {"b": torch.ones(3), "c": torch.ones(1)}, {"d": torch.zeros(4)}]
    weights = SimpleNamespace(iter_tensor_buckets=lambda size: iter(buckets))
    sent: list[list[str]] = []
    monkeypatch.setattr(broadcast, "broadcast_tensors", lambda group, values, src: sent.append(values))
    calls: list[tuple] = []
    side = broadcast.BroadcastRankSide(weights, "", rank=0)  # type: ignore[arg-type]
    side.group = SimpleNamespace(backend="gloo")  # type: ignore[assignment]
    side.engines.clients = [_RecordingEngine(calls)]  # type: ignore[list-item]
    try:
        result = side.broadcast_weights(version=7, bucket_bytes=1, sglang=sglang)
    finally:
        side.engines.loop.close()
    assert result == {"num_buckets": 3, "num_bytes": 40, **({} if sglang else {"weight_version": 7})}
    assert len(sent) == 3
    names = [("a",), ("b", "c"), ("d",)]
    if sglang:
        stamps = [{"weight_version": None, "flush_cache": False}] * 2 + [{"weight_version": 7, "flush_cache": True}]
        assert calls == [("bucket", n, stamp) for n, stamp in zip(names, stamps, strict=True)]
    else:
        assert calls == [("begin",), *(("bucket", n, {}) for n in names), ("end", 7)]


def test_a_restarted_engine_waits_for_the_weight_file_being_written() -> None:
    """A restarted engine loads the weight file only once no write is under way, and the version it then holds."""

    class Ranks:
        async def all(self, call: str, *args: Any) -> list[Any]:
            assert call == "write_weights"
            await asyncio.sleep(0.05)
            order.append("written")
            return [12]

    class Engine:
        async def update_weights_from_disk(self, path: str, version: int | None) -> dict:
            order.append(f"loaded v{version}")
            return {}

    async def scenario() -> None:
        weight_file = file.WeightFile(Path("/nowhere"))
        writing = asyncio.create_task(weight_file.write(Ranks(), 3))  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        await weight_file.load_into(Engine())  # type: ignore[arg-type]
        assert await writing == 12

    order: list[str] = []
    asyncio.run(scenario())
    assert order == ["written", "loaded v3"]

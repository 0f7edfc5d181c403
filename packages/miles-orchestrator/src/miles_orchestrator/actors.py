"""The Ray actors of a run: the rollout engine (an embedded `miles-rollout` server) and the trainer ranks.

Each actor holds one process's share of the job; the driver (`loop.py`) talks to the engine over HTTP with
`miles_rollout.Client`, exactly as it would talk to a standalone `miles-rollout serve` or an SGLang server, and to
the trainer ranks through Ray calls that every rank receives together (their work is collective). Samples cross
to the trainer as JSON dicts (`Sample.model_dump(mode="json")`); weights go from trainer rank 0 to the engine as a
safetensors checkpoint in a shared-memory directory when both are on one node (`run.sync_transport`), else as
DESIGN.md buckets over HTTP, never pickled by Miles.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import httpx
import torch

from miles_contracts import Sample
from miles_kernels import KernelConfig


def _node_id() -> str:
    import ray  # inside a Ray worker: ray is imported already

    return str(ray.get_runtime_context().get_node_id())


def _set_threads(num_threads: int) -> None:
    torch.set_num_threads(max(1, num_threads))
    os.environ["OMP_NUM_THREADS"] = str(max(1, num_threads))


class RolloutEngineActor:
    """An embedded engine served over HTTP on 127.0.0.1 inside this actor (uvicorn in a thread)."""

    def __init__(
        self, model_dir: str, kernel: dict[str, Any], engine: dict[str, Any], admin_key: str, num_threads: int
    ) -> None:
        import uvicorn

        from miles_rollout import KEEP_ALIVE_S, Engine, EngineConfig, create_app, free_port

        _set_threads(num_threads)
        self.engine = Engine(EngineConfig(model_path=model_dir, kernel=KernelConfig(**kernel), **engine))
        port = free_port()
        app = create_app(self.engine, admin_key=admin_key, host="127.0.0.1")
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)
        )
        threading.Thread(target=self.server.run, daemon=True, name="miles-rollout-http").start()
        self.url = f"http://127.0.0.1:{port}"
        asyncio.run(_wait_until_healthy(self.url))

    def get_url(self) -> str:
        return self.url

    def node_id(self) -> str:
        return _node_id()

    def shutdown(self) -> None:
        self.server.should_exit = True
        self.engine.shutdown()


async def _wait_until_healthy(url: str) -> None:
    from miles_rollout import Client

    async with Client(url) as client:
        await client.wait_until_healthy(timeout=60, interval=0.1)


class TrainerRankActor:
    """One FSDP2 rank. `setup` must be called on every rank at once (it joins the gloo/NCCL group)."""

    def __init__(self, rank: int, world_size: int, num_threads: int) -> None:
        _set_threads(num_threads)
        self.rank, self.world_size = rank, world_size
        self.backend: Any = None
        self._http = httpx.Client(timeout=600)  # kept across syncs: a new client costs ~30 ms of TLS setup

    def node_id(self) -> str:
        return _node_id()

    def address(self) -> tuple[str, int]:
        from miles_rollout import free_port

        return "127.0.0.1", free_port()

    def setup(self, master: tuple[str, int], model_dir: str, kernel: dict[str, Any], options: dict[str, Any]) -> str:
        import torch.distributed as dist

        from miles_trainer import FSDP2Backend, OptimizerConfig, PolicyLossConfig

        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size))  # fmt: skip
        dist.init_process_group("gloo")
        kernel_config = KernelConfig(**kernel)
        self.model_dir = model_dir
        self.backend = FSDP2Backend(
            model_dir, kernel_config, OptimizerConfig(**options["optimizer"]), PolicyLossConfig(**options["loss"]),
            max_tokens_per_micro_batch=options["max_tokens_per_micro_batch"],
            activation_checkpointing=options["activation_checkpointing"], offload_dir=options["offload_dir"],
        )  # fmt: skip
        return kernel_config.fingerprint(next(self.backend.model.parameters()).device.type)

    def train(
        self, samples: list[dict[str, Any]], advantages: list[list[float]], old_logprobs: Any, measure_mismatch: bool
    ) -> dict[str, float]:
        batch = [Sample.model_validate(s) for s in samples]
        result: dict[str, float] = self.backend.train_step(
            batch, advantages, old_logprobs=old_logprobs, measure_mismatch=measure_mismatch
        )
        return result

    def compute_logprobs(self, samples: list[dict[str, Any]]) -> list[list[float]]:
        result: list[list[float]] = self.backend.compute_logprobs([Sample.model_validate(s) for s in samples])
        return result

    def sync_weights(
        self, url: str, admin_key: str, version: int, bucket_bytes: int, directory: str | None
    ) -> dict[str, Any]:
        """Every rank gathers the weights; rank 0 hands them to the engine: with `directory` (shared memory on the
        engine's node), as a checkpoint there that the engine loads (`/update_weights_from_disk`); else as buckets
        posted over HTTP (the last one applies the version)."""
        headers = {"Authorization": f"Bearer {admin_key}"}
        if directory is not None:
            target = Path(directory)
            num_bytes = self.backend.write_weights(target / "model.safetensors", write=self.rank == 0)
            result: dict[str, Any] = {"num_buckets": 1, "num_bytes": num_bytes}
            if self.rank == 0:
                if not (target / "config.json").is_file():
                    shutil.copy(Path(self.model_dir) / "config.json", target / "config.json")
                body = {"model_path": directory, "weight_version": version}
                response = self._http.post(f"{url}/update_weights_from_disk", json=body, headers=headers)
                if response.status_code != 200:
                    raise RuntimeError(f"weight sync rejected by the engine: {response.text}")
                result.update(response.json())
            return result
        result = {"num_buckets": 0, "num_bytes": 0}
        for data in self.backend.iter_weight_buckets(version, bucket_bytes):
            if self.rank == 0:
                response = self._http.post(f"{url}/update_weights_from_tensor", content=data, headers=headers)
                if response.status_code != 200:
                    raise RuntimeError(f"weight sync rejected by the engine: {response.text}")
                result.update(response.json())
            result["num_buckets"] += 1
            result["num_bytes"] += len(data)
        return result

    def weights_checksum(self) -> str:
        result: str = self.backend.weights_checksum()
        return result

    def offload(self) -> int:
        return int(self.backend.offload())

    def onload(self) -> int:
        return int(self.backend.onload())

    def save(self, directory: str, extra: dict[str, Any]) -> None:
        from miles_trainer import save_checkpoint

        save_checkpoint(self.backend, directory, extra)

    def load(self, directory: str) -> dict[str, Any]:
        from miles_trainer import load_checkpoint

        extra: dict[str, Any] = load_checkpoint(self.backend, directory)
        return extra

    def export(self, directory: str, tokenizer_dir: str) -> None:
        from transformers import AutoTokenizer

        from miles_trainer import export_hf

        export_hf(self.backend, directory, tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir))

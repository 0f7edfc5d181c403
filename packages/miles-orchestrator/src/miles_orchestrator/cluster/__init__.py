"""The cluster interface: where the rollout engine and the trainer ranks run, and the calls the loop makes on them.

`run_training` (loop.py) talks to a `Cluster` and never knows which one it runs on (docs/architecture.md, "Cluster"):
- `RayCluster` (ray/cluster.py, `run.cluster=ray`, the default): the engine and each trainer rank are Ray actors
  in one placement group, on a local Ray or an existing cluster; the loop reaches the engine over HTTP with
  `miles_rollout.Client`, exactly as it would a standalone `miles-rollout serve` or an SGLang server.
- `LocalCluster` (local.py, `run.cluster=local`): the engine and one trainer rank in the driver process,
  no Ray and no HTTP; the loop reaches the engine with `miles_rollout.InProcessClient`.

Either cluster moves the weights through one `WeightTransport` (transport/: a file, HTTP buckets or a broadcast on
Ray, `run.sync_transport`; an in-memory copy on the local cluster) and never asks which one it is.

Colocated (`run.colocate`, the default): engine and trainer take turns. While the trainer works the engine has
released its KV cache and weights (`release_memory_occupation`); while the engine works the trainer has offloaded
parameters and optimizer state (`FSDP2Backend.offload`). Every trainer call goes to all ranks at once.
"""

from miles_orchestrator.cluster.factory import start_cluster
from miles_orchestrator.cluster.protocol import Cluster, CriticTargets, EngineClient, EngineFailed
from miles_orchestrator.cluster.settings import TrainerSettings, num_threads, trainer_settings

__all__ = [
    "Cluster", "CriticTargets", "EngineClient", "EngineFailed", "TrainerSettings", "num_threads", "start_cluster",
    "trainer_settings",
]  # fmt: skip

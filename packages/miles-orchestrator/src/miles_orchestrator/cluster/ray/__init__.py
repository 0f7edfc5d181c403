"""`run.cluster=ray`: `RayCluster` (cluster.py) and what it places on Ray: the engine and trainer rank actors
(actors.py), the SGLang engine actor (sglang.py), placement groups and CPU pinning (placement.py), the engines behind
one client (fleet.py), engine and trainer rank health (engine_health.py, rank_health.py)."""

import os

# Under `uv run`, Ray would rebuild the uv environment for every worker from the current directory (and refuse to
# start outside the project). Workers run the driver's own interpreter and venv instead. Read when ray is imported,
# which every module here does after this package's __init__.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

"""`run.profile_steps`: torch.profiler traces of chosen steps, in RUN_DIR/profiles/step_N/ (docs/debugging.md).

For a profiled step, from the moment the loop asks for its batch to its metrics line:
- each trainer rank: `trainer_rank{r}.trace.json` (its own thread, on its own node);
- each engine: `engine{i}-TP-0.trace.json` through SGLang's `/start_profile` (an SGLang engine writes its own files,
  on its node);
- the driver (run.cluster=ray): `driver.trace.json`, the loop's own thread (advantages, packing, the event loop).
On run.cluster=local the engine and the trainer run on one thread, whose trace is `engine_and_trainer-TP-0.trace.json`;
the driver thread is not traced beside it (two profilers in one process crash it). Open a trace in Perfetto
(ui.perfetto.dev) or chrome://tracing; the phases of every step are in RUN_DIR/timeline.png (timeline.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from miles_orchestrator.cluster import Cluster
from miles_orchestrator.cluster.local import LocalCluster
from miles_orchestrator.config import RunConfig
from miles_orchestrator.run_dir import RunDir
from miles_rollout import TraceRecorder

PROFILES = "profiles"


class StepProfiler:
    def __init__(self, cfg: RunConfig, cluster: Cluster, run: RunDir) -> None:
        self.steps = set(cfg.run.profile_steps)
        self.cluster, self.run = cluster, run
        self.driver = None if isinstance(cluster, LocalCluster) else TraceRecorder()

    @contextlib.asynccontextmanager
    async def step(self, step: int) -> AsyncIterator[None]:
        """Profile the body when `step` is one of run.profile_steps. A profile is a diagnostic: one that cannot
        start or stop (an engine restarted during the step was not recording) is logged, and the run goes on."""
        directory = self.run.path / PROFILES / f"step_{step:06d}"
        if step not in self.steps or not await self._start(step, directory):
            yield
            return
        try:
            yield
        finally:
            await self._stop(step, directory)

    async def _start(self, step: int, directory: Path) -> bool:
        directory.mkdir(parents=True, exist_ok=True)
        try:
            await self.cluster.start_profile(directory)
        except Exception as error:
            self.run.log(f"warning: step {step} not profiled: {type(error).__name__}: {error}")
            return False
        if self.driver is not None:
            self.driver.start(directory / "driver.trace.json")
        return True

    async def _stop(self, step: int, directory: Path) -> None:
        if self.driver is not None:
            self.driver.stop()
        try:
            await self.cluster.stop_profile()
        except Exception as error:
            self.run.log(f"warning: the profile of step {step} is incomplete ({type(error).__name__}: {error}); "
                         f"what was written is in {directory}")  # fmt: skip
            return
        self.run.log(f"profile of step {step}: {directory} (open its traces in ui.perfetto.dev)")

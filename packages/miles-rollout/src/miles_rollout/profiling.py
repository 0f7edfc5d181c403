"""`torch.profiler` traces of the engine: SGLang's `/start_profile` and `/stop_profile` (admin routes; the same request
body), `InProcessClient.start_profile` / `stop_profile` in process.

The profiler runs on the engine thread (every op of a step runs there; a profiler only records the thread that
started it) from the start request to the stop request, and the stop writes one Chrome / Perfetto trace,
`OUTPUT_DIR/[PREFIX]PROFILE_ID-TP-0.trace.json` (SGLang's file name, uncompressed). Step-counted profiles
(`start_step`, `num_steps`), per-stage profiles and merged ranks are SGLang features this engine refuses by name.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, model_validator

from miles_rollout.engine_error import EngineError

DEFAULT_DIR = "/tmp"  # SGLang's default, unless SGLANG_TORCH_PROFILER_DIR says otherwise


class ProfileRequest(BaseModel):
    """SGLang's `ProfileReq` body of /start_profile, each field honoured or refused."""

    model_config = ConfigDict(extra="forbid")

    output_dir: str | None = None
    start_step: int | None = None
    num_steps: int | None = None
    activities: list[Literal["CPU", "GPU", "MEM"]] | None = None
    profile_by_stage: bool = False
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_id: str | None = None
    merge_profiles: bool = False
    profile_prefix: str | None = None
    profile_stages: list[str] | None = None

    @model_validator(mode="after")
    def _supported(self) -> ProfileRequest:
        refused = {"start_step": self.start_step is not None, "num_steps": self.num_steps is not None,
                   "profile_by_stage": self.profile_by_stage, "merge_profiles": self.merge_profiles,
                   "profile_stages": self.profile_stages is not None}  # fmt: skip
        named = [name for name, is_set in refused.items() if is_set]
        if named:
            raise ValueError(f"{', '.join(named)}: not supported by this engine; start and stop the profile around "
                             "the work to trace (/start_profile, then /stop_profile)")  # fmt: skip
        if self.profile_id is not None and not _is_plain_name(self.profile_id):
            raise ValueError("profile_id: letters, digits, '-', '_' and '.' only (it names the trace file)")
        if self.profile_prefix is not None and not _is_plain_name(self.profile_prefix):
            raise ValueError("profile_prefix: letters, digits, '-', '_' and '.' only (it names the trace file)")
        return self


def _is_plain_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and all(c.isalnum() or c in "-_." for c in name)


class TraceRecorder:
    """One `torch.profiler` trace of the calling thread, from `start` to `stop`, written as Chrome / Perfetto JSON
    (the engine's, and a trainer rank's in the orchestrator's run.profile_steps)."""

    def __init__(self) -> None:
        self._profile: Any = None
        self._path: Path | None = None

    @property
    def is_recording(self) -> bool:
        return self._profile is not None

    def start(self, path: Path, gpu: bool = True, memory: bool = False, shapes: bool = False,
              stack: bool = False) -> None:  # fmt: skip
        """Record this thread's ops (and the GPU's, with `gpu`, where there is one) until `stop` writes `path`."""
        if self._profile is not None:
            raise EngineError(f"a profile is already recording (to {self._path}); stop it first", status_code=400)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if gpu and torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._profile = torch.profiler.profile(
            activities=activities, record_shapes=shapes, with_stack=stack, profile_memory=memory
        )
        self._profile.start()
        self._path = path

    def stop(self) -> Path:
        """Stop recording and write the trace; its path."""
        if self._profile is None or self._path is None:
            raise EngineError("no profile is recording; start one first", status_code=400)
        profile, path = self._profile, self._path
        self._profile = self._path = None
        profile.stop()
        profile.export_chrome_trace(str(path))
        return path

    def start_request(self, request: ProfileRequest) -> Path:
        """/start_profile's body: the trace `stop` will write (SGLang's file name in `output_dir`)."""
        directory = Path(request.output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR", DEFAULT_DIR))
        name = request.profile_id or f"{time.time():.0f}"
        path = directory / f"{request.profile_prefix or ''}{name}-TP-0.trace.json"
        activities = request.activities or ["CPU", "GPU"]
        self.start(path, gpu="GPU" in activities, memory="MEM" in activities, shapes=bool(request.record_shapes),
                   stack=bool(request.with_stack))  # fmt: skip
        return path

"""The engine's control operations, run on the engine thread between steps (`Engine.control`; the server's admin
routes): pause and continue generation, the weight-update bracket and the commit of new weights, the radix cache
flush, and releasing / resuming memory by tag (SGLang's `/release_memory_occupation`).
"""

from __future__ import annotations

from miles_contracts import WeightVersion
from miles_memory import OffloadManager
from miles_rollout.engine_error import EngineError
from miles_rollout.model_runner import ModelRunner
from miles_rollout.scheduler import Scheduler

MEMORY_TAGS = ("weights", "kv_cache")
PAUSE_MODES = ("abort", "retract", "in_place")


class EngineControls:
    """The `Engine`'s control operations (a mixin: they work on the engine's scheduler, memory and flags)."""

    scheduler: Scheduler
    runner: ModelRunner
    memory: OffloadManager
    released: set[str]
    weights_stale: bool
    paused: str | None
    updating_weights: bool

    def commit_weights(self, version: WeightVersion) -> WeightVersion:
        """New weights are loaded (by `self.weights`): serve them as `version` (None: the version stays, as SGLang
        keeps it when an update names none)."""
        self.weights_stale = False
        return self.scheduler.commit_weights(version)

    def require_weights_resident(self) -> None:
        """An EngineError (409) while the weights are released."""
        if "weights" in self.released:
            raise EngineError("weights are released; call /resume_memory_occupation first", status_code=409)

    def flush_cache(self) -> None:
        """Empty the radix cache; refused (409) while requests are queued or running, as SGLang refuses it."""
        if self.scheduler.has_work:
            raise EngineError("the cache is in use by queued or running requests; flush it when they are done")
        self.scheduler.radix.reset()

    def pause_generation(self, mode: str) -> int:
        """Stop generating until `continue_generation` (SGLang's `/pause_generation`): `abort` finishes every
        request in flight with `abort`; `retract` takes them out of the batch and frees their KV (they recompute
        it and continue after `continue_generation`); `in_place` keeps them, KV and all, where they are. Returns
        the number of requests paused (aborted for `abort`)."""
        if mode not in PAUSE_MODES:
            raise EngineError(f"unknown pause mode {mode!r}; use one of {list(PAUSE_MODES)}")
        scheduler = self.scheduler
        if mode == "abort":
            count = scheduler.num_in_flight
            scheduler.process_aborts([None])
        elif mode == "retract":
            count = scheduler.retract()
        else:
            count = scheduler.num_in_flight
        self.paused = mode
        return count

    def continue_generation(self) -> None:
        """Generate again after `pause_generation`."""
        self.paused = None

    def begin_weight_update(self) -> None:
        """Open a weight update made of several calls (SGLang's `/begin_weight_update`): no request runs until
        `end_weight_update`, so none sees a half-updated model. The weights are updated in place: no second copy
        is held."""
        self.require_weights_resident()
        self.updating_weights = True

    def end_weight_update(self, version: WeightVersion) -> WeightVersion:
        """Close the weight update: serve the new weights (as `version` when given)."""
        if not self.updating_weights:
            raise EngineError("no weight update is open; call /begin_weight_update first", 409)
        self.updating_weights = False
        return self.commit_weights(version)

    def _memory_tags(self, tags: list[str] | None) -> list[str]:
        for tag in tags or MEMORY_TAGS:
            if tag not in MEMORY_TAGS:
                raise EngineError(f"unknown memory tag {tag!r}; use one of {list(MEMORY_TAGS)}")
        return list(tags or MEMORY_TAGS)

    def release_memory(self, tags: list[str] | None) -> list[str]:
        """Drop the memory of `tags` (None: all; SGLang's `/release_memory_occupation`); returns what is released."""
        for tag in self._memory_tags(tags):
            if tag in self.released:
                continue
            if tag == "kv_cache":
                self.scheduler.forget_kv()
            self.memory.offload([tag])
            self.released.add(tag)
        return sorted(self.released)

    def resume_memory(self, tags: list[str] | None) -> list[str]:
        """Take back what `release_memory` dropped, zeroed; released weights wait for a weight update."""
        for tag in self._memory_tags(tags):
            if tag not in self.released:
                continue
            self.memory.onload([tag])
            if tag == "weights":
                self.weights_stale = True  # contents were dropped: a weight update must come first
            self.released.discard(tag)
        return sorted(self.released)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the engine holds now, by tag (`/get_server_info`'s `memory_bytes`), and the routed-experts host
        buffer's (`routed_experts`; never released, as SGLang keeps it)."""
        held = self.memory.resident_bytes()
        if self.runner.routed_experts is not None:
            held["routed_experts"] = self.runner.routed_experts.num_bytes
        return held

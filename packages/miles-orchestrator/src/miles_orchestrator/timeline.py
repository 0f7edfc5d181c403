"""The run's phase timeline: when each step's rollout, reward, train, checkpoint, weight sync and evaluation ran.

Every phase the loop goes through is a span (`Timeline.span`), appended to RUN_DIR/timeline.jsonl as it ends
({"step", "phase", "start", "end"}, seconds since the epoch); the step is the one the current task works on
(`CURRENT_STEP`, set where a step's work begins: the producer's rollout, the loop's train step), so an overlapped run's
rollout of step k + 1 and training of step k each land in their own step. `plot_timeline` draws them as one lane per
phase (RUN_DIR/timeline.png, at the end of the run): where the time goes, and in overlapped runs what overlaps.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

CURRENT_STEP: ContextVar[int] = ContextVar("miles_step", default=0)
PHASES = ("rollout", "reward", "train", "checkpoint", "sync", "eval")  # the lanes, top to bottom


class Timeline:
    def __init__(self, path: Path) -> None:
        self.path = path

    @contextlib.contextmanager
    def span(self, phase: str, step: int | None = None) -> Iterator[None]:
        """Record `phase` of `step` (default: the current task's) from entry to exit, also when it raises."""
        step = CURRENT_STEP.get() if step is None else step
        began = time.time()
        try:
            yield
        finally:
            line = json.dumps({"step": step, "phase": phase, "start": began, "end": time.time()})
            with self.path.open("a") as f:
                f.write(line + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop the spans of steps after `step` (a resumed run redoes them)."""
        kept = [s for s in self.spans() if s["step"] <= step]
        if self.path.is_file():
            self.path.write_text("".join(json.dumps(s) + "\n" for s in kept))

    def spans(self) -> list[dict[str, Any]]:
        """The recorded spans (a torn last line, from a crash, is skipped)."""
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out


def plot_timeline(spans: list[dict[str, Any]], path: Path) -> Path | None:
    """One lane per phase, a bar per span (colored by step parity, the step number on bars wide enough), seconds
    since the first span; None (no file) without spans."""
    if not spans:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min(s["start"] for s in spans)
    lanes = [p for p in PHASES if any(s["phase"] == p for s in spans)]
    lanes += sorted({s["phase"] for s in spans} - set(lanes))
    end = max(s["end"] for s in spans) - origin
    figure, axis = plt.subplots(figsize=(12, 0.55 * len(lanes) + 1.4))
    for lane, phase in enumerate(lanes):
        for span in (s for s in spans if s["phase"] == phase):
            start, width = span["start"] - origin, max(span["end"] - span["start"], end * 1e-4)
            color = "tab:blue" if span["step"] % 2 else "tab:orange"
            axis.barh(lane, width, left=start, height=0.6, color=color, edgecolor="black", linewidth=0.3)
            if width > end * 0.03:
                axis.text(start + width / 2, lane, str(span["step"]), ha="center", va="center", fontsize=7)
    axis.set_yticks(range(len(lanes)), lanes)
    axis.invert_yaxis()
    axis.set_xlabel("seconds since the first phase (bars: steps, alternating colors)")
    axis.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path

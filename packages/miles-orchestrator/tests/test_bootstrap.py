"""The built-in policy's bootstrap: its early stop checks the probe pass rate every 10 steps from step 100 and stops
at the first check that reaches the target; its learning-rate schedule spans the cap (`model.bootstrap_steps`), so
a stop at the target comes with the learning rate still high (benchmarks/robustness.py measured why that matters)."""

from __future__ import annotations

from miles_orchestrator.config import RunConfig
from miles_orchestrator.data.bootstrap import ProbeStop
from miles_trainer import SFTConfig


def _probe(rates: dict[int, float], target: float) -> tuple[ProbeStop, list[int], list[str]]:
    """A ProbeStop whose pass rate at step s is `rates.get(s, 0)` (no model, no tokenizer)."""
    checked: list[int] = []
    logged: list[str] = []
    stop = ProbeStop.__new__(ProbeStop)
    stop.target, stop.log = target, logged.append

    def pass_rate(model: int) -> float:  # the test passes the step as the model
        checked.append(model)
        return rates.get(model, 0.0)

    stop.pass_rate = pass_rate  # type: ignore[method-assign]
    return stop, checked, logged


def test_the_probe_checks_every_10_steps_from_step_100_and_stops_at_the_first_that_reaches_the_target() -> None:
    stop, checked, logged = _probe({320: 0.3, 330: 0.36, 340: 0.5}, target=0.35)
    stopped = next(step for step in range(1, 1001) if stop(step, step))
    assert stopped == 330
    assert checked == list(range(100, 331, 10))
    assert logged[-1] == "bootstrap step 330: probe pass@1 36.0% (target 35%)"


def test_the_default_cap_leaves_the_learning_rate_high_where_the_bootstraps_stopped() -> None:
    """With the default cap the cosine schedule (down to a floor of 10%) is at 64-88% of its peak at steps 250-410,
    where the probe stopped every bootstrap of benchmarks/results/robustness.json."""
    cfg = RunConfig()
    optimizer = SFTConfig().optimizer.model_copy(update={"total_steps": cfg.model.bootstrap_steps})
    assert optimizer.schedule == "cosine"
    assert 0.63 < optimizer.lr_factor(410) < optimizer.lr_factor(250) < 0.88
    assert optimizer.lr_factor(cfg.model.bootstrap_steps - 1) < 0.11  # annealed only at the cap

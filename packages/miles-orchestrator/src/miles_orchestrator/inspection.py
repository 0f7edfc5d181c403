"""`miles-orchestrator inspect RUN_DIR --step N [--sample K]`: a saved step (run.save_rollouts) on the console.

Without `--sample`: one line per sample of the step's trained batch (reward, lengths, log-prob summary,
advantage, version, the start of the response) under the step's training metrics. With `--sample K` (K: the `#`
column, the sample's place in the batch): its prompt, response, label and reward, then one row per response token
(id, text, rollout log-prob, the trainer's where it recomputed them and their difference, advantage, loss mask,
weight version).
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from miles_contracts import Sample
from miles_orchestrator.rollout_dump import SavedStep

SUMMARY_METRICS = ("loss", "pg_loss", "grad_norm", "entropy", "kl", "train_rollout_logprob_abs_diff",
                   "train_rollout_logprob_abs_diff_max", "batch_reward_mean", "advantage_std")  # fmt: skip


def step_view(saved: SavedStep) -> Group:
    """The step's header (its training metrics, when it trained) and one row per sample."""
    title = f"step {saved.step}: {len(saved.samples)} samples (trained by version {saved.trained_version})"
    table = Table(title=title)
    for column in ("#", "index", "group", "reward", "status", "prompt", "response", "mean logp", "min logp",
                   "adv", "version", "text"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("status", "text") else "right")
    for i, (sample, adv) in enumerate(zip(saved.samples, saved.advantages, strict=True)):
        logps = sample.rollout_logprobs or []
        table.add_row(
            str(i), str(sample.index), str(sample.group_index), _number(sample.reward), str(sample.status),
            str(len(sample.prompt_tokens)), str(len(sample.response_tokens)),
            _number(sum(logps) / len(logps) if logps else None), _number(min(logps, default=None)),
            _number(adv[0] if adv else None), str(sample.weight_version), _excerpt(sample.response),
        )  # fmt: skip
    return Group(_outcome_line(saved), table)


def sample_view(saved: SavedStep, position: int, tokenizer: Any | None = None) -> Group:
    """One sample: its text, reward and label, then a row per response token."""
    if not 0 <= position < len(saved.samples):
        raise ValueError(f"--sample {position}: step {saved.step} has samples 0..{len(saved.samples) - 1}")
    sample, advantages = saved.samples[position], saved.advantages[position]
    trainer = None if saved.trainer_logprobs is None else saved.trainer_logprobs[position]
    head = Text()
    head.append(f"step {saved.step}, sample #{position} (index {sample.index}, group {sample.group_index})\n",
                style="bold")  # fmt: skip
    head.append(f"reward {_number(sample.reward)}, {sample.status}, finish {sample.finish_reason}, "
                f"weight version {sample.weight_version}, label {sample.label!r}\n")  # fmt: skip
    head.append("prompt: ", style="bold")
    head.append(_prompt_text(sample) + "\n")
    head.append("response: ", style="bold")
    head.append(sample.response + "\n")
    table = Table(title="response tokens")
    columns = ["pos", "id", "token", "rollout logp"] + (["trainer logp", "|Δ|"] if trainer is not None else [])
    for column in [*columns, "adv", "mask", "version"]:
        table.add_column(column, justify="left" if column == "token" else "right")
    mask, versions = sample.effective_loss_mask(), sample.token_versions()
    rollout = sample.rollout_logprobs
    for t, token in enumerate(sample.response_tokens):
        piece = repr(tokenizer.decode([token])) if tokenizer is not None else ""
        mine = None if rollout is None else rollout[t]
        cells = [str(t), str(token), piece, _number(mine, 6)]
        if trainer is not None:
            cells += [_number(trainer[t], 6), _number(None if mine is None else abs(trainer[t] - mine), 3)]
        table.add_row(*cells, _number(advantages[t]), str(mask[t]), str(versions[t]))
    return Group(head, table)


def _outcome_line(saved: SavedStep) -> Text:
    if saved.outcome is None:
        return Text(f"step {saved.step} did not finish training (no step_{saved.step:06d}.json)", style="yellow")
    metrics = saved.outcome["metrics"]
    shown = [f"{key} {metrics[key]:.4g}" for key in SUMMARY_METRICS if key in metrics]
    return Text("trained: " + ", ".join(shown))


def _prompt_text(sample: Sample) -> str:
    if isinstance(sample.prompt, str):
        return sample.prompt
    return " | ".join(f"{m.role}: {m.content}" for m in sample.prompt)


def _excerpt(text: str, width: int = 40) -> str:
    flat = text.replace("\n", "⏎")
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"

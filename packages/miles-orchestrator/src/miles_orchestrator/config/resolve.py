"""The run config's derived settings, applied in one place (docs/architecture.md, "Config").

Some settings follow from others: the trainer's log-prob temperature is the rollout's, the engine drafts when
`spec.mode` says so, an optimizer's schedule spans the run. `DERIVED` lists every one of them, each as the field it
sets, the setting it comes from and why; `resolve` applies the table once, after each section validated itself
and before the checks across sections (which read the resolved values). Two kinds:

- a *default* (`owned=False`): applied only where the config leaves the field unset; a value given wins;
- an *owned* setting (`owned=True`): its source is the one knob. A value given that differs from what the source
  says is refused, naming the knob to set instead (one knob per feature).

The derived fields a config got are kept on it (`RunConfig.derived`): `miles-orchestrator config show` says where
each value came from, and `dump_config` leaves them out, so a saved config re-derives them from their sources
(a resumed run whose overrides change a source follows it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from miles_spec.config import EAGLE3_DRAFT_DIR

if TYPE_CHECKING:
    from miles_orchestrator.config.run import RunConfig


class _Keep:
    """`Derived.value`'s answer when there is nothing to derive for this config."""

    def __repr__(self) -> str:
        return "KEEP"


KEEP: Any = _Keep()


@dataclass(frozen=True)
class Derived:
    """`field` (dotted) takes `value(cfg)` (KEEP: nothing to derive here), from `source`, because `why`."""

    field: str
    source: str
    why: str
    value: Callable[[RunConfig], Any]
    owned: bool = False


def _megatron(cfg: RunConfig) -> bool:
    return cfg.trainer.backend.name == "megatron"


def _optimizer_steps(cfg: RunConfig) -> int:
    return cfg.run.num_steps * cfg.trainer.steps_per_rollout


def _speculative_algorithm(cfg: RunConfig) -> str | None:
    if not cfg.spec.drafts:
        return None
    if cfg.spec.draft == "eagle3":
        return "EAGLE3"
    given = cfg.rollout.engine.speculative_algorithm
    return given if given in ("NEXTN", "EAGLE") else "NEXTN"


def eagle3_draft_path(cfg: RunConfig) -> str | None:
    """The EAGLE-3 draft the run starts from: spec.draft_path, or the fresh one in RUN_DIR/eagle3_draft (online
    without a path; `preflight.with_fresh_eagle3` writes it); None for an MTP draft."""
    if cfg.spec.draft != "eagle3":
        return None
    return cfg.spec.draft_path or str(Path(cfg.run.run_dir).resolve() / EAGLE3_DRAFT_DIR)


DERIVED: tuple[Derived, ...] = (
    Derived("trainer.loss.temperature", "rollout.temperature",
            "the log-prob contract: the trainer's log-probs are log_softmax(logits / T) at the rollout's T",
            lambda c: c.rollout.temperature, owned=True),
    Derived("trainer.loss.max_response_len", "rollout.max_new_tokens",
            "Dr.GRPO's constant L: the longest response", lambda c: c.rollout.max_new_tokens),
    Derived("trainer.loss.is_mode", "run.mode",
            "overlapped runs train stale tokens: each is weighted by pi_old / pi_behaviour, truncated (TIS)",
            lambda c: "truncate" if c.run.mode != "sync" else KEEP),
    Derived("trainer.loss.opd_topk_coef", "opd.kl_coef",
            "with opd.top_k the teacher's top-k forward KL is a loss term of weight opd.kl_coef (0 without)",
            lambda c: c.opd.kl_coef if c.opd.is_enabled and c.opd.top_k else 0.0, owned=True),
    Derived("trainer.optimizer.total_steps", "run.num_steps x trainer.steps_per_rollout",
            "the learning-rate schedule spans the run", _optimizer_steps),
    Derived("trainer.critic.optimizer.total_steps", "run.num_steps x trainer.steps_per_rollout",
            "the critic's learning-rate schedule spans the run", _optimizer_steps),
    Derived("spec.optimizer.total_steps", "run.num_steps x trainer.steps_per_rollout",
            "the MTP draft's learning-rate schedule spans the run", _optimizer_steps),
    Derived("rollout.batch_requests", "rollout.num_engines",
            "one batched request would go to one engine: the router spreads the groups' requests",
            lambda c: False if c.rollout.num_engines > 1 else KEEP),
    Derived("rollout.return_routed_experts", "trainer.routing_replay",
            "routing replay trains on the experts the rollout recorded",
            lambda c: True if c.trainer.routing_replay == "rollout" else KEEP, owned=True),
    Derived("rollout.engine.enable_return_routed_experts", "rollout.return_routed_experts",
            "the engine records each token's experts for the rollout that asks for them",
            lambda c: c.rollout.return_routed_experts, owned=True),
    Derived("rollout.engine.speculative_algorithm", "spec.mode",
            "spec.mode frozen / online drafts with the policy's MTP modules (SGLang's NEXTN, or EAGLE) or, with "
            "spec.draft=eagle3, an EAGLE-3 draft (EAGLE3); off does not draft", _speculative_algorithm, owned=True),
    Derived("rollout.engine.speculative_draft_model_path", "spec.draft_path",
            "spec.draft=eagle3 drafts with spec.draft_path, or a fresh draft in RUN_DIR/eagle3_draft",
            lambda c: eagle3_draft_path(c) if c.spec.drafts else None, owned=True),
    Derived("rollout.engine.speculative_num_steps", "spec.num_steps",
            "the draft tokens per decoding step that the draft trains for",
            lambda c: c.spec.num_steps if c.spec.drafts else KEEP, owned=True),
    Derived("rollout.engine.speculative_eagle_topk", "spec.eagle_topk",
            "the draft's branches per level: a chain (1) or a tree",
            lambda c: c.spec.eagle_topk if c.spec.drafts else KEEP, owned=True),
    Derived("rollout.engine.speculative_num_draft_tokens", "spec.num_draft_tokens",
            "the tokens one verify step checks",
            lambda c: c.spec.num_draft_tokens if c.spec.drafts and c.spec.num_draft_tokens else KEEP, owned=True),
    Derived("rollout.engine.policy_lora", "trainer.lora",
            "the engine merges the adapters each weight sync sends into its base, so it needs their shape",
            lambda c: c.trainer.lora.adapters(), owned=True),
    Derived("memory.plan.distributed_optimizer", "trainer.backend.name",
            "Miles' Megatron backend replicates AdamW's state over the data-parallel ranks",
            lambda c: False if _megatron(c) else KEEP),
)  # fmt: skip


def _parent(cfg: BaseModel, dotted: str) -> tuple[BaseModel, str]:
    *path, name = dotted.split(".")
    node = cfg
    for part in path:
        node = getattr(node, part)
    return node, name


def value_at(cfg: BaseModel, dotted: str) -> Any:
    """The value of the dotted field `dotted` of `cfg`."""
    parent, name = _parent(cfg, dotted)
    return getattr(parent, name)


def is_set(cfg: BaseModel, dotted: str) -> bool:
    """Whether the config gave `dotted` a value (a file or an override), rather than its default."""
    node: BaseModel = cfg
    for part in dotted.split("."):
        if part not in node.model_fields_set:
            return False
        node = getattr(node, part)
    return True


def _set(cfg: BaseModel, dotted: str, value: Any) -> None:
    """Set `dotted` on `cfg`'s (nested) models, each rebuilt with `model_copy`: sections may be shared."""
    head, _, rest = dotted.partition(".")
    if not rest:
        object.__setattr__(cfg, head, value)
        return
    child = getattr(cfg, head).model_copy()
    _set(child, rest, value)
    object.__setattr__(cfg, head, child)


def resolve(cfg: RunConfig) -> dict[str, Derived]:
    """Apply `DERIVED` to `cfg` in order; the fields derived (name → its row). ValueError when a value given for an
    owned field disagrees with its source."""
    derived: dict[str, Derived] = {}
    for row in DERIVED:
        value = row.value(cfg)
        if value is KEEP:
            continue
        current = value_at(cfg, row.field)
        if is_set(cfg, row.field):
            if row.owned and current != value:
                raise ValueError(
                    f"{row.field}={current} disagrees with {row.source}={value_at(cfg, row.source)} ({row.why}); "
                    f"it follows {row.source}: drop {row.field} and set {row.source} instead"
                )
            continue
        if current != value:
            _set(cfg, row.field, value)
        derived[row.field] = row
    return derived

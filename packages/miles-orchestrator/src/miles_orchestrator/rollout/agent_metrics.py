"""The metrics of agentic rollouts (agentic.py), over a step's samples: read from each episode's
`Sample.metadata["agent"]` (turns, tool calls, tool errors, how it ended) and its reward."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from miles_contracts import Sample

ENDS = ("done", "max_turns", "budget", "truncated")


@dataclass(frozen=True)
class Episode:
    """What a step's metrics read of one episode."""

    num_turns: int
    num_tool_calls: int
    num_tool_errors: int
    num_model_tokens: int
    end: str
    reward: float

    @classmethod
    def of(cls, sample: Sample) -> Episode | None:
        agent = sample.metadata.get("agent")
        if not isinstance(agent, dict):
            return None
        return cls(
            num_turns=int(agent["turns"]),  # type: ignore[arg-type]
            num_tool_calls=int(agent["tool_calls"]),  # type: ignore[arg-type]
            num_tool_errors=int(agent["tool_errors"]),  # type: ignore[arg-type]
            num_model_tokens=sum(sample.effective_loss_mask()),
            end=str(agent["end"]),
            reward=sample.reward or 0.0,
        )


def agent_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """A step's agentic metrics: turns, tool calls and their failures per sample, model tokens per turn, how the
    episodes ended, and the mean reward of the samples by their number of turns."""
    episodes = [e for e in map(Episode.of, samples) if e is not None]
    if not episodes:
        return {}
    num = len(episodes)
    num_calls = sum(e.num_tool_calls for e in episodes)
    num_errors = sum(e.num_tool_errors for e in episodes)
    num_turns = sum(e.num_turns for e in episodes)
    out = {
        "agent_turns_mean": num_turns / num,
        "agent_tool_calls_mean": num_calls / num,
        "agent_tool_use_frac": sum(1 for e in episodes if e.num_tool_calls) / num,
        "agent_tool_errors": float(num_errors),
        "agent_tool_error_frac": num_errors / max(num_calls, 1),
        "agent_tokens_per_turn": sum(e.num_model_tokens for e in episodes) / max(num_turns, 1),
    }
    for end in ENDS:
        out[f"agent_end_{end}_frac"] = sum(1 for e in episodes if e.end == end) / num
    by_turns: dict[int, list[float]] = defaultdict(list)
    for episode in episodes:
        by_turns[episode.num_turns].append(episode.reward)
    for n, rewards in sorted(by_turns.items()):
        out[f"agent_reward_turns_{n}"] = sum(rewards) / len(rewards)
        out[f"agent_frac_turns_{n}"] = len(rewards) / num
    return out

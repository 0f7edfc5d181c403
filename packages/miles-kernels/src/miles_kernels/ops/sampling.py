"""Token sampling and log-probs, reproducible per (sample seed, position).

- Log-prob contract (docs/architecture.md): a token's log-prob is `log_softmax(logits / T)` over the full
  vocabulary, in float32, without top-k/top-p/min-p truncation; T is the request's temperature, T = 1 for greedy.
- Greedy (T = 0) takes the first maximum. Otherwise the logits are scaled by 1/T and one uniform number per
  row picks a token by inverse CDF: over the token-id order when no filter is set, else over the descending
  stable sort (ties keep the lower token id) after top-k, then top-p, then min-p, renormalized.
- The uniform number comes from a counter-based generator: splitmix64 of (seed, position). It is a pure function
  of its two integers, so the same sample at the same position draws the same number on any batch, thread count
  or device, and a resumed run redraws it exactly.
All per-row ops (softmax, sort, cumsum over the vocabulary) run row by row, so rows are batch-invariant.
Shapes: logits_MV (rows, vocab).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def splitmix64(value: int) -> int:
    """One step of the splitmix64 mixer (Steele et al.), on Python ints modulo 2^64."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def uniform(seed: int, position: int) -> float:
    """A float64 in [0, 1) that depends only on (seed, position)."""
    return (splitmix64(splitmix64(seed & _MASK64) ^ (position & _MASK64)) >> 11) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class RowSampling:
    """Sampling settings of one row (one sequence at one position)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    position: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def logprob_temperatures(rows: Sequence[RowSampling], device: torch.device) -> torch.Tensor:
    """Per-row T of the log-prob contract (1 for greedy), shape (M, 1)."""
    return torch.tensor([[1.0 if r.is_greedy else r.temperature] for r in rows], dtype=torch.float32, device=device)


def token_logprobs(logits_MV: torch.Tensor, tokens_M: torch.Tensor, temperatures_M1: torch.Tensor) -> torch.Tensor:
    """float32 `log_softmax(logits / T)[token]` per row (the log-prob contract)."""
    logprobs = torch.log_softmax(logits_MV.to(torch.float32) / temperatures_M1, dim=-1)
    return logprobs.gather(-1, tokens_M[:, None]).squeeze(-1)


def full_logprobs(logits_MV: torch.Tensor, temperatures_M1: torch.Tensor) -> torch.Tensor:
    """float32 `log_softmax(logits / T)` over the whole vocabulary (for top-logprobs)."""
    return torch.log_softmax(logits_MV.to(torch.float32) / temperatures_M1, dim=-1)


def _filtered_probs(row_logits_V: torch.Tensor, params: RowSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Descending (stable) sorted token ids and their renormalizable kept probabilities."""
    probs = torch.softmax(row_logits_V.to(torch.float32) / params.temperature, dim=-1)
    sorted_probs, sorted_ids = torch.sort(probs, descending=True, stable=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if params.top_k > 0:
        keep[params.top_k :] = False
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it stays).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep &= mass_before < params.top_p
    if params.min_p > 0.0:
        keep &= sorted_probs >= params.min_p * sorted_probs[0]
    keep[0] = True
    return sorted_ids, torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))


def sample(logits_MV: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """One token id per row, reproducible per (seed, position); greedy rows take the first argmax.

    Rows without top-k / top-p / min-p draw from the unsorted distribution (inverse CDF in token-id order: no sort
    needed), all at once; filtered rows sort their distribution one by one. Both are per-row computations.
    """
    if len(rows) != logits_MV.shape[0]:
        raise ValueError(f"got {len(rows)} sampling rows for {logits_MV.shape[0]} logit rows")
    tokens = torch.argmax(logits_MV, dim=-1)
    plain = [i for i, r in enumerate(rows) if not r.is_greedy and r.top_k <= 0 and r.top_p >= 1.0 and r.min_p <= 0.0]
    if plain:
        index = torch.tensor(plain, device=logits_MV.device)
        temps = torch.tensor([[rows[i].temperature] for i in plain], dtype=torch.float32, device=logits_MV.device)
        cdf = torch.cumsum(torch.softmax(logits_MV[index].to(torch.float32) / temps, dim=-1).to(torch.float64), dim=-1)
        draws = torch.tensor([[uniform(rows[i].seed, rows[i].position)] for i in plain], dtype=torch.float64)
        choice = torch.searchsorted(cdf, draws.to(cdf.device) * cdf[:, -1:], right=True).squeeze(1)
        tokens[index] = choice.clamp(max=logits_MV.shape[1] - 1)
    is_plain = set(plain)
    for i, params in enumerate(rows):
        if params.is_greedy or i in is_plain:
            continue
        sorted_ids, kept = _filtered_probs(logits_MV[i], params)
        cdf_row = torch.cumsum(kept.to(torch.float64), dim=-1)
        threshold = uniform(params.seed, params.position) * float(cdf_row[-1])
        # First index whose cumulative mass exceeds the threshold; kept[0] > 0 so it always exists.
        pick = int(torch.searchsorted(cdf_row, torch.tensor([threshold], dtype=torch.float64), right=True).item())
        tokens[i] = sorted_ids[min(pick, sorted_ids.shape[0] - 1)]
    return tokens

"""Token sampling and log-probs, reproducible per (sample seed, position).

- Log-prob contract (docs/architecture.md): a token's log-prob is `log_softmax(logits / T)` over the full
  vocabulary, in float32, without top-k/top-p/min-p truncation; T is the request's temperature, T = 1 for greedy.
- Greedy (T = 0) takes the first maximum. Otherwise a row takes the Gumbel-max: argmax over tokens of
  logits / T + g_token, in float64, where g_token is a standard Gumbel variable per (seed, position, token id).
  With top-k / top-p / min-p the argmax runs over the tokens the filters keep (top-k, then top-p, then min-p over the
  descending stable sort; ties keep the lower token id), which samples the renormalized filtered distribution.
- The noise comes from a counter-based generator: splitmix64 of (seed, position, token id) -> uniform u in (0, 1)
  -> g = -log(-log u). It is a pure function of its three integers, so the same sample at the same position draws
  the same noise on any batch, thread count or device, and a resumed run redraws it exactly.
- Why Gumbel-max: speculative decoding's draft samples with the target's noise and is accepted where both pick the
  same token. Noise per token couples the two almost as well as rejection sampling can (1 - TV); the inverse CDF of
  one uniform per position accepts far less (benchmarks/spec_coupling.py, docs/architecture.md).
Every op is elementwise or runs row by row (noise, softmax, sort, argmax), so rows are batch-invariant.
Shapes: logits_MV (rows, vocab).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from miles_kernels import native

_MASK64 = (1 << 64) - 1


def splitmix64(value: int) -> int:
    """One step of the splitmix64 mixer (Steele et al.), on Python ints modulo 2^64."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """`splitmix64` elementwise on int64 tensors holding 64-bit patterns (int64 arithmetic wraps modulo 2^64)."""
    x = x + _signed(0x9E3779B97F4A7C15)
    x = (x ^ _shift_right(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shift_right(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shift_right(x, 31)


def _row_key(seed: int, position: int) -> int:
    return splitmix64(splitmix64(seed & _MASK64) ^ (position & _MASK64))


def uniform(seed: int, position: int, token: int) -> float:
    """A float64 in (0, 1) that depends only on (seed, position, token): the reference for `uniforms`."""
    return ((splitmix64(_row_key(seed, position) ^ token) >> 11) + 0.5) * (1.0 / (1 << 53))


def _uniforms(keys_M: torch.Tensor, vocab: int) -> torch.Tensor:
    """float64 uniforms (M, vocab): splitmix64(key ^ token id) of each row's key, elementwise."""
    tokens = torch.arange(vocab, dtype=torch.int64, device=keys_M.device)
    bits = _splitmix64_tensor(keys_M[:, None] ^ tokens[None, :])
    return (_shift_right(bits, 11).to(torch.float64) + 0.5) * (1.0 / (1 << 53))


def uniforms(seed: int, position: int, vocab: int, device: torch.device | None = None) -> torch.Tensor:
    """`uniform(seed, position, token)` for every token id in 0 .. vocab - 1, float64, shape (vocab,)."""
    return row_uniforms([RowSampling(seed=seed, position=position)], vocab, device or torch.device("cpu"))[0]


def _seeds_and_positions(rows: Sequence[RowSampling]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' seeds and positions as int64 tensors holding their 64-bit patterns, on the host."""
    seeds = torch.tensor([_signed(r.seed & _MASK64) for r in rows], dtype=torch.int64)
    positions = torch.tensor([_signed(r.position & _MASK64) for r in rows], dtype=torch.int64)
    return seeds, positions


def row_keys(rows: Sequence[RowSampling], device: torch.device) -> torch.Tensor:
    """Each row's noise key (from its seed and position) as the int64 holding its 64 bits, shape (rows,)."""
    seeds, positions = _seeds_and_positions(rows)
    return _splitmix64_tensor(_splitmix64_tensor(seeds) ^ positions).to(device)


def row_uniforms(rows: Sequence[RowSampling], vocab: int, device: torch.device) -> torch.Tensor:
    """float64 (rows, vocab): `uniform(row.seed, row.position, token)` for every token id. On a CPU where the native
    kernels run, one threaded call (native/noise.cpp: the same bits as the torch ops here, which take ~20 int64 passes
    over rows x vocab: 0.65 s for 64 rows of a 151,936-token vocabulary on a 2-core AMD EPYC)."""
    if device.type == "cpu" and native.status() is True:
        return native.gumbel_uniforms(*_seeds_and_positions(rows), vocab)
    return _uniforms(row_keys(rows, device), vocab)


def gumbel_noise(rows: Sequence[RowSampling], vocab: int, device: torch.device) -> torch.Tensor:
    """One standard Gumbel variable per (row's seed, row's position, token id), float64, shape (rows, vocab)."""
    return -torch.log(-torch.log(row_uniforms(rows, vocab, device)))


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


def _filter_mask(row_logits_V: torch.Tensor, params: RowSampling) -> torch.Tensor:
    """The tokens top-k, then top-p, then min-p keep (in token-id order); the most likely token always stays.

    The probabilities are sorted descending and stably (ties keep the lower token id) to apply the filters."""
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
    return torch.zeros_like(keep).scatter(0, sorted_ids, keep)


def sample(logits_MV: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """One token id per row, reproducible per (seed, position); greedy rows take the first argmax.

    Sampled rows take the Gumbel-max: argmax over the kept tokens of logits / T + g, g = `gumbel_noise`, in float64
    (first maximum on ties). Rows are computed independently of each other (batch-invariant).
    """
    _check_rows(logits_MV, rows)
    tokens = torch.argmax(logits_MV, dim=-1)
    sampled = [i for i, r in enumerate(rows) if not r.is_greedy]
    if sampled:
        tokens[torch.tensor(sampled, device=logits_MV.device)] = torch.argmax(
            _noisy_scores(logits_MV, rows, sampled), dim=-1
        )
    return tokens


def sampling_scores(logits_MV: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """float64 (M, V): the scores `sample` takes the argmax of, per row: the logits of a greedy row; logits / T + g
    of a sampled one, -inf where its filters drop a token. A speculative draft tree ranks its candidates by them
    (their softmax): the token `sample` draws is always the first."""
    _check_rows(logits_MV, rows)
    scores = logits_MV.to(torch.float64).clone()
    sampled = [i for i, r in enumerate(rows) if not r.is_greedy]
    if sampled:
        scores[torch.tensor(sampled, device=logits_MV.device)] = _noisy_scores(logits_MV, rows, sampled)
    return scores


def _check_rows(logits_MV: torch.Tensor, rows: Sequence[RowSampling]) -> None:
    if len(rows) != logits_MV.shape[0]:
        raise ValueError(f"got {len(rows)} sampling rows for {logits_MV.shape[0]} logit rows")


def _noisy_scores(logits_MV: torch.Tensor, rows: Sequence[RowSampling], sampled: list[int]) -> torch.Tensor:
    """float64 logits / T + g of the `sampled` rows, -inf where a row's filters drop a token."""
    device, vocab = logits_MV.device, logits_MV.shape[1]
    index = torch.tensor(sampled, device=device)
    temps = torch.tensor([[rows[i].temperature] for i in sampled], dtype=torch.float64, device=device)
    scores = logits_MV[index].to(torch.float64) / temps + gumbel_noise([rows[i] for i in sampled], vocab, device)
    for j, i in enumerate(sampled):
        if rows[i].top_k > 0 or rows[i].top_p < 1.0 or rows[i].min_p > 0.0:
            scores[j].masked_fill_(~_filter_mask(logits_MV[i], rows[i]), float("-inf"))
    return scores

"""The shared inputs of the reference-formula tests (test_reference_*.py): random float64 tensors with ragged masks
(rows of different lengths, a row with a hole in its mask, an all-masked row) and extreme values (log-ratios of ±30,
log-probs of -50 and -1e-9, advantages of both signs), the TRL loss types as Miles aggregation modes, and the tight
comparison and value-and-gradient helpers. The formulas they are fed to are transcribed in reference_verl_losses.py,
reference_verl_advantages.py and reference_trl.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

F64 = torch.float64


# Ragged mask: full row, right-padded rows of 5, 1 and 3 tokens, a row with a hole (tool output), an all-masked row.
MASK = torch.tensor(
    [
        [1, 1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
    ],
    dtype=torch.bool,
)
N, T = MASK.shape
HOLE_ROW, EMPTY_ROW = 3, 4
# Masks whose every row is right-padded (no hole, no all-masked row): where verl <= 0.7 and Miles agree.
RIGHT_PADDED = torch.arange(T) < torch.tensor([8, 5, 1, 7, 2, 3]).unsqueeze(-1)
# Valid (row, column) positions of MASK that carry extreme log-ratios in `logprob_pair`.
EXTREME_LOG_RATIOS = {(0, 1): 30.0, (0, 2): -30.0, (1, 0): 25.0, (3, 4): -21.0, (5, 1): 19.5, (0, 6): -19.5}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Round to a multiple of 1/64: differences and row sums of such values are exact in float32, so a float32
    computation (Miles' importance weights, entropy) differs from the float64 reference only by exp's rounding."""
    return torch.round(x * 64) / 64


def logprob_pair(seed: int, *, extreme: bool = True, garbage: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, old) float64 (N, T): log-ratios ~ N(0, 0.5) plus, with `extreme`, log-ratios of ±30, ±25, ±21, ±19.5
    between tiny (-50) and near-one (-1e-9) probabilities; with `garbage`, padding holds finite nonsense."""
    g = gen(seed)
    old = -3.0 * torch.rand(N, T, generator=g, dtype=F64)
    logp = old + 0.5 * torch.randn(N, T, generator=g, dtype=F64)
    if extreme:
        for (i, t), log_ratio in EXTREME_LOG_RATIOS.items():
            if log_ratio > 0:  # pi_old tiny, pi near one
                old[i, t], logp[i, t] = -1e-9 - log_ratio, -1e-9
            else:  # pi_old near one, pi tiny
                old[i, t], logp[i, t] = -1e-9, -1e-9 + log_ratio
        old[2, 0], logp[2, 0] = -50.0, -49.0  # both tiny
    if garbage:
        logp = torch.where(MASK, logp, torch.full_like(logp, 7.0))
        old = torch.where(MASK, old, torch.full_like(old, -40.0))
    return logp, old


def token_advantages(seed: int) -> torch.Tensor:
    """Token advantages of both signs (N, T), a few exact zeros, large and small magnitudes."""
    adv = 2.0 * torch.randn(N, T, generator=gen(seed), dtype=F64)
    adv[0, 3] = 0.0
    adv[1, 1] = 50.0
    adv[5, 2] = -1e-6
    return adv


def seq_advantages(seed: int) -> torch.Tensor:
    """One advantage per row, both signs (N,)."""
    adv = torch.randn(N, generator=gen(seed), dtype=F64)
    adv[0], adv[1] = 1.5, -2.0
    return adv


def assert_close(actual: Any, expected: Any, *, rtol: float = 1e-7, atol: float = 1e-9) -> None:
    """Tight comparison; float32 Miles outputs are compared in float64 (pass a looser rtol for them)."""
    actual_t = torch.as_tensor(actual).to(F64)
    expected_t = torch.as_tensor(expected).to(F64)
    if expected_t.dim() == 0:  # a scalar expectation for every element
        expected_t = expected_t.expand_as(actual_t)
    torch.testing.assert_close(actual_t, expected_t, rtol=rtol, atol=atol, equal_nan=True)


def value_and_grad(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fn(x) detached, d fn(x) / dx) for a scalar fn."""
    x = x.detach().clone().requires_grad_(True)
    value = fn(x)
    (grad,) = torch.autograd.grad(value, x)
    return value.detach(), grad


TRL_COUNTS = {"max_completion_length": T + 5, "num_items_in_batch": int(MASK.sum()) + 17}
# TRL's loss_type -> (Miles aggregation mode, the global counts that reproduce TRL's normalizer)
TRL_LOSS_TYPES = {
    "grpo": ("seq-mean-token-mean", {"global_num_seqs": N}),
    "bnpo": ("token-mean", {}),
    "dr_grpo": ("seq-mean-token-sum-norm", {"global_num_seqs": N, "max_response_len": T + 5}),
    "dapo": ("token-mean", {"global_num_tokens": int(MASK.sum()) + 17}),  # num_items_in_batch: the generation batch
}


def trl_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, old, sampling, ref, advantages): log-ratios within ±20 (TRL does not clamp them), k3 below verl's cap
    of 10 (x = logp - ref >= -2), probabilities from tiny to near one, padding with finite nonsense."""
    g = gen(seed)
    old = quantize(-6.0 * torch.rand(N, T, generator=g, dtype=F64))
    logp = old + quantize(0.4 * torch.randn(N, T, generator=g, dtype=F64))
    logp[0, 1], old[0, 1] = -0.015625, -6.0  # ratio e^5.98, both signs of advantage below
    logp[1, 2], old[1, 2] = -8.0, -0.015625
    sampling = old + quantize(0.3 * torch.randn(N, T, generator=g, dtype=F64))
    sampling[0, 4] = old[0, 4] - 4.0  # token IS ratio e^4: truncated / rejected
    sampling[3, 5] = old[3, 5] + 3.0  # e^-3: below clip_min
    ref = logp + quantize(0.5 * torch.rand(N, T, generator=g, dtype=F64)) - 0.25
    ref[2, 0] = logp[2, 0] - 9.0  # x = 9: k3 = e^-9 + 8, below the cap
    for t in (logp, old, sampling, ref):
        t.masked_fill_(~MASK, -3.5)
    logp.masked_fill_(~MASK, 1.25)
    adv = seq_advantages(seed + 1)
    return logp, old, sampling, ref, adv


TRL_IS_MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def miles_is_from_trl_mode(trl_mode: str) -> tuple[str, str]:
    level, mode = trl_mode.split("_")
    return level, mode

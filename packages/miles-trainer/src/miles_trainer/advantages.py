"""Advantage estimators: step 5 of the RL step (docs/architecture.md), between the reward / filter and the train step.

The reward step leaves one scalar reward per sample (outcome reward) and the samples of one prompt share a
`group_index`. These pure torch functions turn rewards into per-token advantages that `losses.policy_loss`
consumes. No model, no distributed code: every estimator here sees the whole rollout batch at once (advantages
are computed once per rollout, before the batch is split into micro-batches).

Estimators (the formulas are in each docstring):
- GRPO, Dr.GRPO, RLOO: one advantage per sample from its group, broadcast to the sample's valid tokens.
- REINFORCE++ (with and without the group baseline): token-level, whitened over all valid tokens of the batch.
- GAE: token rewards + a critic's values (PPO).

Conventions (where this module departs from verl, it says so in the docstring):
- A group of one sample has no baseline to compare against, so its GRPO / Dr.GRPO / RLOO / REINFORCE++-baseline
  advantage is 0 (verl instead keeps the raw reward for these, which trains on an unbaselined signal).
- The group std is the unbiased (n - 1) std, as `torch.std` and verl use.
- Group statistics are accumulated in float64 and the result is cast back to the rewards' dtype.
- "Whitening" is verl's `masked_whiten`: (x - mean) / sqrt(var + 1e-8), mean and unbiased var over valid tokens.

Shapes: N samples (rows), T response tokens (padded length); `rewards_N`, `group_index_N` (integers),
`response_mask_NT` (bool or 0/1; 1 = the token is part of the response and carries loss).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from miles_trainer.config import SCALE_REWARDS, AdvantageConfig
from miles_trainer.plugins import load_checked_plugin

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "compute_advantages",
    "dr_grpo_advantages",
    "estimator_kwargs",
    "expand_to_tokens",
    "gae_advantages",
    "grpo_advantages",
    "outcome_token_rewards",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "rloo_advantages",
]

WHITEN_EPSILON = 1e-8  # verl's masked_whiten adds this to the variance


def _check_rewards(rewards_N: torch.Tensor, group_index_N: torch.Tensor | None = None) -> None:
    if rewards_N.dim() != 1:
        raise ValueError(f"rewards_N must be 1-D (one outcome reward per sample), got shape {tuple(rewards_N.shape)}")
    if group_index_N is None:
        return
    if group_index_N.shape != rewards_N.shape:
        raise ValueError(
            f"group_index_N must have one entry per reward: got shape {tuple(group_index_N.shape)} "
            f"for rewards of shape {tuple(rewards_N.shape)}"
        )
    if group_index_N.is_floating_point() or group_index_N.is_complex():
        raise ValueError(
            f"group_index_N must hold integer group ids (Sample.group_index), got dtype {group_index_N.dtype}; "
            "convert it with .long()"
        )


def _check_mask(response_mask_NT: torch.Tensor, num_rows: int, name: str = "response_mask_NT") -> None:
    if response_mask_NT.dim() != 2 or response_mask_NT.shape[0] != num_rows:
        raise ValueError(f"{name} must have shape (N, T) with N = {num_rows}, got {tuple(response_mask_NT.shape)}")


def _out_dtype(rewards: torch.Tensor) -> torch.dtype:
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def _group_mean_std_count(
    rewards_N: torch.Tensor, group_index_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group mean, unbiased group std, group size), in float64, for any order of group ids."""
    _, inverse_N, counts_G = torch.unique(group_index_N, return_inverse=True, return_counts=True)
    rewards = rewards_N.to(torch.float64)
    counts = counts_G.to(torch.float64)
    zeros_G = torch.zeros(counts_G.shape[0], dtype=torch.float64, device=rewards.device)
    mean_G = zeros_G.index_add(0, inverse_N, rewards) / counts
    centered_N = rewards - mean_G[inverse_N]
    # Bessel's correction (n - 1); size-1 groups get std 0 here and advantage 0 from the callers.
    var_G = zeros_G.index_add(0, inverse_N, centered_N.square()) / (counts - 1).clamp(min=1)
    return mean_G[inverse_N], var_G.sqrt()[inverse_N], counts_G[inverse_N]


def expand_to_tokens(adv_N: torch.Tensor, response_mask_NT: torch.Tensor) -> torch.Tensor:
    """Broadcast one advantage per sample to its valid tokens: adv_NT[i, t] = adv_N[i] * mask[i, t]."""
    if adv_N.dim() != 1:
        raise ValueError(f"adv_N must be 1-D (one value per sample), got shape {tuple(adv_N.shape)}")
    _check_mask(response_mask_NT, adv_N.shape[0])
    return adv_N.unsqueeze(-1) * response_mask_NT.to(adv_N.dtype)


def grpo_advantages(
    rewards_N: torch.Tensor,
    group_index_N: torch.Tensor,
    *,
    epsilon: float = 1e-6,
    scale_rewards: str = "group",
) -> torch.Tensor:
    """GRPO advantage of each sample, shape (N,).

        A_i = (r_i - mean_g) / (std_g + epsilon)      (scale_rewards="group", GRPO)
        A_i = (r_i - mean_g) / (std_B + epsilon)      (scale_rewards="batch", TRL's scale_rewards="batch")
        A_i = r_i - mean_g                            (scale_rewards="none", Dr.GRPO)

    mean_g and std_g are over the samples of i's group g, std_B over every reward of the batch; both are unbiased
    stds, sqrt(sum (r - mean)^2 / (n - 1)), as verl's `compute_grpo_outcome_advantage` and TRL's `nanstd` (TRL's
    epsilon is 1e-4). A group of one sample gets A = 0 (verl gives r / (1 + epsilon) there). A group whose rewards
    are all equal gets A = 0 for every sample.
    """
    _check_rewards(rewards_N, group_index_N)
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0 (it keeps the division finite for zero-std groups), got {epsilon}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; choose one of {list(SCALE_REWARDS)}")
    mean_N, std_N, count_N = _group_mean_std_count(rewards_N, group_index_N)
    adv_N = rewards_N.to(torch.float64) - mean_N
    if scale_rewards == "group":
        adv_N = adv_N / (std_N + epsilon)
    elif scale_rewards == "batch":
        batch_std = (
            rewards_N.to(torch.float64).std() if rewards_N.numel() > 1 else torch.zeros((), dtype=torch.float64)
        )
        adv_N = adv_N / (batch_std + epsilon)
    adv_N = torch.where(count_N > 1, adv_N, torch.zeros_like(adv_N))
    return adv_N.to(_out_dtype(rewards_N))


def dr_grpo_advantages(rewards_N: torch.Tensor, group_index_N: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO advantage (Liu et al. 2025), shape (N,): A_i = r_i - mean_g, no std scaling; size-1 groups get 0.

    Dr.GRPO also changes the loss aggregation (`seq-mean-token-sum-norm` in `losses.aggregate_loss`).
    """
    return grpo_advantages(rewards_N, group_index_N, scale_rewards="none")


def rloo_advantages(rewards_N: torch.Tensor, group_index_N: torch.Tensor) -> torch.Tensor:
    """RLOO (leave-one-out) advantage, shape (N,).

        A_i = r_i - (sum_{j in g, j != i} r_j) / (n_g - 1)  =  n_g / (n_g - 1) * (r_i - mean_g)

    A group of one sample has no other sample to form a baseline: A = 0 (verl leaves the raw reward there).
    """
    _check_rewards(rewards_N, group_index_N)
    mean_N, _, count_N = _group_mean_std_count(rewards_N, group_index_N)
    n = count_N.to(torch.float64)
    adv_N = n / (n - 1).clamp(min=1) * (rewards_N.to(torch.float64) - mean_N)
    adv_N = torch.where(count_N > 1, adv_N, torch.zeros_like(adv_N))
    return adv_N.to(_out_dtype(rewards_N))


def _masked_whiten(values_NT: torch.Tensor, mask_NT: torch.Tensor, epsilon: float) -> torch.Tensor:
    """verl's masked_whiten: (x - mean) / sqrt(var + epsilon) over valid tokens (unbiased var), 0 elsewhere."""
    mask = mask_NT.to(values_NT.dtype)
    num_valid = mask.sum()
    if int(num_valid.item()) < 2:
        raise ValueError(
            f"whitening needs at least 2 valid tokens in the batch (it uses the unbiased variance), got "
            f"{int(num_valid.item())}; pass whiten=False or a larger batch"
        )
    mean = (values_NT * mask).sum() / num_valid
    var = ((values_NT - mean).square() * mask).sum() / (num_valid - 1)
    return (values_NT - mean) * torch.rsqrt(var + epsilon) * mask


def outcome_token_rewards(rewards_N: torch.Tensor, response_mask_NT: torch.Tensor) -> torch.Tensor:
    """Token rewards (float64) with the outcome reward on each row's last valid token (zeros for rows with no valid
    token): the token rewards of REINFORCE++ and of GAE."""
    mask = response_mask_NT.bool()
    num_tokens = mask.shape[1]
    positions_NT = torch.arange(num_tokens, device=mask.device).expand_as(mask)
    last_N = torch.where(mask, positions_NT, -1).amax(dim=1)
    has_token_N = last_N >= 0
    token_rewards_NT = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    rows = torch.arange(mask.shape[0], device=mask.device)[has_token_N]
    token_rewards_NT[rows, last_N[has_token_N]] = rewards_N.to(torch.float64)[has_token_N]
    return token_rewards_NT


def reinforce_plus_plus_advantages(
    rewards_N: torch.Tensor,
    response_mask_NT: torch.Tensor,
    *,
    gamma: float = 1.0,
    whiten: bool = True,
    epsilon: float = WHITEN_EPSILON,
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025) token advantages of outcome rewards, shape (N, T).

    The reward r_i sits on the last valid token of row i. Going backwards over the valid tokens of a row,

        G_t = rew_t + gamma * G_next       (G_next: the return of the next valid token, 0 after the last one)

    then, with whiten=True (as verl does), A = (G - mean) / sqrt(var + epsilon), mean and unbiased var over all
    valid tokens of the batch; masked tokens get 0. Masked tokens inside a response (e.g. tool output in a
    multi-turn sample) are skipped: the return passes through them undiscounted, as in verl 0.9.1; verl <= 0.7
    reset the return at every masked token, which matches this for right-padded responses and cuts the credit at
    mask holes.
    """
    _check_rewards(rewards_N)
    _check_mask(response_mask_NT, rewards_N.shape[0])
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    mask = response_mask_NT.to(torch.float64)
    token_rewards_NT = outcome_token_rewards(rewards_N, response_mask_NT)
    returns_NT = torch.zeros_like(token_rewards_NT)
    running_N = torch.zeros(rewards_N.shape[0], dtype=torch.float64, device=rewards_N.device)
    for t in reversed(range(mask.shape[1])):
        running_N = torch.where(mask[:, t] > 0, token_rewards_NT[:, t] + gamma * running_N, running_N)
        returns_NT[:, t] = running_N
    returns_NT = returns_NT * mask
    advantages_NT = _masked_whiten(returns_NT, mask, epsilon) if whiten else returns_NT
    return advantages_NT.to(_out_dtype(rewards_N))


def reinforce_plus_plus_baseline_advantages(
    rewards_N: torch.Tensor,
    group_index_N: torch.Tensor,
    response_mask_NT: torch.Tensor,
    epsilon: float = WHITEN_EPSILON,
) -> torch.Tensor:
    """REINFORCE++-baseline token advantages (verl's version), shape (N, T).

        a_i = r_i - mean_g                        (group-mean baseline; 0 for a group of one sample)
        A[i, t] = (a_i - mean) / sqrt(var + epsilon) * mask[i, t]

    with mean and unbiased var taken over all valid tokens of the batch (each sample weighs by its token count).
    `epsilon` is the whitening epsilon: verl's signature has `epsilon=1e-6` but never uses it, and its whitening
    adds 1e-8 to the variance, which is this default.
    """
    _check_rewards(rewards_N, group_index_N)
    _check_mask(response_mask_NT, rewards_N.shape[0])
    centered_N = dr_grpo_advantages(rewards_N.to(torch.float64), group_index_N)
    advantages_NT = _masked_whiten(expand_to_tokens(centered_N, response_mask_NT), response_mask_NT, epsilon)
    return advantages_NT.to(_out_dtype(rewards_N))


def gae_advantages(
    token_rewards_NT: torch.Tensor,
    values_NT: torch.Tensor,
    response_mask_NT: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    whiten: bool = True,
    epsilon: float = WHITEN_EPSILON,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2015) for PPO with a critic: (advantages_NT, returns_NT).

    Backwards over the valid tokens t of each row, with t' the next valid token (none after the last one):

        delta_t = rew_t + gamma * V_t' - V_t          (V_t' = 0 after the last valid token)
        A_t     = delta_t + gamma * lam * A_t'        (A_t' = 0 after the last valid token)
        R_t     = A_t + V_t                           (the value target, taken before whitening)

    Masked tokens are skipped (their values and rewards are ignored; the recursion passes through them), as in
    verl's `compute_gae_advantage_return`. With whiten=True (verl's behaviour) the advantages are whitened over
    all valid tokens of the batch: (A - mean) / sqrt(var + epsilon), unbiased var. Masked positions of both
    outputs are 0. Computed in float64, returned in the dtype of `values_NT`.
    """
    if token_rewards_NT.dim() != 2 or values_NT.shape != token_rewards_NT.shape:
        raise ValueError(
            f"token_rewards_NT and values_NT must both have shape (N, T), got {tuple(token_rewards_NT.shape)} "
            f"and {tuple(values_NT.shape)}"
        )
    _check_mask(response_mask_NT, token_rewards_NT.shape[0])
    if response_mask_NT.shape != token_rewards_NT.shape:
        raise ValueError(
            f"response_mask_NT must match token_rewards_NT's shape {tuple(token_rewards_NT.shape)}, "
            f"got {tuple(response_mask_NT.shape)}"
        )
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    rewards = token_rewards_NT.to(torch.float64)
    values = values_NT.detach().to(torch.float64)
    is_valid = response_mask_NT.bool()
    num_rows, num_tokens = rewards.shape
    next_value_N = torch.zeros(num_rows, dtype=torch.float64, device=rewards.device)
    next_adv_N = torch.zeros_like(next_value_N)
    advantages_NT = torch.zeros_like(rewards)
    for t in reversed(range(num_tokens)):
        delta_N = rewards[:, t] + gamma * next_value_N - values[:, t]
        adv_N = delta_N + gamma * lam * next_adv_N
        next_value_N = torch.where(is_valid[:, t], values[:, t], next_value_N)
        next_adv_N = torch.where(is_valid[:, t], adv_N, next_adv_N)
        advantages_NT[:, t] = next_adv_N
    mask = is_valid.to(torch.float64)
    advantages_NT = advantages_NT * mask
    returns_NT = (advantages_NT + values) * mask
    if whiten:
        advantages_NT = _masked_whiten(advantages_NT, mask, epsilon)
    return advantages_NT.to(values_NT.dtype), returns_NT.to(values_NT.dtype)


class AdvantageEstimator(Protocol):
    """An outcome-reward advantage estimator plug-in: (rewards_N, group_index_N, response_mask_NT) -> adv_NT."""

    def __call__(
        self, rewards_N: torch.Tensor, group_index_N: torch.Tensor, response_mask_NT: torch.Tensor, /, **kwargs: Any
    ) -> torch.Tensor: ...


def _grpo(rewards_N: torch.Tensor, group_index_N: torch.Tensor, mask_NT: torch.Tensor, /, **kw: Any) -> torch.Tensor:
    return expand_to_tokens(grpo_advantages(rewards_N, group_index_N, **kw), mask_NT)


def _dr_grpo(
    rewards_N: torch.Tensor, group_index_N: torch.Tensor, mask_NT: torch.Tensor, /, **kw: Any
) -> torch.Tensor:
    return expand_to_tokens(dr_grpo_advantages(rewards_N, group_index_N, **kw), mask_NT)


def _rloo(rewards_N: torch.Tensor, group_index_N: torch.Tensor, mask_NT: torch.Tensor, /, **kw: Any) -> torch.Tensor:
    return expand_to_tokens(rloo_advantages(rewards_N, group_index_N, **kw), mask_NT)


def _rpp(rewards_N: torch.Tensor, group_index_N: torch.Tensor, mask_NT: torch.Tensor, /, **kw: Any) -> torch.Tensor:
    _check_rewards(rewards_N, group_index_N)  # REINFORCE++ has no group baseline; the ids are only checked
    return reinforce_plus_plus_advantages(rewards_N, mask_NT, **kw)


def _rpp_baseline(
    rewards_N: torch.Tensor, group_index_N: torch.Tensor, mask_NT: torch.Tensor, /, **kw: Any
) -> torch.Tensor:
    return reinforce_plus_plus_baseline_advantages(rewards_N, group_index_N, mask_NT, **kw)


# Outcome-reward estimators under one signature. GAE needs a critic's values and token rewards, so it is called
# directly (`gae_advantages`), not through this table. The keys are miles_trainer.config's names (a run config checks
# them without torch); a test holds the two equal.
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "rloo": _rloo,
    "reinforce_plus_plus": _rpp,
    "reinforce_plus_plus_baseline": _rpp_baseline,
}


def compute_advantages(
    name: str,
    rewards_N: torch.Tensor,
    group_index_N: torch.Tensor,
    response_mask_NT: torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:
    """Token advantages (N, T) from the outcome estimator `name` in ADVANTAGE_ESTIMATORS; kwargs go to it.

    e.g. compute_advantages("grpo", rewards_N, group_index_N, mask_NT, epsilon=1e-4) or
    compute_advantages("reinforce_plus_plus", rewards_N, group_index_N, mask_NT, gamma=0.99). A
    "module:function" name loads an `AdvantageEstimator` plug-in (see `load_advantage_estimator`).
    """
    estimator = load_advantage_estimator(name) if ":" in name else ADVANTAGE_ESTIMATORS.get(name)
    if estimator is None:
        raise ValueError(
            f"unknown advantage estimator {name!r}; choose one of {sorted(ADVANTAGE_ESTIMATORS)} "
            "(GAE needs a critic: call gae_advantages directly)"
        )
    return estimator(rewards_N, group_index_N, response_mask_NT, **kwargs)


def estimator_kwargs(name: str, config: AdvantageConfig) -> dict[str, Any]:
    """The keyword arguments of the outcome estimator `name` that `config` sets (`trainer.advantage` of a run
    config); a knob an estimator does not use is not passed, and a plug-in gets none."""
    if name == "grpo":
        return {"epsilon": config.std_epsilon, "scale_rewards": config.scale_rewards}
    if name == "reinforce_plus_plus":
        return {"gamma": config.gamma, "whiten": config.whiten}
    return {}


def load_advantage_estimator(path: str) -> AdvantageEstimator:
    """Load a "module:function" `AdvantageEstimator` and check it takes (rewards_N, group_index_N, mask_NT)."""
    estimator: AdvantageEstimator = load_checked_plugin(
        path, AdvantageEstimator, "advantage", ("rewards_N", "group_index_N", "response_mask_NT")
    )
    return estimator

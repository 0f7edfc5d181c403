"""verl's advantage estimators re-typed as small pure-torch functions (their masked_whiten is
reference_verl_losses.py's transcription of verl/utils/torch_functional.py).

No verl import at test time: each function cites the package, version, file and function it is transcribed from;
test-only changes to a transcription (a config object replaced by arguments) are marked "test-only".
test_reference_advantages.py compares miles_trainer.advantages against them.

References:
- verl 0.9.1: verl/trainer/ppo/core_algos.py (compute_grpo_outcome_advantage, compute_rloo_outcome_advantage,
  compute_reinforce_plus_plus_outcome_advantage, compute_reinforce_plus_plus_baseline_outcome_advantage,
  compute_gae_advantage_return).
- verl 0.7.0: verl/trainer/ppo/core_algos.py (compute_reinforce_plus_plus_outcome_advantage resetting the return at
  masked tokens).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from reference_verl_losses import verl_masked_whiten


# verl 0.9.1, verl/trainer/ppo/core_algos.py, compute_grpo_outcome_advantage
def verl_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: list[int],
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = token_level_rewards.sum(dim=-1)
    id2score: dict[int, list[torch.Tensor]] = defaultdict(list)
    id2mean, id2std = {}, {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
                id2std[idx] = torch.tensor(1.0)
            else:
                scores_tensor = torch.stack(id2score[idx])
                id2mean[idx] = torch.mean(scores_tensor)
                id2std[idx] = torch.std(scores_tensor)
        for i in range(bsz):
            if norm_adv_by_std_in_grpo:
                scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


# verl 0.9.1, verl/trainer/ppo/core_algos.py, compute_rloo_outcome_advantage
def verl_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = token_level_rewards.sum(dim=-1)
    id2score: dict[int, list[torch.Tensor]] = defaultdict(list)
    id2mean = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
            else:
                id2mean[idx] = torch.mean(torch.stack(id2score[idx]))
        for i in range(bsz):
            response_num = len(id2score[index[i]])
            if response_num > 1:
                scores[i] = scores[i] * response_num / (response_num - 1) - id2mean[index[i]] * response_num / (
                    response_num - 1
                )
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


# verl 0.9.1, verl/trainer/ppo/core_algos.py, compute_reinforce_plus_plus_baseline_outcome_advantage
def verl_rpp_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    response_length = token_level_rewards.shape[-1]
    scores = token_level_rewards.sum(dim=-1)
    id2score: dict[int, list[torch.Tensor]] = defaultdict(list)
    id2mean = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
            else:
                id2mean[idx] = torch.mean(torch.stack(id2score[idx]))
        for i in range(bsz):
            scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1).tile([1, response_length]) * response_mask
        scores = verl_masked_whiten(scores, response_mask) * response_mask
    return scores, scores


# verl 0.9.1, verl/trainer/ppo/core_algos.py, compute_reinforce_plus_plus_outcome_advantage (test-only: gamma is an
# argument instead of config.gamma)
def verl_rpp_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running_return: Any = 0
        for t in reversed(range(token_level_rewards.shape[1])):
            new_running_return = token_level_rewards[:, t] + gamma * running_return
            returns[:, t] = new_running_return * response_mask[:, t]
            running_return = new_running_return * response_mask[:, t] + running_return * (1 - response_mask[:, t])
        advantages = verl_masked_whiten(returns, response_mask)
        advantages = advantages * response_mask
    return advantages, returns


# verl 0.7.0, verl/trainer/ppo/core_algos.py, compute_reinforce_plus_plus_outcome_advantage (resets at masked tokens)
def verl070_rpp_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running_return: Any = 0
        for t in reversed(range(token_level_rewards.shape[1])):
            running_return = token_level_rewards[:, t] + gamma * running_return
            returns[:, t] = running_return
            running_return = running_return * response_mask[:, t]  # Reset after EOS
        advantages = verl_masked_whiten(returns, response_mask)
        advantages = advantages * response_mask
    return advantages, returns


# verl 0.9.1, verl/trainer/ppo/core_algos.py, compute_gae_advantage_return (test-only: `whiten=False` skips the final
# masked_whiten, to compare Miles' whiten=False)
def verl_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        nextvalues: Any = 0
        lastgaelam: Any = 0
        advantages_reversed = []
        gen_len = token_level_rewards.shape[-1]
        for t in reversed(range(gen_len)):
            delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
            lastgaelam_ = delta + gamma * lam * lastgaelam
            nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
            lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
        returns = advantages + values
        if whiten:
            advantages = verl_masked_whiten(advantages, response_mask)
    return advantages, returns

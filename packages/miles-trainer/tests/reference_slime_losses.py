"""slime's loss-side formulas re-typed as small pure-torch functions (no slime import at test time), for the
test_reference_*.py files. Each cites the file and function it is transcribed from; test-only changes are marked.

References:
- slime (THUDM/slime, main, 2026-12): slime/utils/ppo_utils.py (compute_cispo_loss).
"""

from __future__ import annotations

import torch


# slime, slime/utils/ppo_utils.py, compute_cispo_loss (test-only: without its @torch.compile(dynamic=True))
def slime_compute_cispo_loss(
    ppo_kl: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = (-ppo_kl).exp()
    ratio_truncated = torch.clamp(ratio, min=1.0 - eps_clip, max=1.0 + eps_clip_high)
    pg_losses = -ratio_truncated.detach() * advantages * log_probs
    clipfrac = (ratio_truncated != ratio).float()
    return pg_losses, clipfrac

"""verl's top-k on-policy distillation loss re-typed as a small pure-torch function (no verl import at test time).

Reference: verl (main branch, 2026), verl/trainer/distillation/fsdp/losses.py: `kl_divergence` and
`compute_forward_kl_topk` (the teacher top-k truncated forward KL). Test-only changes: the nested-tensor unpacking,
Ulysses sequence-parallel slicing, the optional log-prob clamp and the overlap diagnostics are left out; the config
object is gone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


# verl, verl/trainer/distillation/fsdp/losses.py, kl_divergence
def verl_kl_divergence(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    log_p = log_p.float()
    log_q = log_q.float()
    p = log_p.exp()
    kld = p * (log_p - log_q)
    return kld.sum(dim=-1)


# verl, verl/trainer/distillation/fsdp/losses.py, compute_forward_kl_topk (its loss and masses)
def verl_forward_kl_topk(
    student_logits: torch.Tensor, teacher_topk_log_probs: torch.Tensor, teacher_topk_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    student_log_probs = F.log_softmax(student_logits, dim=-1)
    student_topk_log_probs = torch.gather(student_log_probs, dim=-1, index=teacher_topk_ids)
    student_mass = student_topk_log_probs.exp().sum(dim=-1)
    teacher_mass = teacher_topk_log_probs.exp().sum(dim=-1)
    distillation_losses = verl_kl_divergence(log_q=student_topk_log_probs, log_p=teacher_topk_log_probs)
    return distillation_losses, student_mass, teacher_mass

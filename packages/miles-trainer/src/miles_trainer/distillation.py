"""On-policy distillation from a teacher's sparse top-k log-probs (a run's `opd.top_k`; docs/algorithms.md,
"On-policy distillation").

The teacher returns, for every response position, its k most likely next tokens and their log-probs
(`Sample.teacher_top_logprobs`, SGLang's `input_top_logprobs`). The loss term of each trained token is the forward KL
of the teacher's top-k to the student on the same tokens, truncated to them (verl's `compute_forward_kl_topk`):

    kl_t = sum_{j in top-k_T(t)} p_T(j) * (log p_T(j) - log p_S(j))

with log p_S the student's log_softmax(logits / T) at the rollout's temperature, gathered at the teacher's ids (the
gradient flows through every logit, via the log-sum-exp). It is weighted by `PolicyLossConfig.opd_topk_coef` and
aggregated like every token loss (`agg_mode`). Beside the sampled-token reverse KL (the advantage path of
`opd.top_k=0`), it sees k tokens of the teacher's distribution per position instead of one. Shapes: K response
tokens of a micro-batch, J the top-k entries, V the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miles_contracts import Sample


def check_teacher_top(samples: Sequence[Sample]) -> int:
    """The samples' common k; ValueError when a sample has no `teacher_top_logprobs` or its positions differ in k."""
    ks: set[int] = set()
    for sample in samples:
        if sample.teacher_top_logprobs is None:
            raise ValueError(
                f"sample {sample.index} has no teacher_top_logprobs: opd_topk_coef > 0 distills from the teacher's "
                "top-k (a run's opd.top_k asks the teacher for them)"
            )
        ks.update(len(row) for row in sample.teacher_top_logprobs)
    if len(ks) > 1:
        raise ValueError(f"teacher_top_logprobs rows have {sorted(ks)} entries: give k per response token, every one")
    return ks.pop() if ks else 0


def teacher_top_K(samples: Sequence[Sample], rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k ids (K, J) int64 and log-probs (K, J) float32 of `rows`' response tokens, in the order
    a micro-batch lays them out (sample by sample), on the CPU."""
    positions = [position for i in rows for position in samples[i].teacher_top_logprobs or []]
    k = len(positions[0]) if positions else 0
    ids = torch.tensor([[p[0] for p in position] for position in positions], dtype=torch.int64).view(-1, k)
    logprobs = torch.tensor([[p[1] for p in position] for position in positions], dtype=torch.float32).view(-1, k)
    return ids, logprobs


def student_logprobs_at(logits_KV: torch.Tensor, ids_KJ: torch.Tensor, temps_K1: torch.Tensor) -> torch.Tensor:
    """float32 log_softmax(logits / T) of each row at `ids_KJ` (K, J)."""
    scaled = logits_KV.float() / temps_K1
    return scaled.gather(-1, ids_KJ) - torch.logsumexp(scaled, dim=-1, keepdim=True)


def topk_forward_kl(student_KJ: torch.Tensor, teacher_KJ: torch.Tensor) -> torch.Tensor:
    """Per token (K,): sum_j p_T(j) (log p_T(j) - log p_S(j)) over the teacher's top-k (no renormalization)."""
    return (teacher_KJ.exp() * (teacher_KJ - student_KJ)).sum(dim=-1)

"""On-policy distillation from a teacher's top-k (miles_trainer.distillation; `PolicyLossConfig.opd_topk_coef`).
CPU numerics.

- The per-token loss and its gradient against a transcription of verl's `compute_forward_kl_topk`
  (reference_verl_distillation.py), at temperature 1 and below.
- In a policy step: the `opd_topk_loss` term is `opd_topk_coef` times the token mean of the formula over the trained
  tokens (a loss-masked span left out), exactly 0 when the teacher is the student itself, and a step on it alone
  (zero advantages) moves the student toward the teacher: the KL falls; a batch of zero advantages still steps.
"""

from __future__ import annotations

import pytest
import torch
from reference_verl_distillation import verl_forward_kl_topk
from test_step import KERNEL, make_samples

from miles_contracts import Sample
from miles_kernels import CausalLM
from miles_kernels.testing import packed_logits, random_model, tiny_config
from miles_trainer import PolicyLossConfig, accumulate_policy_gradients
from miles_trainer.distillation import student_logprobs_at, topk_forward_kl


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_topk_forward_kl_and_its_gradient_are_verls(temperature: float) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 50, generator=generator, requires_grad=True)
    teacher_full = torch.log_softmax(torch.randn(12, 50, generator=generator) * 2, dim=-1)
    teacher_top, ids = teacher_full.topk(5, dim=-1)
    temps = torch.full((12, 1), temperature)
    ours = topk_forward_kl(student_logprobs_at(logits, ids, temps), teacher_top)
    (grad,) = torch.autograd.grad(ours.sum(), logits)
    theirs, student_mass, teacher_mass = verl_forward_kl_topk(logits / temperature, teacher_top, ids)
    (their_grad,) = torch.autograd.grad(theirs.sum(), logits)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, their_grad, rtol=1e-5, atol=1e-7)
    assert bool((teacher_mass < 1).all() and (student_mass < 1).all())  # truncated: neither sums to 1


def top_k_of(model: CausalLM, samples: list[Sample], k: int) -> list[list[list[tuple[int, float]]]]:
    """Each response position's k most likely next tokens under `model` (a teacher scoring the samples)."""
    out = []
    with torch.no_grad():
        for sample in samples:
            (logits,) = packed_logits(model, [torch.tensor(sample.prompt_tokens + sample.response_tokens)])
            rows = torch.log_softmax(logits[len(sample.prompt_tokens) - 1 : sample.num_tokens - 1].float(), dim=-1)
            values, ids = rows.topk(k, dim=-1)
            out.append([list(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(ids, values, strict=True)])
    return out


def test_the_loss_term_in_a_step_follows_the_formula_and_pulls_toward_the_teacher() -> None:
    student = random_model(tiny_config("dense"), KERNEL, seed=6).train()
    teacher = random_model(tiny_config("dense"), KERNEL, seed=7)
    samples, _ = make_samples(6)
    zero = [0.0] * len(samples)
    scored = [s.model_copy(update={"teacher_top_logprobs": top}) for s, top in
              zip(samples, top_k_of(teacher, samples, 4), strict=True)]  # fmt: skip
    config = PolicyLossConfig(opd_topk_coef=0.5)
    stats = accumulate_policy_gradients(student, scored, zero, KERNEL, config, 20).summary()
    with torch.no_grad():  # the formula, token by token, over the trained tokens
        kls = []
        for sample in scored:
            (logits,) = packed_logits(student, [torch.tensor(sample.prompt_tokens + sample.response_tokens)])
            rows = logits[len(sample.prompt_tokens) - 1 : sample.num_tokens - 1]
            top = sample.teacher_top_logprobs or []
            ids = torch.tensor([[p[0] for p in row] for row in top])
            teacher_lp = torch.tensor([[p[1] for p in row] for row in top])
            per_token, _, _ = verl_forward_kl_topk(rows.float(), teacher_lp, ids)
            kls += [float(v) for v, m in zip(per_token, sample.effective_loss_mask(), strict=True) if m]
    expected = sum(kls) / len(kls)
    assert stats["opd_topk_kl"] == pytest.approx(expected, rel=1e-5)
    assert stats["opd_topk_loss"] == pytest.approx(0.5 * expected, rel=1e-5)
    assert stats["pg_loss"] == 0.0
    # a plain SGD step on the term alone lowers it
    with torch.no_grad():
        for p in student.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    student.zero_grad(set_to_none=True)
    after = accumulate_policy_gradients(student, scored, zero, KERNEL, config, 20).summary()
    assert after["opd_topk_kl"] < stats["opd_topk_kl"]
    # the student as its own teacher: nothing to learn
    own = [s.model_copy(update={"teacher_top_logprobs": top}) for s, top in
           zip(samples, top_k_of(student, samples, 4), strict=True)]  # fmt: skip
    student.zero_grad(set_to_none=True)
    assert accumulate_policy_gradients(student, own, zero, KERNEL, config, 20).summary()["opd_topk_kl"] == \
        pytest.approx(0.0, abs=1e-6)  # fmt: skip


def test_zero_advantages_still_step_on_the_distillation_term() -> None:
    """Pure distillation has no advantage: the backend must still apply the step (it skips all-zero batches)."""
    from miles_trainer import ensure_process_group
    from miles_trainer.step import has_update_signal

    ensure_process_group()
    assert not has_update_signal([0.0, 0.0], PolicyLossConfig())
    assert has_update_signal([0.0, 0.0], PolicyLossConfig(opd_topk_coef=0.5))


def test_samples_without_the_teachers_top_k_are_refused() -> None:
    model = random_model(tiny_config("dense"), KERNEL, seed=6).train()
    samples, advantages = make_samples(6)
    with pytest.raises(ValueError, match="has no teacher_top_logprobs"):
        accumulate_policy_gradients(model, samples, advantages, KERNEL, PolicyLossConfig(opd_topk_coef=1.0), 20)

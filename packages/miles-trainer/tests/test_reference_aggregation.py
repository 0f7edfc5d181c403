"""CPU numerics: miles_trainer's aggregate_loss against verl's agg_loss (0.9.1, and 0.7.0's
seq-mean-token-sum-norm) and TRL's loss_type aggregations, values and gradients, with local and global counts.

The reference formulas are transcribed in reference_verl_losses.py and reference_trl.py (no verl / TRL import), the
inputs are reference_inputs.py's. Where Miles deliberately departs from a reference (its docstrings say so), the
agreement is tested where the two agree and the documented difference is asserted on an input where they differ.
"""

from __future__ import annotations

import math

import pytest
import torch
from reference_inputs import F64, MASK, TRL_COUNTS, TRL_LOSS_TYPES, N, T, assert_close, gen, value_and_grad
from reference_trl import trl_aggregate_loss
from reference_verl_losses import reference_agg, verl070_agg_loss_seq_mean_token_sum_norm, verl_agg_loss

from miles_trainer.config import AGGREGATION_MODES
from miles_trainer.losses import aggregate_loss


def _loss_matrix(seed: int) -> torch.Tensor:
    loss = torch.randn(N, T, generator=gen(seed), dtype=F64) * 3.0
    loss[0, 0] = 1e6
    return loss


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregate_loss_matches_verl_agg_loss(mode: str) -> None:
    """Local counts: verl 0.9.1 agg_loss (token-sum-norm: verl 0.7.0's seq-mean-token-sum-norm), values and grads."""
    loss = _loss_matrix(1)
    mask = MASK.to(F64)
    value, grad = value_and_grad(lambda x: aggregate_loss(x, MASK, mode), loss)
    ref_value, ref_grad = value_and_grad(lambda x: reference_agg(x, mask, mode), loss)
    assert_close(value, ref_value)
    assert_close(grad, ref_grad)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregate_loss_global_counts_match_verl_agg_loss(mode: str) -> None:
    """Global counts (verl's batch_num_tokens / global_batch_size / loss_scale_factor): each micro-batch matches
    verl, the micro-batches sum to the full batch, and verl's dp_size scaling is a plain factor."""
    loss = _loss_matrix(2)
    mask = MASK.to(F64)
    max_len = 13
    num_tokens, num_seqs = int(MASK.sum()), int(MASK.any(-1).sum())
    miles_kw = {"global_num_tokens": num_tokens, "global_num_seqs": num_seqs, "max_response_len": max_len}
    verl_kw = {"batch_num_tokens": num_tokens, "global_batch_size": num_seqs, "loss_scale_factor": max_len}
    total = torch.zeros((), dtype=F64)
    for rows in (slice(0, 2), slice(2, 6)):
        micro = aggregate_loss(loss[rows], MASK[rows], mode, **miles_kw)
        assert_close(micro, reference_agg(loss[rows], mask[rows], mode, **verl_kw))
        total = total + micro
    assert_close(total, aggregate_loss(loss, MASK, mode, **miles_kw))
    if mode != "token-sum-norm":  # verl 0.7.0's seq-mean-token-sum-norm has no dp_size
        assert_close(verl_agg_loss(loss, mask, mode, dp_size=4, **verl_kw), 4 * total)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_aggregate_loss_matches_trl_loss_types(loss_type: str) -> None:
    """TRL's loss_type aggregations are Miles modes with global counts: grpo = seq-mean-token-mean over every row
    (N_seq = B), bnpo = token-mean, dr_grpo = seq-mean-token-sum-norm with N_seq = B and L = max_completion_length,
    dapo = token-mean over num_items_in_batch tokens. Values and gradients, the all-masked row included."""
    mode, counts = TRL_LOSS_TYPES[loss_type]
    value, grad = value_and_grad(lambda x: aggregate_loss(x, MASK, mode, **counts), _loss_matrix(3))
    ref_value, ref_grad = value_and_grad(
        lambda x: trl_aggregate_loss(x, MASK, loss_type, **TRL_COUNTS), _loss_matrix(3)
    )
    assert_close(value, ref_value)
    assert_close(grad, ref_grad)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_trl_counts_the_all_masked_row_where_miles_local_counts_do_not(loss_type: str) -> None:
    """Documented in aggregate_loss: TRL's "grpo" / "dr_grpo" average over every row, the all-masked one included;
    Miles' local count (as verl 0.9.1) is the rows with a valid token. global_num_seqs=B gives TRL's."""
    loss = _loss_matrix(4)
    mode, _ = TRL_LOSS_TYPES[loss_type]
    trl = trl_aggregate_loss(loss, MASK, loss_type, max_completion_length=T)
    assert_close(aggregate_loss(loss, MASK, mode, global_num_seqs=N, max_response_len=T), trl)
    assert_close(aggregate_loss(loss, MASK, mode), trl * N / (N - 1))  # 5 rows with a valid token, not 6
    assert_close(aggregate_loss(loss, MASK, mode), verl_agg_loss(loss, MASK, mode))


def test_dr_grpo_normalizers_of_verl_070_and_091_differ_by_num_seqs() -> None:
    """verl <= 0.7 divides Dr.GRPO's token sum by L alone (Miles' token-sum-norm), verl 0.9.1 by N_seq * L."""
    loss, mask = _loss_matrix(4), MASK.to(F64)
    old = verl070_agg_loss_seq_mean_token_sum_norm(loss, mask)
    new = verl_agg_loss(loss, mask, "seq-mean-token-sum-norm")
    assert_close(aggregate_loss(loss, MASK, "token-sum-norm"), old)
    assert_close(aggregate_loss(loss, MASK, "seq-mean-token-sum-norm"), new)
    assert_close(old, new * int(MASK.any(-1).sum()))


def test_aggregate_loss_ignores_nonfinite_padding_where_verl_sum_modes_do_not() -> None:
    """Miles zeroes padding with `where` (aggregate_loss: "padding may hold inf / nan"); verl's seq-mean modes
    multiply loss_mat by the mask, so an inf there gives nan. With finite padding the two agree (tested above)."""
    loss = _loss_matrix(5).masked_fill(~MASK, math.inf)
    clean = loss.masked_fill(~MASK, 0.0)
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        assert torch.isnan(verl_agg_loss(loss, MASK.to(F64), mode))
        assert_close(aggregate_loss(loss, MASK, mode), verl_agg_loss(clean, MASK.to(F64), mode))

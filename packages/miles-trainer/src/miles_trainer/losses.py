"""RL and SFT loss terms: step 6 of the RL step (docs/architecture.md), run on every micro-batch of the train step.

Inputs per micro-batch: the trainer's log-probs of the response tokens under the weights being trained
(`logprobs_BT`, with grad), the old log-probs (`old_logprobs_BT`: the rollout's own log-probs under true on-policy,
else the trainer's recomputed ones under the rollout weights), the advantages from `advantages.py`, and the loss
mask. Out: one scalar to backpropagate plus detached metrics.

- `aggregate_loss` turns a per-token loss into a scalar. With the global token / sequence counts of the whole
  batch it normalizes globally, so the micro-batch losses SUM to the full-batch loss and the gradient does not
  depend on how the batch is split. Data parallelism: FSDP2 / DDP average gradients over ranks, so multiply each
  rank's loss by the data-parallel size (verl's `dp_size`) or reduce with a sum.
- `policy_loss`: PPO clip (clip-higher, dual-clip), token or sequence (GSPO) ratio, optional IS weights.
- TIS / MIS importance weights for a non-zero train/rollout mismatch, fed to `policy_loss`: importance.py.
- `kl_estimate`, `entropy_from_logits`, `entropy_bonus_loss`, `sft_loss`.
- PPO's value loss lives with the critic (`critic.value_loss`).
- `train_rollout_logprob_abs_diff`: the train/rollout mismatch metric (exactly 0 under true on-policy).

Masks are bool or 0/1 (1 = the token carries loss). Metrics are detached 0-dim tensors (no host sync here),
computed over this micro-batch's valid tokens.
Shapes: B sequences in the micro-batch, T response tokens (padded), V vocabulary.
"""

from __future__ import annotations

import torch

from miles_trainer.config import AGGREGATION_MODES, KL_KINDS, RATIO_TYPES

__all__ = [
    "AGGREGATION_MODES",
    "aggregate_loss",
    "entropy_bonus_loss",
    "entropy_from_logits",
    "kl_estimate",
    "policy_loss",
    "sft_loss",
    "train_rollout_logprob_abs_diff",
]


# Log-ratio clamps, as verl: exp() of a PPO log-ratio is kept within e^±20, a GSPO sequence log-ratio below 10.
MAX_LOG_RATIO = 20.0
_MAX_SEQ_LOG_RATIO = 10.0

Count = int | float | torch.Tensor

# Aggregation modes that divide by the constant L (max_response_len), Dr.GRPO's normalizers
_NORM_MODES = ("seq-mean-token-sum-norm", "token-sum-norm")


def check_same_shape(**tensors: torch.Tensor) -> torch.Size:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(tensors.values())).shape
    if len(first) != 2 or any(t.shape != first for t in tensors.values()):
        raise ValueError(f"expected tensors of one (B, T) shape, got {shapes}")
    return first


def _check_count(name: str, value: Count | None) -> None:
    if isinstance(value, int | float) and value <= 0:
        raise ValueError(f"{name} must be > 0 (a count over the whole global batch), got {value}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def _check_policy_inputs(
    logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, advantages_BT: torch.Tensor, mask_BT: torch.Tensor,
    is_weights_BT: torch.Tensor | None, clip_low: float, clip_high: float,
) -> None:  # fmt: skip
    """A policy loss's tensors share one shape (IS weights too) and its clip bounds are in range; ValueError if not."""
    shape = check_same_shape(
        logprobs_BT=logprobs_BT, old_logprobs_BT=old_logprobs_BT, advantages_BT=advantages_BT, mask_BT=mask_BT
    )
    if is_weights_BT is not None and is_weights_BT.shape != shape:
        raise ValueError(f"is_weights_BT must have shape {tuple(shape)}, got {tuple(is_weights_BT.shape)}")
    if not 0.0 <= clip_low <= 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low <= 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}")


def _ratio_max(ratio_BT: torch.Tensor, is_valid: torch.Tensor) -> torch.Tensor:
    """The largest ratio over valid tokens, 0 when there is none."""
    if not ratio_BT.numel():
        return ratio_BT.new_zeros((), dtype=torch.float32)
    # ratios are > 0, so the clamp turns "no valid token" (-inf) into 0 without a host sync
    return torch.where(is_valid, ratio_BT.float(), float("-inf")).amax().clamp(min=0.0)


def aggregate_loss(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    *,
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    max_response_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar (verl's `agg_loss` modes). With l = loss, m = mask, n_i = sum_t m[i, t]:

        token-mean:               sum_{i,t} l m / N_tok
        seq-mean-token-mean:      sum_i (sum_t l m / n_i) / N_seq
        seq-mean-token-sum:       sum_i (sum_t l m) / N_seq
        seq-mean-token-sum-norm:  sum_i (sum_t l m) / (N_seq * L)      (Dr.GRPO: a constant L, no length bias)
        token-sum-norm:           sum_{i,t} l m / L                    (Dr.GRPO, divided by L alone)
        token-sum:                sum_{i,t} l m

    N_tok = global_num_tokens and N_seq = global_num_seqs when given (counts over the whole batch: then summing the
    micro-batch results gives the full-batch loss exactly), else the local counts: valid tokens, and sequences with
    at least one valid token (an all-masked row adds nothing and is not counted, as in recent verl; TRL's "grpo"
    counts every row: pass global_num_seqs=B to match). L = max_response_len, else this micro-batch's T (verl's
    default, `loss_mask.shape[-1]`); pass the configured maximum response length so L stays constant.
    Dr.GRPO's two normalizers: verl 0.4-0.7 (`core_algos.agg_loss`) divide seq-mean-token-sum-norm by L alone
    (here: token-sum-norm); verl 0.9.1 and TRL 1.16's loss_type="dr_grpo" divide by N_seq * L (here:
    seq-mean-token-sum-norm; TRL's N_seq counts every row of the batch).
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {list(AGGREGATION_MODES)}")
    check_same_shape(loss_BT=loss_BT, mask_BT=mask_BT)
    _check_count("global_num_tokens", global_num_tokens)
    _check_count("global_num_seqs", global_num_seqs)
    if max_response_len is not None and max_response_len <= 0:
        raise ValueError(f"max_response_len must be > 0, got {max_response_len}")
    if (
        mode in _NORM_MODES
        and (global_num_seqs is not None or global_num_tokens is not None)
        and (max_response_len is None)
    ):
        raise ValueError(
            f"{mode} with global counts also needs max_response_len (the configured maximum response length); the "
            "micro-batch's padded length changes from one micro-batch to the next"
        )
    is_valid = mask_BT.bool()
    # where, not a multiply: padding may hold inf / nan (e.g. -log 0), and 0 * inf would poison the sum
    token_sums_B = torch.where(is_valid, loss_BT, torch.zeros_like(loss_BT)).sum(dim=-1)
    num_valid_B = is_valid.sum(dim=-1).to(loss_BT.dtype)
    if mode == "token-mean":
        num_tokens = num_valid_B.sum().clamp(min=1) if global_num_tokens is None else global_num_tokens
        return token_sums_B.sum() / num_tokens
    length = loss_BT.shape[-1] if max_response_len is None else max_response_len
    if mode == "token-sum":
        return token_sums_B.sum()
    if mode == "token-sum-norm":
        return token_sums_B.sum() / length
    num_seqs = (num_valid_B > 0).sum().clamp(min=1) if global_num_seqs is None else global_num_seqs
    if mode == "seq-mean-token-mean":
        return (token_sums_B / num_valid_B.clamp(min=1)).sum() / num_seqs
    if mode == "seq-mean-token-sum":
        return token_sums_B.sum() / num_seqs
    return token_sums_B.sum() / (num_seqs * length)


def policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    ratio_type: str = "token",
    agg_mode: str = "token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    max_response_len: int | None = None,
    is_weights_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss (PPO; DAPO clip-higher; dual-clip; GSPO), aggregated by `aggregate_loss`.

    Per valid token, with A the advantage and r the ratio:

        token ratio (PPO):     r_t = exp(logp_t - old_t)                   (log-ratio clamped to [-20, 20])
        sequence ratio (GSPO): s_i = exp(sum_t m (logp_t - old_t) / n_i),  r_t = sg[s_i] * exp(logp_t - sg[logp_t])
        loss_t = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high))
        dual-clip (c > 1), only where A < 0:  loss_t = min(loss_t, -A c)
        with IS weights w (see `importance_weights`): loss_t = w_t * loss_t

    GSPO's r_t has the value s_i on every token of sequence i (so the clip is decided per sequence) and the
    gradient s_i * grad logp_t (the GSPO-token straight-through form of the GSPO paper and verl's "gspo" loss;
    its log is clamped below 10 as verl does). With seq-mean-token-mean this is GSPO's sequence objective.
    clip_high > clip_low is DAPO's clip-higher. Tokens whose loss is the clipped branch get no gradient.

    Metrics (over this micro-batch's valid tokens): clip_fraction (share of tokens on the clipped branch), its
    split clip_fraction_high (r > 1 + clip_high, A > 0) and clip_fraction_low (r < 1 - clip_low, A < 0),
    dual_clip_fraction (A < 0 tokens capped by -A c; verl calls this pg_clipfrac_lower), ppo_kl (mean of
    old - logp), ratio_mean, ratio_max.
    """
    _check_policy_inputs(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, is_weights_BT, clip_low, clip_high)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (the cap on the ratio for negative advantages), got {dual_clip}")
    if ratio_type not in RATIO_TYPES:
        raise ValueError(f"unknown ratio_type {ratio_type!r}; choose one of {list(RATIO_TYPES)}")

    is_valid = mask_BT.bool()
    old = old_logprobs_BT.detach()
    # Padding may hold anything (even inf / nan): zero it before exp so it cannot poison the loss or its gradient.
    log_ratio_BT = torch.where(is_valid, logprobs_BT - old, torch.zeros_like(logprobs_BT))
    advantages = torch.where(is_valid, advantages_BT.detach(), torch.zeros_like(advantages_BT))
    if ratio_type == "token":
        ratio_BT = torch.exp(log_ratio_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    else:
        num_valid_B = is_valid.sum(dim=-1).clamp(min=1)
        seq_log_ratio_B = log_ratio_BT.sum(dim=-1) / num_valid_B
        logprobs = torch.where(is_valid, logprobs_BT, torch.zeros_like(logprobs_BT))
        log_seq_ratio_BT = logprobs - logprobs.detach() + seq_log_ratio_B.detach().unsqueeze(-1)
        ratio_BT = torch.exp(log_seq_ratio_BT.clamp(max=_MAX_SEQ_LOG_RATIO))

    unclipped_BT = -advantages * ratio_BT
    clipped_BT = -advantages * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    is_dual_clipped = torch.zeros_like(is_valid)
    if dual_clip is not None:
        cap_BT = -advantages * dual_clip
        is_dual_clipped = (advantages < 0) & (loss_BT > cap_BT)
        loss_BT = torch.where(advantages < 0, torch.minimum(loss_BT, cap_BT), loss_BT)
    if is_weights_BT is not None:
        loss_BT = loss_BT * is_weights_BT.detach()
    loss = aggregate_loss(
        loss_BT,
        mask_BT,
        agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        max_response_len=max_response_len,
    )

    with torch.no_grad():
        is_clipped = clipped_BT > unclipped_BT
        ratio = ratio_BT.detach()
        metrics = {
            "clip_fraction": masked_mean(is_clipped.float(), is_valid),
            "clip_fraction_high": masked_mean((is_clipped & (ratio > 1.0 + clip_high)).float(), is_valid),
            "clip_fraction_low": masked_mean((is_clipped & (ratio < 1.0 - clip_low)).float(), is_valid),
            "dual_clip_fraction": masked_mean(is_dual_clipped.float(), is_valid),
            "ppo_kl": masked_mean(-log_ratio_BT.detach().float(), is_valid),
            "ratio_mean": masked_mean(ratio.float(), is_valid),
            "ratio_max": _ratio_max(ratio, is_valid),
        }
    return loss, metrics


def cispo_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float = 1.0,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    ratio_type: str = "token",
    agg_mode: str = "token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    max_response_len: int | None = None,
    is_weights_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585, eq. 4-5; slime's `compute_cispo_loss`), aggregated by `aggregate_loss`:

        loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * logp_t,   r_t = exp(logp_t - old_t)

    The clipped importance ratio is a constant weight (stop-gradient): unlike PPO-clip, a token past the clip keeps
    its gradient, A_t * grad logp_t scaled by the clipped ratio. MiniMax-M1 bounds the ratio above only
    (clip_low = 1, this function's default: clip(r, 0, ...) leaves it as is). Token level only: no sequence ratio,
    no dual clip. With IS weights w (train / rollout mismatch): loss_t = w_t * loss_t. Metrics as `policy_loss`'s:
    clip_fraction (tokens whose ratio the clip changed; high: above 1 + clip_high, low: below 1 - clip_low),
    ppo_kl, ratio_mean, ratio_max.
    """
    _check_policy_inputs(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, is_weights_BT, clip_low, clip_high)
    if ratio_type != "token" or dual_clip is not None:
        raise ValueError("CISPO is a token-level loss: it takes no ratio_type=sequence and no dual_clip")
    is_valid = mask_BT.bool()
    # Padding may hold anything (even inf / nan): zero it before exp or the product, so it cannot poison the loss.
    logprobs = torch.where(is_valid, logprobs_BT, torch.zeros_like(logprobs_BT))
    log_ratio_BT = torch.where(is_valid, logprobs_BT - old_logprobs_BT.detach(), torch.zeros_like(logprobs_BT))
    advantages = torch.where(is_valid, advantages_BT.detach(), torch.zeros_like(advantages_BT))
    ratio = torch.exp(log_ratio_BT.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_BT = -clipped * advantages * logprobs
    if is_weights_BT is not None:
        loss_BT = loss_BT * is_weights_BT.detach()
    loss = aggregate_loss(
        loss_BT, mask_BT, agg_mode, global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
        max_response_len=max_response_len,
    )  # fmt: skip
    with torch.no_grad():
        metrics = {
            "clip_fraction": masked_mean((clipped != ratio).float(), is_valid),
            "clip_fraction_high": masked_mean((ratio > 1.0 + clip_high).float(), is_valid),
            "clip_fraction_low": masked_mean((ratio < 1.0 - clip_low).float(), is_valid),
            "ppo_kl": masked_mean(-log_ratio_BT.float(), is_valid),
            "ratio_mean": masked_mean(ratio.float(), is_valid),
            "ratio_max": _ratio_max(ratio, is_valid),
        }
    return loss, metrics


def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, in float32: H = -sum_v p_v log p_v, shape logits.shape[:-1].

    Computed from log_softmax (stable for large logits); a -inf logit (a banned token) adds 0 and keeps the
    gradient finite.
    """
    logp = torch.log_softmax(logits_BTV.float(), dim=-1)
    p = logp.exp()
    safe_logp = torch.where(p > 0, logp, torch.zeros_like(logp))
    return -(p * safe_logp).sum(dim=-1)


def entropy_bonus_loss(
    entropy_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    coef: float,
    mode: str = "token-mean",
    *,
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    max_response_len: int | None = None,
) -> torch.Tensor:
    """Entropy bonus as a loss term to add: -coef * aggregate_loss(H, mask, mode) (minimizing it raises entropy)."""
    return -coef * aggregate_loss(
        entropy_BT,
        mask_BT,
        mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        max_response_len=max_response_len,
    )


# verl's names of the KL estimators (`core_algos.kl_penalty_forward`, verl 0.9.1)
_KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "low_var_kl+": "k3+"}


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL divergence", 2020).

    With x = log pi(y) - log pi_ref(y) = logprobs - ref_logprobs:

        k1  = x                          unbiased, can be negative        (verl "kl")
        k2  = x^2 / 2                    biased, >= 0                     (verl "mse")
        k3  = exp(-x) - (-x) - 1         unbiased, >= 0, low variance     (verl "low_var_kl", TRL's GRPO KL)
              i.e. exp(ref - logp) - (ref - logp) - 1, with ref - logp clamped to [-20, 20] and k3 to [-10, 10]
              as verl does.
        abs = |x|                        (verl "abs")
        k1+, k3+ (verl "low_var_kl+"), abs+: straight-through: the value of k1 / k3 / abs, the gradient of k2,
              k2 + sg[k - k2]. k1 and k3 estimate KL's value without bias but not its gradient; k2's gradient is
              the unbiased one (verl's `core_algos.kl_penalty`).

    As a loss term: aggregate_loss(beta * kl, mask, mode) (gradient flows through `logprobs`). As a reward
    penalty: token_rewards - beta * kl_estimate(...).detach(). Same shape as the inputs.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs and ref_logprobs must have one shape, got {tuple(logprobs.shape)} and "
            f"{tuple(ref_logprobs.shape)}"
        )
    kind = _KL_ALIASES.get(kind, kind)
    if kind not in KL_KINDS:
        raise ValueError(
            f"unknown KL estimator {kind!r}; choose one of {list(KL_KINDS)} (verl's 'kl' / 'mse' / 'low_var_kl' are "
            "k1 / k2 / k3)"
        )
    base = kind.removesuffix("+")
    x = logprobs - ref_logprobs
    if base == "k1":
        value = x
    elif base == "k2":
        value = 0.5 * x.square()
    elif base == "abs":
        value = x.abs()
    else:
        ref_minus_logp = (-x).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        value = (torch.exp(ref_minus_logp) - ref_minus_logp - 1.0).clamp(-10.0, 10.0)
    if not kind.endswith("+"):
        return value
    k2 = 0.5 * x.square()
    return k2 - k2.detach() + value.detach()


def sft_loss(
    logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str = "token-mean",
    *,
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    max_response_len: int | None = None,
) -> torch.Tensor:
    """Negative log-likelihood of the target tokens: aggregate_loss(-logprobs, mask, mode)."""
    return aggregate_loss(
        -logprobs_BT,
        mask_BT,
        mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        max_response_len=max_response_len,
    )


def train_rollout_logprob_abs_diff(
    train_logprobs_BT: torch.Tensor, rollout_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The train/rollout mismatch metric: |train - rollout| over response tokens -> {"mean", "max", "num_tokens"}.

    train_logprobs are the trainer's log-probs under the weights that generated the samples (before the first
    optimizer step of the rollout), rollout_logprobs the engine's. Differences are taken and summed in float64
    (exact for float32 inputs), so identical log-probs give exactly 0.0. An empty mask gives 0.0 for both.
    num_tokens lets a caller combine micro-batches or ranks: mean_all = sum(mean * num_tokens) / sum(num_tokens).
    """
    check_same_shape(train_logprobs_BT=train_logprobs_BT, rollout_logprobs_BT=rollout_logprobs_BT, mask_BT=mask_BT)
    with torch.no_grad():
        is_valid = mask_BT.bool()
        diff_BT = (train_logprobs_BT.double() - rollout_logprobs_BT.double()).abs()
        diff_BT = torch.where(is_valid, diff_BT, torch.zeros_like(diff_BT))
        num_tokens = is_valid.sum()
        return {
            "mean": diff_BT.sum() / num_tokens.clamp(min=1).double(),
            "max": diff_BT.amax() if diff_BT.numel() else diff_BT.new_zeros(()),
            "num_tokens": num_tokens,
        }

"""Which policy versions a batch's tokens come from, checked before training (docs/architecture.md, "Log-probs
and versions").

Every sample carries the version of each response token (`Sample.token_versions`). A batch is trained at
`trained_version` (the trainer's weights before the step); a token's staleness is how many versions it lags that.
`bound_staleness` drops every prompt group holding a token staler than `max_staleness` (sync runs: 0, so a sample
from the wrong weights is never trained on silently), applies `rollout.partial_tokens=mask`, and reports the
staleness histogram. `onpolicy_mismatch` is the train/rollout mismatch over the tokens the trained version itself
generated: under true on-policy exactly 0, however stale the rest of the batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from miles_contracts import Sample


def sample_versions(sample: Sample) -> list[int]:
    """The sample's per-token versions; a ValueError if the rollout did not record them."""
    versions = sample.token_versions()
    if sample.response_tokens and any(v is None for v in versions):
        raise ValueError(
            f"sample {sample.index} has no weight version: the rollout function must copy the engine's "
            "meta_info.weight_version (and weight_versions) onto its samples, as the one-turn rollout does"
        )
    return [int(v) for v in versions if v is not None]


def bound_staleness(
    batch: list[Sample], trained_version: int, max_staleness: int, mask_partial: bool = False
) -> tuple[list[Sample], dict[str, float], list[int]]:
    """The samples of every group whose tokens lag `trained_version` by at most `max_staleness` (in order), their
    metrics, and the indices of the groups dropped. `mask_partial`: tokens of a partial rollout generated before
    its newest version get loss mask 0. A token newer than `trained_version` is a bug upstream: ValueError."""
    versions = {s.index: sample_versions(s) for s in batch}
    newer = [s.index for s in batch if any(v > trained_version for v in versions[s.index])]
    if newer:
        raise ValueError(f"samples {newer[:5]} carry weight versions newer than the trained one ({trained_version})")
    lag = {s.index: trained_version - min(versions[s.index], default=trained_version) for s in batch}
    stale_groups = sorted({s.group_index for s in batch if lag[s.index] > max_staleness})
    kept = [s for s in batch if s.group_index not in stale_groups]
    if mask_partial:
        kept = [masked_partial(s, versions[s.index]) for s in kept]
    histogram = Counter(lag[s.index] for s in batch)
    tokens = [v for s in kept for v in versions[s.index]]
    metrics = {f"staleness_frac_{k}": histogram[k] / len(batch) for k in sorted(histogram)}
    metrics |= {
        "staleness_max": float(max(lag.values(), default=0)),
        "staleness_mean": sum(lag.values()) / max(len(lag), 1),
        "off_policy_token_frac": sum(1 for v in tokens if v != trained_version) / max(len(tokens), 1),
        "num_partial_samples": float(sum(1 for s in batch if len(set(versions[s.index])) > 1)),
        "num_stale_groups_dropped": float(len(stale_groups)),
    }
    return kept, metrics, stale_groups


def masked_partial(sample: Sample, versions: list[int]) -> Sample:
    """`rollout.partial_tokens=mask`: loss mask 0 on the tokens generated before the sample's newest version."""
    if len(set(versions)) <= 1:
        return sample
    newest = max(versions)
    mask = [m if v == newest else 0 for m, v in zip(sample.effective_loss_mask(), versions, strict=True)]
    return sample.model_copy(update={"loss_mask": mask})


def has_off_policy_tokens(batch: Sequence[Sample], trained_version: int) -> bool:
    return any(v != trained_version for s in batch for v in sample_versions(s))


def onpolicy_mismatch(
    batch: Sequence[Sample], old_logprobs: Sequence[Sequence[float]], trained_version: int
) -> dict[str, float]:
    """|trainer log-prob - rollout log-prob| over the trained tokens `trained_version` generated (mean, max, count);
    empty when there are none. The trainer's log-probs are `old_logprobs`, computed with the trained version."""
    diffs = [
        abs(old - rollout)
        for s, olds in zip(batch, old_logprobs, strict=True)
        for old, rollout, version, mask in zip(
            olds, s.rollout_logprobs or [], sample_versions(s), s.effective_loss_mask(), strict=True
        )
        if version == trained_version and mask
    ]
    if not diffs:
        return {}
    return {
        "train_rollout_logprob_abs_diff": sum(diffs) / len(diffs),
        "train_rollout_logprob_abs_diff_max": max(diffs),
        "num_onpolicy_tokens": float(len(diffs)),
    }

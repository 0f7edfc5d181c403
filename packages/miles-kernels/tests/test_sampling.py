"""CPU numerics: sampling is reproducible per (seed, position), respects its filters, follows the softmax
distribution, and log-probs follow the log-prob contract (docs/architecture.md)."""

from __future__ import annotations

import math

import pytest
import torch

from miles_kernels import RowSampling, logprob_temperatures, sample, sampling_scores, token_logprobs, uniform, uniforms


def test_uniform_is_a_pure_function_in_unit_interval() -> None:
    values = [uniform(seed, pos, tok) for seed in range(20) for pos in range(20) for tok in range(10)]
    assert all(0.0 < u < 1.0 for u in values)
    assert uniform(7, 3, 1) == uniform(7, 3, 1)
    assert len({uniform(7, 3, 1), uniform(7, 4, 1), uniform(8, 3, 1), uniform(7, 3, 2)}) == 4
    assert abs(sum(values) / len(values) - 0.5) < 0.02


@pytest.mark.parametrize(("seed", "position"), [(0, 0), (12345, 77), (2**63 + 5, 2**40), (-1, 3)])
def test_vectorized_noise_equals_the_python_reference(seed: int, position: int) -> None:
    # The tensor version emulates 64-bit unsigned arithmetic with int64; the reference uses Python ints.
    got = uniforms(seed, position, 300)
    assert got.dtype == torch.float64
    assert got.tolist() == [uniform(seed, position, tok) for tok in range(300)]


@pytest.mark.parametrize("threads", [1, 2])
def test_native_noise_is_the_bits_of_the_torch_ops(threads: int) -> None:
    # The sampler's uniforms come from the native kernel on a CPU (native/noise.cpp) and from torch's int64 ops
    # elsewhere: both are integer arithmetic and one exact conversion, so every bit agrees, at any thread count.
    from miles_kernels import native
    from miles_kernels.ops.sampling import _uniforms, row_keys, row_uniforms

    assert native.status() is True
    extremes = [(0, 0), (1, 2**40), (2**64 - 1, 9), (-(2**63), 2**63 + 5), (2**70 + 3, 1)]
    rows = [RowSampling(seed=seed, position=position) for seed, position in extremes]
    rows += [RowSampling(seed=seed * 7919, position=seed * 31) for seed in range(40)]
    cpu = torch.device("cpu")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for vocab in (1, 257, 40_000):  # 40_000 x 45 rows runs threaded
            got = row_uniforms(rows, vocab, cpu)
            assert torch.equal(got, _uniforms(row_keys(rows, cpu), vocab)), vocab
            assert got[2, vocab - 1].item() == uniform(2**64 - 1, 9, vocab - 1)
    finally:
        torch.set_num_threads(previous)


def test_greedy_takes_first_maximum() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 1.0, 5.0, 5.0]])
    assert sample(logits, [RowSampling(temperature=0.0)] * 2).tolist() == [1, 0]


@pytest.mark.parametrize("top_p", [1.0, 0.9])  # the unsorted (no filter) and the sorted (filtered) paths
def test_same_seed_and_position_same_token_whatever_the_batch(top_p: float) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 100, generator=generator)
    rows = [RowSampling(temperature=1.0, top_p=top_p, seed=1000 + i, position=17 + i) for i in range(32)]
    together = sample(logits, rows)
    for i in range(32):
        assert sample(logits[i : i + 1], [rows[i]]).item() == together[i].item()
    shuffled = list(reversed(range(32)))
    assert sample(logits[shuffled], [rows[i] for i in shuffled]).tolist() == together[shuffled].tolist()


def test_sampling_follows_softmax_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    temperature = 0.7
    probs = torch.softmax(logits[0] / temperature, dim=-1)
    num = 4000
    counts = torch.zeros(4)
    for seed in range(num):
        counts[sample(logits, [RowSampling(temperature=temperature, seed=seed, position=3)])[0]] += 1
    expected = probs * num
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (counts, expected)  # p = 0.001 for 3 degrees of freedom


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (RowSampling(top_k=2), {0, 1}),
        (RowSampling(top_p=0.5), {0}),  # p(0) = 0.64 already reaches 0.5
        (RowSampling(top_p=0.7), {0, 1}),
        (RowSampling(min_p=0.3), {0, 1}),  # p(1) / p(0) = 0.37, p(2) / p(0) = 0.14
    ],
)
def test_filters_restrict_support(params: RowSampling, allowed: set[int]) -> None:
    logits = torch.log(torch.tensor([[0.64, 0.236, 0.087, 0.037]]))
    seen = set()
    for seed in range(300):
        row = RowSampling(params.temperature, params.top_k, params.top_p, params.min_p, seed=seed, position=0)
        seen.add(int(sample(logits, [row])[0]))
    assert seen == allowed


def test_filtered_sampling_follows_the_renormalized_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    num = 4000
    counts = torch.zeros(4)
    for seed in range(num):
        counts[sample(logits, [RowSampling(top_k=3, seed=seed, position=9)])[0]] += 1
    assert counts[3] == 0
    expected = torch.tensor([0.5, 0.3, 0.15]) / 0.95 * num
    chi2 = float(((counts[:3] - expected) ** 2 / expected).sum())
    assert chi2 < 13.82, (counts, expected)  # p = 0.001 for 2 degrees of freedom


def test_a_close_draft_picks_the_same_token_under_the_same_noise() -> None:
    # Gumbel-max couples two distributions through noise per token: a slightly perturbed distribution picks the
    # same token nearly always (the inverse CDF of one uniform per position would not; benchmarks/spec_coupling.py).
    generator = torch.Generator().manual_seed(1)
    target = torch.randn(200, 64, generator=generator) * 3
    draft = target + 0.1 * torch.randn(200, 64, generator=generator)
    rows = [RowSampling(seed=i, position=5) for i in range(200)]
    agree = (sample(target, rows) == sample(draft, rows)).double().mean()
    assert agree > 0.9


def test_logprob_contract_uses_temperature_and_full_vocabulary() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 0.5, 3.0, 0.0]])
    rows = [RowSampling(temperature=0.5, top_k=1), RowSampling(temperature=0.0)]
    temps = logprob_temperatures(rows, logits.device)
    assert temps.flatten().tolist() == [0.5, 1.0]  # greedy scores at T = 1
    got = token_logprobs(logits, torch.tensor([1, 2]), temps)
    expected0 = 1.0 / 0.5 - math.log(sum(math.exp(v / 0.5) for v in (2.0, 1.0, 0.0, -1.0)))
    expected1 = 3.0 - math.log(2 * math.exp(0.5) + math.exp(3.0) + 1.0)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx([expected0, expected1], abs=1e-6)  # no top-k truncation applied


def test_row_count_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="2 sampling rows for 1 logit rows"):
        sample(torch.zeros(1, 4), [RowSampling(), RowSampling()])


def test_the_sampling_scores_argmax_is_the_sampled_token() -> None:
    """A draft tree ranks candidates by `sampling_scores`: its first candidate must be the token `sample` draws,
    greedy, sampled and filtered alike, and a filtered-out token scores -inf."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    rows = [RowSampling(temperature=0.0, seed=1, position=4), RowSampling(temperature=1.0, seed=1, position=4),
            RowSampling(temperature=0.7, seed=2, position=9, top_k=5), RowSampling(temperature=1.3, seed=3, position=0,
            top_p=0.5), RowSampling(temperature=1.0, seed=4, position=2, min_p=0.2),
            RowSampling(temperature=1.0, seed=1, position=4)]  # fmt: skip
    scores = sampling_scores(logits, rows)
    assert scores.dtype == torch.float64
    assert torch.equal(scores.argmax(-1), sample(logits, rows))
    assert torch.equal(scores[0], logits[0].double())  # greedy: the logits themselves
    assert int(torch.isfinite(scores[2]).sum()) == 5  # top_k = 5 keeps five
    noise = scores[[1, 5]] - logits[[1, 5]].double()  # T = 1: the noise itself
    torch.testing.assert_close(noise[0], noise[1])  # the same (seed, position): the same noise

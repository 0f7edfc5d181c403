"""CPU numerics: the whole model is batch-invariant in deterministic mode.

Every row of every sequence must equal, bit for bit, the trainer-style packed forward of the same sequences,
whatever the engine-style schedule: alone or in batches of 1..64, prefill vs decode vs chunked prefill, with a
reused prefix, with 1 or 2 threads, every family (Qwen2.5 with a sliding-window layer too; DeepSeek-V3 through its
latent cache), fp32 and bf16, on each deterministic backend set of the CPU (torch: the tiled GEMMs and the blocked
attention; native: the C++ GEMM, attention and RMSNorm). Several seeds, because one row can match by luck.
"""

from __future__ import annotations

import pytest
import torch

from miles_kernels import KernelConfig
from miles_kernels.testing import PagedRunner, packed_logits, random_model, tiny_config

SMALL_KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)


def random_seqs(vocab: int, lengths: list[int], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]


# Qwen2.5 with its second layer windowed (11 keys: a row's window spans two or three pages of 8, and the pages
# before it are wholly masked once the row is past position 18).
SLIDING = {"sliding_window": 11, "layer_types": ("full_attention", "sliding_attention")}


@pytest.fixture(params=["torch-tiled", "native"])
def backend(request: pytest.FixtureRequest) -> str:
    """The deterministic backends under test: torch-tiled linear layers with the torch-blocked attention, or the
    native linear layers, attention and RMSNorm."""
    return str(request.param)


def make_model(kind: str, seed: int, backend: str, dtype: str = "float32", **overrides):
    native = backend == "native"
    update = {"dtype": dtype, "linear_backend": backend, "attention_backend": "native" if native else "torch-blocked",
              "norm_backend": "native" if native else "torch"}  # fmt: skip
    kernel = SMALL_KERNEL.model_copy(update=update)
    if kind == "qwen2-window":
        kind, overrides = "qwen2", SLIDING | overrides
    return random_model(tiny_config(kind, **overrides), kernel, seed=seed)


def assert_rows_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, what
    bad = (got != want).any(dim=-1).nonzero().flatten().tolist()
    assert not bad, f"{what}: rows {bad[:10]} differ (max abs diff {(got - want).abs().max().item():.3g})"


@pytest.mark.parametrize("kind", ["dense", "moe", "glm", "qwen2", "llama", "qwen2-window", "deepseek"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_batch_composition(kind: str, seed: int, backend: str) -> None:
    model = make_model(kind, seed, backend)
    seqs = random_seqs(model.config.vocab_size, [1, 7, 23, 4, 40, 9], seed)
    reference = packed_logits(model, seqs)
    for i, seq in enumerate(seqs):
        assert_rows_equal(packed_logits(model, [seq])[0], reference[i], f"seq {i} alone")
    shuffled = [seqs[j] for j in (5, 2, 0, 4)]
    for got, j in zip(packed_logits(model, shuffled), (5, 2, 0, 4), strict=True):
        assert_rows_equal(got, reference[j], f"seq {j} among others")


@pytest.mark.parametrize("kind", ["dense", "moe", "glm", "qwen2", "llama", "qwen2-window", "deepseek"])
@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_decode_chunked_and_prefix_reuse(kind: str, seed: int, backend: str) -> None:
    model = make_model(kind, seed, backend)
    vocab = model.config.vocab_size
    prompts = random_seqs(vocab, [19, 3, 33, 11], seed)
    continuations = random_seqs(vocab, [6, 9, 4, 12], seed + 100)
    full = [torch.cat([p, c]) for p, c in zip(prompts, continuations, strict=True)]
    reference = packed_logits(model, full)

    driver = PagedRunner(model)
    # Prefill sequence 0 whole, sequence 1 with 2 as one batch, sequence 3 in uneven chunks across steps.
    outputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(full))}
    for seq, logits in driver.step({0: prompts[0]}).items():
        outputs[seq].append(logits)
    for seq, logits in driver.step({1: prompts[1], 2: prompts[2][:10], 3: prompts[3][:5]}).items():
        outputs[seq].append(logits)
    for seq, logits in driver.step({2: prompts[2][10:], 3: prompts[3][5:]}).items():
        outputs[seq].append(logits)
    # Decode: one token per sequence per step, sequences joining and leaving the batch.
    for t in range(max(len(c) for c in continuations)):
        step = {s: continuations[s][t : t + 1] for s in range(len(full)) if t < len(continuations[s])}
        for seq, logits in driver.step(step).items():
            outputs[seq].append(logits)
    for seq in range(len(full)):
        assert_rows_equal(torch.cat(outputs[seq]), reference[seq], f"engine schedule, seq {seq}")

    # Prefix reuse: a new sequence shares sequence 2's first pages and prefills only the rest.
    shared = 17  # two full pages of 8 are reused; the partial third page is recomputed
    newcomer = torch.cat([full[2][:shared], random_seqs(vocab, [8], seed + 7)[0]])
    driver.share_prefix(10, donor=2, num_tokens=shared)
    cached = driver.cached[10]
    got = driver.step({10: newcomer[cached:]})[10]
    assert_rows_equal(got, packed_logits(model, [newcomer])[0][cached:], "prefix reuse")


@pytest.mark.parametrize("kind", ["dense", "moe", "glm", "qwen2", "llama", "qwen2-window", "deepseek"])
@pytest.mark.parametrize("seed", [0, 1])
def test_verify_shaped_steps_equal_one_token_decode(kind: str, seed: int, backend: str) -> None:
    """Speculative decoding's verify forward: k + 1 new tokens per sequence after a cached prefix, next to
    sequences decoding one token, give every row the bits of the packed forward (so of one-token decode too)."""
    model = make_model(kind, seed, backend)
    vocab = model.config.vocab_size
    prompts = random_seqs(vocab, [13, 8, 21, 5], seed)
    drafts = random_seqs(vocab, [4, 1, 3, 4], seed + 50)  # k + 1 = 4, 1 (plain decode), 3, 4 rows
    full = [torch.cat([p, d]) for p, d in zip(prompts, drafts, strict=True)]
    reference = packed_logits(model, full)
    driver = PagedRunner(model)
    driver.step(dict(enumerate(prompts)))
    verified = driver.step(dict(enumerate(drafts)))
    for seq in range(len(full)):
        assert_rows_equal(verified[seq], reference[seq][len(prompts[seq]) :], f"verify rows, seq {seq}")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_decode_batch_sizes_1_to_64(kind: str, backend: str) -> None:
    model = make_model(kind, 3, backend)
    vocab = model.config.vocab_size
    seqs = random_seqs(vocab, [5 + (7 * i) % 23 for i in range(64)], seed=3)
    reference = packed_logits(model, seqs)
    for batch_size in (1, 2, 3, 5, 8, 13, 32, 64):
        driver = PagedRunner(model, num_pages=1024)
        members = list(range(batch_size))
        driver.step({s: seqs[s][:-1] for s in members})
        last = driver.step({s: seqs[s][-1:] for s in members})
        for s in members:
            assert_rows_equal(last[s], reference[s][-1:], f"decode batch {batch_size}, seq {s}")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_one_vs_two_threads(kind: str, backend: str) -> None:
    model = make_model(kind, 4, backend)
    seqs = random_seqs(model.config.vocab_size, [13, 1, 29], seed=4)
    torch.set_num_threads(2)
    two = packed_logits(model, seqs)
    torch.set_num_threads(1)
    one = [packed_logits(model, [s])[0] for s in seqs]
    for i, (a, b) in enumerate(zip(one, two, strict=True)):
        assert_rows_equal(a, b, f"seq {i}, 1 vs 2 threads")


@pytest.mark.parametrize("kind", ["moe", "glm", "deepseek"])
def test_bfloat16_model_is_invariant(kind: str, backend: str) -> None:
    model = make_model(kind, 5, backend, dtype="bfloat16")
    seqs = random_seqs(model.config.vocab_size, [9, 21, 2], seed=5)
    reference = packed_logits(model, seqs)
    driver = PagedRunner(model)
    driver.step({0: seqs[0][:-1], 1: seqs[1][:-1]})
    last = driver.step({0: seqs[0][-1:], 1: seqs[1][-1:], 2: seqs[2]})
    assert_rows_equal(last[0], reference[0][-1:], "bf16 decode seq 0")
    assert_rows_equal(last[1], reference[1][-1:], "bf16 decode seq 1")
    assert_rows_equal(last[2], reference[2], "bf16 prefill seq 2")


def test_fast_mode_is_not_claimed_invariant_but_close() -> None:
    """Fast mode runs plain torch ops: close to deterministic mode, not promised to be bitwise."""
    det = make_model("dense", 6, "torch-tiled")
    fast = random_model(det.config, KernelConfig(mode="fast", page_size=8), seed=6)
    seqs = random_seqs(det.config.vocab_size, [12, 30], seed=6)
    for a, b in zip(packed_logits(det, seqs), packed_logits(fast, seqs), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)

"""lm-evaluation-harness' own `local-completions` model (`LocalCompletionsAPI`) scores log-likelihood requests
against a real `miles-rollout serve` process through `/v1/completions` — token-id prompts in batches, `echo` with
`logprobs`, one greedy token, as it sends them to any OpenAI-compatible server — and its (log-likelihood, is greedy)
results equal the native API's prompt log-probs for the same tokens. Server tier, CPU.

lm-eval is no test dependency (it brings datasets, pandas, pyarrow, scikit-learn and more), so this file is skipped
without it; run it with

    uv run --with 'lm-eval[api]==0.4.13' pytest -m lm_eval packages/miles-rollout/tests/test_lm_eval.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.lm_eval
openai_completions = pytest.importorskip(
    "lm_eval.models.openai_completions", reason="lm-eval is not installed: uv run --with 'lm-eval[api]==0.4.13' ..."
)
from lm_eval.api.instance import Instance  # noqa: E402

PAIRS = [("12 + 7 =", " 19"), ("12 + 7 =", " 20"), ("The capital of France is", " Paris")]
ROLLING = "Paris is the capital of France. 12 + 7 = 19."


def native_scores(url: str, ids: list[int], start: int) -> tuple[float, bool]:
    """The native API's log-likelihood of `ids[start:]` given what precedes them, and whether each of those tokens
    is its position's most likely one (by token id, from `input_top_logprobs`)."""
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0}}  # fmt: skip
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    meta = response.json()["meta_info"]
    scored = meta["input_token_logprobs"][start:]
    tops = meta["input_top_logprobs"][start:]
    return sum(lp for lp, _, _ in scored), all(tok == top[0][1] for (_, tok, _), top in zip(scored, tops, strict=True))


def local_completions(url: str, dense_dir: Path, **options: Any) -> Any:
    name = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    return openai_completions.LocalCompletionsAPI(
        base_url=f"{url}/v1/completions", model=name, tokenizer=str(dense_dir), tokenizer_backend="huggingface",
        tokenized_requests=True, max_length=512, max_retries=1, **options,
    )  # fmt: skip


@pytest.mark.parametrize("options", [{"batch_size": 2}, {"batch_size": 1, "num_concurrent": 2}])
def test_local_completions_loglikelihood_equals_native(
    dense_server: str, dense_dir: Path, options: dict[str, Any]
) -> None:
    """Batched (the synchronous client) and concurrent (lm-eval's aiohttp client), with the model's own greedy
    continuation among the pairs; plus a rolling log-likelihood (perplexity tasks), which scores a text after the
    tokenizer's prefix token."""
    lm = local_completions(dense_server, dense_dir, **options)
    greedy = httpx.post(f"{dense_server}/generate", json={"text": PAIRS[0][0], "sampling_params": {
        "max_new_tokens": 2, "temperature": 0}}, timeout=120).json()["text"]  # fmt: skip
    pairs = [*PAIRS, (PAIRS[0][0], greedy)]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    results = lm.loglikelihood(requests, disable_tqdm=True)
    assert results[-1][1], "the model's own greedy continuation is greedy"
    for (context, continuation), (total, is_greedy) in zip(pairs, results, strict=True):
        whole = lm.tokenizer(context + continuation, add_special_tokens=False).input_ids
        start = len(lm.tokenizer(context, add_special_tokens=False).input_ids)
        want_total, want_greedy = native_scores(dense_server, whole, start)
        assert (total, is_greedy) == (want_total, want_greedy)
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (ROLLING,), 0)], disable_tqdm=True)
    ids = [lm.prefix_token_id, *lm.tokenizer(ROLLING, add_special_tokens=False).input_ids]
    assert rolling == native_scores(dense_server, ids, 1)[0]

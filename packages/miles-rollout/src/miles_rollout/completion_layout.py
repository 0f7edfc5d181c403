"""The legacy `/v1/completions` choice layout, which openai_api.py builds from the engine's responses: log-probs as
parallel lists (token texts, their log-probs, the top alternatives as {text: log-prob}, each token's character
offset in the choice's text), and `echo`.

`echo: true` puts the prompt in front of the output, as SGLang's OpenAI layer does (`serving_completions.py`): its
text before the choice's text (token-id prompts decoded with the tokenizer) and, with `logprobs`, its tokens'
entries before the output's, the first one's log-prob and alternatives null (nothing precedes it to predict it).
The prompt's log-probs are the native `input_token_logprobs` (`logprob_start_len: 0`), under the same log-prob
contract as the output's. lm-evaluation-harness' `local-completions` model scores log-likelihood tasks this way:
token-id prompts (context + continuation), `echo: true, logprobs: 1, max_tokens: 1, temperature: 0`, then the sum
of `token_logprobs[ctxlen:-1]` (the continuation's tokens; the last entry is the one generated token) and whether
each of them is its position's top alternative.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from miles_contracts import LogprobEntry
from miles_rollout.engine_error import EngineError
from miles_rollout.intake import check_token_rows

if TYPE_CHECKING:
    from miles_rollout.engine import Engine

Prompt = str | list[str] | list[int] | list[list[int]]


def completion_logprobs(entries: list[Any], tops: list[Any], offset: int = 0) -> dict[str, Any]:
    """The legacy layout of `entries` (log-prob, token id, token text) and their top alternatives; offsets count
    from `offset` (the characters of the choice's text before the first of these tokens)."""
    tokens = [text or "" for _, _, text in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [logprob for logprob, _, _ in entries],
        "top_logprobs": [_by_text(top) if top else None for top in tops],
        "text_offset": offsets,
    }


def _by_text(top: list[Any]) -> dict[str, float]:
    """Alternatives (most likely first) keyed by text. Tokens whose texts coincide (byte pieces of one character all
    read "\ufffd") keep the most likely one's log-prob, so the largest value stays the position's top log-prob, the
    one lm-eval compares a token's log-prob with to tell whether it was greedy (SGLang keeps the least likely)."""
    alternatives: dict[str, float] = {}
    for logprob, _, text in top:
        alternatives.setdefault(text or "", logprob)
    return alternatives


def with_prompt(source: Any, output: dict[str, Any]) -> dict[str, Any]:
    """An echoed choice's log-probs: the prompt's entries (offsets from 0), then `output` (the output's entries in
    the legacy layout, their offsets counted from the echoed text's length). `source`: the sample's `meta_info` or
    its first stream delta, either holding `input_token_logprobs` / `input_top_logprobs`."""
    entries: list[LogprobEntry] = source.input_token_logprobs or []
    prompt = completion_logprobs(entries, source.input_top_logprobs or [None] * len(entries))
    return {key: prompt[key] + output[key] for key in output}


async def echo_texts(engine: Engine, prompt: Prompt, skip_special_tokens: bool) -> list[str]:
    """Each prompt's text, to echo: a text prompt as sent; a token-id prompt decoded by the tokenizer (in the intake
    pool, off the event loop, within its time limit), special tokens dropped unless `skip_special_tokens` is false.
    An id outside the vocabulary is the client's 400, as the engine's intake would answer it."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], str):
        return cast("list[str]", list(prompt))
    rows = cast("list[list[int]]", [prompt] if isinstance(prompt[0], int) else prompt)
    if engine.tokenizer is None:
        raise EngineError(
            "echo: this model directory has no tokenizer, so a token-id prompt's text cannot be echoed; remove echo, "
            "or use /generate with return_logprob and logprob_start_len 0 for the prompt's log-probs"
        )
    check_token_rows(rows, "prompt", engine.limits.vocab_size)

    def decode(tokenizer: Any) -> list[str]:
        return [str(tokenizer.decode(row, skip_special_tokens=skip_special_tokens)) for row in rows]

    return await engine.intake.run_in_pool(decode, "decoding the prompts to echo")

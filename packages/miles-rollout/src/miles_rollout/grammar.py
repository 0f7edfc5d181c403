"""Structured output: a sample constrained to a JSON schema, a regular expression or an EBNF grammar, through
xgrammar (the grammar library SGLang uses).

A request's grammar is compiled once (`Grammars.compile`, cached by its text) against the served tokenizer; each
sample gets its own `GrammarMatcher`, which every sampled token advances. At a row's sampling the matcher's mask of
allowed next tokens sets every other logit to -inf, before the sampler (row_sampling.py): the choice follows the
grammar, while the returned log-probs stay those of the unconstrained logits (the log-prob contract,
docs/architecture.md). The mask depends only on the tokens so far, so a constrained sample is as deterministic
as any other. A sample ends (`stop`) when its grammar is complete and it emits an end token; a mask that allows no
token at all ends it (`abort`, `NO_TOKEN_FITS_THE_GRAMMAR`) without emitting one the grammar forbids.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from miles_contracts import SamplingParams
from miles_rollout.engine_error import EngineError

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
# A constrained sample's finish message (type "abort") when its grammar's mask allows no token of the vocabulary.
NO_TOKEN_FITS_THE_GRAMMAR = (
    "structured output: no token of the vocabulary continues the grammar here (the tokenizer has no token for what it "
    "needs next, or another constraint such as min_new_tokens forbids the only ones it allows); the sample ends with "
    "what it generated so far"
)


class Grammars:
    """xgrammar over the served tokenizer: compiles grammars, makes matchers, masks logits (xgrammar is imported
    here, the first time a request carries a grammar)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int] | None = None) -> None:
        """`vocab_size`: the model's (padded) vocabulary, the logits' width; `stop_token_ids`: the tokens that end a
        sample (the model's EOS ids and the tokenizer's, as SGLang passes them), the only ones a complete grammar
        allows (None: xgrammar's guess from the tokenizer)."""
        import xgrammar

        self._xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        self._compiler = xgrammar.GrammarCompiler(self.info, max_threads=1)
        self._compile = functools.lru_cache(maxsize=256)(self._compile_uncached)

    def compile(self, params: SamplingParams) -> Any:
        """The compiled grammar of a request's sampling params (None without one); an invalid grammar is a 400
        that names the field and xgrammar's reason."""
        kinds = [(field, getattr(params, field)) for field in GRAMMAR_FIELDS if getattr(params, field) is not None]
        if not kinds:
            return None
        return self._compile(*kinds[0])

    def _compile_uncached(self, field: str, text: str) -> Any:
        try:
            if field == "json_schema":
                return self._compiler.compile_json_schema(text)
            if field == "regex":
                return self._compiler.compile_regex(text)
            return self._compiler.compile_grammar(text)
        except (RuntimeError, ValueError) as error:
            reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            raise EngineError(f"sampling_params.{field} is not a valid {field.replace('_', ' ')}: {reason}") from error

    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher (one per sample)."""
        return self._xgr.GrammarMatcher(compiled)

    def mask(self, logits: torch.Tensor, matchers: list[Any]) -> None:
        """Set, in place, the logits of tokens each row's matcher does not allow next to -inf (rows with no matcher:
        None, unchanged)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = self._xgr.allocate_token_bitmask(len(rows), self.info.vocab_size)
        for slot, row in enumerate(rows):
            matchers[row].fill_next_token_bitmask(bitmask, slot)
        index = torch.tensor(rows, device=logits.device)
        constrained = logits[index].float()
        self._xgr.apply_token_bitmask_inplace(constrained, bitmask.to(logits.device))
        logits[index] = constrained.to(logits.dtype)

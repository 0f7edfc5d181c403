"""The engine's output stage, SGLang's detokenizer manager and result hand-back: what happens to a sampled token and
to a finished request, on the engine thread.

- `append_token`: a sample's new token joins its output (the grammar's matcher advanced, its log-prob entries kept),
  its text grows token by token when it has stops or streams (detokenizer.py, at a cost that does not grow with its
  length), and the stop rules decide whether it ends: EOS / stop token, stop string / regex (stops.py), a complete
  grammar, max_new_tokens, the context length; a streaming sample that goes on hands its gain to its listener;
- `final_text`: a finished sample's text, decoded once, whole, cut where its stop starts;
- `complete` / `fail`: a finished request's responses (sequence.py's `build_response`) to its stream and its future,
  or its error, on the caller's loop (`deliver`).

The scheduler decides nothing here: it appends what the model runner sampled and finishes a sample with the reason
`append_token` returns (scheduler.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from miles_contracts import FinishReason, SamplingParams
from miles_rollout.detokenizer import IncrementalDetokenizer, IncrementalText
from miles_rollout.engine_error import EngineError
from miles_rollout.grammar import NO_TOKEN_FITS_THE_GRAMMAR
from miles_rollout.sequence import Group, Sequence, build_delta, build_response, finish_reason
from miles_rollout.stops import StopMatcher


class OutputStage:
    """Tokens to text, stop rules and results, for the engine serving `tokenizer` (None: token ids only)."""

    def __init__(self, tokenizer: Any, eos_ids: set[int], context_length: int, stop_regex_window_chars: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.context_length = context_length
        self.stop_regex_window_chars = stop_regex_window_chars
        self.num_generated_tokens = 0

    def append_token(
        self, seq: Sequence, token: int, logprob: float, top: list[tuple[float, int]]
    ) -> FinishReason | None:
        """Append a sampled token to `seq`; the reason it finishes with now, None when it goes on (a streaming sample
        then hands its gain to its listener)."""
        params = seq.group.params
        if seq.matcher is not None and not seq.matcher.accept_token(token):
            # The grammar's mask allowed no token of the vocabulary (each logit -inf, the sampler's choice
            # meaningless): the sample ends here rather than emit a token the grammar forbids.
            return finish_reason("abort", message=NO_TOKEN_FITS_THE_GRAMMAR)
        seq.output_ids.append(token)
        grammar_done = seq.matcher is not None and seq.matcher.is_terminated()
        seq.output_logprobs.append(logprob)
        if seq.group.top_logprobs_num > 0 and seq.group.return_logprob:
            seq.output_top_logprobs.append(top)
        self.num_generated_tokens += 1
        new_text = self._decode_new(seq)
        may_stop = len(seq.output_ids) >= params.min_new_tokens  # SGLang: no stop before min_new_tokens
        is_eos = token in self.eos_ids and not params.ignore_eos
        reason = None
        if may_stop and (is_eos or (params.stop_token_ids and token in params.stop_token_ids)):
            reason = finish_reason("stop", matched=token)
        elif may_stop and new_text and (found := self._find_stop(seq, len(new_text))) is not None:
            seq.stop_match = found
            reason = finish_reason("stop", matched=found[1])
        elif grammar_done:  # the grammar is complete and accepted its end token
            reason = finish_reason("stop", matched=token)
        elif len(seq.output_ids) >= params.max_new_tokens:
            reason = finish_reason("length", length=len(seq.output_ids))
        elif seq.num_tokens >= self.context_length:
            reason = finish_reason("length", length=len(seq.output_ids), message="context length reached")
        if reason is None and seq.group.on_progress is not None:
            self._stream_progress(seq)
        return reason

    def _decode_new(self, seq: Sequence) -> str:
        """The text a sample's newest token added, when it has stops or streams (decoded token by token, at a cost
        that does not grow with its length: detokenizer.py); "" otherwise (its text is decoded once, at the end)."""
        group = seq.group
        if seq.text_so_far is None:
            if self.tokenizer is None or not (_has_stops(group.params) or group.on_progress is not None):
                return ""
            params = group.params
            if group.stops is None and _has_stops(params):
                group.stops = StopMatcher(params, self.stop_regex_window_chars)
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens
            )
            seq.text_so_far = IncrementalText(detokenizer, group.stops.num_context_chars if group.stops else 0)
        return seq.text_so_far.add(seq.output_ids)

    def _find_stop(self, seq: Sequence, num_new: int) -> tuple[int, str] | None:
        """The first stop string or regex match that the sample's newest `num_new` characters complete (stops.py)."""
        if seq.group.stops is None:
            return None
        text = seq.text_so_far
        assert text is not None
        found: tuple[int, str] | None = seq.group.stops.find(text.tail, text.tail_start, num_new)
        return found

    def _stream_progress(self, seq: Sequence) -> None:
        """Hand what a streaming sample gained with its newest token to its listener (`StreamDelta`: new ids and
        log-prob entries, new text), at a cost that does not grow with its length. The text holds back the last
        characters a stop could still trim (`StopMatcher.num_held_chars`) and a trailing partial UTF-8 character
        (detokenizer.py), so streamed text is always a prefix of the final text."""
        group = seq.group
        text = ""
        if seq.text_so_far is not None:
            end = seq.text_so_far.num_chars - (group.stops.num_held_chars if group.stops is not None else 0)
            if end > seq.num_streamed_chars:
                text = seq.text_so_far.between(seq.num_streamed_chars, end)
                seq.num_streamed_chars = end
        delta = build_delta(seq, text, self._token_text_for(group))
        seq.num_streamed_tokens = len(seq.output_ids)
        assert group.on_progress is not None
        group.on_progress(seq.sample_index, delta, False)

    def _decode(self, ids: list[int], params: SamplingParams) -> str:
        """`ids` decoded whole, as the sample's params ask."""
        return str(
            self.tokenizer.decode(
                ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        )

    def final_text(self, seq: Sequence) -> str:
        """A finished sample's text: its output ids decoded once, whole (per-token decoding matched stops on, and
        streamed, this text up to a held-back partial character), cut where its stop starts unless no_stop_trim."""
        if self.tokenizer is None:
            return ""
        params = seq.group.params
        text = self._decode(seq.output_ids, params)
        if seq.stop_match is None or params.no_stop_trim:
            return text
        start, matched = seq.stop_match
        if text[start : start + len(matched)] != matched:  # a decoder that rewrites earlier text: SGLang's rule
            start = text.find(matched)
        return text[:start] if start >= 0 else text

    def _token_text(self, token: int) -> str:
        return str(self.tokenizer.decode([token], skip_special_tokens=False))

    def _token_text_for(self, group: Group) -> Any:
        return self._token_text if group.return_text_in_logprobs and self.tokenizer is not None else None

    def complete(self, group: Group) -> None:
        """Every sample of `group` finished: its responses to its stream's listener and to its caller's future."""
        responses = [build_response(s, self._token_text_for(group)) for s in group.sequences]
        if group.on_progress is not None:
            for seq, response in zip(group.sequences, responses, strict=True):
                group.on_progress(seq.sample_index, response, True)
        if group.future is not None and group.loop is not None:
            deliver(group.loop, set_result, group.future, responses)

    @staticmethod
    def fail(group: Group, message: str) -> None:
        """The request failed: its caller's future raises `message` (a 500)."""
        if group.future is not None and group.loop is not None:
            deliver(group.loop, set_exception, group.future, EngineError(message, 500))


def _has_stops(params: SamplingParams) -> bool:
    return bool(params.stop_strings() or params.stop_regexes())


def deliver(
    loop: asyncio.AbstractEventLoop,
    callback: Callable[[asyncio.Future[Any], Any], None],
    future: asyncio.Future[Any],
    value: Any,
) -> None:
    """Engine thread: hand `value` to `future` on its loop (`callback`: `set_result` or `set_exception`). A closed loop
    means its caller is gone (an in-process caller's `asyncio.run` returned, say, once it had what it streamed):
    nothing to hand over, and never an error of the engine's step, which would fail every other caller's requests."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, future, value)


def set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)

"""Stop strings and stop regexes (SGLang's `stop` and `stop_regex`): refused at intake when a request asks for more
than the server's limits allow (`check_stop_patterns`), then matched on each sample's text as it grows, on the
engine thread (`StopMatcher`, called by the output stage, output.py, after every token).

Matching costs the same after every token however long the output is:
- a stop string can only newly appear in the token's new text or in the (longest stop - 1) characters before it,
  so only that region is searched;
- stop regexes run on RE2 (google-re2: linear time, no backtracking, so a pattern like `([\\s\\S]+)+QQQQQ` cannot
  hold the engine thread, and the GIL with it, for minutes), all of a sample's patterns in one pass, over the last
  `RequestLimits.stop_regex_window_chars` characters of its text only: a match longer than the window is not found.
  RE2 sees the character before the window, so `^` and `\\b` there mean what they mean in the whole text.
Patterns RE2 does not support (backreferences, lookaround) are refused with a 400 naming the pattern.

Semantics are SGLang's: the earliest stop string wins, then the earliest regex match (the first pattern listed at
a tie); the text is trimmed where the match starts unless `no_stop_trim`; `finish_reason.matched` is the matched text.
"""

from __future__ import annotations

from typing import Any

import re2

from miles_contracts import SamplingParams
from miles_rollout.config import RequestLimits
from miles_rollout.engine_error import EngineError


def regex_options() -> re2.Options:
    """RE2's options for stop regexes: no capture groups (only where a match starts and ends is needed, which lets
    RE2 answer with its DFA), and no RE2 log lines on stderr for a pattern it refuses (the 400 says why)."""
    options = re2.Options()
    options.never_capture = True
    options.log_errors = False
    return options


def compile_regexes(patterns: list[str]) -> Any:
    """One RE2 program matching any of `patterns`, leftmost first (an `re2.error` when RE2 refuses it)."""
    return re2.compile("|".join(f"(?:{p})" for p in patterns), regex_options())


def _reason(error: re2.error) -> str:
    reason = error.args[0] if error.args else error
    return reason.decode(errors="replace") if isinstance(reason, bytes) else str(reason)


def check_stop_patterns(params: SamplingParams, limits: RequestLimits) -> None:
    """Refuse (an `EngineError`, 400) stop strings and regexes beyond `limits` (how many, how long) and any regex
    RE2 cannot run (backreferences, lookaround, repetition counts over 1000, a program too large)."""
    strings, regexes = params.stop_strings(), params.stop_regexes()
    if len(strings) + len(regexes) > limits.max_stop_patterns:
        raise EngineError(
            f"sampling_params has {len(strings)} stop strings and {len(regexes)} stop_regex patterns; this server "
            f"takes at most {limits.max_stop_patterns} in all (engine.limits.max_stop_patterns)"
        )
    for name, pattern in [*(("stop", s) for s in strings), *(("stop_regex", r) for r in regexes)]:
        if len(pattern) > limits.max_stop_chars:
            shown = repr(pattern) if len(pattern) <= 64 else f"{pattern[:64]!r}..."
            raise EngineError(
                f"sampling_params.{name} {shown} has {len(pattern)} characters; this server takes at most "
                f"{limits.max_stop_chars} (engine.limits.max_stop_chars)"
            )
    for pattern in regexes:
        try:
            compile_regexes([pattern])
        except re2.error as error:
            raise EngineError(
                f"sampling_params.stop_regex {pattern!r} is not supported: {_reason(error)}. Stop regexes use RE2 "
                "syntax (linear-time matching): no backreferences or lookaround"
            ) from error
    if len(regexes) > 1:
        try:
            compile_regexes(regexes)
        except re2.error as error:
            raise EngineError(
                f"sampling_params.stop_regex: the {len(regexes)} patterns together are too large for RE2 "
                f"({_reason(error)}); send fewer or simpler patterns"
            ) from error


class StopMatcher:
    """A request's stop strings and regexes, matched on the tail of a sample's text after each token."""

    def __init__(self, params: SamplingParams, window_chars: int) -> None:
        self.strings = [s for s in params.stop_strings() if s]
        patterns = params.stop_regexes()
        self.regex = compile_regexes(patterns) if patterns else None
        self.window_chars = window_chars
        self.is_trimmed = not params.no_stop_trim
        self.longest = max((len(s) for s in self.strings), default=0)

    @property
    def num_context_chars(self) -> int:
        """Characters before a token's new text that matching must see: a stop string's start (longest - 1), the
        regex window and the character before it (what `^` and `\\b` look at)."""
        return max(self.longest - 1, self.window_chars + 1 if self.regex is not None else 0)

    @property
    def num_held_chars(self) -> int:
        """Trailing characters a stream holds back: a later match may still start there and trim them (none with
        `no_stop_trim`). Streamed text is therefore always a prefix of the final text."""
        if not self.is_trimmed:
            return 0
        return max(self.longest - 1, self.window_chars if self.regex is not None else 0)

    def find(self, tail: str, tail_start: int, num_new: int) -> tuple[int, str] | None:
        """The first stop in a sample's text, given its end `tail` (the text from character `tail_start` on) whose
        last `num_new` characters are new; `tail` holds at least `num_context_chars` characters before them, or the
        whole text. Returns (where the match starts in the text, the matched text)."""
        start = max(0, len(tail) - num_new - (self.longest - 1))
        hits = [(at, s) for s in self.strings if (at := tail.find(s, start)) >= 0]
        if hits:
            at, matched = min(hits)
            return tail_start + at, matched
        if self.regex is None:
            return None
        # The window, with the character before it as context (searched from position 1, so never part of a match).
        begin = max(0, len(tail) - self.window_chars - 1)
        found = self.regex.search(tail[begin:], 1 if tail_start + begin > 0 else 0)
        return (tail_start + begin + found.start(), found.group(0)) if found is not None else None

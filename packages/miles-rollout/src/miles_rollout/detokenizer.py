"""Incremental detokenization: a sample's text grows by the text of its new tokens without decoding all of its
output ids again, on the engine thread (output.py). It feeds stop matching (stops.py) and streaming.

The algorithm is the prefix-offset / read-offset one of vLLM, TGI and SGLang's detokenizer: decode a short window
of trailing ids twice, with and without the new ones, and hand out what the new ones added. The window starts a
few tokens back because a token's text can depend on the one before it (a SentencePiece word start, the bytes of
a character split across tokens). Text that ends in U+FFFD may be the first bytes of a character whose other bytes
come with the next tokens, so up to `MAX_HELD_CHARS` trailing U+FFFD are held back until a later token settles
them. A run of tokens that add no settled text (invalid bytes, skipped special tokens) would make the window grow;
past `MAX_WINDOW_TOKENS` its start moves up to a settled boundary. Each token costs two decodes of a bounded window.

The sample's final text is still one full decode of its ids when it finishes (`OutputStage.final_text`, output.py), so
a tokenizer whose decoder rewrites earlier text can only move where a stop is found or what streams, never what the
response returns."""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"
# A partial UTF-8 character is at most 3 bytes; byte-level decoders write one U+FFFD for it, byte-fallback ones one
# per byte.
MAX_HELD_CHARS = 3
MAX_WINDOW_TOKENS = 16
SETTLED_TOKENS = 4  # a character is at most 4 bytes (4 tokens): what lies 4 tokens back no later token changes


class IncrementalDetokenizer:
    """The text of a growing list of token ids, handed out as it becomes complete (`step`)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._options = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        self.prefix_offset = 0  # the window's first id
        self.read_offset = 0  # ids before it have all of their text handed out
        self._num_context = 0  # characters of the window's text before `read_offset` (decode(ids[prefix:read]))
        self._num_extra = 0  # characters handed out beyond that: the settled part of text still held

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, **self._options))

    def step(self, ids: list[int]) -> str:
        """The text the ids added since the last call (`ids`: all of them so far, extended since)."""
        window = self._decode(ids[self.prefix_offset :])
        done = self._num_context + self._num_extra
        held = min(len(window) - len(window.rstrip(REPLACEMENT)), MAX_HELD_CHARS)
        new = window[done : len(window) - held]
        if held == 0 and new:  # everything is handed out: the window starts again at the last read ids
            self.prefix_offset, self.read_offset, self._num_extra = self.read_offset, len(ids), 0
            self._num_context = len(self._decode(ids[self.prefix_offset : self.read_offset]))
        else:
            self._num_extra += len(new)
            if len(ids) - self.prefix_offset > MAX_WINDOW_TOKENS:
                self._move_window(ids, window)
        return new

    def _move_window(self, ids: list[int], window: str) -> None:
        """Start the window later, at a boundary `SETTLED_TOKENS` back whose text is the window's and handed out."""
        boundary = len(ids) - SETTLED_TOKENS
        if boundary <= self.read_offset:
            return
        settled = self._decode(ids[self.prefix_offset : boundary])
        done = self._num_context + self._num_extra
        if not window.startswith(settled) or len(settled) > done:
            return  # a later token changed that text: try again after the next one
        self._num_extra = done - len(settled)
        self.prefix_offset, self.read_offset = self.read_offset, boundary
        self._num_context = len(self._decode(ids[self.prefix_offset : self.read_offset]))


class IncrementalText:
    """A sample's text as its tokens arrive, kept short: its length and its last characters (`tail`: the
    `num_context_chars` before the newest text, and that text), never all of it."""

    def __init__(self, detokenizer: IncrementalDetokenizer, num_context_chars: int) -> None:
        self.detokenizer = detokenizer
        self.num_context_chars = num_context_chars
        self.num_chars = 0
        self.tail = ""

    @property
    def tail_start(self) -> int:
        """Where `tail` starts in the text."""
        return self.num_chars - len(self.tail)

    def add(self, ids: list[int]) -> str:
        """Decode what `ids` (the output so far) added; returns the new text."""
        new = self.detokenizer.step(ids)
        if new:
            keep = self.num_context_chars
            self.tail = (self.tail[-keep:] if keep else "") + new
            self.num_chars += len(new)
        return new

    def between(self, start: int, end: int) -> str:
        """The text's characters [start, end), which the tail still holds."""
        assert start >= self.tail_start, (start, self.tail_start)
        return self.tail[start - self.tail_start : end - self.tail_start]

"""Per-request state inside the engine: a `Group` is one prompt of a `/generate` call; its `n` samples are
`Sequence`s that share the prompt's KV pages.

Life of a group: waiting → prefill (the prompt is computed once, in chunks under the step's token budget) → fork
into `n` sequences that decode one token per step → each finishes on EOS / stop token / stop string /
max_new_tokens / context length / abort, and the group answers when all of them have. A sample with stops or a
stream gets its text token by token (detokenizer.py, stops.py); a streamed one hands each event's gain to the
request's loop as a `StreamDelta` (streaming.py), never its whole response so far.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles_contracts import (
    FinishReason,
    GenerateResponse,
    LogprobEntry,
    MetaInfo,
    SamplingParams,
    WeightVersion,
    version_string,
)
from miles_kernels import RowSampling
from miles_rollout.detokenizer import IncrementalText


@dataclass
class DraftState:
    """Speculative decoding's draft state of a sequence (or of a prompt while it prefills; speculative.py): the
    draft K/V is exact for positions < `computed`; `pending` holds the trunk's hidden states (rows, H) of positions
    `computed` .. num_computed - 1, whose draft rows wait for their next token (None: no rows)."""

    computed: int = 0
    pending: Any = None  # torch.Tensor | None (sequence.py stays torch-free)

    @property
    def num_pending(self) -> int:
        return 0 if self.pending is None else int(self.pending.shape[0])


@dataclass
class SpecCounts:
    """A sequence's verify steps, its drafts proposed and accepted, and SGLang's histogram of accepted drafts per
    verify step (`histogram[a]`: steps that accepted exactly a drafts)."""

    verify_ct: int = 0
    num_proposed: int = 0
    num_correct: int = 0
    histogram: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.verify_ct += 1
        self.num_proposed += proposed
        self.num_correct += accepted
        self.histogram += [0] * (accepted + 1 - len(self.histogram))
        self.histogram[accepted] += 1

    def meta_info(self) -> dict[str, Any]:
        """SGLang's speculative `meta_info` keys."""
        return {
            "spec_verify_ct": self.verify_ct,
            "spec_num_proposed_drafts": self.num_proposed,
            "spec_num_correct_drafts": self.num_correct,
            "spec_accept_rate": self.num_correct / self.num_proposed if self.num_proposed else 0.0,
            "spec_accept_length": (self.verify_ct + self.num_correct) / self.verify_ct if self.verify_ct else 1.0,
            "spec_accept_histogram": list(self.histogram),
        }


@dataclass(eq=False)  # identity: the scheduler's lists find and remove this very object
class Sequence:
    """One sample being generated."""

    group: Group
    sample_index: int
    seed: int
    pages: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in `pages` (prompt + output)
    text: str = ""
    finish: FinishReason | None = None
    reserved_pages: int = 0  # admission reservation not yet allocated
    resume_at: int = 0  # retracted: tokens whose KV to recompute before decoding again
    # (weight version, first output token generated with it): more than one when the weights were updated while
    # the sequence was retracted; the response reports them as SGLang's `weight_versions` spans.
    version_starts: list[tuple[WeightVersion, int]] = field(default_factory=list)
    draft: DraftState = field(default_factory=DraftState)
    spec: SpecCounts | None = None  # speculative decoding's counts (None when the engine does not speculate)
    routed_experts: str | None = None  # SGLang's meta_info.routed_experts, gathered at finish (routed_experts.py)
    matcher: Any = None  # structured output: the sample's xgrammar GrammarMatcher (grammar.py), None without one
    # Text decoded token by token, for stops and streaming (None: the text is decoded once, at the end).
    text_so_far: IncrementalText | None = None
    stop_match: tuple[int, str] | None = None  # a stop string's or regex's (start in the text, matched text)
    num_streamed_tokens: int = 0  # output tokens handed to the stream so far
    num_streamed_chars: int = 0  # characters of text handed to the stream so far

    @property
    def tokens(self) -> list[int]:
        """The prompt and the output so far, as a new list (the per-step paths read `num_tokens` / `last_token`
        instead: building it costs the context's length at every row of every step)."""
        return self.group.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """`len(self.tokens)`, without building the list."""
        return len(self.group.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        """`self.tokens[-1]`, without building the list."""
        return self.output_ids[-1] if self.output_ids else self.group.prompt_ids[-1]

    @property
    def rid(self) -> str:
        return self.group.rid if self.group.params.n == 1 else f"{self.group.rid}-{self.sample_index}"

    def row_sampling(self, offset: int = 0) -> RowSampling:
        """Sampling settings of the sequence's next token, or of the one `offset` tokens further (a draft's)."""
        params = self.group.params
        return RowSampling(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            seed=self.seed,
            position=self.num_tokens + offset,
        )


@dataclass(eq=False)
class Group:
    """One prompt of a generate call and its `n` samples."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    weight_version: WeightVersion
    future: asyncio.Future[list[GenerateResponse]] | None
    loop: asyncio.AbstractEventLoop | None
    prefill_pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # prompt tokens whose K/V are computed
    cached_tokens: int = 0  # prompt tokens reused from the radix cache
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    sequences: list[Sequence] = field(default_factory=list)
    reserved_pages: int = 0
    total_pages: int = 0  # pages the whole generation needs (a retracted prefill reserves them again)
    arrived_at: float = field(default_factory=time.perf_counter)  # for SGLang's e2e_latency
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    lora_id: str | None = None  # the LoRA adapter it is generated with (served_loras.py), None: the base model
    draft: DraftState = field(default_factory=DraftState)  # the prompt's draft rows (speculative.py)
    # Streaming: called on the engine thread with (sample index, what it gained, False) after each token of a sample
    # and with (sample index, its final response, True) when the group completes (`Engine.generate_stream`).
    on_progress: Callable[[int, StreamDelta | GenerateResponse, bool], None] | None = None
    grammar: Any = None  # structured output: the request's compiled grammar (grammar.py), None without one
    stops: Any = None  # the request's StopMatcher (stops.py), made at its first token; None without stops

    @property
    def is_prefilled(self) -> bool:
        return self.num_computed == len(self.prompt_ids)

    @property
    def needs_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    def logprob_temperature(self) -> float:
        return 1.0 if self.params.temperature == 0.0 else self.params.temperature


def finish_reason(
    kind: str, matched: int | str | None = None, message: str | None = None, length: int | None = None
) -> FinishReason:
    return FinishReason(type=kind, matched=matched, message=message, length=length)  # type: ignore[arg-type]


@dataclass
class StreamDelta:
    """What a streamed sample gained since its previous event, handed from the engine thread to the request's loop
    (streaming.py): its new output ids, their log-prob entries (None: not asked for), the new text that no stop can
    still trim, and its `meta_info` now without the log-prob lists; a sample's first delta also carries the input's
    log-prob entries. Deltas a slow reader has not taken yet are merged (`merge`), so they hold what the final
    response holds at most."""

    output_ids: list[int]
    text_pieces: list[str]
    meta: dict[str, Any]
    output_token_logprobs: list[LogprobEntry] | None = None
    output_top_logprobs: list[list[LogprobEntry] | None] | None = None
    input_token_logprobs: list[LogprobEntry] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_pieces)

    def merge(self, later: StreamDelta) -> None:
        """Add a later delta of the same sample to this one (costs what `later` holds)."""
        self.output_ids += later.output_ids
        self.text_pieces += later.text_pieces
        self.meta = later.meta
        if self.output_token_logprobs is not None and later.output_token_logprobs is not None:
            self.output_token_logprobs += later.output_token_logprobs
        if self.output_top_logprobs is not None and later.output_top_logprobs is not None:
            self.output_top_logprobs += later.output_top_logprobs


def _entry_maker(token_text: Callable[[int], str] | None) -> Callable[[float | None, int], LogprobEntry]:
    def entry(lp: float | None, tok: int) -> LogprobEntry:
        return (lp, tok, token_text(tok) if token_text is not None else None)

    return entry


def build_delta(seq: Sequence, text: str, token_text: Callable[[int], str] | None = None) -> StreamDelta:
    """A streamed sample's gain since `seq.num_streamed_tokens` (its output tokens from there on, `text`); costs what
    it holds, not the sample's length (but the input's entries, in the sample's first delta)."""
    group = seq.group
    entry = _entry_maker(token_text)
    start = seq.num_streamed_tokens
    delta = StreamDelta(output_ids=seq.output_ids[start:], text_pieces=[text] if text else [], meta=_meta(seq))
    if group.return_logprob:
        new = zip(seq.output_logprobs[start:], seq.output_ids[start:], strict=True)
        delta.output_token_logprobs = [entry(lp, tok) for lp, tok in new]
        if group.top_logprobs_num > 0:
            tops = seq.output_top_logprobs[start:]
            delta.output_top_logprobs = [[entry(lp, tok) for lp, tok in top] for top in tops]
        if start == 0 and group.logprob_start_len >= 0:
            delta.input_token_logprobs, delta.input_top_logprobs = _input_entries(group, entry)
    return delta


def _input_entries(
    group: Group, entry: Callable[[float | None, int], LogprobEntry]
) -> tuple[list[LogprobEntry], list[list[LogprobEntry] | None] | None]:
    ids = group.prompt_ids[group.logprob_start_len :]
    entries = [entry(lp, tok) for lp, tok in zip(group.input_logprobs, ids, strict=True)]
    if group.top_logprobs_num <= 0:
        return entries, None
    return entries, [None if top is None else [entry(lp, tok) for lp, tok in top] for top in group.input_top_logprobs]


def _meta(seq: Sequence) -> dict[str, Any]:
    """A sequence's `meta_info` without its log-prob lists."""
    group = seq.group
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": seq.finish,
        "prompt_tokens": len(group.prompt_ids),
        "completion_tokens": len(seq.output_ids),
        "cached_tokens": group.cached_tokens,
        # the newest version it was generated with (a retracted sequence continued under updated weights: theirs)
        "weight_version": seq.version_starts[-1][0] if seq.version_starts else group.weight_version,
        "e2e_latency": time.perf_counter() - group.arrived_at,
    }
    if seq.spec is not None:
        meta.update(seq.spec.meta_info())
    if seq.routed_experts is not None:
        meta["routed_experts"] = seq.routed_experts
    if len(seq.version_starts) > 1:
        ends = [start for _, start in seq.version_starts[1:]] + [len(seq.output_ids)]
        meta["weight_versions"] = [
            {"version": version_string(version), "start": start, "end": end}
            for (version, start), end in zip(seq.version_starts, ends, strict=True)
        ]
    return meta


def build_response(seq: Sequence, token_text: Callable[[int], str] | None = None) -> GenerateResponse:
    """The SGLang-shaped response of one finished sequence; `token_text` fills each log-prob entry's text (SGLang's
    `return_text_in_logprobs`), else it is None."""
    group = seq.group
    entry = _entry_maker(token_text)
    meta = _meta(seq)
    if group.return_logprob:
        meta["output_token_logprobs"] = [
            entry(lp, tok) for lp, tok in zip(seq.output_logprobs, seq.output_ids, strict=True)
        ]
        if group.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [[entry(lp, tok) for lp, tok in top] for top in seq.output_top_logprobs]
        if group.logprob_start_len >= 0:
            meta["input_token_logprobs"], tops = _input_entries(group, entry)
            if tops is not None:
                meta["input_top_logprobs"] = tops
    return GenerateResponse(text=seq.text, output_ids=list(seq.output_ids), meta_info=MetaInfo(**meta))

"""Request intake, SGLang's tokenizer-manager stage: a `GenerateRequest` becomes the scheduler's `Group`s (one per
prompt, its KV pages sized and its seed chosen), or an `EngineError` (a 4xx) that names what the engine cannot serve.
`Engine.generate` and `Engine.generate_stream` call it before anything is queued (engine.py).

What intake decides depends only on the request, the engine's `EngineLimits` (vocabulary, context length, KV pages,
features, the server's request limits) and the tokenizer: `check_request` (cheap, on the caller's loop) and
`build_groups` (tokenizing, compiling grammars, sizing pages) are functions of those, and `Intake` only runs them:
every token id (prompt, stop ids, logit-bias keys) against the vocabulary, prompts and samples per request, top
log-prob entries, stop patterns, so the engine step never meets an id outside the vocabulary or a request larger
than the server's limits. CPU-heavy intake work (tokenizing text, compiling a grammar, and the OpenAI routes' chat
templates through `run_in_pool`) runs in a small worker pool with a time limit, never on the event loop, so one
request's intake cannot stall the server's other clients. Requests that carry token ids and no grammar (what the
orchestrator sends) skip the pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import itertools
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from miles_contracts import GenerateRequest, SamplingParams
from miles_rollout.config import RequestLimits
from miles_rollout.engine_error import EngineError
from miles_rollout.grammar import Grammars
from miles_rollout.page_allocator import ceil_div, num_shared_pages
from miles_rollout.sequence import Group
from miles_rollout.stops import check_stop_patterns

T = TypeVar("T")
# A prompt text longer than this many characters per token of context cannot fit: refused before tokenizing.
MAX_CHARS_PER_TOKEN = 64
MAX_ID_DIGITS = 12  # a logit-bias key longer than this is no token id (and int() of 5,000 digits raises)


@dataclass(frozen=True)
class EngineLimits:
    """What intake needs to know of the engine it feeds: the model's vocabulary, the context and KV-page budget, the
    features the engine was started with, and the server's request limits."""

    vocab_size: int
    context_length: int
    page_size: int
    num_kv_pages: int
    max_running_requests: int
    seed: int  # the engine's; seeds of requests that carry none derive from it
    model_type: str
    is_moe: bool
    has_draft: bool  # speculative decoding (no structured output with it)
    returns_routed_experts: bool  # started with enable_return_routed_experts
    has_tokenizer: bool
    requests: RequestLimits


# ------------------------------------------------------------------ checks (cheap, on the caller's loop)


def check_request(request: GenerateRequest, limits: EngineLimits) -> list[SamplingParams]:
    """The request's size, routed-experts ask and sampling params against `limits` (a 4xx naming what cannot be
    served); each prompt's sampling params."""
    _check_size(request, limits.requests)
    _check_routed_experts(request, limits)
    params = [request.params_for(i) for i in range(request.batch_size)]
    for p in {id(p): p for p in params}.values():
        _check_params(p, limits)
    return params


def _check_size(request: GenerateRequest, limits: RequestLimits) -> None:
    """The request's prompts, samples and top log-prob entries within the server's limits."""
    num_prompts = request.batch_size
    if num_prompts > limits.max_prompts_per_request:
        raise EngineError(
            f"the request has {num_prompts} prompts; this server takes at most {limits.max_prompts_per_request} "
            "per request (split the batch)"
        )
    num_samples = sum(request.params_for(i).n for i in range(num_prompts))
    if num_samples > limits.max_samples_per_request:
        raise EngineError(
            f"the request asks for {num_samples} samples (prompts x n); this server takes at most "
            f"{limits.max_samples_per_request} per request (split the batch)"
        )


def _check_top_logprobs(request: GenerateRequest, prompts: list[list[int]], limits: EngineLimits) -> None:
    entries = 0
    for i, prompt in enumerate(prompts):
        top = request.top_logprobs_num_for(i)
        if not (top and request.return_logprob_for(i)):
            continue
        params = request.params_for(i)
        positions = params.n * min(params.max_new_tokens, limits.context_length)
        if request.logprob_start_len_for(i) >= 0:
            positions += len(prompt) - request.logprob_start_len_for(i)
        entries += top * positions
    if entries > limits.requests.max_top_logprob_entries:
        raise EngineError(
            f"top_logprobs_num x positions is {entries} entries; this server returns at most "
            f"{limits.requests.max_top_logprob_entries} per request: lower top_logprobs_num or max_new_tokens"
        )


def _check_params(params: SamplingParams, limits: EngineLimits) -> None:
    """Token ids the sampling params name, inside the vocabulary; structured output's needs; stop patterns."""
    vocab = limits.vocab_size
    bad_stops = [t for t in params.stop_token_ids or () if t >= vocab]
    if bad_stops:
        raise EngineError(
            f"sampling_params.stop_token_ids has token ids {bad_stops[:5]} outside the vocabulary (0 .. {vocab - 1})"
        )
    for key in params.logit_bias or {}:
        if len(key) > MAX_ID_DIGITS or int(key) >= vocab:
            raise EngineError(f"sampling_params.logit_bias token id {key[:20]} is outside the vocabulary "
                              f"(0 .. {vocab - 1})")  # fmt: skip
    check_stop_patterns(params, limits.requests)
    if params.grammar is not None:
        if not limits.has_tokenizer:
            raise EngineError(f"sampling_params.{params.grammar} needs the model's tokenizer; this has none")
        if limits.has_draft:
            raise EngineError(
                f"sampling_params.{params.grammar} with speculative decoding is not supported: serve without "
                "--speculative-algorithm for structured output"
            )


def _check_routed_experts(request: GenerateRequest, limits: EngineLimits) -> None:
    """SGLang aborts such requests (or, without its flag, returns no routing); Miles answers 400."""
    if not request.return_routed_experts or limits.returns_routed_experts:
        return
    if not limits.is_moe:
        raise EngineError(
            f"return_routed_experts: this {limits.model_type} model has no MoE layer, so no token is "
            "routed to experts; remove return_routed_experts"
        )
    raise EngineError(
        "return_routed_experts needs a server started with --enable-return-routed-experts "
        "(rollout.engine.enable_return_routed_experts in a run config); restart it so, or remove "
        "return_routed_experts"
    )


def check_token_rows(rows: list[list[int]], field: str, vocab_size: int) -> None:
    """An EngineError (400) naming `field[i]` when a row holds a token id outside the model's vocabulary."""
    for i, row in enumerate(rows):
        bad = [t for t in row if t >= vocab_size]
        if bad:
            raise EngineError(f"{field}[{i}] has token ids {bad[:5]} outside the vocabulary (size {vocab_size})")


def prompt_texts(request: GenerateRequest, limits: EngineLimits) -> list[str]:
    """A text request's prompts, each short enough that its tokens could fit the context."""
    if not limits.has_tokenizer:
        raise EngineError("this model directory has no tokenizer; send `input_ids` instead of `text`")
    texts = request.text if isinstance(request.text, list) else [request.text]
    longest = limits.context_length * MAX_CHARS_PER_TOKEN
    for i, text in enumerate(texts):
        if text is not None and len(text) > longest:
            raise EngineError(f"text[{i}] has {len(text)} characters: more than the context length "
                              f"({limits.context_length} tokens) can hold; shorten it")  # fmt: skip
    return [t for t in texts if t is not None]


def needs_pool(request: GenerateRequest, params: list[SamplingParams]) -> bool:
    """Text to tokenize or a grammar to compile: intake work for the pool, not the event loop."""
    return request.input_ids is None or any(p.grammar is not None for p in params)


# ------------------------------------------------------------------ groups


def build_groups(
    request: GenerateRequest, params: list[SamplingParams], seeds: list[int], texts: list[str] | None,
    limits: EngineLimits, tokenizer: Any, grammars: Grammars | None,
) -> list[Group]:  # fmt: skip
    """One group per prompt (no future yet: the engine attaches its caller's), checked and sized (its KV pages
    reserved at admission): `texts` tokenized by `tokenizer` (None: the request's token ids), each prompt's grammar
    compiled by `grammars` (None when no prompt has one)."""
    if texts is None:
        rows = request.input_ids if request.is_batch else [request.input_ids]
        prompts: list[list[int]] = [[int(t) for t in row] for row in rows]  # type: ignore[union-attr,arg-type]
        check_token_rows(prompts, "input_ids", limits.vocab_size)
    else:
        prompts = [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    compiled = [grammars.compile(p) if grammars is not None and p.grammar is not None else None for p in params]
    _check_top_logprobs(request, prompts, limits)
    return [_group(request, i, prompt, params[i], seeds[i], compiled[i], limits) for i, prompt in enumerate(prompts)]


def _group(
    request: GenerateRequest, i: int, prompt: list[int], sampling: SamplingParams, seed: int, grammar: Any,
    limits: EngineLimits,
) -> Group:  # fmt: skip
    logprob_start_len = request.logprob_start_len_for(i)
    if logprob_start_len >= len(prompt):
        raise EngineError(
            f"logprob_start_len={logprob_start_len} is past the prompt ({len(prompt)} tokens); "
            "use -1 for no input log-probs or a value below the prompt length"
        )
    if request.return_routed_experts and request.routed_experts_start_len > len(prompt):
        raise EngineError(
            f"routed_experts_start_len={request.routed_experts_start_len} is past prompt {i} ({len(prompt)} "
            f"tokens); use a value in [0, {len(prompt)}] (0: the whole sequence)"
        )
    if len(prompt) >= limits.context_length:
        raise EngineError(
            f"the prompt has {len(prompt)} tokens; the context length is {limits.context_length}: shorten the prompt"
        )
    if sampling.n > limits.max_running_requests:
        raise EngineError(
            f"sampling_params.n={sampling.n} exceeds the server's max_running_requests={limits.max_running_requests}"
        )
    page_size = limits.page_size
    max_tokens = min(len(prompt) + sampling.max_new_tokens, limits.context_length)
    pages = ceil_div(len(prompt), page_size) + sampling.n * (
        ceil_div(max_tokens, page_size) - num_shared_pages(len(prompt), page_size, limits.has_draft)
    )
    if pages > limits.num_kv_pages - 1:
        raise EngineError(
            f"prompt {i} needs {pages} KV pages ({len(prompt)} prompt tokens, max_new_tokens="
            f"{sampling.max_new_tokens}, n={sampling.n}) but the server has {limits.num_kv_pages - 1}; "
            "lower max_new_tokens or n, or restart with more --kv-pages"
        )
    rid = request.rid[i] if isinstance(request.rid, list) else request.rid
    rid = (rid if not request.is_batch else f"{rid}-{i}") if rid else uuid.uuid4().hex
    return Group(
        rid=rid,
        prompt_ids=prompt,
        params=sampling,
        seed=seed,
        return_logprob=request.return_logprob_for(i),
        logprob_start_len=logprob_start_len,
        top_logprobs_num=request.top_logprobs_num_for(i),
        return_text_in_logprobs=request.return_text_in_logprobs,
        return_routed_experts=request.return_routed_experts,
        routed_experts_start_len=request.routed_experts_start_len,
        weight_version=None,
        future=None,
        loop=None,
        reserved_pages=pages,
        total_pages=pages,
        grammar=grammar,
    )


class Intake:
    """Runs intake for one engine: the cheap checks on the caller's loop, the rest in the intake pool when there is
    text to tokenize or a grammar to compile. It holds the pool, each pool thread's tokenizer copy and the counter
    that seeds requests without a `sampling_seed`; `grammars` makes (once) the engine's structured-output backend."""

    def __init__(self, limits: EngineLimits, tokenizer: Any, grammars: Callable[[], Grammars]) -> None:
        self.limits = limits
        self.tokenizer = tokenizer
        self._grammars = grammars
        self._seed_counter = itertools.count()  # seeds of requests that carry no sampling_seed
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=limits.requests.max_intake_workers, thread_name_prefix="miles-rollout-intake"
        )
        self._local = threading.local()  # each pool thread's own tokenizer copy (fast tokenizers are not shared)

    def shutdown(self) -> None:
        """Stop the intake pool (work still running finishes in the background)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def run_in_pool(self, fn: Callable[[Any], T], what: str) -> T:
        """`fn(tokenizer)` in the intake pool, with the pool thread's own copy of the tokenizer, within
        `limits.requests.intake_timeout_s` (else a 400 naming `what`). The event loop keeps serving meanwhile."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, lambda: fn(self._thread_tokenizer()))
        timeout = self.limits.requests.intake_timeout_s
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError as error:
            raise EngineError(
                f"{what} took longer than the server's intake limit ({timeout:g} s); send a smaller request"
            ) from error

    def _thread_tokenizer(self) -> Any:
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None and self.tokenizer is not None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return tokenizer

    async def make_groups(self, request: GenerateRequest) -> list[Group]:
        """The request's groups (`build_groups`), or the 4xx that names what cannot be served."""
        limits = self.limits
        params = check_request(request, limits)
        seeds = [p.sampling_seed if p.sampling_seed is not None else self._next_seed() for p in params]
        if not needs_pool(request, params):
            return build_groups(request, params, seeds, None, limits, self.tokenizer, None)
        texts = prompt_texts(request, limits) if request.input_ids is None else None
        has_grammar = any(p.grammar is not None for p in params)

        def prepare(tokenizer: Any) -> list[Group]:  # in the pool: xgrammar is set up there the first time too
            grammars = self._grammars() if has_grammar else None
            return build_groups(request, params, seeds, texts, limits, tokenizer, grammars)

        return await self.run_in_pool(prepare, "tokenizing the prompts and compiling the grammar")

    def _next_seed(self) -> int:
        return (self.limits.seed * 1_000_003 + next(self._seed_counter) * 7919) % (1 << 62)

"""Request intake: a `GenerateRequest` becomes the scheduler's `Group`s (one per prompt, its KV pages sized and its
seed chosen), or an `EngineError` (a 4xx) that names what the engine cannot serve. `Engine.generate` and
`Engine.generate_stream` call it before anything is queued (engine.py).

Everything a request refers to is checked here, so the engine step never meets an id outside the vocabulary or a
request larger than the server's limits (`EngineConfig.limits`): every token id (prompt, stop ids, logit-bias
keys) against the vocabulary, prompts and samples per request, top log-prob entries, stop patterns. CPU-heavy
intake work (tokenizing text, compiling a grammar, and the OpenAI routes' chat templates through `run_in_pool`)
runs in a small worker pool with a time limit, never on the event loop, so one request's intake cannot stall the
server's other clients. Requests that carry token ids and no grammar (what the orchestrator sends) skip the pool.
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
from typing import TYPE_CHECKING, Any, TypeVar

from miles_contracts import GenerateRequest, SamplingParams
from miles_rollout.engine_error import EngineError
from miles_rollout.scheduler import ceil_div
from miles_rollout.sequence import Group
from miles_rollout.stops import check_stop_patterns

if TYPE_CHECKING:
    from miles_rollout.engine import Engine

T = TypeVar("T")
# A prompt text longer than this many characters per token of context cannot fit: refused before tokenizing.
MAX_CHARS_PER_TOKEN = 64
MAX_ID_DIGITS = 12  # a logit-bias key longer than this is no token id (and int() of 5,000 digits raises)


@dataclass
class _Prepared:
    """A request's CPU-heavy intake results: prompts as token ids and each prompt's compiled grammar."""

    prompts: list[list[int]]
    grammars: list[Any]


class Intake:
    """The engine's request checks and group construction (it reads the engine's model, tokenizer and settings)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.limits = engine.config.limits
        self._seed_counter = itertools.count()  # seeds of requests that carry no sampling_seed
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.limits.max_intake_workers, thread_name_prefix="miles-rollout-intake"
        )
        self._local = threading.local()  # each pool thread's own tokenizer copy (fast tokenizers are not shared)

    def shutdown(self) -> None:
        """Stop the intake pool (work still running finishes in the background)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def run_in_pool(self, fn: Callable[[Any], T], what: str) -> T:
        """`fn(tokenizer)` in the intake pool, with the pool thread's own copy of the tokenizer, within
        `limits.intake_timeout_s` (else a 400 naming `what`). The event loop keeps serving meanwhile."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, lambda: fn(self._thread_tokenizer()))
        try:
            return await asyncio.wait_for(future, self.limits.intake_timeout_s)
        except TimeoutError as error:
            raise EngineError(
                f"{what} took longer than the server's intake limit ({self.limits.intake_timeout_s:g} s); send a "
                "smaller request"
            ) from error

    def _thread_tokenizer(self) -> Any:
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None and self.engine.tokenizer is not None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self.engine.tokenizer)
        return tokenizer

    # ------------------------------------------------------------------ checks (cheap, on the caller's loop)

    def _check_size(self, request: GenerateRequest) -> None:
        """The request's prompts, samples and top log-prob entries within the server's limits."""
        limits = self.limits
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

    def _check_top_logprobs(self, request: GenerateRequest, prompts: list[list[int]]) -> None:
        entries = 0
        for i, prompt in enumerate(prompts):
            top = request.top_logprobs_num_for(i)
            if not (top and request.return_logprob_for(i)):
                continue
            params = request.params_for(i)
            positions = params.n * min(params.max_new_tokens, self.engine.context_length)
            if request.logprob_start_len_for(i) >= 0:
                positions += len(prompt) - request.logprob_start_len_for(i)
            entries += top * positions
        if entries > self.limits.max_top_logprob_entries:
            raise EngineError(
                f"top_logprobs_num x positions is {entries} entries; this server returns at most "
                f"{self.limits.max_top_logprob_entries} per request: lower top_logprobs_num or max_new_tokens"
            )

    def _check_params(self, params: SamplingParams) -> None:
        """Token ids the sampling params name, inside the vocabulary; structured output's needs; stop patterns."""
        engine = self.engine
        vocab = engine.model_config.vocab_size
        bad_stops = [t for t in params.stop_token_ids or () if t >= vocab]
        if bad_stops:
            raise EngineError(
                f"sampling_params.stop_token_ids has token ids {bad_stops[:5]} outside the vocabulary "
                f"(0 .. {vocab - 1})"
            )
        for key in params.logit_bias or {}:
            if len(key) > MAX_ID_DIGITS or int(key) >= vocab:
                raise EngineError(f"sampling_params.logit_bias token id {key[:20]} is outside the vocabulary "
                                  f"(0 .. {vocab - 1})")  # fmt: skip
        check_stop_patterns(params, self.limits)
        if params.grammar is not None:
            if engine.tokenizer is None:
                raise EngineError(f"sampling_params.{params.grammar} needs the model's tokenizer; this has none")
            if engine.scheduler.drafter is not None:
                raise EngineError(
                    f"sampling_params.{params.grammar} with speculative decoding is not supported: serve without "
                    "--speculative-algorithm for structured output"
                )

    def _check_routed_experts(self, request: GenerateRequest) -> None:
        """SGLang aborts such requests (or, without its flag, returns no routing); Miles answers 400."""
        engine = self.engine
        if not request.return_routed_experts or engine.scheduler.routed_experts is not None:
            return
        if not engine.model_config.is_moe:
            raise EngineError(
                f"return_routed_experts: this {engine.model_config.model_type} model has no MoE layer, so no token is "
                "routed to experts; remove return_routed_experts"
            )
        raise EngineError(
            "return_routed_experts needs a server started with --enable-return-routed-experts "
            "(rollout.engine.enable_return_routed_experts in a run config); restart it so, or remove "
            "return_routed_experts"
        )

    def _token_prompts(self, request: GenerateRequest) -> list[list[int]]:
        rows = request.input_ids if request.is_batch else [request.input_ids]
        prompts: list[list[int]] = [[int(t) for t in row] for row in rows]  # type: ignore[union-attr,arg-type]
        self.check_token_rows(prompts, "input_ids")
        return prompts

    def check_token_rows(self, rows: list[list[int]], field: str) -> None:
        """An EngineError (400) naming `field[i]` when a row holds a token id outside the model's vocabulary."""
        vocab = self.engine.model_config.vocab_size
        for i, row in enumerate(rows):
            bad = [t for t in row if t >= vocab]
            if bad:
                raise EngineError(f"{field}[{i}] has token ids {bad[:5]} outside the vocabulary (size {vocab})")

    def _texts(self, request: GenerateRequest) -> list[str]:
        if self.engine.tokenizer is None:
            raise EngineError("this model directory has no tokenizer; send `input_ids` instead of `text`")
        texts = request.text if isinstance(request.text, list) else [request.text]
        longest = self.engine.context_length * MAX_CHARS_PER_TOKEN
        for i, text in enumerate(texts):
            if text is not None and len(text) > longest:
                raise EngineError(f"text[{i}] has {len(text)} characters: more than the context length "
                                  f"({self.engine.context_length} tokens) can hold; shorten it")  # fmt: skip
        return [t for t in texts if t is not None]

    # ------------------------------------------------------------------ groups

    async def make_groups(self, request: GenerateRequest) -> list[Group]:
        """One group per prompt, checked (a 4xx naming what cannot be served) and sized (its KV pages reserved at
        admission). Tokenizing text and compiling grammars run in the intake pool."""
        self._check_size(request)
        self._check_routed_experts(request)
        params = [request.params_for(i) for i in range(request.batch_size)]
        for p in {id(p): p for p in params}.values():
            self._check_params(p)
        seeds = [p.sampling_seed if p.sampling_seed is not None else self._next_seed() for p in params]
        needs_pool = request.input_ids is None or any(p.grammar is not None for p in params)
        if needs_pool:
            texts = self._texts(request) if request.input_ids is None else None
            prepared = await self.run_in_pool(lambda tokenizer: self._prepare(request, params, texts, tokenizer),
                                              "tokenizing the prompts and compiling the grammar")  # fmt: skip
        else:
            prepared = _Prepared(self._token_prompts(request), [None] * len(params))
        self._check_top_logprobs(request, prepared.prompts)
        return self._groups(request, params, seeds, prepared)

    def _next_seed(self) -> int:
        return (self.engine.config.seed * 1_000_003 + next(self._seed_counter) * 7919) % (1 << 62)

    def _prepare(
        self, request: GenerateRequest, params: list[SamplingParams], texts: list[str] | None, tokenizer: Any
    ) -> _Prepared:
        """Pool thread: token ids of every prompt, the compiled grammar of each prompt's params."""
        if texts is None:
            prompts = self._token_prompts(request)
        else:
            prompts = [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
        grammars = self.engine.scheduler.grammars() if any(p.grammar is not None for p in params) else None
        compiled = [grammars.compile(p) if grammars is not None and p.grammar is not None else None for p in params]
        return _Prepared(prompts, compiled)

    def _groups(
        self, request: GenerateRequest, params: list[SamplingParams], seeds: list[int], prepared: _Prepared
    ) -> list[Group]:
        engine = self.engine
        loop = asyncio.get_running_loop()
        groups = []
        for i, prompt in enumerate(prepared.prompts):
            sampling = params[i]
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
            if len(prompt) >= engine.context_length:
                raise EngineError(
                    f"the prompt has {len(prompt)} tokens; the context length is {engine.context_length}: "
                    "shorten the prompt"
                )
            if sampling.n > engine.config.max_running_requests:
                raise EngineError(
                    f"sampling_params.n={sampling.n} exceeds the server's max_running_requests="
                    f"{engine.config.max_running_requests}"
                )
            max_tokens = min(len(prompt) + sampling.max_new_tokens, engine.context_length)
            pages = ceil_div(len(prompt), engine.page_size) + sampling.n * (
                ceil_div(max_tokens, engine.page_size) - engine.scheduler.num_shared_pages(len(prompt))
            )
            if pages > engine.config.num_kv_pages - 1:
                raise EngineError(
                    f"prompt {i} needs {pages} KV pages ({len(prompt)} prompt tokens, max_new_tokens="
                    f"{sampling.max_new_tokens}, n={sampling.n}) but the server has {engine.config.num_kv_pages - 1}; "
                    "lower max_new_tokens or n, or restart with more --kv-pages"
                )
            rid = request.rid[i] if isinstance(request.rid, list) else request.rid
            rid = (rid if not request.is_batch else f"{rid}-{i}") if rid else uuid.uuid4().hex
            groups.append(
                Group(
                    rid=rid,
                    prompt_ids=prompt,
                    params=sampling,
                    seed=seeds[i],
                    return_logprob=request.return_logprob_for(i),
                    logprob_start_len=logprob_start_len,
                    top_logprobs_num=request.top_logprobs_num_for(i),
                    return_text_in_logprobs=request.return_text_in_logprobs,
                    return_routed_experts=request.return_routed_experts,
                    routed_experts_start_len=request.routed_experts_start_len,
                    weight_version=engine.weight_version,
                    future=loop.create_future(),
                    loop=loop,
                    reserved_pages=pages,
                    total_pages=pages,
                    grammar=prepared.grammars[i],
                )
            )
        return groups

"""Request intake: a `GenerateRequest` becomes the scheduler's `Group`s (one per prompt, its KV pages sized and its
seed chosen), or an `EngineError` (a 4xx) that names what the engine cannot serve. `Engine.generate` and
`Engine.generate_stream` call it on the request's event loop, before anything is queued (engine.py)."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import TYPE_CHECKING

from miles_contracts import GenerateRequest
from miles_rollout.engine_error import EngineError
from miles_rollout.scheduler import ceil_div
from miles_rollout.sequence import Group

if TYPE_CHECKING:
    from miles_rollout.engine import Engine


class Intake:
    """The engine's request checks and group construction (it reads the engine's model, tokenizer and settings)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._seed_counter = itertools.count()  # seeds of requests that carry no sampling_seed

    def _check_constraints(self, request: GenerateRequest) -> None:
        """Structured output and logit bias need what they refer to: a tokenizer, token ids in the vocabulary."""
        engine = self.engine
        for i in range(request.batch_size):
            params = request.params_for(i)
            if params.grammar is not None:
                if engine.tokenizer is None:
                    raise EngineError(f"sampling_params.{params.grammar} needs the model's tokenizer; this has none")
                if engine.scheduler.drafter is not None:
                    raise EngineError(
                        f"sampling_params.{params.grammar} with speculative decoding is not supported: serve without "
                        "--speculative-algorithm for structured output"
                    )
            vocab = engine.model_config.vocab_size
            bad = [key for key in params.logit_bias or {} if int(key) >= vocab]
            if bad:
                raise EngineError(f"logit_bias token id {bad[0]} is outside the vocabulary (0 .. {vocab - 1})")

    def _tokenize(self, request: GenerateRequest) -> list[list[int]]:
        engine = self.engine
        if request.input_ids is not None:
            rows = request.input_ids if request.is_batch else [request.input_ids]
            prompts: list[list[int]] = [[int(t) for t in row] for row in rows]  # type: ignore[union-attr,arg-type]
            vocab = engine.model_config.vocab_size
            for i, row in enumerate(prompts):
                bad = [t for t in row if t >= vocab]
                if bad:
                    raise EngineError(f"input_ids[{i}] has token ids {bad[:5]} outside the vocabulary (size {vocab})")
            return prompts
        if engine.tokenizer is None:
            raise EngineError("this model directory has no tokenizer; send `input_ids` instead of `text`")
        texts = request.text if isinstance(request.text, list) else [request.text]
        return [list(engine.tokenizer.encode(t, add_special_tokens=False)) for t in texts if t is not None]

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

    def make_groups(self, request: GenerateRequest) -> list[Group]:
        """One group per prompt, checked (a 4xx naming what cannot be served) and sized (its KV pages reserved at
        admission), on the request's event loop."""
        engine = self.engine
        self._check_routed_experts(request)
        self._check_constraints(request)
        loop = asyncio.get_running_loop()
        groups = []
        for i, prompt in enumerate(self._tokenize(request)):
            params = request.params_for(i)
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
            if params.n > engine.config.max_running_requests:
                raise EngineError(
                    f"sampling_params.n={params.n} exceeds the server's max_running_requests="
                    f"{engine.config.max_running_requests}"
                )
            max_tokens = min(len(prompt) + params.max_new_tokens, engine.context_length)
            pages = ceil_div(len(prompt), engine.page_size) + params.n * (
                ceil_div(max_tokens, engine.page_size) - engine.scheduler.num_shared_pages(len(prompt))
            )
            if pages > engine.config.num_kv_pages - 1:
                raise EngineError(
                    f"prompt {i} needs {pages} KV pages ({len(prompt)} prompt tokens, max_new_tokens="
                    f"{params.max_new_tokens}, n={params.n}) but the server has {engine.config.num_kv_pages - 1}; "
                    "lower max_new_tokens or n, or restart with more --kv-pages"
                )
            grammar = engine.scheduler.grammars().compile(params) if params.grammar is not None else None
            rid = request.rid[i] if isinstance(request.rid, list) else request.rid
            rid = (rid if not request.is_batch else f"{rid}-{i}") if rid else uuid.uuid4().hex
            seed = params.sampling_seed
            if seed is None:
                seed = (engine.config.seed * 1_000_003 + next(self._seed_counter) * 7919) % (1 << 62)
            groups.append(
                Group(
                    rid=rid,
                    prompt_ids=prompt,
                    params=params,
                    seed=seed,
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
                    grammar=grammar,
                )
            )
        return groups

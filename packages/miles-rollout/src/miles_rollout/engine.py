"""The embedded rollout engine: continuous batching over the miles-kernels model, a paged KV cache with a radix
prefix cache, sampling, stop handling, log-probs, weight updates and memory release.

One background thread owns the model and runs `step()` in a loop; the asyncio side (server, in-process client)
submits work and awaits futures. Each step:
1. admits waiting prompts while sequences and KV pages allow (pages are reserved for the whole generation at
   admission, so a running request never runs out; a request that waits is never over-allocated);
2. builds one mixed batch: one token for every decoding sequence, then prompt chunks under the step's token
   budget (chunked prefill), and runs one forward over it;
3. samples the next token of every sequence whose input ended this step, records its log-prob (the log-prob
   contract), and finishes sequences on EOS / stop token / stop string / max_new_tokens / context length.
Control operations (weight updates, memory release) wait until no request is running, so no request ever mixes
two weight versions; aborts and cache flushes apply at the next step boundary.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles_contracts import GenerateRequest, GenerateResponse
from miles_kernels import (
    BucketAssembler,
    KernelConfig,
    KVStore,
    build_attention_batch,
    decode_bucket,
    full_logprobs,
    iter_checkpoint,
    load_model,
    load_state,
    read_model_config,
    sample,
    token_logprobs,
)
from miles_rollout.kv_cache import PageAllocator
from miles_rollout.radix_cache import RadixCache
from miles_rollout.sequence import Group, Sequence, build_response, finish_reason

logger = logging.getLogger("miles_rollout.engine")

MEMORY_TAGS = ("weights", "kv_cache")


class EngineError(Exception):
    """A request the engine cannot serve; `status_code` is the HTTP status the server answers with."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs (the `miles-rollout serve` flags)."""

    model_path: str
    kernel: KernelConfig = field(default_factory=KernelConfig)
    num_kv_pages: int = 1024
    max_running_requests: int = 256
    max_prefill_tokens: int = 2048
    context_length: int | None = None
    device: str = "cpu"
    seed: int = 0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Engine:
    """Owns the model, the KV store and the scheduler thread."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model = load_model(config.model_path, config.kernel, config.device)
        self.model_config = self.model.config
        self.page_size = config.kernel.page_size
        self.context_length = config.context_length or self.model_config.max_position_embeddings
        self.tokenizer = _load_tokenizer(config.model_path)
        self.eos_ids = set(self.model_config.eos_token_ids())
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(int(self.tokenizer.eos_token_id))
        self.store = KVStore.allocate(
            self.model_config, config.num_kv_pages, self.page_size, config.kernel.torch_dtype, config.device
        )
        self.allocator = PageAllocator(config.num_kv_pages)
        self.radix = RadixCache(self.allocator, self.page_size)
        self.weight_version = 0
        self.released: set[str] = set()
        self.weights_stale = False
        self._param_shapes = {name: (p.shape, p.dtype) for name, p in self.model.named_parameters()}
        self._assemblers: dict[int, BucketAssembler] = {}
        self._waiting: deque[Group] = deque()
        self._prefilling: list[Group] = []
        self._running: list[Sequence] = []
        self._reserved = 0
        self._controls: deque[tuple[Callable[[], Any], bool, asyncio.Future[Any], asyncio.AbstractEventLoop]] = deque()
        self._aborts: deque[str | None] = deque()
        self._lock = threading.Condition()
        self._stopped = False
        self._seed_counter = itertools.count()
        self.num_steps = 0
        self.num_generated_tokens = 0
        self._thread = threading.Thread(target=self._loop, name="miles-rollout-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ asyncio-facing API

    async def generate(self, request: GenerateRequest) -> list[GenerateResponse]:
        """Run a generate request; returns one response per prompt and sample, prompt-major."""
        groups = self._make_groups(request)
        with self._lock:
            self._check_can_generate()
            self._waiting.extend(groups)
            self._lock.notify()
        results = await asyncio.gather(*(g.future for g in groups if g.future is not None))
        return [response for group_responses in results for response in group_responses]

    async def abort(self, rid: str | None) -> None:
        """Abort one request (by rid) or every request (None); they finish with `abort`."""
        with self._lock:
            self._aborts.append(rid)
            self._lock.notify()

    async def control(self, fn: Callable[[], Any], needs_idle: bool) -> Any:
        """Run `fn` on the engine thread between steps; with `needs_idle`, once no request is running."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            self._controls.append((fn, needs_idle, future, loop))
            self._lock.notify()
        return await future

    def is_alive(self) -> bool:
        """True while the engine thread runs."""
        return self._thread.is_alive()

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ control operations (engine thread)

    def update_weights_from_disk(self, model_path: str, version: int | None) -> int:
        path = Path(model_path)
        new_config = read_model_config(path)
        if new_config.to_hf() != self.model_config.to_hf():
            raise EngineError(f"{model_path} holds a different architecture than the served model; cannot update")
        self._require_weights_resident()
        load_state(self.model, dict(iter_checkpoint(path)))
        return self._new_version(version)

    def receive_bucket(self, data: bytes) -> dict[str, Any]:
        """Take one weight bucket; apply the version when its last bucket arrives."""
        try:
            bucket = decode_bucket(data)
        except ValueError as error:
            raise EngineError(f"invalid weight bucket: {error}") from error
        assembler = self._assemblers.setdefault(bucket.version, BucketAssembler(version=bucket.version))
        try:
            assembler.add(bucket)
        except ValueError as error:
            del self._assemblers[bucket.version]
            raise EngineError(f"weight bucket rejected: {error}") from error
        if not assembler.is_complete:
            return {"complete": False, "weight_version": self.weight_version, "missing": sorted(assembler.missing)}
        del self._assemblers[bucket.version]
        self._require_weights_resident()
        try:
            load_state(self.model, assembler.tensors)
        except ValueError as error:
            raise EngineError(f"weight update rejected: {error}") from error
        return {"complete": True, "weight_version": self._new_version(bucket.version)}

    def apply_named_tensors(self, tensors: dict[str, torch.Tensor], version: int | None) -> int:
        """Load a complete set of HF-named tensors (the distributed update path)."""
        self._require_weights_resident()
        try:
            load_state(self.model, tensors)
        except ValueError as error:
            raise EngineError(f"weight update rejected: {error}") from error
        return self._new_version(version)

    def _new_version(self, version: int | None) -> int:
        self.weight_version = self.weight_version + 1 if version is None else version
        self.weights_stale = False
        self.radix.reset()  # cached K/V were computed with the old weights
        return self.weight_version

    def _require_weights_resident(self) -> None:
        if "weights" in self.released:
            raise EngineError("weights are released; call /resume_memory_occupation first", status_code=409)

    def flush_cache(self) -> None:
        self.radix.reset()

    def release_memory(self, tags: list[str] | None) -> list[str]:
        for tag in tags or MEMORY_TAGS:
            if tag not in MEMORY_TAGS:
                raise EngineError(f"unknown memory tag {tag!r}; use one of {list(MEMORY_TAGS)}")
            if tag in self.released:
                continue
            if tag == "kv_cache":
                self.radix.reset()
                self.allocator.reset()
                self.store.release()
            else:
                for param in self.model.parameters():
                    param.data = param.data.new_empty(0)
            self.released.add(tag)
        return sorted(self.released)

    def resume_memory(self, tags: list[str] | None) -> list[str]:
        for tag in tags or MEMORY_TAGS:
            if tag not in MEMORY_TAGS:
                raise EngineError(f"unknown memory tag {tag!r}; use one of {list(MEMORY_TAGS)}")
            if tag not in self.released:
                continue
            if tag == "kv_cache":
                self.store = KVStore.allocate(
                    self.model_config, self.config.num_kv_pages, self.page_size,
                    self.config.kernel.torch_dtype, self.config.device,
                )  # fmt: skip
            else:
                for name, param in self.model.named_parameters():
                    shape, dtype = self._param_shapes[name]
                    param.data = torch.zeros(shape, dtype=dtype, device=self.config.device)
                self.weights_stale = True  # contents were dropped: a weight update must come first
            self.released.discard(tag)
        return sorted(self.released)

    # ------------------------------------------------------------------ request intake

    def _check_can_generate(self) -> None:
        if self.released:
            raise EngineError(
                f"memory is released ({', '.join(sorted(self.released))}); call /resume_memory_occupation", 503
            )
        if self.weights_stale:
            raise EngineError("weights were released and not updated since; update weights before generating", 503)

    def _tokenize(self, request: GenerateRequest) -> list[list[int]]:
        if request.input_ids is not None:
            rows = request.input_ids if request.is_batch else [request.input_ids]
            prompts = [list(row) for row in rows]  # type: ignore[arg-type]
            vocab = self.model_config.vocab_size
            for i, row in enumerate(prompts):
                bad = [t for t in row if t >= vocab]
                if bad:
                    raise EngineError(f"input_ids[{i}] has token ids {bad[:5]} outside the vocabulary (size {vocab})")
            return prompts
        if self.tokenizer is None:
            raise EngineError("this model directory has no tokenizer; send `input_ids` instead of `text`")
        texts = request.text if isinstance(request.text, list) else [request.text]
        return [list(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts if t is not None]

    def _make_groups(self, request: GenerateRequest) -> list[Group]:
        if request.stream:
            raise EngineError("stream=true is not supported yet by the embedded engine; send stream=false")
        loop = asyncio.get_running_loop()
        groups = []
        for i, prompt in enumerate(self._tokenize(request)):
            params = request.params_for(i)
            if request.logprob_start_len >= len(prompt):
                raise EngineError(
                    f"logprob_start_len={request.logprob_start_len} is past the prompt ({len(prompt)} tokens); "
                    "use -1 for no input log-probs or a value below the prompt length"
                )
            if len(prompt) >= self.context_length:
                raise EngineError(
                    f"the prompt has {len(prompt)} tokens; the context length is {self.context_length}: "
                    "shorten the prompt"
                )
            if params.n > self.config.max_running_requests:
                raise EngineError(
                    f"sampling_params.n={params.n} exceeds the server's max_running_requests="
                    f"{self.config.max_running_requests}"
                )
            max_tokens = min(len(prompt) + params.max_new_tokens, self.context_length)
            pages = _ceil_div(len(prompt), self.page_size) + params.n * (
                _ceil_div(max_tokens, self.page_size) - len(prompt) // self.page_size
            )
            if pages > self.allocator.num_pages - 1:
                raise EngineError(
                    f"prompt {i} needs {pages} KV pages ({len(prompt)} prompt tokens, max_new_tokens="
                    f"{params.max_new_tokens}, n={params.n}) but the server has {self.allocator.num_pages - 1}; "
                    "lower max_new_tokens or n, or restart with more --kv-pages"
                )
            rid = request.rid[i] if isinstance(request.rid, list) else request.rid
            rid = (rid if not request.is_batch else f"{rid}-{i}") if rid else uuid.uuid4().hex
            seed = params.sampling_seed
            if seed is None:
                seed = (self.config.seed * 1_000_003 + next(self._seed_counter) * 7919) % (1 << 62)
            groups.append(
                Group(
                    rid=rid,
                    prompt_ids=prompt,
                    params=params,
                    seed=seed,
                    return_logprob=request.return_logprob,
                    logprob_start_len=request.logprob_start_len,
                    top_logprobs_num=request.top_logprobs_num,
                    weight_version=self.weight_version,
                    future=loop.create_future(),
                    loop=loop,
                    reserved_pages=pages,
                )
            )
        return groups

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stopped or self._has_work()):
                    self._lock.wait()
                if self._stopped:
                    break
            try:
                self._process_aborts()
                self._run_controls()
                if self._waiting or self._prefilling or self._running:
                    self._step()
            except Exception as error:  # a failing step must not take the server down: fail its requests
                logger.exception("engine step failed")
                self._fail_all(f"engine step failed: {type(error).__name__}: {error}")

    def _has_work(self) -> bool:
        # Waiting prompts always make progress: with nothing running, every page is free or evictable and a
        # prompt that could never fit was refused at submission.
        return bool(self._waiting or self._prefilling or self._running or self._aborts or self._controls)

    def _is_draining(self) -> bool:
        return any(needs_idle for _, needs_idle, _, _ in self._controls)

    def _run_controls(self) -> None:
        while self._controls:
            fn, needs_idle, future, loop = self._controls[0]
            if needs_idle and (self._prefilling or self._running):
                return
            with self._lock:
                self._controls.popleft()
            try:
                result = fn()
            except EngineError as error:
                loop.call_soon_threadsafe(_set_exception, future, error)
            except Exception as error:  # report, never crash the engine thread
                logger.exception("control operation failed")
                loop.call_soon_threadsafe(_set_exception, future, EngineError(f"{type(error).__name__}: {error}", 500))
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

    def _process_aborts(self) -> None:
        with self._lock:
            aborts = list(self._aborts)
            self._aborts.clear()
        for rid in aborts:
            for group in [g for g in self._waiting if rid is None or g.rid == rid]:
                self._waiting.remove(group)
                group.sequences = [Sequence(group, i, group.seed + i) for i in range(group.params.n)]
                for seq in group.sequences:
                    seq.finish = finish_reason("abort", message="aborted before it started")
                self._complete_group(group)
            for group in [g for g in self._prefilling if rid is None or g.rid == rid]:
                self._prefilling.remove(group)
                self.allocator.release(group.prefill_pages)
                self._reserved -= group.reserved_pages
                group.sequences = [Sequence(group, i, group.seed + i) for i in range(group.params.n)]
                for seq in group.sequences:
                    seq.finish = finish_reason("abort", message="aborted during prefill")
                self._complete_group(group)
            for seq in [s for s in self._running if rid is None or s.group.rid == rid or s.rid == rid]:
                self._finish(seq, finish_reason("abort", message="aborted"))

    def _fail_all(self, message: str) -> None:
        groups = {id(g): g for g in [*self._waiting, *self._prefilling, *(s.group for s in self._running)]}
        self._waiting.clear()
        self._prefilling.clear()
        self._running.clear()
        self.radix.reset()
        self.allocator.reset()
        self._reserved = 0
        for group in groups.values():
            if group.future is not None and group.loop is not None:
                group.loop.call_soon_threadsafe(_set_exception, group.future, EngineError(message, 500))

    def _admit(self) -> None:
        if self._is_draining():
            return
        while self._waiting:
            group = self._waiting[0]
            if len(self._running) + len(self._prefilling) + group.params.n > self.config.max_running_requests:
                return
            limit = len(group.prompt_ids) - 1
            if group.needs_input_logprobs:
                limit = min(limit, max(group.logprob_start_len - 1, 0))
            matched = self.radix.match(group.prompt_ids[:limit])
            available = self.allocator.num_free + self.radix.num_evictable() - self._reserved
            needed = group.reserved_pages - len(matched)
            if needed > available:
                self.allocator.release(matched)
                return  # admission waits for pages
            self._waiting.popleft()
            group.reserved_pages = needed
            self._reserved += needed
            group.prefill_pages = matched
            group.num_computed = group.cached_tokens = len(matched) * self.page_size
            self._prefilling.append(group)

    def _take_pages(self, count: int) -> list[int]:
        if count > self.allocator.num_free:
            self.radix.evict(count - self.allocator.num_free)
        self._reserved -= count
        return self.allocator.allocate(count)

    def _step(self) -> None:
        self._admit()
        if not (self._prefilling or self._running):
            return
        ids: list[int] = []
        query_lens: list[int] = []
        prefix_lens: list[int] = []
        tables: list[list[int]] = []
        owners: list[tuple[str, Any, int]] = []  # ("decode", seq, start) | ("prefill", group, start)
        for seq in self._running:
            total = seq.num_computed + 1
            extra = _ceil_div(total, self.page_size) - len(seq.pages)
            if extra > 0:
                seq.pages += self._take_pages(extra)
                seq.reserved_pages -= extra
            owners.append(("decode", seq, len(ids)))
            ids.append(seq.tokens[-1])
            query_lens.append(1)
            prefix_lens.append(seq.num_computed)
            tables.append(seq.pages)
        budget = max(self.config.max_prefill_tokens - len(ids), 1)
        for group in self._prefilling:
            if budget <= 0:
                break
            chunk = group.prompt_ids[group.num_computed : group.num_computed + budget]
            budget -= len(chunk)
            extra = _ceil_div(group.num_computed + len(chunk), self.page_size) - len(group.prefill_pages)
            if extra > 0:
                group.prefill_pages += self._take_pages(extra)
                group.reserved_pages -= extra
            owners.append(("prefill", group, len(ids)))
            ids += chunk
            query_lens.append(len(chunk))
            prefix_lens.append(group.num_computed)
            tables.append(group.prefill_pages)
        device = self.config.device
        batch = build_attention_batch(
            query_lens, prefix_lens, tables, self.page_size, self.config.kernel.attention_query_tile, device
        )
        with torch.no_grad():
            hidden = self.model.forward_hidden(torch.tensor(ids, device=device), batch, self.store)
            self._after_forward(hidden, owners, query_lens)
        self.num_steps += 1

    def _after_forward(self, hidden: torch.Tensor, owners: list[tuple[str, Any, int]], query_lens: list[int]) -> None:
        # Rows whose logits are needed: every decode row, the last row of a finished prompt, input-logprob rows.
        sample_rows: list[tuple[Sequence | Group, int]] = []
        for (kind, owner, start), length in zip(owners, query_lens, strict=True):
            if kind == "decode":
                owner.num_computed += 1
                sample_rows.append((owner, start))
                continue
            group: Group = owner
            first_position = group.num_computed
            group.num_computed += length
            if group.needs_input_logprobs:
                self._record_input_logprobs(group, hidden, start, first_position, length)
            if group.is_prefilled:
                sample_rows.append((group, start + length - 1))
        if not sample_rows:
            return
        logits = self.model.logits(hidden[torch.tensor([row for _, row in sample_rows], device=hidden.device)])
        sequences: list[Sequence] = []
        row_index: list[int] = []
        for i, (owner, _) in enumerate(sample_rows):
            if isinstance(owner, Group):
                children = self._fork(owner)
                sequences += children
                row_index += [i] * len(children)
            else:
                sequences.append(owner)
                row_index.append(i)
        sequences_to_sample = [s for s in sequences if s.group.params.max_new_tokens > 0]
        rows = [row_index[sequences.index(s)] for s in sequences_to_sample]
        for seq in sequences:
            if seq.group.params.max_new_tokens == 0:
                self._finish(seq, finish_reason("length", length=0))
        if not sequences_to_sample:
            return
        row_logits = logits[torch.tensor(rows, device=logits.device)]
        settings = [s.row_sampling() for s in sequences_to_sample]
        tokens = sample(row_logits, settings)
        temps = torch.tensor([[s.group.logprob_temperature()] for s in sequences_to_sample], device=logits.device)
        logprobs = token_logprobs(row_logits, tokens, temps)
        top = self._top_logprobs(row_logits, temps, sequences_to_sample)
        for j, seq in enumerate(sequences_to_sample):
            self._append_token(seq, int(tokens[j]), float(logprobs[j]), top[j])

    def _top_logprobs(
        self, row_logits: torch.Tensor, temps: torch.Tensor, seqs: list[Sequence]
    ) -> list[list[tuple[float, int]]]:
        wanted = max(s.group.top_logprobs_num if s.group.return_logprob else 0 for s in seqs)
        if wanted == 0:
            return [[] for _ in seqs]
        values, indices = full_logprobs(row_logits, temps).topk(wanted, dim=-1)
        return [
            list(
                zip(
                    values[j, : s.group.top_logprobs_num].tolist(),
                    indices[j, : s.group.top_logprobs_num].tolist(),
                    strict=True,
                )
            )
            for j, s in enumerate(seqs)
        ]

    def _record_input_logprobs(self, group: Group, hidden: torch.Tensor, start: int, first: int, length: int) -> None:
        # Row at position p scores prompt token p + 1; entries cover tokens logprob_start_len .. L - 1.
        begin = max(group.logprob_start_len - 1, first)
        end = min(first + length, len(group.prompt_ids) - 1)
        if group.logprob_start_len == 0 and first == 0:
            group.input_logprobs.append(None)
            group.input_top_logprobs.append(None)
        if begin >= end:
            return
        rows = hidden[start + begin - first : start + end - first]
        logits = self.model.logits(rows)
        next_ids = torch.tensor(group.prompt_ids[begin + 1 : end + 1], device=logits.device)
        temps = logits.new_full((logits.shape[0], 1), group.logprob_temperature())
        group.input_logprobs += token_logprobs(logits, next_ids, temps).tolist()
        if group.top_logprobs_num > 0:
            values, indices = full_logprobs(logits, temps).topk(group.top_logprobs_num, dim=-1)
            group.input_top_logprobs += [
                list(zip(v, i, strict=True)) for v, i in zip(values.tolist(), indices.tolist(), strict=True)
            ]

    def _fork(self, group: Group) -> list[Sequence]:
        """The prompt is computed: start its n samples on its pages (full pages shared, the partial one copied)."""
        self._prefilling.remove(group)
        length = len(group.prompt_ids)
        num_full = length // self.page_size
        self.radix.insert(group.prompt_ids, group.prefill_pages[:num_full])
        partial = group.prefill_pages[num_full:]
        children = []
        for i in range(group.params.n):
            seq = Sequence(group=group, sample_index=i, seed=group.seed + i, num_computed=length)
            shared = group.prefill_pages[:num_full]
            self.allocator.retain(shared)
            if partial and i == 0:
                own = list(partial)
                self.allocator.retain(own)
            elif partial:
                own = self._take_pages(1)
                group.reserved_pages -= 1
                for k_pages, v_pages in zip(self.store.k, self.store.v, strict=True):
                    k_pages[own[0]] = k_pages[partial[0]]
                    v_pages[own[0]] = v_pages[partial[0]]
            else:
                own = []
            seq.pages = shared + own
            share = group.reserved_pages // (group.params.n - i)
            seq.reserved_pages, group.reserved_pages = share, group.reserved_pages - share
            children.append(seq)
        self.allocator.release(group.prefill_pages)
        group.prefill_pages = []
        group.sequences = children
        self._running += children
        return children

    def _append_token(self, seq: Sequence, token: int, logprob: float, top: list[tuple[float, int]]) -> None:
        params = seq.group.params
        seq.output_ids.append(token)
        seq.output_logprobs.append(logprob)
        if seq.group.top_logprobs_num > 0 and seq.group.return_logprob:
            seq.output_top_logprobs.append(top)
        self.num_generated_tokens += 1
        if self.tokenizer is not None:
            seq.text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=params.skip_special_tokens)
        is_eos = token in self.eos_ids and not params.ignore_eos
        if is_eos or (params.stop_token_ids and token in params.stop_token_ids):
            self._finish(seq, finish_reason("stop", matched=token))
        elif (matched := _first_stop(seq.text, params.stop_strings())) is not None:
            if not params.no_stop_trim:
                seq.text = seq.text[: seq.text.index(matched)]
            self._finish(seq, finish_reason("stop", matched=matched))
        elif len(seq.output_ids) >= params.max_new_tokens:
            self._finish(seq, finish_reason("length", length=len(seq.output_ids)))
        elif len(seq.tokens) >= self.context_length:
            self._finish(seq, finish_reason("length", length=len(seq.output_ids), message="context length reached"))

    def _finish(self, seq: Sequence, reason: Any) -> None:
        seq.finish = reason
        if seq in self._running:
            self._running.remove(seq)
        if seq.pages:
            self.radix.insert(seq.tokens[: seq.num_computed], seq.pages)
            self.allocator.release(seq.pages)
            seq.pages = []
        self._reserved -= seq.reserved_pages
        seq.reserved_pages = 0
        group = seq.group
        if all(s.finish is not None for s in group.sequences):
            self._reserved -= group.reserved_pages
            group.reserved_pages = 0
            self._complete_group(group)

    def _complete_group(self, group: Group) -> None:
        responses = [build_response(s) for s in group.sequences]
        if group.future is not None and group.loop is not None:
            group.loop.call_soon_threadsafe(_set_result, group.future, responses)

    # ------------------------------------------------------------------ info

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.config.model_path,
            "tokenizer_path": self.config.model_path if self.tokenizer is not None else None,
            "is_generation": True,
            "architecture": self.model_config.architecture,
            "vocab_size": self.model_config.vocab_size,
            "weight_version": self.weight_version,
        }

    def server_info(self) -> dict[str, Any]:
        return {
            "model_path": self.config.model_path,
            "kernel_config": self.config.kernel.describe(),
            "num_kv_pages": self.config.num_kv_pages,
            "page_size": self.page_size,
            "max_running_requests": self.config.max_running_requests,
            "max_prefill_tokens": self.config.max_prefill_tokens,
            "context_length": self.context_length,
            "device": self.config.device,
            "weight_version": self.weight_version,
            "released_memory": sorted(self.released),
            "num_running": len(self._running),
            "num_waiting": len(self._waiting),
            "num_used_pages": self.allocator.num_used,
            "num_cached_pages": self.radix.num_cached_pages,
            "num_steps": self.num_steps,
            "num_generated_tokens": self.num_generated_tokens,
            "time": time.time(),
        }


def _first_stop(text: str, stops: list[str]) -> str | None:
    hits = [(text.find(s), s) for s in stops if s and s in text]
    return min(hits)[1] if hits else None


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _load_tokenizer(model_path: str) -> Any:
    path = Path(model_path)
    if not ((path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)

"""The embedded rollout engine: the model, its weights and memory, and the thread that runs the scheduler. Its stages,
as SGLang splits its own (docs/architecture.md, "The rollout engine"):

- intake (intake.py, SGLang's tokenizer manager): a request becomes the scheduler's groups, or a 4xx;
- the scheduler (scheduler.py, batch_results.py): admission, KV pages, radix cache, batch building, the served
  weight version;
- the model runner (model_runner.py): the model, its KV store, the forward and the sampling of a step;
- the output stage (output.py, SGLang's detokenizer manager): text, stop rules, stream deltas, responses handed back
  to asyncio;
- the weight receiver (weight_receiver.py): every way new weights arrive (`Engine.weights`).

One background thread owns the model and runs scheduler steps in a loop; the asyncio side (server, in-process
client) submits work and awaits futures. Control operations (weight updates, memory release) wait until no
request is running, so no request ever mixes two weight versions; aborts and cache flushes apply at the next
step boundary. LoRA adapters served per request (served_loras.py) are loaded between steps and unloaded once no
request uses them. A failing step fails the requests in it and the engine keeps serving.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import torch

from miles_contracts import GenerateRequest, GenerateResponse, WeightVersion
from miles_kernels import (
    CausalLM,
    KernelConfig,
    add_lora,
    fold_adapters,
    folded_weights,
    hold_packed_weights,
    load_eagle3,
    load_model,
    packed_weights,
)
from miles_memory import HostStore, OffloadManager
from miles_rollout import engine_info
from miles_rollout.config import EngineConfig, ServedLoraConfig
from miles_rollout.engine_controls import EngineControls
from miles_rollout.engine_error import EngineError
from miles_rollout.grammar import Grammars
from miles_rollout.intake import EngineLimits, Intake
from miles_rollout.model_runner import ModelRunner
from miles_rollout.output import OutputStage, deliver, set_exception, set_result
from miles_rollout.profiling import TraceRecorder
from miles_rollout.scheduler import Scheduler
from miles_rollout.sequence import Group
from miles_rollout.served_loras import LoraControls, ServedLoras
from miles_rollout.speculative import Drafter
from miles_rollout.streaming import StreamChannel, StreamEvent
from miles_rollout.weight_receiver import WeightReceiver

logger = logging.getLogger("miles_rollout.engine")

ControlItem = tuple[Callable[[], Any], bool, "asyncio.Future[Any]", asyncio.AbstractEventLoop]
Watcher = tuple[Callable[[dict[str, int]], bool], "asyncio.Future[dict[str, int]]", asyncio.AbstractEventLoop]


def _push_progress(channel: StreamChannel, base: int, index: int, payload: Any, is_last: bool) -> None:
    """A group's `on_progress` (engine thread): hand a sample's delta, or final response, to the request's channel
    (its index over the request's samples: the group's first, `base`, plus the sample's)."""
    channel.push(base + index, payload, is_last)


def _push_failure(channel: StreamChannel, future: asyncio.Future[Any]) -> None:
    """A streaming group's future failed (the engine failed the step): end the stream with the error."""
    error = None if future.cancelled() else future.exception()
    if error is not None:
        channel.fail(error)


class Engine(EngineControls, LoraControls):
    """Owns the model, the KV store and the scheduler thread: serves the Hugging Face directory `model_path` with
    the ops `kernel` selects, run as `config` says, with the LoRA adapters `lora` serves per request."""

    def __init__(
        self, model_path: str, kernel: KernelConfig | None = None, config: EngineConfig | None = None,
        lora: ServedLoraConfig | None = None,
    ) -> None:  # fmt: skip
        self.model_path = str(model_path)
        self.kernel = kernel or KernelConfig()
        self.config = config or EngineConfig()
        self.lora_config = lora or ServedLoraConfig()
        self.loras: ServedLoras | None = None  # made at setup when the engine serves adapters
        self.profiler = TraceRecorder()  # /start_profile, /stop_profile: runs on the engine thread
        self.page_size = self.kernel.page_size
        self.tokenizer = _load_tokenizer(self.model_path)
        self.released: set[str] = set()
        self.weights_stale = False
        # Nothing is generated while paused (`/pause_generation`: the mode) or inside a weight-update bracket
        # (`/begin_weight_update` .. `/end_weight_update`); requests that arrive meanwhile wait.
        self.paused: str | None = None
        self.updating_weights = False
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        self._incoming: list[Group] = []
        self._controls: deque[ControlItem] = deque()
        self._aborts: deque[str | None] = deque()
        self._watchers: list[Watcher] = []
        self._new_watcher = False
        self._lock = threading.Condition()
        self._stopped = False
        # Every torch op of the engine runs on its thread, model loading included: a second thread that has run
        # parallel ops keeps its own OpenMP team, and two teams on the same cores make each op wake the other's
        # threads (a decode step measured ~1.7x slower on 2 cores).
        self._started = threading.Event()
        self._setup_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(torch.get_num_threads(),), name="miles-rollout-engine", daemon=True
        )
        self._thread.start()
        self._started.wait()
        if self._setup_error is not None:
            self._thread.join()  # the thread ends right after setup fails: none is left behind
            raise self._setup_error

    def _setup(self) -> None:
        config, kernel, tokenizer = self.config, self.kernel, self.tokenizer
        # low-precision weights (docs/low-precision.md): the trunk's linear layers stored in the engine's format
        self.model = model = load_model(self.model_path, kernel, config.device, weights=config.weight_quant())
        if config.policy_lora.is_enabled:  # LoRA RL: weight updates send adapters, merged into the base (docs/lora.md)
            add_lora(model, config.policy_lora)
            fold_adapters(model)
        self.model_config = model.config
        self.context_length = config.context_length or self.model_config.max_position_embeddings
        self.eos_ids = set(model.config.eos_token_ids())
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(int(tokenizer.eos_token_id))
        drafter = None
        if config.draft_kind == "eagle3":
            assert config.speculative_draft_model_path is not None
            model.attach_eagle3(load_eagle3(config.speculative_draft_model_path, model.config, kernel, config.device))
        if config.draft_kind is not None:
            tile = kernel.attention_query_tile
            drafter = Drafter(model, config.num_draft_steps, self.page_size, tile, config.device, self.eos_ids,
                              config.draft_kind)  # fmt: skip
        hold_packed_weights(_weight_tensors(model))  # the native CPU linear keeps them packed (miles_kernels.native)
        lora = self.lora_config
        self.loras = ServedLoras(model, kernel, lora) if lora.is_enabled else None
        self.runner = ModelRunner(model, config, kernel, self.eos_ids, self.grammars, drafter is not None,
                                  self.loras.slots if self.loras is not None else None)  # fmt: skip
        output = OutputStage(tokenizer, self.eos_ids, self.context_length, config.limits.stop_regex_window_chars)
        self.scheduler = Scheduler(self.runner, output, config, self.context_length, drafter,
                                   lora.max_loras_per_batch if self.loras is not None else None)  # fmt: skip
        for spec in lora.adapters():  # before serving: a bad one stops the start-up (exit status 2), naming it
            assert self.loras is not None
            try:
                self.loras.install(*self.loras.read(*spec))
            except EngineError as error:
                raise ValueError(f"--lora-paths {spec.lora_name}: {error.message}") from error
        # Released memory is dropped, not saved, as SGLang drops it: the KV cache is recomputed, the weights come
        # back with the next weight update (`weights_stale` until then). Both return zeroed.
        self.memory = OffloadManager(HostStore(), name="engine")
        # LoRA RL: weight updates send only adapters, so the base must come back as it was (kept in host memory).
        # The native linear's packed copies of the weights (miles_kernels.packed_weights) go with them.
        self.memory.add("weights", lambda: _weight_memory(model), keep_contents=config.policy_lora.is_enabled)
        self.memory.add("kv_cache", self.runner.kv_tensors, keep_contents=False)
        # every way new weights arrive (weight_receiver.py)
        self.weights = WeightReceiver(model, self.commit_weights, version=lambda: self.weight_version,
                                      check_resident=self.require_weights_resident, device=config.device)  # fmt: skip
        self.limits = EngineLimits(
            vocab_size=self.model_config.vocab_size, context_length=self.context_length, page_size=self.page_size,
            num_kv_pages=config.num_kv_pages, max_running_requests=config.max_running_requests, seed=config.seed,
            model_type=self.model_config.model_type, is_moe=self.model_config.is_moe, has_draft=drafter is not None,
            returns_routed_experts=self.runner.routed_experts is not None, has_tokenizer=tokenizer is not None,
            requests=config.limits,
        )  # fmt: skip
        self.intake = Intake(self.limits, tokenizer, self.grammars)  # requests -> groups, or a 4xx (intake.py)

    @property
    def weight_version(self) -> WeightVersion:
        """The served weights' version (the scheduler's: it stamps each admitted request with it)."""
        return self.scheduler.weight_version

    def grammars(self) -> Grammars:
        """The structured-output backend (xgrammar over the tokenizer), made at the first request with a grammar
        (from an intake thread, which compiles it, or the engine thread)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_ids))
            return self._grammars

    def _run(self, num_threads: int) -> None:
        torch.set_num_threads(num_threads)  # the creator's setting (OpenMP keeps it per thread)
        try:
            self._setup()
        except BaseException as error:  # re-raised by __init__ on the caller's thread
            self._setup_error = error
            return
        finally:
            self._started.set()
        self._loop()

    # ------------------------------------------------------------------ asyncio-facing API

    async def generate(self, request: GenerateRequest) -> list[GenerateResponse]:
        """Run a generate request; returns one response per prompt and sample, prompt-major."""
        if request.stream:
            raise EngineError("stream=true: call Engine.generate_stream (or POST /generate), which streams")
        groups = await self._accept(request)
        self._submit(groups)
        try:
            results = await asyncio.gather(*(g.future for g in groups if g.future is not None))
        except asyncio.CancelledError:  # the caller gave up (a client that disconnected): free its KV pages
            self._queue_aborts([group.rid for group in groups])
            raise
        return [response for group_responses in results for response in group_responses]

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        """Run a generate request, streaming: returns (once the request is accepted: bad input raises here, before
        anything streams) an iterator of `StreamEvent`s (streaming.py), index prompt-major over samples as
        `generate` orders them. A sample's events carry what it gained since the previous one (new ids, their
        log-prob entries, new text: concatenated, a prefix of its final text), its last one the final response. A
        reader that lags gets fewer, merged events; the engine never waits for it. Leaving the iterator early (a
        client that disconnects) aborts the request, which frees its KV pages."""
        groups = await self._accept(request)
        channel = StreamChannel(asyncio.get_running_loop())
        base = 0
        for group in groups:
            group.on_progress = functools.partial(_push_progress, channel, base)
            base += group.params.n
            assert group.future is not None
            group.future.add_done_callback(functools.partial(_push_failure, channel))
        self._submit(groups)
        return self._stream(groups, channel, base)

    async def _accept(self, request: GenerateRequest) -> list[Group]:
        """The request's groups (intake.py), each with its caller's future, the version it would be served now and
        its LoRA adapter."""
        adapters = self._resolve_loras(request)
        groups = await self.intake.make_groups(request)
        loop = asyncio.get_running_loop()
        for group, adapter in zip(groups, adapters, strict=True):
            group.future, group.loop, group.weight_version = loop.create_future(), loop, self.weight_version
            group.lora_id = adapter
        return groups

    async def _stream(self, groups: list[Group], channel: StreamChannel, total: int) -> AsyncIterator[StreamEvent]:
        remaining = total
        try:
            while remaining:
                for event in await channel.take():
                    remaining -= event.final is not None
                    yield event
        finally:
            if remaining:  # the consumer left before the end: stop the generation and free its KV
                self._queue_aborts([group.rid for group in groups])

    def _submit(self, groups: list[Group]) -> None:
        with self._lock:
            self._check_can_generate()
            if self.loras is not None and not all(self.loras.is_served(group.lora_id) for group in groups):
                raise EngineError("the request's LoRA adapter was unloaded while the request was being read")
            queued = len(self._incoming) + self.scheduler.num_waiting
            limit = self.config.limits.max_queued_requests
            if queued + len(groups) > limit:
                raise EngineError(
                    f"the server is busy: {queued} prompts wait for admission (limit {limit}); retry later",
                    429,
                    retry_after_s=1 + queued // max(self.config.max_running_requests, 1),
                )
            self._incoming.extend(groups)
            self._lock.notify()

    async def abort(self, rid: str | None) -> None:
        """Abort one request (by rid) or every request (None); they finish with `abort`."""
        self._queue_aborts([rid])

    def _queue_aborts(self, rids: list[str | None]) -> None:
        with self._lock:
            self._aborts.extend(rids)
            self._lock.notify()

    async def control(self, fn: Callable[[], Any], needs_idle: bool) -> Any:
        """Run `fn` on the engine thread between steps; with `needs_idle`, once no request is running."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            self._controls.append((fn, needs_idle, future, loop))
            self._lock.notify()
        return await future

    async def wait_until(
        self, condition: Callable[[dict[str, int]], bool], timeout: float | None = 60.0
    ) -> dict[str, int]:
        """Wait for an engine event: `condition` gets the scheduler's counters (`num_waiting`, `num_running`,
        `num_steps`, `num_generated_tokens`, ...; see `Scheduler.stats`) on the engine thread, now and after every
        engine step, and this returns the counters that satisfied it. E.g. a request admitted and decoding:
        `wait_until(lambda s: s["num_running"] > 0)`; a step done: `lambda s: s["num_steps"] > before`."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, int]] = loop.create_future()
        with self._lock:
            self._watchers.append((condition, future, loop))
            self._new_watcher = True
            self._lock.notify()
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            with self._lock:
                self._watchers = [w for w in self._watchers if w[1] is not future]

    def is_alive(self) -> bool:
        """True while the engine thread runs."""
        return self._thread.is_alive()

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify()
        self._thread.join(timeout=10)
        self.intake.shutdown()

    async def update_weights_from_distributed(
        self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]], version: WeightVersion
    ) -> WeightVersion:
        """Receive one broadcast of `names` off the engine thread, then load it between engine steps; returns the
        weight version. As in SGLang, a call may carry any subset of the weights (one bucket of a larger update):
        bracket a multi-call update with `/begin_weight_update` and `/end_weight_update` so that no request runs on
        a half-updated model."""
        tensors = await self.weights.receive_broadcast(group_name, names, dtypes, shapes)
        applied: WeightVersion = await self.control(
            lambda: self.weights.load_tensors(tensors, version, partial=True), needs_idle=True
        )
        return applied

    # ------------------------------------------------------------------ request intake

    def _check_can_generate(self) -> None:
        if self.released:
            raise EngineError(
                f"memory is released ({', '.join(sorted(self.released))}); call /resume_memory_occupation", 503
            )
        if self.weights_stale:
            raise EngineError("weights were released and not updated since; update weights before generating", 503)

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        scheduler = self.scheduler
        while True:
            with self._lock:
                while not (
                    self._stopped or self._incoming or self._aborts or self._controls or self._new_watcher
                    or (scheduler.has_work and self.may_generate)
                ):  # fmt: skip
                    self._lock.wait()
                if self._stopped:
                    break
                self._new_watcher = False
                scheduler.submit(self._incoming)
                self._incoming = []
                aborts = list(self._aborts)
                self._aborts.clear()
            try:
                scheduler.process_aborts(aborts)
                self._run_controls()
                if scheduler.has_work and self.may_generate:
                    scheduler.step(may_admit=not self._is_draining())
            except Exception as error:  # a failing step must not take the server down: fail its requests
                logger.exception("engine step failed")
                scheduler.fail_all(f"engine step failed: {type(error).__name__}: {error}")
            self._notify_watchers()

    def _notify_watchers(self) -> None:
        with self._lock:
            watchers = list(self._watchers)
        if not watchers:
            return
        stats = self.scheduler.stats()
        for condition, future, loop in watchers:
            try:
                if condition(stats):
                    deliver(loop, set_result, future, dict(stats))
            except Exception as error:  # a broken condition fails its waiter, never the engine
                deliver(loop, set_exception, future, error)

    @property
    def may_generate(self) -> bool:
        """False while paused or inside a weight-update bracket."""
        return self.paused is None and not self.updating_weights

    def _is_draining(self) -> bool:
        return any(needs_idle for _, needs_idle, _, _ in self._controls)

    def _run_controls(self) -> None:
        while self._controls:
            fn, needs_idle, future, loop = self._controls[0]
            if needs_idle and self.scheduler.is_busy:
                if not self.may_generate:  # the requests holding KV will not run until continued: refuse
                    with self._lock:
                        self._controls.popleft()
                    deliver(loop, set_exception, future, EngineError(
                        f"generation is paused {self.paused or 'for a weight update'} with requests holding KV; "
                        "call /continue_generation first, or pause with mode abort or retract", 409))  # fmt: skip
                    continue
                return
            with self._lock:
                self._controls.popleft()
            try:
                result = fn()
            except EngineError as error:
                deliver(loop, set_exception, future, error)
            except Exception as error:  # report, never crash the engine thread
                logger.exception("control operation failed")
                deliver(loop, set_exception, future, EngineError(f"{type(error).__name__}: {error}", 500))
            else:
                deliver(loop, set_result, future, result)

    # ------------------------------------------------------------------ info (engine_info.py)

    def model_info(self) -> dict[str, Any]:
        """SGLang's `/model_info` fields (plus the architecture's vocabulary size)."""
        return engine_info.model_info(self)

    def server_info(self) -> dict[str, Any]:
        """SGLang's `/server_info`: the server's arguments as SGLang names them, the engine's settings and counters."""
        return engine_info.server_info(self)

    def load(self) -> dict[str, Any]:
        """What a router balances on (SGLang's `/get_load`): requests running and waiting, KV pages in use."""
        return engine_info.load(self)


def _weight_tensors(model: CausalLM) -> list[torch.Tensor]:
    """The engine's weights: the parameters and the merged weights of folded adapters."""
    return [*model.parameters(), *folded_weights(model)]


def _weight_memory(model: CausalLM) -> list[torch.Tensor]:
    """What the "weights" memory tag holds: the weights and the native linear's packed copies of them."""
    weights = _weight_tensors(model)
    return [*weights, *packed_weights(weights)]


# Tokenizer classes that are transformers' plain fast tokenizer (TokenizersBackend in transformers 5): loaded with
# that class directly, which is what AutoTokenizer resolves them to, without importing the Auto machinery (8 of a
# tiny model's 18 s of server start-up on the reference CPU: it pulls in torch._dynamo and the modeling utilities).
PLAIN_FAST_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _load_tokenizer(model_path: str) -> Any:
    path = Path(model_path)
    if not ((path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()):
        return None
    config = path / "tokenizer_config.json"
    if config.is_file() and json.loads(config.read_text()).get("tokenizer_class") in PLAIN_FAST_TOKENIZERS:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)

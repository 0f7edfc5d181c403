"""LoRA adapters served per request, SGLang's multi-LoRA serving: which adapters the engine serves, by name, and the
per-row adapter slots on the model's trunk (`miles_kernels.AdapterSlots`). docs/architecture.md, "The rollout engine".

Where it sits: a request names an adapter (`lora_path` on /generate, `model` on the OpenAI routes); the engine
resolves each prompt's name to the adapter's id here (`resolve`: a 400 naming the loaded adapters for an unknown
one) and stamps its groups with it; the scheduler keys the radix cache by that id, bounds the adapters of one step
(`max_loras_per_batch`) and hands each row's id to the model runner, which names the rows' adapters to the slots
around the trunk's forward (the MTP draft and the LM head carry no adapter). Every load gets a new id (SGLang's
`lora_id`), so a name unloaded and loaded again while requests of the old adapter still run never mixes the two, and
their cached K/V never meet.

Loading reads and checks the PEFT directory off the engine thread (`read`), then makes it servable between engine
steps (`install`); unloading unregisters the name at once, so new requests naming it are refused, and drops the
adapter once no request in flight uses it (`drop`), as SGLang waits for them (`Engine.unload_lora_adapter`).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from miles_contracts import GenerateRequest
from miles_kernels import AdapterSlots, CausalLM, KernelConfig, read_peft_adapter
from miles_kernels.config import LoraConfig
from miles_rollout.config import ServedLoraConfig
from miles_rollout.engine_error import EngineError

if TYPE_CHECKING:
    from miles_rollout.scheduler import Scheduler
    from miles_rollout.sequence import Group


@dataclass(frozen=True)
class LoadedLora:
    """A served adapter: its id (new for every load), the name requests use, its directory, SGLang's `pinned`."""

    lora_id: str
    lora_name: str
    lora_path: str
    pinned: bool
    config: LoraConfig

    def sglang_ref(self) -> dict[str, Any]:
        """SGLang's `LoRARef` as its `/server_info` writes one."""
        return {"lora_id": self.lora_id, "lora_name": self.lora_name, "lora_path": self.lora_path,
                "pinned": self.pinned}  # fmt: skip


class ServedLoras:
    """The adapters `model` serves per request (the slots on its trunk's linear layers) and their names. Names are
    read and changed under a lock (requests resolve them on the caller's loop); the slots are changed on the engine
    thread only, between steps."""

    def __init__(self, model: CausalLM, kernel: KernelConfig, config: ServedLoraConfig) -> None:
        self.config = config
        self.slots = AdapterSlots(model, kernel)
        self._by_name: dict[str, LoadedLora] = {}
        self._lock = threading.Lock()

    def loaded(self) -> dict[str, str]:
        """SGLang's `loaded_adapters`: each loaded adapter's name and path."""
        with self._lock:
            return {name: lora.lora_path for name, lora in self._by_name.items()}

    def refs(self) -> list[LoadedLora]:
        with self._lock:
            return list(self._by_name.values())

    def _unknown(self, name: str) -> EngineError:
        loaded = sorted(self._by_name)
        return EngineError(
            f"LoRA adapter {name!r} is not loaded; loaded adapters: {loaded} (load one with /load_lora_adapter or "
            "--lora-paths)"
        )

    def resolve(self, names: list[str | None]) -> list[str | None]:
        """The adapter id of each name (None: the base model); a 400 naming the loaded adapters for an unknown one."""
        with self._lock:
            for name in names:
                if name is not None and name not in self._by_name:
                    raise self._unknown(name)
            return [None if name is None else self._by_name[name].lora_id for name in names]

    def is_served(self, lora_id: str | None) -> bool:
        """True for the base model (None) and for an adapter id whose name is still registered."""
        with self._lock:
            return lora_id is None or any(lora.lora_id == lora_id for lora in self._by_name.values())

    def read(self, name: str, path: str, pinned: bool) -> tuple[LoadedLora, dict[str, torch.Tensor]]:
        """Read adapter directory `path` for `name` (any thread): a 400 that says what is wrong with it (not a PEFT
        LoRA directory, a setting not supported, a rank above `max_lora_rank`, a name already loaded)."""
        if not name:
            raise EngineError("lora_name is empty: name the adapter")
        with self._lock:
            if name in self._by_name:
                raise EngineError(f"Failed to load LoRA adapter {name} because it is already loaded")  # SGLang's
        try:
            config, tensors = read_peft_adapter(path)
        except ValueError as error:
            raise EngineError(f"cannot load LoRA adapter {name!r} from {path}: {error}") from error
        except Exception as error:  # an unreadable or corrupt file is the caller's adapter, never a 500
            raise EngineError(
                f"cannot load LoRA adapter {name!r} from {path}: {type(error).__name__}: {error}"
            ) from error
        limit = self.config.max_lora_rank
        if limit is not None and config.rank > limit:
            raise EngineError(
                f"LoRA adapter {name!r} has rank {config.rank}, above this server's --max-lora-rank {limit}"
            )
        return LoadedLora(uuid.uuid4().hex, name, path, pinned, config), tensors

    def install(self, lora: LoadedLora, tensors: dict[str, torch.Tensor]) -> None:
        """Make an adapter `read` gave servable (engine thread, between steps): a 400 when its tensors do not fit the
        served model (experts, routers, MLA's kv_b_proj, the LM head or MTP layers, a wrong shape)."""
        with self._lock:
            if lora.lora_name in self._by_name:
                raise EngineError(f"Failed to load LoRA adapter {lora.lora_name} because it is already loaded")
            try:
                self.slots.load(lora.lora_id, lora.config, tensors)
            except ValueError as error:
                raise EngineError(f"cannot serve LoRA adapter {lora.lora_name!r}: {error}") from error
            self._by_name[lora.lora_name] = lora

    def unregister(self, name: str) -> str:
        """Stop serving `name` to new requests; returns its id (to `drop` once no request uses it)."""
        with self._lock:
            if name not in self._by_name:
                raise self._unknown(name)
            return self._by_name.pop(name).lora_id

    def drop(self, lora_id: str) -> None:
        """Free an unregistered adapter's tensors (engine thread, no request in flight uses it)."""
        self.slots.unload(lora_id)

    def server_info(self) -> dict[str, Any]:
        """The LoRA fields of `/server_info`: SGLang's arguments, and the adapters loaded now (Miles' own key)."""
        return {
            "enable_lora": True,
            "lora_paths": [spec._asdict() for spec in self.config.adapters()],
            "max_loras_per_batch": self.config.max_loras_per_batch,
            "max_lora_rank": self.config.max_lora_rank,
            "loaded_lora_adapters": [lora.sglang_ref() for lora in self.refs()],
        }


class LoraControls:
    """The `Engine`'s LoRA operations (a mixin: they work on its adapters, scheduler, lock and incoming requests)."""

    loras: ServedLoras | None
    scheduler: Scheduler
    _lock: threading.Condition
    _incoming: list[Group]

    if TYPE_CHECKING:

        async def control(self, fn: Callable[[], Any], needs_idle: bool) -> Any: ...
        async def wait_until(
            self, condition: Callable[[dict[str, int]], bool], timeout: float | None = 60.0
        ) -> dict[str, int]: ...

    def _resolve_loras(self, request: GenerateRequest) -> list[str | None]:
        """Each prompt's adapter id (`lora_path` names a loaded adapter); a 400 naming the loaded ones otherwise."""
        names = [request.lora_path_for(i) for i in range(request.batch_size)]
        if self.loras is None:
            named = next((name for name in names if name is not None), None)
            if named is not None:
                raise EngineError(
                    f"lora_path: LoRA adapter {named!r} was requested, but this server serves no adapters: start it "
                    "with --enable-lora or --lora-paths"
                )
            return names
        return self.loras.resolve(names)

    async def load_lora_adapter(self, name: str, path: str, pinned: bool = False) -> dict[str, str]:
        """Serve the PEFT adapter in directory `path` as `name` (SGLang's `/load_lora_adapter`): read off the engine
        thread, made servable between steps, so no request in flight sees a change. Returns the loaded adapters
        (name -> path); a bad adapter or a name already loaded is a 400."""
        loras = self._require_loras()
        lora, tensors = await asyncio.to_thread(loras.read, name, path, pinned)
        await self.control(lambda: loras.install(lora, tensors), needs_idle=False)
        return loras.loaded()

    async def unload_lora_adapter(self, name: str) -> dict[str, str]:
        """Stop serving adapter `name` (SGLang's `/unload_lora_adapter`): requests that name it are refused from now
        on; the call waits until the requests in flight that use it are done, as SGLang's does, then frees it and its
        cached K/V between steps. Returns the adapters still loaded; an unknown name is a 400."""
        loras = self._require_loras()
        with self._lock:  # after this no request of it is submitted (`_submit` checks under the same lock)
            lora_id = loras.unregister(name)

        def is_unused(_: dict[str, int]) -> bool:  # on the engine thread
            with self._lock:
                queued = any(group.lora_id == lora_id for group in self._incoming)
            return not queued and lora_id not in self.scheduler.adapters_in_flight()

        def drop() -> None:
            loras.drop(lora_id)
            self.scheduler.radix.forget_adapter(lora_id)

        async def finish() -> None:
            await self.wait_until(is_unused, timeout=None)
            await self.control(drop, needs_idle=False)

        await asyncio.shield(finish())  # a caller that gives up leaves the name gone: the adapter is still freed
        return loras.loaded()

    def _require_loras(self) -> ServedLoras:
        if self.loras is None:
            raise EngineError("LoRA is not enabled: start the server with --enable-lora (or --lora-paths)")
        return self.loras

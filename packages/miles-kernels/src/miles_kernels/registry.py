"""The backend registry: every kernel op (attention, matmul, MoE dispatch, ...) is looked up here by name.

The model, the rollout engine and the trainer call ops through this registry rather than importing a kernel
library, so the model file stays plain torch and a faster backend (flash-attn, DeepGEMM, Transformer Engine) slots
in behind the same op without touching it. The config names a backend per op, or ``"auto"``, which picks the
best backend that is installed and usable on this hardware and says which one in the log; the kernel fingerprint
names the resolved backends (docs/architecture.md, "Contracts between engine and trainer").

A backend registers an ``is_available`` check next to its function. Checks run lazily, on the first
`get_backend` that needs them (importing a GPU library at import time would slow down, or break, every CPU
process), and their answer is cached for the life of the process. A check returns True, or False or a string
saying why not (``"flash_attn is not installed"``); a check that raises counts as unavailable, with the exception
as the reason, because a broken optional install must not take down a run that can fall back.

Op code registers its backends at import time::

    register_backend("attention", "torch", sdpa_attention)
    register_backend("attention", "flash_attn", fa_attention, is_available=_has_flash_attn, priority=10)

    attention = get_backend("attention", config.attention_backend)  # "auto", "torch" or "flash_attn"
    out = attention(q, k, v)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("miles_kernels.registry")

AUTO = "auto"


@dataclass(frozen=True)
class Backend:
    """One implementation of an op. Calling it calls `fn`."""

    op: str
    name: str
    fn: Callable[..., Any]
    priority: int

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


@dataclass(frozen=True)
class _Entry:
    backend: Backend
    is_available: Callable[[], bool | str]


def _always_available() -> bool:
    return True


# The registry's whole state. Tests swap these three for copies (see tests/test_registry.py).
_BACKENDS: dict[str, dict[str, _Entry]] = {}  # op -> name -> entry, in registration order
_AVAILABILITY: dict[tuple[str, str], bool | str] = {}  # (op, name) -> True or the reason it is not available
_LOGGED_CHOICES: set[tuple[str, str]] = set()  # (op, name) chosen by "auto" and already logged
# What get_backend resolved (op, name) to, with the two dicts it was resolved from: an op runs this lookup on every
# call (each layer of each forward), and an answer holds while those are the registry's dicts. register_backend
# empties it.
_RESOLVED: dict[tuple[str, str], tuple[dict[str, dict[str, _Entry]], dict[tuple[str, str], bool | str], Backend]] = {}
# Re-entrant: an is_available check may itself look up another op's backend.
_LOCK = threading.RLock()


def _check_name(kind: str, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"backend {kind} must be a str, got {type(value).__name__} {value!r}")
    if not value or value != value.strip():
        raise ValueError(f"backend {kind} {value!r} must be non-empty, without surrounding spaces")


def register_backend(
    op: str,
    name: str,
    fn: Callable[..., Any],
    *,
    is_available: Callable[[], bool | str] = _always_available,
    priority: int = 0,
) -> None:
    """Register `fn` as backend `name` of `op`; registering the same (op, name) again replaces it.

    `priority` orders the candidates of ``"auto"`` (highest first; ties go to the backend registered first).
    A replacement keeps the original's place in that order, and its availability is checked afresh.
    """
    _check_name("op", op)
    _check_name("name", name)
    if name == AUTO:
        raise ValueError(f"{AUTO!r} is reserved: it asks get_backend to choose; register the backend by its own name")
    if not callable(fn):
        raise TypeError(f"backend {op}/{name}: fn must be callable, got {type(fn).__name__}")
    if not callable(is_available):
        raise TypeError(f"backend {op}/{name}: is_available must be callable, got {type(is_available).__name__}")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"backend {op}/{name}: priority must be an int, got {type(priority).__name__}")
    with _LOCK:
        _BACKENDS.setdefault(op, {})[name] = _Entry(Backend(op, name, fn, priority), is_available)
        _AVAILABILITY.pop((op, name), None)
        _RESOLVED.clear()
        # The auto choice for this op may change; let the next choice be logged again.
        for logged in [c for c in _LOGGED_CHOICES if c[0] == op]:
            _LOGGED_CHOICES.discard(logged)


def _entries(op: str) -> dict[str, _Entry]:
    _check_name("op", op)
    entries = _BACKENDS.get(op)
    if not entries:
        raise ValueError(f"unknown op {op!r}; registered ops: {registered_ops()}")
    return entries


def _availability(op: str, entry: _Entry) -> bool | str:
    """True, or the reason the backend is not available; computed once, then cached."""
    key = (op, entry.backend.name)
    if key not in _AVAILABILITY:
        try:
            result = entry.is_available()
        except Exception as exc:  # a broken optional dependency means "unavailable", not a crashed run
            result = f"is_available() raised {type(exc).__name__}: {exc}"
        if result is True:
            answer: bool | str = True
        elif result is False:
            answer = "is_available() returned False"
        elif isinstance(result, str):
            answer = result or "is_available() returned an empty reason"
        else:
            answer = f"is_available() returned {result!r}; it must return True, False or a reason string"
        _AVAILABILITY[key] = answer
    return _AVAILABILITY[key]


def get_backend(op: str, name: str = AUTO) -> Backend:
    """The backend `name` of `op`, or with ``"auto"`` the available one with the highest priority.

    Raises ValueError for an unknown op or name (the message lists the registered ones) and RuntimeError when the
    requested backend, or with ``"auto"`` every backend, is not available (the message says why).
    """
    if type(op) is str and type(name) is str:
        hit = _RESOLVED.get((op, name))
        if hit is not None and hit[0] is _BACKENDS and hit[1] is _AVAILABILITY:
            return hit[2]
    _check_name("name", name)
    with _LOCK:
        backend = _resolve(op, name)
        _RESOLVED[(op, name)] = (_BACKENDS, _AVAILABILITY, backend)
        return backend


def _resolve(op: str, name: str) -> Backend:
    entries = _entries(op)
    if name != AUTO:
        if name not in entries:
            raise ValueError(f"unknown backend {name!r} for op {op!r}; choose one of {[AUTO, *entries]}")
        reason = _availability(op, entries[name])
        if reason is not True:
            raise RuntimeError(f"backend {name!r} for op {op!r} is not available: {reason}")
        return entries[name].backend

    # sorted() is stable, so among equal priorities the earliest registered comes first.
    candidates = sorted(entries.values(), key=lambda e: -e.backend.priority)
    skipped: list[str] = []
    for entry in candidates:
        reason = _availability(op, entry)
        if reason is True:
            _log_choice(entry.backend, skipped)
            return entry.backend
        skipped.append(f"{entry.backend.name} ({reason})")
    raise RuntimeError(f"no backend for op {op!r} is available: {'; '.join(skipped)}")


def _log_choice(backend: Backend, skipped: list[str]) -> None:
    key = (backend.op, backend.name)
    if key in _LOGGED_CHOICES:
        return
    _LOGGED_CHOICES.add(key)
    passed_over = f"; passed over: {', '.join(skipped)}" if skipped else ""
    logger.info(
        "op %r: auto selected backend %r (priority %d)%s", backend.op, backend.name, backend.priority, passed_over
    )


def available_backends(op: str) -> dict[str, bool | str]:
    """For diagnostics: each registered backend of `op`, in registration order, with True or why it is unavailable."""
    with _LOCK:
        return {name: _availability(op, entry) for name, entry in _entries(op).items()}


def registered_ops() -> list[str]:
    """The names of all ops with at least one backend, sorted."""
    with _LOCK:
        return sorted(_BACKENDS)

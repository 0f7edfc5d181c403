"""Pure logic (no torch): the backend registry picks, falls back, explains and replaces backends of a fake op.

Each test runs against an empty registry and the real one is put back afterwards, so the backends that miles-kernels
registers at import time neither affect these tests nor are changed by them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

import miles_kernels.registry as registry
from miles_kernels.registry import Backend, available_backends, get_backend, register_backend, registered_ops

OP = "fake_op"


@pytest.fixture(autouse=True)
def empty_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Give each test an empty registry; monkeypatch puts the real state objects back afterwards."""
    monkeypatch.setattr(registry, "_BACKENDS", {})
    monkeypatch.setattr(registry, "_AVAILABILITY", {})
    monkeypatch.setattr(registry, "_LOGGED_CHOICES", set())
    yield


def _fn(tag: str) -> object:
    def fn(x: int) -> tuple[str, int]:
        return (tag, x)

    return fn


def test_auto_picks_the_highest_priority_available() -> None:
    register_backend(OP, "slow", _fn("slow"), priority=0)
    register_backend(OP, "fast", _fn("fast"), priority=10)
    register_backend(OP, "medium", _fn("medium"), priority=5)

    backend = get_backend(OP)
    assert isinstance(backend, Backend)
    assert (backend.op, backend.name, backend.priority) == (OP, "fast", 10)
    assert backend(3) == ("fast", 3) and backend.fn(4) == ("fast", 4)
    assert get_backend(OP, "auto") == backend


def test_auto_tie_goes_to_the_earliest_registered() -> None:
    register_backend(OP, "first", _fn("first"), priority=1)
    register_backend(OP, "second", _fn("second"), priority=1)
    register_backend(OP, "low", _fn("low"), priority=0)
    assert get_backend(OP).name == "first"


def test_auto_falls_back_when_the_preferred_is_unavailable(caplog: pytest.LogCaptureFixture) -> None:
    register_backend(OP, "torch", _fn("torch"))
    register_backend(OP, "flash", _fn("flash"), is_available=lambda: "flash_attn is not installed", priority=10)
    register_backend(OP, "te", _fn("te"), is_available=lambda: False, priority=5)

    with caplog.at_level(logging.INFO, logger="miles_kernels.registry"):
        assert get_backend(OP).name == "torch"
        assert get_backend(OP).name == "torch"

    # Logged once per (op, choice), and the log says why the better backends were passed over.
    messages = [r.getMessage() for r in caplog.records if r.name == "miles_kernels.registry"]
    assert len(messages) == 1
    assert "'torch'" in messages[0] and "flash_attn is not installed" in messages[0]


def test_explicit_unavailable_backend_gives_the_reason() -> None:
    register_backend(OP, "torch", _fn("torch"))
    register_backend(OP, "flash", _fn("flash"), is_available=lambda: "flash_attn is not installed", priority=10)
    register_backend(OP, "te", _fn("te"), is_available=lambda: False)

    with pytest.raises(RuntimeError, match="'flash' for op 'fake_op' is not available: flash_attn is not installed"):
        get_backend(OP, "flash")
    with pytest.raises(RuntimeError, match="returned False"):
        get_backend(OP, "te")
    assert get_backend(OP, "torch").name == "torch"


def test_nothing_available_lists_every_reason() -> None:
    register_backend(OP, "a", _fn("a"), is_available=lambda: "no GPU")
    register_backend(OP, "b", _fn("b"), is_available=lambda: "no TE")
    with pytest.raises(RuntimeError, match=r"no backend for op 'fake_op' is available: a \(no GPU\); b \(no TE\)"):
        get_backend(OP)


def test_unknown_op_and_name_list_the_choices() -> None:
    register_backend(OP, "torch", _fn("torch"))
    register_backend(OP, "flash", _fn("flash"))
    register_backend("other_op", "torch", _fn("torch"))

    with pytest.raises(ValueError, match=r"unknown op 'nope'; registered ops: \['fake_op', 'other_op'\]"):
        get_backend("nope")
    with pytest.raises(ValueError, match=r"unknown backend 'triton' .* \['auto', 'torch', 'flash'\]"):
        get_backend(OP, "triton")
    with pytest.raises(ValueError, match="unknown op"):
        available_backends("nope")


def test_is_available_that_raises_is_unavailable_with_the_exception() -> None:
    def broken() -> bool:
        raise ImportError("libcudart.so.13: cannot open shared object file")

    register_backend(OP, "torch", _fn("torch"))
    register_backend(OP, "broken", _fn("broken"), is_available=broken, priority=10)

    assert get_backend(OP).name == "torch"
    with pytest.raises(RuntimeError, match=r"ImportError: libcudart\.so\.13"):
        get_backend(OP, "broken")
    reason = available_backends(OP)["broken"]
    assert isinstance(reason, str) and "libcudart" in reason


def test_is_available_returning_junk_is_unavailable() -> None:
    register_backend(OP, "odd", _fn("odd"), is_available=lambda: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(RuntimeError, match="must return True, False or a reason string"):
        get_backend(OP, "odd")


def test_availability_is_lazy_and_cached() -> None:
    calls: list[str] = []

    def check() -> bool:
        calls.append("checked")
        return True

    register_backend(OP, "torch", _fn("torch"), is_available=check)
    assert calls == []  # registering must not run the check (it may import a heavy GPU library)
    get_backend(OP)
    get_backend(OP, "torch")
    available_backends(OP)
    assert calls == ["checked"]


def test_replacement() -> None:
    register_backend(OP, "a", _fn("a-old"), priority=1)
    register_backend(OP, "b", _fn("b"), priority=1, is_available=lambda: "not yet")
    assert get_backend(OP)(0) == ("a-old", 0)
    assert available_backends(OP) == {"a": True, "b": "not yet"}

    # Replacing re-checks availability and keeps the registration order.
    register_backend(OP, "b", _fn("b-new"), priority=1)
    register_backend(OP, "a", _fn("a-new"), priority=1)
    assert available_backends(OP) == {"a": True, "b": True}
    assert get_backend(OP)(0) == ("a-new", 0)
    assert get_backend(OP, "b")(0) == ("b-new", 0)

    register_backend(OP, "b", _fn("b-top"), priority=2)
    assert get_backend(OP).name == "b"


def test_replacement_logs_the_new_choice(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="miles_kernels.registry"):
        register_backend(OP, "a", _fn("a"))
        get_backend(OP)
        register_backend(OP, "a", _fn("a2"))
        get_backend(OP)
    assert len([r for r in caplog.records if r.name == "miles_kernels.registry"]) == 2


def test_available_backends_and_registered_ops() -> None:
    assert registered_ops() == []
    register_backend(OP, "torch", _fn("torch"))
    register_backend(OP, "flash", _fn("flash"), is_available=lambda: "needs a GPU")
    register_backend("another", "torch", _fn("torch"))
    assert registered_ops() == ["another", OP]
    assert available_backends(OP) == {"torch": True, "flash": "needs a GPU"}


def test_registration_mistakes() -> None:
    with pytest.raises(ValueError, match="reserved"):
        register_backend(OP, "auto", _fn("x"))
    with pytest.raises(TypeError, match="fn must be callable"):
        register_backend(OP, "x", "not a function")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="is_available must be callable"):
        register_backend(OP, "x", _fn("x"), is_available=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="priority must be an int"):
        register_backend(OP, "x", _fn("x"), priority=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        register_backend("", "x", _fn("x"))
    with pytest.raises(TypeError, match="must be a str"):
        register_backend(OP, 3, _fn("x"))  # type: ignore[arg-type]
    assert registered_ops() == []  # nothing half-registered


def test_a_resolved_backend_is_remembered_until_a_registration_changes_the_op() -> None:
    """get_backend answers repeated lookups (every layer's op call) from what it resolved, and resolves again after a
    registration, or against other registry state (a test's swapped dicts)."""
    register_backend(OP, "plain", _fn("plain"))
    calls: list[int] = []

    def check() -> bool:
        calls.append(1)
        return True

    register_backend(OP, "fused", _fn("fused"), is_available=check, priority=5)
    assert get_backend(OP).name == "fused" and get_backend(OP).name == "fused" and get_backend(OP, "plain")
    assert len(calls) == 1
    register_backend(OP, "newer", _fn("newer"), priority=9)
    assert get_backend(OP).name == "newer"
    register_backend(OP, "newer", _fn("newer"), is_available=lambda: "gone", priority=9)  # replaced: checked afresh
    assert get_backend(OP).name == "fused"
    registry._AVAILABILITY = {}  # another registry state: resolved anew (the fixture puts the real one back)
    assert get_backend(OP).name == "fused" and len(calls) == 2

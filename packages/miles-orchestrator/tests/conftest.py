"""Shared helpers of the orchestrator's tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel

PLUGINS = str(Path(__file__).parent)  # orchestrator_plugins.py: the plug-ins the tests load by path


@pytest.fixture(scope="module")
def plugins_on_path() -> Iterator[None]:
    """This folder on `sys.path` for a test module (spawned workers inherit it, as they would a user's module's)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(PLUGINS)
        yield


@pytest.fixture(scope="session")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random dense policy (seed 3) with the test tokenizer, as a Hugging Face directory: the runs of the
    local-cluster, tracker and debugging tests start from it (none writes into it)."""
    from miles_kernels.testing import build_tokenizer, save_random_model, tiny_config

    path = tmp_path_factory.mktemp("policy")
    tokenizer = build_tokenizer(vocab_size=300)
    save_random_model(path, tiny_config("dense", vocab_size=len(tokenizer)), seed=3, tokenizer=tokenizer)
    return path


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[object, object]]:
    """An in-process embedded engine on a small random dense model with a test tokenizer, and its `PromptEncoder`."""
    from miles_kernels import KernelConfig
    from miles_kernels.testing import build_tokenizer, save_random_model, tiny_config
    from miles_orchestrator.rollout.batch import PromptEncoder
    from miles_rollout import Engine, EngineConfig

    path = tmp_path_factory.mktemp("model")
    tokenizer = build_tokenizer(vocab_size=300)
    save_random_model(path, tiny_config("dense", vocab_size=len(tokenizer)), seed=2, tokenizer=tokenizer)
    engine = Engine(str(path), KernelConfig(page_size=16), EngineConfig(num_kv_pages=256))
    yield engine, PromptEncoder(str(path))
    engine.shutdown()


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """A local cluster sets the driver's torch thread count (`run.num_threads`): every test gets the count back."""
    import torch

    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


def _leaf_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    from miles_orchestrator.config.loading import section_model

    names = []
    for name, info in model.model_fields.items():
        section = section_model(info.annotation)  # optional sections (opd.teacher) included
        if section is not None:
            names += _leaf_fields(section, f"{prefix}{name}.")
        else:
            names.append(f"{prefix}{name}")
    return names


@pytest.fixture
def leaf_fields() -> Callable[[type[BaseModel]], list[str]]:
    """The dotted name of every leaf field of a config model (nested sections flattened)."""
    return _leaf_fields

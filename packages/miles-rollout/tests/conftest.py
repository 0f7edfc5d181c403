"""Shared fixtures for miles-rollout tests: small random models (with a tokenizer) and real server processes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_kernels import build_tokenizer, save_random_model, tiny_config
from miles_rollout.launch import launch_server

TEST_PAGE_SIZE = "16"


def make_model(directory: Path, kind: str, seed: int = 0) -> Path:
    tokenizer = build_tokenizer(save_dir=directory)
    config = tiny_config(kind, vocab_size=512, max_position_embeddings=512)
    save_random_model(directory, config, seed=seed, tokenizer=tokenizer)
    return directory


@pytest.fixture(scope="session")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("dense"), "dense")


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("moe"), "moe")


@contextlib.contextmanager
def running_server(model_dir: Path, *extra: str) -> Iterator[str]:
    """A test server: small pages and a bounded KV store, one thread so concurrent tests share the cores."""
    flags = ("--page-size", TEST_PAGE_SIZE, "--kv-pages", "512", *extra)
    with launch_server(model_dir, *flags, env={"OMP_NUM_THREADS": "1"}) as url:
        yield url


@pytest.fixture(scope="module")
def dense_server(dense_dir: Path) -> Iterator[str]:
    with running_server(dense_dir, "--deterministic") as url:
        yield url


@pytest.fixture(scope="session")
def start_server():
    """The `running_server` context manager, for tests that need a server with their own flags."""
    return running_server

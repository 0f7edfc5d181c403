"""Shared fixtures for miles-kernels tests: every test starts with torch at 2 threads."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)

"""Integration tier (no numerics): every package installs together and every console script answers --help."""

import importlib
import shutil
import subprocess

import pytest

PACKAGES = ["contracts", "memory", "kernels", "rollout", "trainer", "spec", "orchestrator"]
SCRIPTS = ["miles-rollout", "miles-trainer", "miles-orchestrator", "miles-memory", "miles-spec"]


@pytest.mark.parametrize("name", PACKAGES)
def test_package_imports_with_version(name: str) -> None:
    module = importlib.import_module(f"miles_{name}")
    assert module.__doc__, f"miles_{name} needs a module docstring"
    from importlib.metadata import version

    assert version(f"miles-{name}") == "0.1.0"


@pytest.mark.parametrize("script", SCRIPTS)
def test_console_script_help(script: str) -> None:
    path = shutil.which(script)
    assert path, f"{script} is not installed"
    result = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and script in result.stdout


@pytest.mark.parametrize("name", PACKAGES)
def test_every_exported_name_loads(name: str) -> None:
    """Packages load their attributes lazily (lazy_loader, from __init__.pyi): every name in __all__ resolves."""
    module = importlib.import_module(f"miles_{name}")
    missing = [attr for attr in getattr(module, "__all__", []) if getattr(module, attr, None) is None]
    assert not missing, f"miles_{name}.__all__ names what it cannot load: {missing}"

"""Integration tier (no numerics): every package installs together and every console script answers --help."""

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

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


def _check_cycles(root, files: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """tests/check_cycles.py on a package made of `files` under ROOT/packages/demo/src."""
    for name, text in files.items():
        path = root / "packages" / "demo" / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    script = Path(__file__).resolve().parents[1] / "check_cycles.py"
    (root / "tests").mkdir(exist_ok=True)
    shutil.copy(script, root / "tests" / "check_cycles.py")
    return subprocess.run([sys.executable, str(root / "tests" / "check_cycles.py")], capture_output=True, text=True)


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import(tmp_path) -> None:
    result = _check_cycles(tmp_path, {
        "demo/__init__.py": "",
        "demo/a.py": "from demo.sub import b\n",
        "demo/sub/__init__.py": "",
        "demo/sub/b.py": "def f():\n    from .. import a\n",
    })  # fmt: skip
    assert result.returncode == 1, result.stdout
    assert "import cycle among demo.a, demo.sub.b" in result.stdout


def test_the_cycle_check_lets_annotation_only_imports_be(tmp_path) -> None:
    result = _check_cycles(tmp_path, {
        "demo/__init__.py": "",
        "demo/a.py": "import demo.b\n",
        "demo/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from demo.a import X\n",
    })  # fmt: skip
    assert result.returncode == 0, result.stdout

"""Build hook: compiles the native CPU kernels (src/miles_kernels/native, C++ without torch headers) when the package
is built or installed, so `uv sync` / `pip install` leaves a ready library. An editable install builds it next to
the sources; a wheel carries it (tagged py3-none-<this platform>: the library uses no Python C API). No C++
compiler, or a failed build, is a warning, not a failed install: the op registry then runs the torch-tiled kernels
and says why (`python -m miles_kernels.native status`)."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface
from packaging.tags import sys_tags

NATIVE = Path(__file__).resolve().parent / "src" / "miles_kernels" / "native"


def _recipe() -> Any:
    """native/build.py, loaded by path (the package itself imports torch, which the build environment lacks)."""
    spec = importlib.util.spec_from_file_location("miles_native_build", NATIVE / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class NativeBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        recipe = _recipe()
        out_dir = NATIVE if version == "editable" else Path(tempfile.mkdtemp(prefix="miles-native-"))
        try:
            library = recipe.build(out_dir)
        except RuntimeError as exc:
            self.app.display_warning(f"miles-kernels: the native CPU kernels were not built ({exc}); the torch-tiled "
                                     "kernels run instead")  # fmt: skip
            return
        if version != "editable":
            build_data["force_include"][str(library)] = f"miles_kernels/native/{recipe.LIBRARY}"
            build_data["pure_python"] = False
            # no Python C API in it: any Python 3, this platform only
            build_data["tag"] = f"py3-none-{next(iter(sys_tags())).platform}"

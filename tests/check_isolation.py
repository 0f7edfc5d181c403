"""Check that a package installed alone (by `nox -s tests`) has exactly the siblings it declares.

Run inside the package's own venv: `python tests/check_isolation.py miles-rollout`. It imports the package,
checks every sibling it may use is importable and every one it must never use is absent, and checks the
third-party libraries it must stay free of (torch for miles-contracts, ray for miles-rollout).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

ALLOWED = {  # each package's declared miles dependencies: only those it imports (docs/architecture.md, "Packages")
    "miles-contracts": set(),
    "miles-memory": set(),
    "miles-kernels": set(),
    "miles-rollout": {"miles-contracts", "miles-memory", "miles-kernels"},
    "miles-trainer": {"miles-contracts", "miles-memory", "miles-kernels"},
    "miles-spec": {"miles-contracts", "miles-memory", "miles-kernels", "miles-trainer"},
    "miles-orchestrator": {
        "miles-contracts", "miles-memory", "miles-kernels", "miles-rollout", "miles-spec", "miles-trainer",
    },
}  # fmt: skip
ABSENT_THIRD_PARTY = {"miles-contracts": {"torch", "numpy", "ray"}, "miles-rollout": {"ray"}}


def module_of(package: str) -> str:
    return package.replace("-", "_")


def main(package: str) -> int:
    if package not in ALLOWED:
        print(f"unknown package {package!r}; expected one of {sorted(ALLOWED)}", file=sys.stderr)
        return 2
    importlib.import_module(module_of(package))
    problems = []
    for other in ALLOWED:
        if other == package:
            continue
        present = importlib.util.find_spec(module_of(other)) is not None
        if other in ALLOWED[package] and not present:
            problems.append(f"{other} is a declared dependency but is not installed")
        if other not in ALLOWED[package] and present:
            problems.append(f"{other} is installed but {package} must not depend on it")
    for library in ABSENT_THIRD_PARTY.get(package, set()):
        if importlib.util.find_spec(library) is not None:
            problems.append(f"{library} is installed but {package} must install without it")
    for problem in problems:
        print(f"isolation check failed for {package}: {problem}", file=sys.stderr)
    if not problems:
        print(f"{package} installs alone: siblings {sorted(ALLOWED[package]) or 'none'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

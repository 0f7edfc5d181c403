"""The docs stay true to the code: every module docs/architecture.md names exists, its package table and the
README's match what each package declares, and every relative link in the repository's Markdown resolves."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()


def _sources() -> list[Path]:
    return [p for p in (ROOT / "packages").glob("*/src/**/*") if "__pycache__" not in p.parts]


def test_every_module_the_architecture_doc_names_exists() -> None:
    missing = []
    for path in sorted(set(re.findall(r"`(miles_[a-z_]+/[a-z_/]*(?:\.py)?)`", ARCHITECTURE))):
        package = path.split("/")[0].removeprefix("miles_")
        if not (ROOT / "packages" / f"miles-{package}" / "src" / path).exists():
            missing.append(path)
    names = {p.name for p in _sources()} | {p.name for p in (ROOT / "packages").glob("*/*.py")}  # build hooks
    for name in sorted(set(re.findall(r"`([a-z_]+\.py)`", ARCHITECTURE))):
        if name not in names:
            missing.append(name)
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def _declared(package: str) -> set[str]:
    meta = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())
    return {d for d in meta["project"]["dependencies"] if d.startswith("miles-")}


def _listed(cell: str) -> set[str]:
    """A table cell of package names ("contracts, kernels", "—", "all of the above") as miles-* names."""
    return {f"miles-{name.strip()}" for name in cell.split("(")[0].replace("—", "").split(",") if name.strip()}


def test_the_package_table_is_what_each_package_declares() -> None:
    rows = re.findall(r"^\| (miles-[a-z]+) \| .* \| ([^|]*) \|$", ARCHITECTURE, flags=re.M)
    assert len(rows) == len(list((ROOT / "packages").iterdir())), rows
    for package, cell in rows:
        deps, listed = _declared(package), _listed(cell)
        assert deps == listed, f"{package}: pyproject declares {sorted(deps)}, docs/architecture.md {sorted(listed)}"


def test_the_readme_package_table_is_what_each_package_declares() -> None:
    rows = re.findall(r"^\| \[(miles-[a-z]+)\]\([^)]*\) \| .* \| ([^|]*) \|$", (ROOT / "README.md").read_text(),
                      flags=re.M)  # fmt: skip
    assert len(rows) == len(list((ROOT / "packages").iterdir())), rows
    for package, cell in rows:
        deps, listed = _declared(package), _listed(cell)
        assert deps == listed, f"{package}: pyproject declares {sorted(deps)}, README.md {sorted(listed)}"


def test_relative_links_in_markdown_resolve() -> None:
    broken = []
    for doc in [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("packages/*/README.md"),
                *ROOT.glob("benchmarks/*.md")]:  # fmt: skip
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken

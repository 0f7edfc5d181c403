"""Miles test sessions. `uv run nox` runs them all (gpu skips itself, with the reason, where there is no GPU).

Every session installs from uv.lock (`uv sync --frozen`: never a fresh resolve) into its own venv, reused
across runs. A per-package session installs only that package and its declared dependencies, so it also
proves that the package installs alone.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True

PACKAGES = [
    "miles-contracts",
    "miles-memory",
    "miles-kernels",
    "miles-rollout",
    "miles-trainer",
    "miles-spec",
    "miles-orchestrator",
]
PYTHON = "3.11"
# Optional extras (and dependency groups) a package's tests exercise on this CPU (megatron-core is pure Python: its CPU
# paths are tested; peft loads the trainer's LoRA export).
TEST_EXTRAS = {"miles-trainer": ("--extra", "megatron", "--group", "peft"), "miles-spec": ("--extra", "megatron")}
# Two threads match this project's reference machine; determinism tests set their own counts. Bytecode is written
# even where the environment says not to (PYTHONDONTWRITEBYTECODE=1, as on the CI image): the suite starts hundreds of
# Python processes (rank workers, Ray actors, CLI runs, megatron-core's checkpoint writers), and each one compiled
# torch, transformers and megatron-core from source again, about 10 s of CPU apiece; with the bytecode the sessions'
# venvs keep, an import of them takes about 2 s.
TEST_ENV = {"OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "PYTHONDONTWRITEBYTECODE": ""}  # fmt: skip


def _sync(session: nox.Session, *args: str) -> None:
    """Install from uv.lock into this session's venv."""
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--no-default-groups",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


def _sglang_source(session: nox.Session) -> None:
    """SGLang's Python source without its GPU dependencies, plus the few pure-Python packages its `ServerArgs`
    imports, at their uv.lock versions: the rollout tests parse the SGLang launch config with SGLang's own
    `prepare_server_args` (test_sglang_launch.py). The `sglang` extra itself pulls CUDA kernel wheels."""
    pins = session.run(
        "uv", "export", "--frozen", "--package", "miles-rollout", "--extra", "sglang", "--no-hashes",
        "--no-emit-workspace", "--format", "requirements-txt", silent=True, external=True,
    )  # fmt: skip
    constraints = f"{session.virtualenv.location}/sglang-constraints.txt"
    with open(constraints, "w") as f:
        f.write(str(pins))
    python = f"{session.virtualenv.location}/bin/python"
    session.run_install("uv", "pip", "install", "--python", python, "--no-deps", "-c", constraints, "sglang")
    imported = ["pybase64", "msgspec", "pyzmq", "ipython", "requests", "pillow", "pyyaml"]  # by ServerArgs' imports
    session.run_install("uv", "pip", "install", "--python", python, "-c", constraints, *imported)


def _pytest(session: nox.Session, *paths: str, env: dict[str, str] | None = None) -> None:
    session.run("pytest", *paths, *session.posargs, env={**TEST_ENV, **(env or {})})


@nox.session(python=PYTHON)
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """Unit tests of one package, installed alone with only its declared dependencies."""
    _sync(session, "--package", package, "--group", "test", *TEST_EXTRAS.get(package, ()))
    session.run("python", "tests/check_isolation.py", package)
    env = {}
    if package == "miles-rollout":
        _sglang_source(session)
        env["MILES_SGLANG_SOURCE"] = "1"  # test_sglang_launch.py fails, not skips, if SGLang's parser is missing
    _pytest(session, f"packages/{package}/tests", "-m", "not gpu", env=env)


@nox.session(python=PYTHON)
def integration(session: nox.Session) -> None:
    """Cross-package tests under tests/integration (real servers, a real Ray cluster on this machine; the Megatron
    trainer's run on CPU ranks, hence the megatron extra)."""
    _sync(session, "--all-packages", "--group", "test", "--extra", "megatron")
    _pytest(session, "tests/integration", "-m", "not gpu")


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff (lint + format check), import-linter (the package table of docs/architecture.md) and the import-cycle
    check inside each package (tests/check_cycles.py)."""
    _sync(session, "--all-packages", "--group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports")
    session.run("python", "tests/check_cycles.py")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy (strict) over every package's source."""
    _sync(session, "--all-packages", "--group", "typecheck")
    sources = [f"packages/{p}/src" for p in PACKAGES]
    session.run("mypy", *sources)


@nox.session(python=PYTHON)
def gpu(session: nox.Session) -> None:
    """`gpu`-marked tests on whatever CUDA GPU is present; skips, saying why, where there is none."""
    _sync(session, "--all-packages", "--group", "test")
    probe = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    name = session.run("python", "-c", probe, silent=True, env=TEST_ENV)
    name = (name or "").strip().splitlines()[-1] if name and name.strip() else ""
    if not name:
        session.skip("no CUDA GPU visible to torch (torch.cuda.is_available() is False): gpu tests not run")
    session.log(f"GPU: {name}")
    paths = [f"packages/{p}/tests" for p in PACKAGES] + ["tests/integration"]
    session.run("pytest", *paths, "-m", "gpu", *session.posargs, env=TEST_ENV)
    # the Triton kernels' tests, which the CPU sessions run in Triton's interpreter, compiled for this GPU
    session.run("pytest", "packages/miles-kernels/tests/test_triton_ops.py", *session.posargs, env=TEST_ENV)


@nox.session(python=PYTHON)
@nox.parametrize("hardware", ["h100", "h200", "b200", "gb300"])
def plan(session: nox.Session, hardware: str) -> None:
    """Memory plans of the examples for one hardware profile: each must fit and match its recorded plan
    (examples/plans; re-record with `uv run python tests/plan_matrix.py --hardware HW --record`)."""
    _sync(session, "--package", "miles-memory")
    session.run("python", "tests/plan_matrix.py", "--hardware", hardware)

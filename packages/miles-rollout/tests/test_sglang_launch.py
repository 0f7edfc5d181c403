"""SGLang engines' launch (miles_rollout.sglang_launch; docs/laptop-to-cluster.md).

- The mapping of a run's settings to SGLang's ServerArgs fields, and against SGLang 0.5.23's own `ServerArgs`: the
  config file Miles writes is parsed by SGLang's `prepare_server_args` (SGLang's source, installed without its GPU
  dependencies by the nox session; skipped where it is absent) and every field comes out as Miles meant it.
- The bodies the client sends to an SGLang engine's routes, validated with those routes' own request types (compiled
  from SGLang's source).
- A server process: started with `--config FILE` (a stand-in executable that records what it got and serves the
  fake SGLang API of conftest.py), waited for until /health answers, stopped with its children; a server that
  exits or never answers is reported with its log.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from miles_contracts import GenerateRequest, SamplingParams
from miles_kernels.config import KernelConfig
from miles_rollout import Client
from miles_rollout.config import EngineConfig, SGLangConfig
from miles_rollout.launch import free_port
from miles_rollout.sglang_launch import (
    MANAGED,
    SGLangServer,
    launch_command,
    require_cuda,
    sglang_server_args,
    write_server_config,
)

STAND_IN = Path(__file__).with_name("sglang_stand_in.py")


def mapped(**overrides) -> dict:
    settings = {
        "kernel": KernelConfig(mode="fast", dtype="bfloat16"),
        "engine": EngineConfig(),
        "sglang": SGLangConfig(),
        "memory_saver": False,
        "admin_key": None,
    } | overrides
    return sglang_server_args("/models/qwen3", host="127.0.0.1", port=30001, **settings)


def test_run_settings_map_to_sglang_server_args() -> None:
    assert mapped() == {
        "model_path": "/models/qwen3", "host": "127.0.0.1", "port": 30001, "tp_size": 1, "dp_size": 1,
        "ep_size": 1, "dtype": "bfloat16", "random_seed": 0, "max_running_requests": 256, "log_level": "warning",
        "weight_version": "0",
    }  # fmt: skip
    full = mapped(
        engine=EngineConfig(context_length=4096, seed=7, max_running_requests=64, speculative_algorithm="nextn",
                            speculative_num_steps=2, enable_return_routed_experts=True),
        sglang=SGLangConfig(tp_size=2, ep_size=2, mem_fraction_static=0.5, attention_backend="fa3",
                            chunked_prefill_size=8192, deterministic_inference=True,
                            server_args={"enable_metrics": True}),
        memory_saver=True, admin_key="secret",
    )  # fmt: skip
    assert full == {
        "model_path": "/models/qwen3", "host": "127.0.0.1", "port": 30001, "tp_size": 2, "dp_size": 1,
        "ep_size": 2, "dtype": "bfloat16", "random_seed": 7, "max_running_requests": 64, "log_level": "warning",
        "weight_version": "0", "context_length": 4096, "mem_fraction_static": 0.5, "attention_backend": "fa3",
        "chunked_prefill_size": 8192, "admin_api_key": "secret", "enable_deterministic_inference": True,
        "speculative_algorithm": "NEXTN", "speculative_num_steps": 2, "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 3, "enable_return_routed_experts": True, "enable_memory_saver": True,
        "enable_metrics": True,
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"sets \['random_seed', 'tp_size'\], which Miles sets"):
        mapped(sglang=SGLangConfig(server_args={"tp_size": 4, "random_seed": 1, "enable_metrics": True}))
    assert {"model_path", "admin_api_key", "enable_memory_saver"} <= MANAGED


def test_the_config_file_is_yaml_for_this_user_only(tmp_path) -> None:
    path = write_server_config(mapped(admin_key="secret"), tmp_path / "sglang.yaml")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds the admin key
    yaml = pytest.importorskip("yaml")
    flags = {name.replace("_", "-"): value for name, value in mapped(admin_key="secret").items()}
    assert yaml.safe_load(path.read_text()) == flags  # SGLang reads each key as its flag: --admin-api-key
    with pytest.raises(ValueError, match=r"\*\.yaml"):
        write_server_config({}, tmp_path / "sglang.json")


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {
            "engine": EngineConfig(context_length=4096, seed=7, speculative_algorithm="NEXTN",
                                   enable_return_routed_experts=True),
            "sglang": SGLangConfig(tp_size=2, mem_fraction_static=0.6, attention_backend="fa3",
                                   deterministic_inference=True,
                                   server_args={"enable_metrics": True, "cuda_graph_max_bs_decode": 64}),
            "memory_saver": True, "admin_key": "secret",
        },
    ],
    ids=["defaults", "everything"],
)  # fmt: skip
def test_sglangs_own_server_args_take_the_mapping(overrides: dict, tmp_path) -> None:
    server_args = sglang_module("sglang.srt.server_args")
    args = mapped(**overrides)
    path = write_server_config(args, tmp_path / "sglang.yaml")
    parsed = server_args.prepare_server_args(["--config", str(path)])
    for name, value in args.items():
        assert getattr(parsed, name) == value, name


def sglang_module(name: str):
    """A module of SGLang's source: skipped where it is absent, a failure in the nox session that installs it."""
    if os.environ.get("MILES_SGLANG_SOURCE"):
        import importlib

        return importlib.import_module(name)
    return pytest.importorskip(name, reason="SGLang's source (the nox rollout session)")


@pytest.mark.parametrize("sglang_hosts", [False, True], ids=["miles-hosts", "sglang-hosts"])
def test_sglangs_weight_update_group_and_ours_meet(sglang_hosts: bool) -> None:
    """A weight-update group made by `miles_kernels.init_weight_update_group` on one side and by SGLang's
    `init_custom_process_group` (what SGLang engines and slime's trainer call) on the other: rank 0 broadcasts, rank 1
    receives the same tensor, whichever side hosts (gloo here; NCCL uses the same store keys)."""
    import threading
    from datetime import timedelta

    import torch

    from miles_kernels import broadcast_tensors, init_weight_update_group

    common = sglang_module("sglang.srt.utils.common")
    port, name, got = free_port(), f"weights-{int(sglang_hosts)}", {}

    def sglang_side() -> None:
        group = common.init_custom_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0 if sglang_hosts else 1,
            group_name=name, timeout=timedelta(seconds=30),
        )  # fmt: skip
        tensor = torch.arange(4.0) if sglang_hosts else torch.zeros(4)
        torch.distributed.broadcast(tensor, src=0, group=group)
        got["sglang"] = tensor

    def miles_side() -> None:
        group = init_weight_update_group("127.0.0.1", port, 1 if sglang_hosts else 0, 2, name, "gloo", timeout_s=30)
        tensor = torch.zeros(4) if sglang_hosts else torch.arange(4.0)
        broadcast_tensors(group, [tensor], 0)
        got["miles"] = tensor

    threads = [threading.Thread(target=side) for side in (sglang_side, miles_side)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert set(got) == {"sglang", "miles"}, "the two sides did not meet"
    assert torch.equal(got["sglang"], torch.arange(4.0)) and torch.equal(got["miles"], torch.arange(4.0))


def sglang_request_types() -> dict[str, type]:
    """{route: SGLang 0.5.23's request type of it}, from SGLang's own source: each `Annotated[Type, Body()]` route of
    `http_server.py`, the type's class (and `BaseReq`) compiled from `io_struct.py` alone (importing io_struct pulls
    in SGLang's multimodal GPU stack), validated as FastAPI validates it (`__get_pydantic_core_schema__`)."""
    import ast
    import types
    import typing

    import msgspec

    utils = sglang_module("sglang.srt.utils.msgspec_utils")
    root = Path(utils.__file__).parents[1]
    server = ast.parse((root / "entrypoints" / "http_server.py").read_text())
    routes: dict[str, str] = {}
    for node in server.body:
        if not isinstance(node, ast.AsyncFunctionDef):
            continue
        paths = [d.args[0].value for d in node.decorator_list if isinstance(d, ast.Call) and d.args and
                 isinstance(d.args[0], ast.Constant) and str(d.args[0].value).startswith("/")]  # fmt: skip
        for arg in node.args.args:
            annotation = arg.annotation
            if paths and isinstance(annotation, ast.Subscript) and ast.unparse(annotation).endswith("Body()]"):
                routes[paths[0]] = ast.unparse(annotation.slice.elts[0])  # type: ignore[attr-defined]
    source = (root / "managers" / "io_struct.py").read_text()
    classes = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}
    module = types.ModuleType("sglang_io_struct_requests")  # msgspec resolves annotations in the class's module
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    namespace |= {"msgspec": msgspec, "msgspec_struct_pydantic_core_schema": utils.msgspec_struct_pydantic_core_schema,
                  **{name: getattr(typing, name) for name in typing.__all__}}  # fmt: skip
    for name in ["BaseReq", *sorted(set(routes.values()) & set(classes))]:
        exec(compile(ast.Module([classes[name]], []), "io_struct.py", "exec"), namespace)
    return {route: namespace[name] for route, name in routes.items() if name in namespace}


def test_the_clients_sglang_calls_are_valid_sglang_requests() -> None:
    """Every call a run makes to an SGLang engine (weight sync by broadcast or from disk, pause / continue, memory
    release / resume) sends a body SGLang 0.5.23's route accepts: parsed with the route's own request type, each
    field Miles sends is one SGLang reads (none dropped as unknown), with the value it meant (e.g. the weight version
    a string: SGLang does not turn numbers into strings)."""
    import httpx
    import msgspec
    import pydantic

    types = sglang_request_types()
    sent: list[tuple[str, dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.path, json.loads(request.content or b"{}")))
        return httpx.Response(200, json={"success": True, "message": "Success"})

    async def calls() -> None:
        client = Client("http://sglang", admin_key="k", transport=httpx.MockTransport(handler))
        await client.init_weights_update_group("10.0.0.1", 29500, rank_offset=1, world_size=3,
                                               group_name="miles_weight_sync", backend="nccl")  # fmt: skip
        await client.update_weights_from_distributed(["lm_head.weight"], ["bfloat16"], [[8, 4]], "miles_weight_sync",
                                                     weight_version=3, flush_cache=True)  # fmt: skip
        await client.update_weights_from_distributed(["a"], ["float32"], [[2]], "miles_weight_sync", flush_cache=False)
        await client.update_weights_from_disk("/dev/shm/miles-sync", 4)
        await client.destroy_weights_update_group("miles_weight_sync")
        for mode in ("abort", "retract", "in_place"):
            await client.pause_generation(mode)
        await client.continue_generation()
        await client.release_memory_occupation(["kv_cache", "weights"])
        await client.resume_memory_occupation()
        await client.aclose()

    asyncio.run(calls())
    assert len(sent) == 11
    for route, body in sent:
        assert route in types, f"{route}: SGLang 0.5.23 has no such route taking a body"
        fields = {field.name for field in msgspec.structs.fields(types[route])}
        assert set(body) <= fields, f"{route}: SGLang ignores {sorted(set(body) - fields)}"
        parsed = pydantic.TypeAdapter(types[route]).validate_python(body)
        kept = {name: getattr(parsed, name) for name in body}
        assert kept == body, f"{route}: SGLang reads {kept}, Miles sent {body}"
    by_route = dict(sent)
    assert by_route["/update_weights_from_disk"]["weight_version"] == "4"
    assert sent[1][1]["weight_version"] == "3" and sent[1][1]["flush_cache"] is True


def test_missing_sglang_and_cuda_get_clear_errors(monkeypatch) -> None:
    import importlib.util

    import torch

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    with pytest.raises(ImportError, match="--extra sglang"):
        launch_command(SGLangConfig())
    assert launch_command(SGLangConfig(launch_command=["my-sglang"])) == ["my-sglang"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"needs a CUDA GPU .* use rollout\.backend=embedded"):
        require_cuda()


def test_a_server_is_launched_waited_for_and_stopped(tmp_path) -> None:
    args = mapped(admin_key="secret", memory_saver=True) | {"port": free_port()}
    server = SGLangServer([sys.executable, str(STAND_IN)], args, tmp_path)
    server.start()
    try:
        asyncio.run(server.wait_healthy(timeout=60, interval=0.1))
        launched = json.loads((tmp_path / f"sglang-{args['port']}.launched.json").read_text())
        assert launched == {"argv": ["--config", str(server.config_path)], "server_args": args}

        async def generate() -> list:
            async with Client(server.url) as client:
                request = GenerateRequest(input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=2))
                return await client.generate(request)

        assert asyncio.run(generate())
    finally:
        server.stop(timeout=10)
    assert server.process is not None and server.process.poll() is not None
    with pytest.raises(ProcessLookupError):  # its whole process group is gone
        os.killpg(server.process.pid, 0)


def test_a_server_that_fails_to_start_is_reported_with_its_log(tmp_path) -> None:
    crash = [sys.executable, "-c", "import sys; print('CUDA out of memory while loading weights'); sys.exit(3)"]
    server = SGLangServer(crash, mapped() | {"port": free_port()}, tmp_path / "crash")
    server.start()
    with pytest.raises(RuntimeError, match=r"exited with 3 before it was healthy.*\n.*CUDA out of memory"):
        asyncio.run(server.wait_healthy(timeout=30, interval=0.1))
    silent = SGLangServer([sys.executable, "-c", "import time; print('loading'); time.sleep(60)"],
                          mapped() | {"port": free_port()}, tmp_path / "silent")  # fmt: skip
    silent.start()
    try:
        with pytest.raises(RuntimeError, match=r"did not answer /health within 1 s .*\n.*loading"):
            asyncio.run(silent.wait_healthy(timeout=1.0, interval=0.1))
    finally:
        silent.stop(timeout=5)


def _is_gone(pid: int) -> bool:
    """The process has exited (gone, or a zombie nobody has reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat_line = Path(f"/proc/{pid}/stat").read_text()
    return stat_line.rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_server_dies_with_the_process_that_launched_it(tmp_path) -> None:
    """A killed engine actor (SIGKILL: no chance to stop anything) leaves no SGLang server behind holding its GPUs."""
    import subprocess
    import time

    launcher = (
        "import sys, time\n"
        "from miles_rollout.sglang_launch import SGLangServer\n"
        "server = SGLangServer([sys.executable, '-c', 'import time; time.sleep(120)'],\n"
        f"                      {{'host': '127.0.0.1', 'port': 1}}, {str(tmp_path)!r})\n"
        "server.start()\n"
        "print(server.process.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        server_pid = int(parent.stdout.readline())
        assert not _is_gone(server_pid)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while not _is_gone(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _is_gone(server_pid), "the server outlived the process that launched it"
    finally:
        parent.kill()

"""Start-up tier (in process; loop.py imports torch): `check_plugins`, what `miles-orchestrator run` calls before
any bootstrap or cluster start, refuses a bad data source or an unreachable http reward with the field named."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from miles_orchestrator.config import load_config
from miles_orchestrator.preflight import check_plugins

PLUGINS = str(Path(__file__).parent)


def test_a_bad_data_source_is_refused_naming_the_field(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(PLUGINS)
    check_plugins(load_config(None, ["data.source=orchestrator_plugins:CountingSource", "data.source_args={step: 2}"]))
    cases = {
        "orchestrator_plugins:SourceWithoutResume": r"data\.source='orchestrator_plugins:SourceWithoutResume': "
        r"plug-in .* is not a DataSource: it lacks load_state_dict",
        "no_such_module_xyz:Source": r"data\.source='no_such_module_xyz:Source': plug-in .* cannot import module",
        f"hf:{tmp_path / 'nothing'}": r"data\.source='hf:.*nothing': 'hf:.*nothing': no such local file or directory",
        str(tmp_path / "missing.jsonl"): r"data\.source='.*missing\.jsonl': data file .* does not exist",
    }
    for source, expected in cases.items():
        with pytest.raises(ValueError, match=expected):
            check_plugins(load_config(None, [f"data.source={source}"]))


def test_an_unreachable_http_reward_is_refused_naming_the_url() -> None:
    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}/reward"
    with pytest.raises(ValueError, match=rf"reward\.name='http': reward\.url='{url}': no reward server answers there"):
        check_plugins(load_config(None, ["reward.name=http", f"reward.url={url}", "reward.max_retries=0"]))


def test_a_bad_environment_is_refused_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(PLUGINS)
    check_plugins(load_config(None, ["rollout.agent.env=orchestrator_plugins:ScriptedEnv"]))
    cases = {
        "orchestrator_plugins:CountingSource": r"rollout\.agent\.env='orchestrator_plugins:CountingSource': plug-in "
        r".* is not an Environment: it lacks reset, step",
        "no_such_module_xyz:Env": r"rollout\.agent\.env='no_such_module_xyz:Env': plug-in .* cannot import module",
    }
    for env, expected in cases.items():
        with pytest.raises(ValueError, match=expected):
            check_plugins(load_config(None, [f"rollout.agent.env={env}"]))

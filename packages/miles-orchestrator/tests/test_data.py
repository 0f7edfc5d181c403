"""Pure-logic tier (no torch): data sources read JSONL / Parquet and local Hugging Face datasets, shuffle per epoch,
end after `num_epochs`, hand out run-unique group indices, resume to exactly the prompts an uninterrupted source
gives, and reject bad rows with the file and line; a 'module:Class' DataSource plug-in is checked against the
contract (Protocol, arguments, group indices, JSON state) and resumes the same way."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles_contracts import ChatMessage, DataSource, Sample
from miles_orchestrator.config import DataSection
from miles_orchestrator.data.sources import (
    BuiltinTaskSource,
    FileSource,
    PluginSource,
    build_data_source,
    build_eval_samples,
    check_data_source,
    load_eval_samples,
)
from miles_orchestrator.data.task import BuiltinTask

ROWS = [{"prompt": f"question {i}", "label": str(i), "source": "unit"} for i in range(7)]
PLUGINS = str(Path(__file__).parent)


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def prompt_text(sample: Sample) -> str:
    return sample.prompt if isinstance(sample.prompt, str) else sample.prompt[-1].content


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "train.jsonl", ROWS)


def test_epochs_are_shuffled_permutations_and_end(jsonl: Path) -> None:
    source = FileSource(jsonl, seed=3, num_epochs=2)
    first = source.get_samples(7)
    second = source.get_samples(5)
    second += source.get_samples(5)  # only 2 left in the last epoch
    assert len(second) == 7
    assert source.is_exhausted and source.get_samples(4) == []
    for epoch in (first, second):
        assert sorted(prompt_text(s) for s in epoch) == sorted(r["prompt"] for r in ROWS)
    assert [prompt_text(s) for s in first] != [prompt_text(s) for s in second]  # reshuffled per epoch
    assert [prompt_text(s) for s in first] != [r["prompt"] for r in ROWS]
    indices = [s.group_index for s in first + second]
    assert indices == list(range(14)) and [s.index for s in first + second] == indices
    assert all(s.label == prompt_text(s).split()[-1] and s.metadata == {"source": "unit"} for s in first)


def test_unshuffled_keeps_file_order(jsonl: Path) -> None:
    source = FileSource(jsonl, shuffle=False, apply_chat_template=False)
    assert [s.prompt for s in source.get_samples(3)] == ["question 0", "question 1", "question 2"]


@pytest.mark.parametrize("stop_after", [0, 3, 7, 9, 13])
def test_resume_gives_the_same_prompts(jsonl: Path, stop_after: int) -> None:
    uninterrupted = FileSource(jsonl, seed=5, num_epochs=3)
    expected = [prompt_text(s) for s in uninterrupted.get_samples(21)]
    expected_indices = list(range(stop_after, 21))

    first = FileSource(jsonl, seed=5, num_epochs=3)
    first.get_samples(stop_after)
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints store it as JSON
    resumed = FileSource(jsonl, seed=5, num_epochs=3)
    resumed.load_state_dict(state)
    rest = resumed.get_samples(2) + resumed.get_samples(30)
    assert [prompt_text(s) for s in rest] == expected[stop_after:]
    assert [s.group_index for s in rest] == expected_indices


def test_resume_refuses_other_settings(jsonl: Path) -> None:
    state = FileSource(jsonl, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed: saved 1, now 2"):
        FileSource(jsonl, seed=2).load_state_dict(state)


def test_parquet_matches_jsonl(jsonl: Path, tmp_path: Path) -> None:
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    from_parquet = FileSource(parquet, seed=9).get_samples(7)
    from_jsonl = FileSource(jsonl, seed=9).get_samples(7)
    assert [s.model_dump() for s in from_parquet] == [s.model_dump() for s in from_jsonl]


def test_chat_template_and_message_prompts(tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"q": "plain", "a": 1}, {"q": messages, "a": 2}])
    samples = FileSource(path, prompt_key="q", label_key="a", shuffle=False).get_samples(2)
    assert samples[0].prompt == [ChatMessage(role="user", content="plain")]
    assert samples[1].prompt == [ChatMessage(**m) for m in messages]  # type: ignore[arg-type]
    assert [s.label for s in samples] == [1, 2]
    with pytest.raises(
        ValueError, match=r"chat\.jsonl line 2: 'q' holds chat messages; set data\.apply_chat_template"
    ):
        FileSource(path, prompt_key="q", label_key="a", apply_chat_template=False)


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (['{"prompt": "a"}', "", '{"prompt": "b"', '{"prompt": "c"}'], r"bad\.jsonl line 3: not valid JSON"),
        (['{"prompt": "a"}', '{"question": "b"}'], r"line 2: no 'prompt' key \(keys: \['question'\]\); set data"),
        (['["a", "b"]'], r"line 1: a row must be a JSON object"),
        (['{"prompt": "  "}'], r"line 1: 'prompt' is empty"),
        (['{"prompt": 3}'], r"line 1: 'prompt' must be text or chat messages, got int"),
        (['{"prompt": [{"role": "robot", "content": "x"}]}'], r"line 1: 'prompt' is a list but not chat messages"),
        ([""], r"bad\.jsonl has no rows"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path: Path, lines: list[str], expected: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=expected):
        FileSource(path)


def test_missing_file_and_bad_parquet(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"does not exist; check data\.source"):
        FileSource(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet: cannot read it as Parquet"):
        FileSource(bad)


def test_builtin_source_resumes_and_counts(tmp_path: Path) -> None:
    task = BuiltinTask(num_digits=2)
    uninterrupted = BuiltinTaskSource(task, seed=4)
    expected = uninterrupted.get_samples(10)
    first = BuiltinTaskSource(task, seed=4)
    first.get_samples(6)
    resumed = BuiltinTaskSource(task, seed=4)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert resumed.get_samples(4) == expected[6:]
    assert [s.group_index for s in expected] == list(range(10))
    assert all(s.label == str(task.problem(s.group_index, seed=4).answer) for s in expected)
    with pytest.raises(ValueError, match=r"data\.seed=4"):
        BuiltinTaskSource(task, seed=5).load_state_dict(first.state_dict())


def test_builtin_eval_is_held_out() -> None:
    source = BuiltinTaskSource(BuiltinTask(), seed=0)
    held_out = {prompt_text(s) for s in source.eval_samples(50)}
    train = {prompt_text(s) for s in source.get_samples(2000)}
    assert len(held_out) > 40 and not held_out & train
    assert all(BuiltinTask().split_of(q) == "heldout" for q in held_out)


def test_build_from_config(jsonl: Path) -> None:
    builtin = build_data_source(DataSection(task={"num_digits": 3}))  # type: ignore[arg-type]
    assert isinstance(builtin, DataSource)  # the runtime Protocol check
    assert isinstance(builtin, BuiltinTaskSource)
    assert builtin.task.num_digits == 3
    assert len(build_eval_samples(DataSection(num_eval_prompts=5))) == 5
    assert build_eval_samples(DataSection(num_eval_prompts=0)) == []
    from_file = build_data_source(DataSection(source=str(jsonl), num_epochs=2))
    assert isinstance(from_file, DataSource)
    assert isinstance(from_file, FileSource)
    assert from_file.num_epochs == 2
    assert build_eval_samples(DataSection(source=str(jsonl))) == []  # a file source without eval_path
    evals = build_eval_samples(DataSection(source=str(jsonl), eval_path=str(jsonl), num_eval_prompts=3))
    assert [prompt_text(s) for s in evals] == ["question 0", "question 1", "question 2"]
    assert len(load_eval_samples(jsonl)) == 7


@pytest.fixture
def plugins_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(PLUGINS)


def counting(**source_args: Any) -> DataSection:
    return DataSection(source="orchestrator_plugins:CountingSource", source_args=source_args, seed=3)


@pytest.mark.parametrize("stop_after", [0, 4, 7])
def test_plugin_source_is_built_from_the_data_section_and_resumes(plugins_on_path: None, stop_after: int) -> None:
    source = build_data_source(counting(start=10, step=5, num_prompts=7))
    assert isinstance(source, PluginSource) and isinstance(source, DataSource)
    expected = source.get_samples(5) + source.get_samples(5)  # 7 prompts, then the source is used up
    assert [s.prompt for s in expected] == [f"count {10 + 5 * k}" for k in range(7)]
    assert [s.group_index for s in expected] == list(range(7)) and expected[0].metadata == {"seed": 3}
    assert source.get_samples(3) == []

    first = build_data_source(counting(start=10, step=5, num_prompts=7))
    first.get_samples(stop_after)
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints store it as JSON
    resumed = build_data_source(counting(start=10, step=5, num_prompts=7))
    resumed.load_state_dict(state)
    assert resumed.get_samples(2) + resumed.get_samples(9) == expected[stop_after:]
    with pytest.raises(ValueError, match=r"saved by a 'builtin' source; resume with the data\.source"):
        resumed.load_state_dict(BuiltinTaskSource().state_dict())


@pytest.mark.parametrize(
    ("source", "source_args", "error", "expected"),
    [
        ("orchestrator_plugins:SourceWithoutResume", {}, TypeError, r"is not a DataSource: it lacks load_state_dict"),
        ("orchestrator_plugins:behaves", {}, TypeError, r"is not a DataSource: it lacks get_samples"),
        ("orchestrator_plugins:CountingSource", {"stride": 2}, TypeError,
         r"cannot be built as CountingSource\(data_section, \*\*data\.source_args\) with .*'stride'"),
        ("no_such_module_xyz:Source", {}, ValueError, r"cannot import module 'no_such_module_xyz'"),
        ("orchestrator_plugins:NoSuchSource", {}, ValueError, r"has no attribute 'NoSuchSource'"),
    ],
)  # fmt: skip
def test_plugin_source_is_checked_at_start_up(
    plugins_on_path: None, source: str, source_args: dict[str, Any], error: type[Exception], expected: str
) -> None:
    cfg = DataSection(source=source, source_args=source_args)
    with pytest.raises(error, match=expected):
        check_data_source(cfg)  # before anything is built (preflight.check_plugins prefixes data.source=...)
    with pytest.raises(error, match=expected):
        build_data_source(cfg)


def test_plugin_source_that_breaks_the_contract_is_stopped(plugins_on_path: None) -> None:
    restarting = build_data_source(DataSection(source="orchestrator_plugins:RestartingSource"))
    assert [s.group_index for s in restarting.get_samples(2)] == [0, 1]
    with pytest.raises(ValueError, match=r"data\.source='orchestrator_plugins:RestartingSource': prompt 0 of "
                       r"get_samples\(2\) has group_index 0, expected 2"):  # fmt: skip
        restarting.get_samples(2)
    with pytest.raises(ValueError, match=r"state_dict\(\) must return a JSON-serializable dict"):
        build_data_source(DataSection(source="orchestrator_plugins:UnsavableSource"))


@pytest.fixture
def datasets_lib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The `datasets` library (the hf extra), its cache in tmp_path: the user's cache is never touched."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    return datasets


def test_hf_dataset_reads_like_a_file(datasets_lib: Any, jsonl: Path, tmp_path: Path) -> None:
    datasets_lib.Dataset.from_list(ROWS).save_to_disk(tmp_path / "saved")
    source = build_data_source(DataSection(source=f"hf:{tmp_path / 'saved'}", seed=9, num_epochs=2))
    assert isinstance(source, FileSource)
    from_hf = source.get_samples(7)
    from_jsonl = FileSource(jsonl, seed=9, apply_chat_template=False).get_samples(7)
    assert [s.model_dump() for s in from_hf] == [s.model_dump() for s in from_jsonl]  # rows, metadata, shuffle
    resumed = build_data_source(DataSection(source=f"hf:{tmp_path / 'saved'}", seed=9, num_epochs=2))
    resumed.load_state_dict(json.loads(json.dumps(source.state_dict())))
    assert resumed.get_samples(7) == source.get_samples(7)  # the second epoch

    (tmp_path / "train.csv").write_text("prompt,label\nwhat is 1 + 1?,2\nwhat is 2 + 2?,4\n")
    (tmp_path / "train.json").write_text(json.dumps(ROWS[:3]))  # one JSON array, not JSON lines
    assert [s.label for s in load_eval_samples(f"hf:{tmp_path / 'train.csv'}")] == [2, 4]  # CSV types its columns
    assert [prompt_text(s) for s in load_eval_samples(f"hf:{tmp_path / 'train.json'}")] == [
        "question 0", "question 1", "question 2"
    ]  # fmt: skip


def test_hf_dataset_splits(datasets_lib: Any, tmp_path: Path) -> None:
    train, test = datasets_lib.Dataset.from_list(ROWS[:5]), datasets_lib.Dataset.from_list(ROWS[5:])
    datasets_lib.DatasetDict({"train": train, "test": test}).save_to_disk(tmp_path / "saved")
    folder = tmp_path / "folder"  # a folder of data files, as a hub repository fetched beforehand
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", ROWS[:5])
    write_jsonl(folder / "validation.jsonl", ROWS[5:])
    for path, eval_split in ((tmp_path / "saved", "test"), (folder, "validation")):
        cfg = DataSection(source=f"hf:{path}", eval_path=f"hf:{path}", hf_eval_split=eval_split, shuffle=False)
        assert [prompt_text(s) for s in build_data_source(cfg).get_samples(9)] == [r["prompt"] for r in ROWS[:5]]
        assert [prompt_text(s) for s in build_eval_samples(cfg)] == ["question 5", "question 6"]
    with pytest.raises(ValueError, match=r"has the splits \['train', 'validation'\], not 'test'; choose one with"):
        build_eval_samples(DataSection(eval_path=f"hf:{folder}"))


def test_hf_rows_are_checked_like_file_rows(datasets_lib: Any, tmp_path: Path) -> None:
    datasets_lib.Dataset.from_list([{"prompt": "a"}, {"prompt": "  "}]).save_to_disk(tmp_path / "saved")
    with pytest.raises(ValueError, match=r"hf:.*saved row 1: 'prompt' is empty"):
        build_data_source(DataSection(source=f"hf:{tmp_path / 'saved'}"))


def test_hf_paths_must_be_local_and_need_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if the hf extra were not installed
    for check in (check_data_source, build_data_source):  # refused before datasets could download anything
        with pytest.raises(ValueError, match=r"'hf:openai/gsm8k': no such local file or directory; .* downloads "):
            check(DataSection(source="hf:openai/gsm8k"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"cannot read a \.txt file"):
        check_data_source(DataSection(source=f"hf:{tmp_path / 'notes.txt'}"))
    with pytest.raises(ValueError, match=r"install miles-orchestrator's hf extra \(pip install "):
        check_data_source(DataSection(source=f"hf:{tmp_path}"))
    with pytest.raises(ValueError, match=r"data file .*missing\.jsonl' does not exist"):
        check_data_source(DataSection(source=str(tmp_path / "missing.jsonl")))

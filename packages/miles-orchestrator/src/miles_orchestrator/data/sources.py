"""Data sources: step 1 of the RL data path, turning prompts into pending `Sample`s for the rollout.

Each source yields one `Sample` per prompt, with a run-unique `group_index` that grows by one per prompt; the loop
expands a prompt into its group of n samples with `index = group_index * n + i`. The prompt sample's own `index`
equals its `group_index` until then. With `apply_chat_template` a text prompt becomes one user `ChatMessage`, which
the rollout renders with the tokenizer's chat template; otherwise the text goes to the engine as it is.

- `FileSource`: rows of a local .jsonl or .parquet file, or of a local Hugging Face dataset ('hf:PATH', read by
  hf.py), shuffled per epoch from a seed, for `num_epochs` passes. When the passes are used up it returns
  fewer prompts than asked (then none): the loop ends the run there.
- `BuiltinTaskSource`: the built-in arithmetic task's train split, never exhausted.
- `PluginSource` (plugin_source.py): a user's 'module:Class' DataSource, built from the `data` section, whose
  prompts are checked against the invariants above as they come.

All resume exactly: a source restored from `state_dict()` returns the same next prompts as one that never stopped.
Held-out prompts for evaluation come from `load_eval_samples` / `BuiltinTaskSource.eval_samples`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from pydantic import JsonValue, TypeAdapter, ValidationError

from miles_contracts import ChatMessage, DataSource, Sample
from miles_orchestrator.config import HF_PREFIX, DataSection, data_source_kind
from miles_orchestrator.data.hf import hf_records, import_datasets, local_dataset_path
from miles_orchestrator.data.plugin_source import PluginSource, load_source_class
from miles_orchestrator.data.task import BuiltinTask

__all__ = [
    "BuiltinTaskSource",
    "FileSource",
    "PluginSource",
    "build_data_source",
    "build_eval_samples",
    "check_data_source",
    "load_eval_samples",
]

_MESSAGES = TypeAdapter(list[ChatMessage])
_JSON = TypeAdapter(JsonValue)


def read_rows(
    path: str | Path, prompt_key: str, label_key: str, apply_chat_template: bool, *, split: str = "train"
) -> list[Sample]:
    """Every row of a .jsonl / .parquet file, or of the local Hugging Face dataset 'hf:PATH' (its `split` when it has
    several), as a prompt `Sample` (group_index = row number), checked row by row.

    Keys other than the prompt and the label go to `Sample.metadata`. A bad row raises ValueError naming the file,
    the line (JSONL) or row (Parquet, datasets) and the problem.
    """
    if isinstance(path, str) and path.startswith(HF_PREFIX):
        records, where = hf_records(path, split)
    else:
        records, where = _file_records(Path(path))
    if not records:
        raise ValueError(f"{path} has no rows; give a file with at least one prompt")
    return [
        _row_sample(row, at, i, prompt_key, label_key, apply_chat_template)
        for i, (row, at) in enumerate(zip(records, where, strict=True))
    ]


def _file_records(path: Path) -> tuple[list[Any], list[str]]:
    if not path.is_file():
        raise ValueError(f"data file {str(path)!r} does not exist; check data.source / data.eval_path")
    if path.suffix == ".parquet":
        try:
            records: list[Any] = pq.read_table(path).to_pylist()
        except Exception as error:  # pyarrow raises several types for a corrupt file
            raise ValueError(f"{path}: cannot read it as Parquet ({error})") from error
        return records, [f"{path} row {i}" for i in range(len(records))]
    if path.suffix != ".jsonl":
        raise ValueError(f"{path}: unknown data format {path.suffix!r}; use a .jsonl or .parquet file")
    records, where = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} line {number}: not valid JSON ({error.msg})") from error
        where.append(f"{path} line {number}")
    return records, where


def _row_sample(row: Any, at: str, i: int, prompt_key: str, label_key: str, apply_chat_template: bool) -> Sample:
    if not isinstance(row, dict):
        raise ValueError(f"{at}: a row must be a JSON object with a {prompt_key!r} key, got {type(row).__name__}")
    if prompt_key not in row:
        raise ValueError(f"{at}: no {prompt_key!r} key (keys: {sorted(row)}); set data.prompt_key to the right one")
    raw = row[prompt_key]
    prompt: str | list[ChatMessage]
    if isinstance(raw, str):
        if not raw.strip():
            raise ValueError(f"{at}: {prompt_key!r} is empty; remove the row or fill in the prompt")
        prompt = [ChatMessage(role="user", content=raw)] if apply_chat_template else raw
    elif isinstance(raw, list):
        try:
            prompt = _MESSAGES.validate_python(raw)
        except ValidationError as error:
            raise ValueError(
                f"{at}: {prompt_key!r} is a list but not chat messages [{{role, content}}] ({error})"
            ) from error
        if not prompt:
            raise ValueError(f"{at}: {prompt_key!r} is an empty message list; give at least one message")
        if not apply_chat_template:
            raise ValueError(f"{at}: {prompt_key!r} holds chat messages; set data.apply_chat_template=true")
    else:
        raise ValueError(f"{at}: {prompt_key!r} must be text or chat messages, got {type(raw).__name__}")
    try:
        label = _JSON.validate_python(row.get(label_key))
        metadata = {k: _JSON.validate_python(v) for k, v in row.items() if k not in (prompt_key, label_key)}
    except ValidationError as error:
        raise ValueError(f"{at}: a value is not JSON-serializable ({error})") from error
    return Sample(index=i, group_index=i, prompt=prompt, label=label, metadata=metadata)


class FileSource:
    """Prompts from a .jsonl / .parquet file or a local Hugging Face dataset ('hf:PATH', its `split`), shuffled per
    epoch (`random.Random(seed * 1_000_003 + epoch)`)."""

    def __init__(
        self,
        path: str | Path,
        *,
        prompt_key: str = "prompt",
        label_key: str = "label",
        apply_chat_template: bool = True,
        shuffle: bool = True,
        seed: int = 0,
        num_epochs: int = 1,
        split: str = "train",
    ) -> None:
        if num_epochs < 1:
            raise ValueError(f"num_epochs={num_epochs}: a file source needs at least one pass (data.num_epochs)")
        self.path = str(path)
        self._rows = read_rows(path, prompt_key, label_key, apply_chat_template, split=split)
        self.shuffle, self.seed, self.num_epochs = shuffle, seed, num_epochs
        self.epoch = 0  # position: the next prompt is row _order[offset] of this epoch
        self.offset = 0
        self.next_group_index = 0
        self._order = self._epoch_order(0)

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    @property
    def is_exhausted(self) -> bool:
        """True once all `num_epochs` passes are used up."""
        return self.epoch >= self.num_epochs

    def get_samples(self, num_prompts: int) -> list[Sample]:
        """The next `num_prompts` prompts (crossing epochs); fewer, possibly none, once the passes are used up."""
        samples: list[Sample] = []
        while len(samples) < num_prompts and not self.is_exhausted:
            row = self._rows[self._order[self.offset]]
            samples.append(
                row.model_copy(update={"index": self.next_group_index, "group_index": self.next_group_index})
            )
            self.next_group_index += 1
            self.offset += 1
            if self.offset == len(self._rows):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
        return samples

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "file",
            "path": self.path,
            "num_rows": self.num_rows,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "epoch": self.epoch,
            "offset": self.offset,
            "next_group_index": self.next_group_index,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = {"kind": "file", "num_rows": self.num_rows, "shuffle": self.shuffle, "seed": self.seed}
        changed = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if changed:
            raise ValueError(
                f"cannot resume {self.path}: the checkpoint's data position was saved with different settings "
                f"({', '.join(f'{k}: saved {a!r}, now {b!r}' for k, (a, b) in changed.items())}); "
                "resume with the same data file, data.shuffle and data.seed"
            )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.next_group_index = int(state["next_group_index"])
        self._order = self._epoch_order(self.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order


class BuiltinTaskSource:
    """The built-in task's train split as prompts; problem k is the k-th prompt of the run (never exhausted)."""

    def __init__(self, task: BuiltinTask | None = None, *, seed: int = 0, apply_chat_template: bool = True) -> None:
        self.task = task or BuiltinTask()
        self.seed = seed
        self.apply_chat_template = apply_chat_template
        self.next_group_index = 0

    def get_samples(self, num_prompts: int) -> list[Sample]:
        start = self.next_group_index
        self.next_group_index += num_prompts
        return [self._sample(start + k, "train") for k in range(num_prompts)]

    def eval_samples(self, num_prompts: int) -> list[Sample]:
        """The first `num_prompts` held-out problems (never seen in training), group_index 0..num_prompts-1."""
        return [self._sample(k, "heldout") for k in range(num_prompts)]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "builtin", "seed": self.seed, "next_group_index": self.next_group_index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "builtin" or state.get("seed") != self.seed:
            raise ValueError(
                f"cannot resume the built-in task from {state!r}: it was saved by another source or seed; "
                f"resume with data.source=builtin and data.seed={state.get('seed')}"
            )
        self.next_group_index = int(state["next_group_index"])

    def _sample(self, index: int, split: Any) -> Sample:
        problem = self.task.problem(index, seed=self.seed, split=split)
        prompt: str | list[ChatMessage] = (
            [ChatMessage(role="user", content=problem.question)] if self.apply_chat_template else problem.question
        )
        return Sample(index=index, group_index=index, prompt=prompt, label=problem.label)


def load_eval_samples(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    label_key: str = "label",
    apply_chat_template: bool = True,
    num_prompts: int | None = None,
    split: str = "test",
) -> list[Sample]:
    """The first `num_prompts` rows (all when None) of a held-out file or 'hf:PATH' dataset (its `split` when it has
    several), in file order, group_index = row number."""
    rows = read_rows(path, prompt_key, label_key, apply_chat_template, split=split)
    return rows if num_prompts is None else rows[:num_prompts]


def build_data_source(cfg: DataSection) -> DataSource:
    """The training source that `data` names."""
    kind = data_source_kind(cfg.source)
    if kind == "builtin":
        return _builtin_source(cfg)
    if kind == "plugin":
        return PluginSource(cfg)
    return FileSource(
        cfg.source,
        prompt_key=cfg.prompt_key,
        label_key=cfg.label_key,
        apply_chat_template=cfg.apply_chat_template,
        shuffle=cfg.shuffle,
        seed=cfg.seed,
        num_epochs=cfg.num_epochs,
        split=cfg.hf_split,
    )


def check_data_source(cfg: DataSection) -> None:
    """The start-up check of `data.source`, before anything is built: the file or local dataset exists (and the hf
    extra is installed), or the plug-in class imports, has the DataSource methods and accepts its arguments."""
    kind = data_source_kind(cfg.source)
    if kind == "file" and not Path(cfg.source).is_file():
        raise ValueError(f"data file {cfg.source!r} does not exist; give an existing .jsonl / .parquet file")
    if kind == "hf":
        local_dataset_path(cfg.source)
        import_datasets()
    if kind == "plugin":
        load_source_class(cfg.source, cfg)


def build_eval_samples(cfg: DataSection) -> list[Sample]:
    """Held-out prompts: `data.eval_path`, else the built-in task's held-out split, else none (a file source)."""
    if cfg.num_eval_prompts == 0:
        return []
    if cfg.eval_path is not None:
        return load_eval_samples(
            cfg.eval_path,
            prompt_key=cfg.prompt_key,
            label_key=cfg.label_key,
            apply_chat_template=cfg.apply_chat_template,
            num_prompts=cfg.num_eval_prompts,
            split=cfg.hf_eval_split,
        )
    if cfg.source == "builtin":
        return _builtin_source(cfg).eval_samples(cfg.num_eval_prompts)
    return []


def _builtin_source(cfg: DataSection) -> BuiltinTaskSource:
    return BuiltinTaskSource(cfg.task.to_task(), seed=cfg.seed, apply_chat_template=cfg.apply_chat_template)

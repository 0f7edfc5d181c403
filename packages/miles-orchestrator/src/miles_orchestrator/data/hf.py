"""Hugging Face `datasets` as input: step 1 of the RL data path for `data.source` / `data.eval_path` = 'hf:PATH'.

`hf_records` reads the rows of a local dataset; sources.py turns them into prompt `Sample`s with the same row checks,
shuffling, epochs and resume as a .jsonl / .parquet file (`FileSource`). PATH is one of:

- a directory written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk` (`datasets.load_from_disk`);
- a folder of data files, e.g. a hub repository fetched beforehand (`datasets.load_dataset(PATH)`, which names
  the splits after the files: `train.jsonl`, `data/test-00000-of-00001.parquet`, ...);
- one .json / .jsonl / .parquet / .csv / .arrow file (`load_dataset(<builder>, data_files=PATH)`: one split).

A dataset with several splits gives the one `data.hf_split` (training) or `data.hf_eval_split` (evaluation) names.
Nothing is downloaded: PATH must exist on this machine, so a hub id (`openai/gsm8k`) is refused before `datasets`
could reach the network. `datasets` is the `hf` extra of miles-orchestrator, imported only when an 'hf:' path is used.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from miles_orchestrator.config import HF_PREFIX

__all__ = ["hf_records", "import_datasets", "local_dataset_path"]

# The builders of `datasets` that read one local file, by suffix (datasets' own mapping, narrowed to table formats).
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
_SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes (a DatasetDict / a Dataset)


def import_datasets() -> ModuleType:
    """The `datasets` library, or a ValueError saying which extra installs it."""
    try:
        return importlib.import_module("datasets")  # lazy: an extra, and seconds to import
    except ImportError as error:
        raise ValueError(
            "an 'hf:' data path needs the Hugging Face datasets library: install miles-orchestrator's hf extra "
            "(pip install 'miles-orchestrator[hf]', or uv sync --extra hf in a checkout)"
        ) from error


def local_dataset_path(value: str) -> Path:
    """The local path that 'hf:PATH' names; a ValueError unless it exists here (a hub id would be downloaded)."""
    path = Path(value.removeprefix(HF_PREFIX)).expanduser()
    if not path.exists():
        raise ValueError(
            f"{value!r}: no such local file or directory; Miles reads local datasets only and downloads nothing, so "
            "save the dataset first (datasets.load_dataset(...).save_to_disk(DIR), or huggingface-cli download "
            "--repo-type dataset REPO --local-dir DIR) and give hf:DIR"
        )
    if path.is_file() and path.suffix not in FILE_BUILDERS:
        raise ValueError(
            f"{value!r}: cannot read a {path.suffix or 'suffix-less'} file; give a "
            f"{' / '.join(FILE_BUILDERS)} file or a dataset directory"
        )
    return path


def hf_records(value: str, split: str) -> tuple[list[Any], list[str]]:
    """The rows of the local dataset 'hf:PATH' (its `split` when it has several) and where each is, for errors."""
    path = local_dataset_path(value)
    datasets = import_datasets()
    try:
        if path.is_file():  # one file is one split, which datasets calls 'train'
            loaded = datasets.load_dataset(FILE_BUILDERS[path.suffix], data_files=str(path), split="train")
        elif any((path / marker).is_file() for marker in _SAVED_MARKERS):
            loaded = datasets.load_from_disk(str(path))
        else:
            loaded = datasets.load_dataset(str(path))
    except Exception as error:  # datasets raises many types for a file or folder it cannot read
        raise ValueError(f"{value!r}: datasets cannot load it ({type(error).__name__}: {error})") from error
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(
                f"{value!r} has the splits {sorted(loaded)}, not {split!r}; choose one with data.hf_split (training) "
                "or data.hf_eval_split (evaluation)"
            )
        at = f"{value} split {split}"
        loaded = loaded[split]
    else:
        at = value
    records: list[Any] = loaded.to_list()
    return records, [f"{at} row {i}" for i in range(len(records))]

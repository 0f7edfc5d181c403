"""This folder on `sys.path`: test_megatron.py imports test_fsdp's rank runner and fsdp_worker's batch (pytest's
importlib mode puts no test folder there). `model_dirs`: the small dense and MoE checkpoints test_lora.py and
test_qat.py train on."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A random dense and a random MoE model (seed 5) saved as Hugging Face directories, with a process group."""
    from miles_kernels import save_model
    from miles_kernels.testing import random_model, tiny_config
    from miles_trainer import ensure_process_group

    root = tmp_path_factory.mktemp("models")
    ensure_process_group()
    dirs = {}
    for kind in ("dense", "moe"):
        save_model(random_model(tiny_config(kind), seed=5), root / kind)
        dirs[kind] = str(root / kind)
    return dirs

"""This folder on `sys.path`: test_megatron.py imports test_fsdp's rank runner and fsdp_worker's batch (pytest's
importlib mode puts no test folder there)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

"""This folder on `sys.path`: test_eagle3.py imports the SpecForge transcription next to it (pytest's importlib mode
puts no test folder there)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

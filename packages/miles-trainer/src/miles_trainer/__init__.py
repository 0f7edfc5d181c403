"""miles-trainer: RL losses and advantages (pure functions; formulas in docstrings), sequence packing, the
trainer's log-probs under the log-prob contract, the FSDP2 backend with its checkpoints, offload/onload and weight
export for sync, and supervised fine-tuning (`miles-trainer sft`).

Attributes load on first use (`lazy_loader`, from the imports listed in `__init__.pyi`): importing the package,
or its torch-free `miles_trainer.config`, does not import torch (docs/architecture.md, "Config").
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)

__version__ = "0.1.0"

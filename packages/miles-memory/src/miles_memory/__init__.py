"""miles-memory: memory that does not fall over (docs/memory.md): one offload manager for the trainer and the
engine (per tag, to host memory or disk, partial and bit-exact), live-byte accounting with an enforced budget whose
overrun raises the same `torch.OutOfMemoryError` a CUDA OOM does, and the memory planner that says whether a run
config fits a GPU cluster before one is rented.

Attributes load on first use (`lazy_loader`, from the imports listed in `__init__.pyi`): importing the package
does not import torch.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
